"""Tiny models with deliberately awkward shapes, built offline from a config.

Everything here is random-initialised: nothing is downloaded. The default
dimensions are chosen so that FSDP's ``torch.chunk``-style sharding is uneven:

* ``embed_tokens`` / ``lm_head`` (101, 48): ws=2 51/50, ws=3 34/34/33, ws=4 26/26/26/23 rows
* ``gate_proj`` / ``up_proj`` (86, 48): ws=4 22/22/22/20 rows
* ``down_proj`` (48, 86): even on dim 0; dim 1 (86) divides 2 but not 3 or 4
* ``k_proj`` / ``v_proj`` (24, 48): even at ws 2, 3, 4
* LoRA ``lora_A`` (3, in), r=3: ws=2 2/1, ws=4 1/1/1/0 rows (a rank with zero rows)
* LoRA ``lora_B`` (out, 3): dim 1 divides neither 2 nor 4

Real LLM dimensions never give a rank *zero* rows at sane world sizes; the
zero-row cases are covered by the LoRA rank (``r=3`` at world size 4) and by
:class:`PlainModule` (``proj.weight`` (5, 6) at world size 4: 2/2/1/0 and the
(1,)-shaped ``gain`` which is empty on every rank but 0).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

TINY_DIMS: dict[str, Any] = {
    "hidden_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 86,
    "vocab_size": 101,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
}

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}

SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>")
UNK_ID, PAD_ID, BOS_ID, EOS_ID = range(4)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."


# --------------------------------------------------------------------------- HF models


def tiny_config(
    arch: str = "qwen2",
    *,
    tie_word_embeddings: bool = False,
    overrides: Mapping[str, Any] | None = None,
):
    """A ``transformers`` config for a tiny causal LM (``qwen2`` or ``llama``)."""
    from transformers import LlamaConfig, Qwen2Config

    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(classes)}")
    kwargs = dict(TINY_DIMS)
    kwargs.update(
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if overrides:
        kwargs.update(overrides)
    config = classes[arch](**kwargs)
    config.architectures = [ARCHITECTURES[arch]]
    return config


# Models whose save_pretrained layout differs from their in-memory names (docs/hf-layout.md).
LAYOUT_CASES = ("qwen2_5_vl", "qwen3_moe", "compiled_qwen2", "qwen2_critic")
LAYOUT_DIMS: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 101,
    "max_position_embeddings": 128,
}
MROPE = {"mrope_section": [2, 1, 1]}  # sums to head_dim / 2


def layout_config(case: str):
    """The transformers config of layout ``case`` (``LAYOUT_CASES``), its ``architectures``
    named as a hub config does; ``compiled_qwen2`` is a plain Qwen2 (the caller wraps it)."""
    import transformers

    if case == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(
                LAYOUT_DIMS,
                rope_parameters={"rope_type": "default", **MROPE},  # transformers 5
                rope_scaling={"type": "mrope", **MROPE},  # transformers 4.x
            ),
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 24,
                "num_heads": 2,
                "out_hidden_size": 32,
                "fullatt_block_indexes": [0],
            },
        )
        cls = "Qwen2_5_VLForConditionalGeneration"
    elif case == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **dict(LAYOUT_DIMS, intermediate_size=48),
            head_dim=8,
            moe_intermediate_size=16,  # bf16 grouped_mm: 16-byte strides
            num_experts=3,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
        )
        cls = "Qwen3MoeForCausalLM"
    elif case == "qwen2_critic":
        config = transformers.Qwen2Config(**LAYOUT_DIMS, num_labels=1)
        cls = "Qwen2ForTokenClassification"
    elif case == "compiled_qwen2":
        config = transformers.Qwen2Config(**LAYOUT_DIMS)
        cls = "Qwen2ForCausalLM"
    else:
        raise ValueError(f"unknown layout case {case!r}; expected one of {LAYOUT_CASES}")
    config.architectures = [cls]
    config.dtype = "bfloat16"
    return config


def tiny_moe_config() -> dict:
    """config.json's content for the smallest Qwen3-MoE: one layer, 3 experts of width 6,
    hidden 8 (fused ``experts.gate_up_proj`` [3, 12, 8], ``experts.down_proj`` [3, 8, 6])."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=8,
        intermediate_size=16,
        moe_intermediate_size=6,
        num_experts=3,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=20,
    ).to_dict()
    return {**config, "architectures": ["Qwen3MoeForCausalLM"]}


def randomized(model: nn.Module, scale: float = 1.0) -> nn.Module:
    """``model`` in eval mode with every parameter drawn anew from a normal distribution
    (times ``scale``; the caller seeds torch before building it): none left at a constant
    init, so a swapped or dropped tensor shows in every byte."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return model.eval()


def build_layout_model(case: str, seed: int = 0) -> nn.Module:
    """Layout ``case``'s model in fp32, every weight drawn from ``seed``."""
    import transformers

    config = layout_config(case)
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).float()
    return randomized(model, 0.05)


def build_tiny_model(config, *, seed: int | None = 0, dtype: torch.dtype = torch.float32):
    """Random-initialised causal LM for ``config``, parameters in ``dtype`` (fp32 by default).

    Call it under ``with torch.device("meta"):`` for a shape-only model.
    """
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def _byte_level_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Specials, then byte-level symbols for space and printable ASCII, then merges until
    ``vocab_size`` entries (the ids are dense and the merges only join existing tokens)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    symbols = ["\u0120"] + [chr(b) for b in range(33, 127)]  # "\u0120" is byte-level space
    for sym in symbols[: max(0, vocab_size - len(vocab))]:
        vocab[sym] = len(vocab)
    merges: list[tuple[str, str]] = []
    preferred = ["\u0120"] + list("etaoinshrdlucmfwypvbgkjqxz")
    firsts = [s for s in preferred if s in vocab]
    seconds = [s for s in preferred[1:] if s in vocab]
    seconds += [s for s in vocab if s not in SPECIAL_TOKENS and s not in seconds]
    level = firsts
    while len(vocab) < vocab_size:
        grown = []
        for left in level:
            for right in seconds:
                if len(vocab) >= vocab_size:
                    break
                tok = left + right
                if tok not in vocab:
                    vocab[tok] = len(vocab)
                    merges.append((left, right))
                    grown.append(tok)
        if not grown:
            raise ValueError(f"cannot grow the tiny vocabulary to {vocab_size}")
        level = grown
    return vocab, merges


def build_tiny_tokenizer(vocab_size: int = TINY_DIMS["vocab_size"], model_max_length: int = 128):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries, built offline.

    ``<unk> <pad> <s> </s>``, then space and printable ASCII, then merges. Byte-level BPE
    rather than a word-level model because transformers 5's ``AutoTokenizer`` rebuilds a
    ``qwen2`` tokenizer as byte-level BPE from the vocab/merges in tokenizer.json whatever
    tokenizer_config.json says; this one round-trips through it for qwen2 and llama.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}")
    vocab, merges = _byte_level_vocab(vocab_size)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=model_max_length,
    )


def save_tiny_tokenizer(out_dir: str | Path, vocab_size: int = TINY_DIMS["vocab_size"]) -> None:
    """``save_pretrained`` the tiny tokenizer, naming ``PreTrainedTokenizerFast`` as its class
    (transformers 5 writes ``TokenizersBackend``, which older releases cannot import)."""
    out_dir = Path(out_dir)
    build_tiny_tokenizer(vocab_size).save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def tiny_generation_config():
    """A generation config that differs from what transformers derives from the model config,
    so a merger that regenerates it instead of copying it is caught."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )


def write_config_json(out_dir: str | Path, config, *, config_dtype: str = "bfloat16") -> Path:
    """``config.save_pretrained(out_dir)``, then name ``config_dtype`` under both ``dtype``
    (transformers >= 5) and ``torch_dtype`` (older releases); transformers 5 reads either."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.save_pretrained(out_dir)
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data["dtype"] = config_dtype
    data["torch_dtype"] = config_dtype
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def write_hf_files(
    out_dir: str | Path,
    config,
    *,
    config_dtype: str = "bfloat16",
    tokenizer: bool = True,
    generation_config: bool = True,
) -> Path:
    """Write what verl keeps next to its shards: config.json, generation_config.json, tokenizer."""
    out_dir = Path(out_dir)
    write_config_json(out_dir, config, config_dtype=config_dtype)
    if generation_config:
        tiny_generation_config().save_pretrained(out_dir)
    if tokenizer:
        save_tiny_tokenizer(out_dir, config.vocab_size)
    return out_dir


def write_tiny_hf_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    *,
    tie_word_embeddings: bool = False,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A complete, loadable HF model directory (weights saved in ``dtype``)."""
    config = tiny_config(arch, tie_word_embeddings=tie_word_embeddings, overrides=overrides)
    model = build_tiny_model(config, seed=seed).to(dtype)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    write_hf_files(out_dir, config, config_dtype=str(dtype).removeprefix("torch."))
    return out_dir


# --------------------------------------------------------------------------- PEFT-style LoRA


class LoraLinear(nn.Module):
    """Stand-in for ``peft.tuners.lora.Linear`` with the same submodule names, so the state
    dict keys are PEFT's: ``<name>.base_layer.weight``, ``<name>.lora_A.default.weight``,
    ``<name>.lora_B.default.weight``. Initialised like PEFT (A kaiming-uniform, B zero)."""

    def __init__(self, base_layer: nn.Linear, r: int, lora_alpha: int, adapter: str = "default"):
        super().__init__()
        self.base_layer = base_layer
        self.adapter = adapter
        self.r = r
        self.lora_alpha = lora_alpha
        self.scaling = lora_alpha / r
        dev, dt = base_layer.weight.device, base_layer.weight.dtype
        self.lora_dropout = nn.ModuleDict({adapter: nn.Identity()})
        self.lora_A = nn.ModuleDict(
            {adapter: nn.Linear(base_layer.in_features, r, bias=False, device=dev, dtype=dt)}
        )
        self.lora_B = nn.ModuleDict(
            {adapter: nn.Linear(r, base_layer.out_features, bias=False, device=dev, dtype=dt)}
        )
        nn.init.kaiming_uniform_(self.lora_A[adapter].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[adapter].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        a, b = self.lora_A[self.adapter], self.lora_B[self.adapter]
        return out + b(a(self.lora_dropout[self.adapter](x))) * self.scaling


class _LoraModel(nn.Module):
    """Stand-in for ``peft.LoraModel``: holds the HF model as ``.model``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class PeftStyleModel(nn.Module):
    """Stand-in for ``peft.PeftModelForCausalLM``: keys start with ``base_model.model.``."""

    def __init__(self, model: nn.Module, r: int, lora_alpha: int, target_modules: tuple[str, ...]):
        super().__init__()
        self.base_model = _LoraModel(model)
        self.peft_config = {
            LORA_ADAPTER_NAME: adapter_config(r, lora_alpha, sorted(target_modules)),
        }

    @property
    def config(self):
        return self.base_model.model.config

    def get_base_model(self) -> nn.Module:
        return self.base_model.model

    def forward(self, *args, **kwargs):
        return self.base_model.model(*args, **kwargs)


def add_lora(
    model: nn.Module,
    *,
    r: int = 3,
    lora_alpha: int = 6,
    target_modules: Iterable[str] = LORA_TARGETS,
) -> PeftStyleModel:
    """Wrap ``model`` the way ``peft.get_peft_model`` does for a LoRA config: every
    ``nn.Linear`` whose leaf name is in ``target_modules`` becomes a :class:`LoraLinear`,
    every base parameter is frozen, and the result has PEFT's key naming.
    Uses the global torch RNG for the ``lora_A`` init."""
    targets = tuple(target_modules)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoraLinear(child, r, lora_alpha))
    for pname, p in model.named_parameters():
        p.requires_grad_(".lora_A." in pname or ".lora_B." in pname)
    return PeftStyleModel(model, r, lora_alpha, targets)


def adapter_config(
    r: int, lora_alpha: int, target_modules: list[str], base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """The common fields of PEFT's ``LoraConfig.to_dict()`` with enums as strings, as verl
    writes them to ``adapter_config.json``."""
    return {
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": False,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
        "target_modules": list(target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def is_lora_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def peft_adapter_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LoRA tensors under PEFT's *saved adapter* naming (adapter name dropped):
    ``base_model.model.<...>.q_proj.lora_A.weight``."""
    suffix = f".{LORA_ADAPTER_NAME}.weight"
    return {k.replace(suffix, ".weight"): v for k, v in state_dict.items() if is_lora_key(k)}


def base_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Non-LoRA tensors of a PEFT-style state dict under the plain HF names."""
    out = {}
    for k, v in state_dict.items():
        if is_lora_key(k):
            continue
        k = k.removeprefix(PEFT_PREFIX)
        k = k.replace(".base_layer.weight", ".weight").replace(".base_layer.bias", ".bias")
        out[k] = v
    return out


def fuse_lora_state_dict(
    state_dict: Mapping[str, torch.Tensor], r: int, lora_alpha: int
) -> dict[str, torch.Tensor]:
    """HF-named weights with each LoRA pair folded in: ``W + (alpha / r) * B @ A`` (fp32 math)."""
    scaling = lora_alpha / r
    fused = base_state_dict(state_dict)
    a_suffix = f".lora_A.{LORA_ADAPTER_NAME}.weight"
    for key, a in state_dict.items():
        if not key.endswith(a_suffix):
            continue
        module = key[: -len(a_suffix)]
        b = state_dict[f"{module}.lora_B.{LORA_ADAPTER_NAME}.weight"]
        target = module.removeprefix(PEFT_PREFIX) + ".weight"
        w = fused[target]
        fused[target] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return fused


# --------------------------------------------------------------------------- non-HF module


class PlainModule(nn.Module):
    """A non-``transformers`` module exercising what LLMs lack.

    * uneven and zero-row shards: ``proj.weight`` (5, 6) and ``head.weight`` (3, 5) at
      world size 4 give 2/2/1/0 and 1/1/1/0 rows; ``gain`` (1,) is empty on ranks >= 1;
    * persistent buffers, including a 0-d int64 one (``step_count``), which FSDP2 leaves
      as plain replicated tensors; a non-persistent buffer (``scratch``) that must not
      appear in the state dict;
    * a 0-d parameter (``temperature``): FSDP2 refuses to shard scalars, so it is passed
      to ``fully_shard(ignored_params=...)`` and is saved as a plain tensor.
    """

    IGNORED_PARAMS = ("temperature",)
    VOCAB = 11

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 6)
        self.proj = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)
        self.gain = nn.Parameter(torch.ones(1))
        self.temperature = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("step_count", torch.tensor(3))
        self.register_buffer("running_mean", torch.linspace(-0.2, 0.2, 5))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(ids))) * self.gain + self.running_mean
        # buffers stay fp32 under a bf16 MixedPrecisionPolicy: follow the weight's dtype
        return self.head(h.to(self.head.weight.dtype)) / self.temperature
