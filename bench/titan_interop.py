"""shardstream on checkpoints written by torchtitan 0.3.0's own ``CheckpointManager``.

The tests build torchtitan-like models and train states by hand; this script checks the real
thing, in the project venv (``make interop`` installs torchtitan 0.3.0 with ``--no-deps``, and
the few modules its imports need):

1. **save** (2 ranks over gloo, ``shardstream.testing.distributed``): torchtitan's components
   built as its ``Trainer.__init__`` builds them, on CPU: a tiny Llama 3 from
   ``Llama3Model.Config`` (fused QKV, torchtitan's default, with its
   ``ScaledDotProductAttention``), built on the meta device, FSDP2 through ``parallelize_llama``
   on a CPU mesh from ``ParallelDims``, ``init_weights``; its ``OptimizersContainer`` (AdamW),
   ``LRSchedulersContainer`` (warm-up, linear decay), ``HuggingFaceTextDataLoader`` (a local
   text dataset and a small tokenizer.json) and its train state (the ``Trainer``'s own
   ``state_dict`` / ``load_state_dict``: step and ntokens_seen). Two training steps, then
   ``CheckpointManager.save`` writes ``checkpoint/step-2``. Every rank also writes the full
   parameters, optimizer state, scheduler, train state and its dataloader state and next batch
   as the reference.
2. **CLI**: ``shardstream inspect --json`` and ``shardstream verify`` of ``step-2``.
3. **restore** at 1 and 4 processes (another world size: every tensor resharded) and at 2
   (for the dataloader, which torchtitan does not reshard): fresh, differently seeded
   components, ``shardstream.load`` / ``CheckpointManager.restore(path=...)``, then every
   parameter, optimizer entry, param-group value, scheduler field and train-state field is
   compared with the reference bit for bit.
4. **MoE** (``qwen3_moe/``): the same three steps for torchtitan's Qwen3 MoE (8 experts, top
   2), built by its ``parallelize_qwen3`` with FSDP2 and expert parallelism 2 on the 2 saving
   ranks, its load-balancing hook registered; restored at 1 process (no EP) and at 4 with EP
   2 and EP 4, persistent buffers (``expert_bias_E``) compared too. torchtitan's HF export
   (``last_save_in_hf=True``, ``Qwen3StateDictAdapter``, an index in ``hf_assets_path``)
   then goes through ``shardstream inspect`` / ``verify`` / ``merge`` / ``test``, and is
   compared tensor by tensor with the adapter's ``to_hf`` of the trained model and of
   shardstream's merge of the DCP checkpoint.

torchtitan 0.3.0 imports ``triton`` (its fused kernels) without declaring it, and its trainer
needs CUDA. The worker processes put an inert ``triton`` stub module in ``sys.modules`` (only
there, and only when no triton is installed; torch's own checks for triton run first and see
none); no kernel of it ever runs.

Writes ``bench/results/titan_interop.json`` and its section of ``docs/interop.md``; exits
non-zero on any mismatch.

    .venv/bin/python bench/titan_interop.py            # about 1.5 minutes on 2 cores
    .venv/bin/python bench/titan_interop.py --render   # re-render the docs section only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from harness import REPO, RESULTS
from harness.machine import git_revision
from harness.render import generated_note, table, write_section

DOC = REPO / "docs" / "interop.md"
SECTION = "torchtitan"
OUT_JSON = RESULTS / "titan_interop.json"
SAVE_WORLD = 2
STEPS = 2
SEQ_LEN = 32
BATCH = 2
VOCAB = 256
# world size -> how shardstream restores there and what; the dataloader only where torchtitan
# takes it back (same data-parallel size: it asserts so and does not reshard its data).
RESTORES = [
    {"world": 1, "api": "shardstream.load", "states": ["train_state"]},
    {"world": 4, "api": "CheckpointManager.restore", "states": ["train_state"]},
    {"world": 2, "api": "shardstream.load", "states": ["train_state", "dataloader"]},
]
# The MoE case: torchtitan's Qwen3 MoE saved at 2 ranks with FSDP and expert parallelism 2
# (each rank holds half the experts), restored without EP, and at 4 ranks with EP 2 (the
# experts then _StridedShard over efsdp 2 and Shard over ep 2) and with EP 4.
MOE = "qwen3_moe"
MOE_EXPERTS = 8
MOE_SAVE_EP = 2
MOE_RESTORES = [
    {"world": 1, "ep": 1, "api": "shardstream.load", "states": ["train_state"]},
    {"world": 4, "ep": 2, "api": "CheckpointManager.restore", "states": ["train_state"]},
    {"world": 4, "ep": 4, "api": "shardstream.load", "states": ["train_state"]},
]


# ---------------------------------------------------------------- torchtitan on CPU


def stub_triton() -> bool:
    """An inert ``triton`` module for torchtitan's imports (its Triton kernels are never
    used here). torch's own probes for triton run first, so torch sees none."""
    import torch._functorch.partitioners  # noqa: F401  (imports torch's triton probes)
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()  # cached: False
    torch_triton.has_triton()
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return False

    def unusable(*args, **kwargs):
        raise RuntimeError("triton is an inert stub in this process (bench/titan_interop.py)")

    class Inert:
        def __call__(self, *args, **kwargs):
            return self

        def __getattr__(self, name):
            return self

    class Language(types.ModuleType):
        def __getattr__(self, name):  # tl.constexpr, tl.int64, tl.pointer_type(...), ...
            if name.startswith("__"):
                raise AttributeError(name)
            return Inert()

    triton = types.ModuleType("triton")
    triton.__version__ = "0.0.0+stub"
    triton.jit = lambda fn=None, **kwargs: unusable if fn is not None else (lambda f: unusable)
    triton.autotune = lambda *args, **kwargs: lambda f: unusable
    triton.heuristics = lambda *args, **kwargs: lambda f: unusable
    triton.Config = lambda *args, **kwargs: None
    triton.cdiv = lambda a, b: -(-a // b)
    triton.language = Language("triton.language")
    sys.modules["triton"] = triton
    sys.modules["triton.language"] = triton.language
    return True


def _llama3_config():
    """A tiny Llama 3: torchtitan's debug-model recipe (``_debugmodel``) at 64 wide, 2 layers,
    fused QKV (its default), with torchtitan's SDPA inner attention (0.3.0 names only flex and
    varlen for language models, both needing compiled kernels)."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, heads = 64, 4
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=2,
        dim=dim,
        n_heads=heads,
        n_kv_heads=2,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
        rope=ComplexRoPE.Config(
            dim=dim // heads, max_seq_len=SEQ_LEN * 2, theta=500000, scaling="llama"
        ),  # fmt: skip
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=VOCAB, param_init=llama3._output_linear_init(dim)
        ),
        layers=layers,
    )


def _qwen3_moe_config():
    """A tiny Qwen3 MoE: torchtitan's ``debugmodel_moe`` recipe (``_build_qwen3_moe_layers``:
    fused QKV with q/k norms, a softmax top-k router, ``GroupedExperts`` with 3-D weights, the
    "standard" all-to-all token dispatcher, auxiliary-loss-free load balancing) at 64 wide, 2
    layers, 8 experts, top 2, with torchtitan's SDPA inner attention (as for Llama 3). The
    grouped GEMMs run in bfloat16 (``torch._grouped_mm``, which has a CPU kernel); every
    width is a multiple of 8, as its 16-byte stride rule needs."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, head_dim = 64, 16
    layers = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=2,
        dim=dim,
        n_heads=4,
        n_kv_heads=2,
        head_dim=head_dim,
        moe_hidden_dim=32,
        num_experts=MOE_EXPERTS,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ_LEN * 2, theta=1000000.0),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=layers,
    )


def _model_spec(case: str) -> tuple:
    """(config, torchtitan's parallelize function, its post-optimizer hook or None, its
    state-dict adapter class) of a case, as its ``model_registry`` pairs them."""
    if case == "llama3":
        from torchtitan.models.llama3 import Llama3StateDictAdapter, parallelize_llama

        return _llama3_config(), parallelize_llama, None, Llama3StateDictAdapter
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3

    return (_qwen3_moe_config(), parallelize_qwen3, register_moe_load_balancing_hook,
            Qwen3StateDictAdapter)  # fmt: skip


def make_assets(root: Path) -> None:
    """A local text dataset (``train.json``) and a small byte-pair tokenizer (tokenizer.json,
    tokenizer_config.json) for torchtitan's ``HuggingFaceTextDataLoader``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = (REPO / "README.md").read_text().split()
    texts = [" ".join(words[i : i + 40]) for i in range(0, min(len(words), 4000), 40)]
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )


def _components(rank: int, world: int, seed: int, root: Path, case: str = "llama3",
                ep: int = 1) -> dict:  # fmt: skip
    """torchtitan's components as ``Trainer.__init__`` builds them, on a CPU mesh, for a case
    (``llama3`` or ``qwen3_moe``) at expert-parallel degree ``ep``."""
    stub_triton()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    parallel_dims_module.device_type = "cpu"  # its meshes are built for the accelerator
    torch.manual_seed(seed)
    # "partial_dtensor": DTensor on the model-parallel axes only, FSDP2 over "fsdp" (the
    # default "spmd_types" path wants every parameter distributed first, for TP)
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world, expert_parallel_degree=ep,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    # as the Trainer does (the MoE token dispatcher reads it; its default is spmd_types)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ_LEN, steps=10)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    model_config, parallelize, post_optimizer_build, _ = _model_spec(case)
    # what the Trainer does first (sets the sharding config); a non-trainer config may be
    # anything with a ParallelismConfig in .parallelism
    model_config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = model_config.build()
    model = parallelize(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=str(root / "dump"),
    )
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # torchtitan sets gradient_divide_factor=1.0, which FSDP
        if isinstance(module, FSDPModule):  # sends as PREMUL_SUM(1.0); gloo has only SUM
            module.set_force_sum_reduction_for_comms(True)  # (the same sum, divided by 1)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = default_adamw(lr=5e-3).build(model_parts=[model])
    # the model spec's post_optimizer_build_fn, as the Trainer calls it: for the MoE, its
    # load balancing (an optimizer pre-step hook that updates expert_bias_E)
    if post_optimizer_build is not None:
        post_optimizer_build(optimizers, [model], parallel_dims)
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=1, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=10)
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    dataloader = HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path=str(root / "data"), infinite=True
    ).build(
        dp_world_size=batch_mesh.size() if batch_mesh is not None else 1,
        dp_rank=batch_mesh.get_local_rank() if batch_mesh is not None else 0,
        tokenizer=HuggingFaceTokenizer(tokenizer_path=str(root / "tokenizer")),
        seq_len=SEQ_LEN,
        local_batch_size=BATCH,
        snapshot_every_n_steps=1,
    )
    # torchtitan's train state is the Trainer itself (its state_dict: step, ntokens_seen); a
    # Trainer cannot be built without CUDA, so this object carries the Trainer's own methods.
    train_state = types.SimpleNamespace(step=0, ntokens_seen=0)
    train_state.state_dict = types.MethodType(Trainer.state_dict, train_state)
    train_state.load_state_dict = types.MethodType(Trainer.load_state_dict, train_state)
    return {
        "model_config": model_config,
        "model": model,
        "optimizers": optimizers,
        "lr_schedulers": lr_schedulers,
        "dataloader": dataloader,
        "train_state": train_state,
    }


def _snapshot(parts: dict) -> dict:
    """Everything the checkpoint should carry, gathered to full tensors (a collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    def full(value):
        if isinstance(value, DTensor):
            return value.full_tensor().clone()  # at one rank it may share the storage
        return value.clone() if isinstance(value, torch.Tensor) else value

    model = parts["model"]
    params = {name: full(p.detach()) for name, p in model.named_parameters()}
    buffers = {  # persistent ones: the MoE's expert_bias_E (the load balancing's state)
        f"{prefix}.{name}" if prefix else name: full(buf)
        for prefix, module in model.named_modules()
        for name, buf in module.named_buffers(recurse=False)
        if name not in module._non_persistent_buffers_set
    }
    names = {id(p): name for name, p in model.named_parameters()}
    optim_state, groups = {}, []
    for optimizer in parts["optimizers"].optimizers:
        for param, state in optimizer.state.items():
            optim_state[names[id(param)]] = {k: full(v) for k, v in sorted(state.items())}
        for group in optimizer.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
    return {
        "params": params,
        "optimizer": optim_state,
        "param_groups": groups,
        "lr_scheduler": {
            "container": parts["lr_schedulers"].state_dict(),
            "schedulers": [
                {k: v for k, v in s.state_dict().items() if k != "lr_lambdas"}
                for s in parts["lr_schedulers"].schedulers
            ],
        },
        "train_state": dict(parts["train_state"].state_dict()),
        **({"buffers": buffers} if buffers else {}),
    }


def _dataloader_snapshot(dataloader) -> dict:
    """The dataloader's state and the batch it yields next (iterating a copy of its state)."""
    state = dataloader.state_dict()
    batch, labels = next(iter(dataloader))
    dataloader.load_state_dict(state)
    return {"state": state, "next_input": batch["input"], "next_labels": labels}


def _train(parts: dict, steps: int) -> None:
    import torch.nn.functional as F

    model, optimizers = parts["model"], parts["optimizers"]
    data = iter(parts["dataloader"])
    for _ in range(steps):
        input_dict, labels = next(data)
        logits = model(input_dict["input"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizers.step()
        parts["lr_schedulers"].step()
        optimizers.zero_grad()
        parts["train_state"].step += 1
        parts["train_state"].ntokens_seen += labels.numel()


def _placements(model) -> dict[str, int]:
    """How many parameters have each placement (with the mesh's axes where not ``fsdp``)."""
    placements: dict[str, int] = {}
    for param in model.parameters():
        if not hasattr(param, "placements"):
            key = "plain tensor"
        else:
            key = str(tuple(param.placements))
            if param.device_mesh.mesh_dim_names != ("fsdp",):
                key += f" on {param.device_mesh.mesh_dim_names}"
        placements[key] = placements.get(key, 0) + 1
    return placements


def _hf_reference(parts: dict, adapter_cls, root: Path, rank: int) -> None:
    """What torchtitan's HF export should hold, ``reference/hf/``: its adapter's ``to_hf``
    of the full trained model (its path for plain tensors, which splits each 3-D expert
    weight into one tensor per expert), and ``hf_assets/model.safetensors.index.json`` naming
    two output files for those keys (layer 0 and the embedding in one, the rest in the
    other), so that the export writes per-rank shards into ``sharded/`` and consolidates
    them. A collective."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in parts["model"].state_dict().items()}  # fmt: skip
    if rank == 0:
        hf_state = adapter_cls(parts["model_config"], None).to_hf(full)
        (root / "reference" / "hf").mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().clone() for k, v in hf_state.items()},
                  root / "reference" / "hf" / "model.safetensors")  # fmt: skip
        weight_map = {
            key: f"model-0000{1 if '.layers.0.' in key or 'embed' in key else 2}-of-00002"
            ".safetensors"
            for key in sorted(hf_state)
        }
        assets = root / "hf_assets"
        assets.mkdir(parents=True, exist_ok=True)
        (assets / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
    dist.barrier()


def save_run(rank: int, world: int, root: str, case: str = "llama3", ep: int = 1) -> dict:
    """torchtitan trains two steps and its CheckpointManager saves step-2; the reference. For
    the MoE case also torchtitan's HF export (``last_save_in_hf=True`` through its state-dict
    adapter) of the same model, into ``hf/step-2``."""
    import torch
    from torchtitan.components.checkpoint import CheckpointManager

    root = Path(root)
    parts = _components(rank, world, 0, root, case, ep)
    _train(parts, STEPS)

    def manager(folder: str, sd_adapter=None, **options):
        config = CheckpointManager.Config(
            enable=True, folder=folder, interval=1, keep_latest_k=0, async_mode="disabled",
            **options,
        )  # fmt: skip
        return CheckpointManager(
            config,
            dataloader=parts["dataloader"],
            model_parts=[parts["model"]],
            optimizers=parts["optimizers"],
            lr_schedulers=parts["lr_schedulers"],
            states={"train_state": parts["train_state"]},
            sd_adapter=sd_adapter,
            base_folder=str(root),
        )

    checkpointer = manager("checkpoint")
    t0 = time.perf_counter()
    saved = checkpointer.save(curr_step=parts["train_state"].step)
    seconds = time.perf_counter() - t0
    checkpointer.close()
    hf = {}
    reference = root / "reference"
    reference.mkdir(exist_ok=True)
    if case == MOE:  # the last step's save, model only, through the adapter's to_hf
        adapter_cls = _model_spec(case)[3]
        _hf_reference(parts, adapter_cls, root, rank)
        exporter = manager(
            "hf", sd_adapter=adapter_cls(parts["model_config"], str(root / "hf_assets")),
            last_save_model_only=True, last_save_in_hf=True, export_dtype="float32",
        )  # fmt: skip
        t0 = time.perf_counter()
        hf_saved = exporter.save(curr_step=parts["train_state"].step, last_step=True)
        hf = {"saved": bool(hf_saved), "seconds": round(time.perf_counter() - t0, 2),
              "adapter": adapter_cls.__name__}  # fmt: skip
        exporter.close()
    snapshot = _snapshot(parts)
    torch.save(_dataloader_snapshot(parts["dataloader"]), reference / f"dataloader-{rank}.pt")
    model_keys = sorted(parts["model"].state_dict())  # the fused-QKV hook splits DTensors:
    if rank != 0:  # every rank takes part
        return {}
    torch.save(snapshot, reference / "state.pt")
    return {
        "saved": bool(saved),
        "seconds": round(seconds, 2),
        "placements": _placements(parts["model"]),
        "model_keys": model_keys,
        "params": {n: list(p.shape) for n, p in snapshot["params"].items()},
        "buffers": sorted(snapshot.get("buffers", {})),
        "train_state": snapshot["train_state"],
        "lr_scheduler": snapshot["lr_scheduler"]["container"],
        **({"hf": hf} if hf else {}),
    }


# ---------------------------------------------------------------- restore


def _diff(got, want, where: str, out: list[str]) -> int:
    """Compare nested values bit for bit (tensors: dtype, shape, bytes); count the leaves."""
    import torch

    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            out.append(f"{where}: keys {sorted(map(str, got)) if isinstance(got, dict) else got}")
            return 0
        return sum(_diff(got[k], want[k], f"{where}.{k}", out) for k in want)
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            out.append(f"{where}: {got!r} != {want!r}")
            return 0
        return sum(_diff(g, w, f"{where}[{i}]", out) for i, (g, w) in enumerate(zip(got, want)))
    if isinstance(want, torch.Tensor):
        same = (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got.view(torch.uint8) if got.dim() else got, want.view(torch.uint8)
                            if want.dim() else want)
        )  # fmt: skip
        if not same:
            out.append(f"{where}: tensor differs")
        return 1
    if type(got) is not type(want) or got != want:
        out.append(f"{where}: {got!r} != {want!r}")
    return 1


def restore_run(rank: int, world: int, root: str, api: str, states: list[str],
                case: str = "llama3", ep: int = 1) -> dict:  # fmt: skip
    """Fresh components (another seed, another world size, another expert-parallel degree);
    shardstream restores step-2."""
    import torch

    import shardstream
    from shardstream import CheckpointConfig, CheckpointManager

    root = Path(root)
    parts = _components(rank, world, 1234 + world + 100 * (ep - 1), root, case, ep)
    path = root / "checkpoint" / f"step-{STEPS}"
    stateful = {name: parts[name] for name in states}
    before = _snapshot(parts)
    t0 = time.perf_counter()
    optimizer = parts["optimizers"].optimizers[0]
    if api == "CheckpointManager.restore":
        cfg = CheckpointConfig(directory=str(root / f"shardstream-ws{world}"))
        manager = CheckpointManager(cfg, model=parts["model"], optimizer=optimizer,
                                    lr_scheduler=parts["lr_schedulers"])  # fmt: skip
        restored = manager.restore(path=str(path), states=stateful)  # (step, extra)
        restored = restored[0] if isinstance(restored, tuple) else restored
        manager.close()
    else:
        result = shardstream.load(path, model=parts["model"], optimizer=optimizer,
                                  lr_scheduler=parts["lr_schedulers"], states=stateful)  # fmt: skip
        restored = result.step
    seconds = time.perf_counter() - t0
    after = _snapshot(parts)
    mismatches: list[str] = []
    counts = {}
    if "dataloader" in states:
        want = torch.load(root / "reference" / f"dataloader-{rank}.pt", weights_only=True)
        got = _dataloader_snapshot(parts["dataloader"])
        counts["dataloader"] = _diff(got, want, f"rank {rank} dataloader", mismatches)
    if rank != 0:
        return {"mismatches": mismatches}
    want = torch.load(root / "reference" / "state.pt", weights_only=True)
    for part in ("params", "buffers", "optimizer", "param_groups", "lr_scheduler",
                 "train_state"):  # fmt: skip
        if part in want or part in after:
            counts[part] = _diff(after.get(part), want.get(part), part, mismatches)
    changed = sum(
        not torch.equal(before["params"][n], after["params"][n]) for n in before["params"]
    )
    return {
        "restored_step": restored,
        "placements": _placements(parts["model"]),
        "counts": counts,
        "params_changed": changed,
        "train_state": after["train_state"],
        "lr_scheduler": after["lr_scheduler"]["container"],
        "mismatches": mismatches,
        "seconds": round(seconds, 2),
    }


def refused_run(rank: int, world: int, root: str) -> dict:
    """The dataloader at another data-parallel size: torchtitan asserts the size, so the
    restore must be refused, naming it, before any tensor is written."""
    import torch

    import shardstream

    root = Path(root)
    parts = _components(rank, world, 99, root)
    before = _snapshot(parts)
    try:
        shardstream.load(
            root / "checkpoint" / f"step-{STEPS}",
            model=parts["model"],
            optimizer=parts["optimizers"].optimizers[0],
            lr_scheduler=parts["lr_schedulers"],
            states={"train_state": parts["train_state"], "dataloader": parts["dataloader"]},
        )
        said = "restored without an error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        said = f"{type(exc).__name__}: {exc}"
    after = _snapshot(parts)
    untouched = all(torch.equal(before["params"][n], after["params"][n]) for n in before["params"])
    untouched = untouched and before["train_state"] == after["train_state"]
    untouched = untouched and before["lr_scheduler"] == after["lr_scheduler"]
    return {"said": said.replace(str(root) + "/", ""), "untouched": untouched}


# ---------------------------------------------------------------- CLI checks


def _shardstream(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardstream", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip


def _last_line(proc: subprocess.CompletedProcess, stderr_first: bool = False) -> str:
    streams = (proc.stderr, proc.stdout) if stderr_first else (proc.stdout, proc.stderr)
    last = (streams[0].strip() or streams[1].strip()).splitlines()
    return last[-1] if last else ""


def cli_checks(path: Path, base: Path | None = None, tensors: int | None = None) -> list[dict]:
    """``shardstream inspect --json`` and ``shardstream verify`` of a checkpoint (and, given
    ``tensors``, inspect's format and tensor count); paths in details are relative to
    ``base``."""
    base = base or path.parent.parent
    checks = []
    inspect = _shardstream("inspect", "--json", path)
    step = found = None
    try:
        report = json.loads(inspect.stdout)
        step = report.get("step")
        found = (report.get("format"), report.get("num_tensors"))
    except (json.JSONDecodeError, AttributeError):
        pass
    detail = f"exit {inspect.returncode}, step {step}"
    if tensors is not None:
        detail += f", format {found and found[0]}, {found and found[1]} tensors"
    checks.append({
        "check": "shardstream inspect --json reads it",
        "ok": inspect.returncode == 0 and step == STEPS
        and (tensors is None or (found and found[1] == tensors)),
        "detail": detail + (
            f": {inspect.stderr.strip().splitlines()[-1]}" if inspect.returncode else ""),
    })  # fmt: skip
    verify = _shardstream("verify", path)
    checks.append({
        "check": "shardstream verify checks it",
        "ok": verify.returncode == 0,
        "detail": f"exit {verify.returncode}: {_last_line(verify)}".replace(
            str(base) + "/", ""),
    })  # fmt: skip
    return checks


def hf_checks(root: Path, base: Path, reference_tensors: int) -> list[dict]:
    """The MoE case's HF export (``hf/step-2``) through shardstream's merge and test; merges
    it and the DCP checkpoint for ``hf_compare_run``."""
    export, ckpt = root / "hf" / f"step-{STEPS}", root / "checkpoint" / f"step-{STEPS}"
    checks = []

    def rel(text: str) -> str:
        return text.replace(str(base) + "/", "")

    for source, target in ((export, "merged-hf"), (ckpt, "merged-dcp")):
        merge = _shardstream("merge", "--local_dir", source, "--target_dir", root / target,
                             "--json", "--quiet", "--overwrite")  # fmt: skip
        try:
            summary = json.loads(merge.stdout)
        except json.JSONDecodeError:
            summary = {}
        tensors = summary.get("tensors")
        want = reference_tensors if source == export else None
        checks.append({
            "check": f"shardstream merge --local_dir {rel(str(source))} writes "
                     f"{rel(str(root / target))}",
            "ok": merge.returncode == 0 and (want is None or tensors == want),
            "detail": rel(f"exit {merge.returncode}: {tensors} tensors into "
                          f"{', '.join(summary.get('files', []))}"
                          + (f": {_last_line(merge, True)}" if merge.returncode else "")),
        })  # fmt: skip
    test = _shardstream("test", "--local_dir", export, "--test_hf_dir",
                        root / "reference" / "hf", "--exact")  # fmt: skip
    checks.append({
        "check": f"shardstream test --local_dir {rel(str(export))} --test_hf_dir "
                 "<torchtitan's to_hf of the trained model> --exact agrees",
        "ok": test.returncode == 0 and _last_line(test).startswith("OK"),
        "detail": rel(f"exit {test.returncode}: {_last_line(test)}"),
    })  # fmt: skip
    # the DCP checkpoint holds torchtitan's names (fused-QKV hook's wq/wk/wv, 3-D experts),
    # the export HF's; only torchtitan's adapter maps one to the other, so shardstream's test
    # must say the names differ, clearly (hf_compare_run maps them with the adapter)
    test = _shardstream("test", "--local_dir", ckpt, "--test_hf_dir", export, "--exact")
    out = test.stdout + test.stderr
    missing, unexpected = out.count("missing from the checkpoint"), out.count("unexpected;")
    checks.append({
        "check": f"shardstream test --local_dir {rel(str(ckpt))} --test_hf_dir "
                 f"{rel(str(export))} --exact says the names differ (torchtitan's names in "
                 "the DCP checkpoint, HF's in the export)",
        "ok": test.returncode != 0 and "Traceback" not in out and missing > 0,
        "detail": rel(f"exit {test.returncode}: {missing} HF names missing from the "
                      f"checkpoint, {unexpected} torchtitan names unexpected; "
                      f"{_last_line(test)}"),
    })  # fmt: skip
    return checks


def hf_compare_run(rank: int, world: int, root: str) -> dict:
    """Tensor by tensor, bit for bit (one process): torchtitan's HF export (its consolidated
    files) against torchtitan's own ``to_hf`` of the trained model, shardstream's merge of
    the export against the export, and torchtitan's ``to_hf`` of shardstream's merge of the
    DCP checkpoint against the export."""
    stub_triton()
    from safetensors.torch import load_file

    root = Path(root)

    def read(folder: Path) -> dict:
        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(file))
        return tensors

    export = read(root / "hf" / f"step-{STEPS}")
    merged_dcp = read(root / "merged-dcp")
    config, _, _, adapter_cls = _model_spec(MOE)
    adapter = adapter_cls(config, None)
    mapped = adapter.to_hf(merged_dcp)
    out = {"export_tensors": len(export),
           "expert_tensors": sum(".mlp.experts." in k for k in export),
           "dropped_by_to_hf": sorted(k for k, v in merged_dcp.items()
                                      if not adapter.to_hf({k: v}))}  # fmt: skip
    for name, got in (
        ("reference_vs_export", read(root / "reference" / "hf")),
        ("merged_export_vs_export", read(root / "merged-hf")),
        ("to_hf_of_merged_dcp_vs_export", mapped),
    ):
        mismatches: list[str] = []
        out[name] = {"count": _diff(got, export, name, mismatches), "mismatches": mismatches}
    return out


# ---------------------------------------------------------------- driver and report


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torchtitan", "torch", "torchdata", "datasets", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_all(work: Path) -> dict:
    import shutil

    from shardstream.testing.distributed import run

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    make_assets(work)
    results: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_revision(),
        "versions": _versions(),
        "save_world": SAVE_WORLD,
    }
    print(f"torchtitan saves at {SAVE_WORLD} ranks ...", flush=True)
    t0 = time.perf_counter()
    results["save"] = run(save_run, SAVE_WORLD, str(work), timeout=900)[0]
    results["save"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    ckpt = work / "checkpoint" / f"step-{STEPS}"
    results["files"] = sorted(p.name for p in ckpt.iterdir())
    print("shardstream inspect / verify ...", flush=True)
    results["cli"] = cli_checks(ckpt)
    results["restores"] = []
    for spec in RESTORES:
        print(f"shardstream restores at {spec['world']} ({spec['api']}) ...", flush=True)
        try:
            out = run(restore_run, spec["world"], str(work), spec["api"], spec["states"],
                      timeout=900)[0]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            out = {"mismatches": [f"{type(exc).__name__}: {str(exc)[-600:]}"]}
        results["restores"].append({**spec, **out})
    print("dataloader at another data-parallel size (must be refused) ...", flush=True)
    results["refused"] = run(refused_run, 4, str(work), timeout=900)[0]
    results["moe"] = moe_run(work)
    return results


def moe_run(work: Path) -> dict:
    """The MoE case: torchtitan's Qwen3 MoE with FSDP and expert parallelism saves a full
    checkpoint and its HF export; shardstream reads, verifies, restores and merges them."""
    from shardstream.testing.distributed import run

    root = work / MOE
    root.mkdir(parents=True)
    make_assets(root)
    out: dict = {"case": MOE, "save_world": SAVE_WORLD, "save_ep": MOE_SAVE_EP}
    print(f"torchtitan's Qwen3 MoE saves at {SAVE_WORLD} ranks, EP {MOE_SAVE_EP} ...", flush=True)
    t0 = time.perf_counter()
    try:
        out["save"] = run(save_run, SAVE_WORLD, str(root), MOE, MOE_SAVE_EP, timeout=900)[0]
    except Exception as exc:  # noqa: BLE001 - reported as a failure; nothing else can run
        out["save"] = {"saved": False, "error": f"{type(exc).__name__}: {str(exc)[-800:]}"}
        return out
    out["save"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    ckpt, export = root / "checkpoint" / f"step-{STEPS}", root / "hf" / f"step-{STEPS}"
    out["files"] = sorted(p.name for p in ckpt.iterdir())
    out["hf_files"] = sorted(str(p.relative_to(export)) for p in export.rglob("*") if p.is_file())
    print("shardstream inspect / verify (MoE) ...", flush=True)
    out["cli"] = cli_checks(ckpt, base=work)
    out["restores"] = []
    for spec in MOE_RESTORES:
        print(f"shardstream restores the MoE at {spec['world']}, EP {spec['ep']} "
              f"({spec['api']}) ...", flush=True)  # fmt: skip
        try:
            got = run(restore_run, spec["world"], str(root), spec["api"], spec["states"], MOE,
                      spec["ep"], timeout=900)[0]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            got = {"mismatches": [f"{type(exc).__name__}: {str(exc)[-600:]}"]}
        out["restores"].append({**spec, **got})
    print("shardstream on torchtitan's HF export ...", flush=True)
    from safetensors import safe_open

    with safe_open(root / "reference" / "hf" / "model.safetensors", "pt") as f:
        reference = len(list(f.keys()))
    out["hf_cli"] = cli_checks(export, base=work, tensors=reference)
    out["hf_cli"] += hf_checks(root, work, reference)
    try:
        out["hf_compare"] = run(hf_compare_run, 1, str(root), timeout=900)[0]
    except Exception as exc:  # noqa: BLE001 - reported as a failure
        out["hf_compare"] = {"error": f"{type(exc).__name__}: {str(exc)[-800:]}"}
    return out


HF_COMPARISONS = {
    "reference_vs_export": "torchtitan's HF export holds its adapter's `to_hf` of the trained "
    "model",
    "merged_export_vs_export": "shardstream's merge of the export holds the export's tensors",
    "to_hf_of_merged_dcp_vs_export": "torchtitan's adapter `to_hf` of shardstream's merge of "
    "the DCP checkpoint (3-D experts split per expert) equals the export",
}


def _restore_ok(r: dict) -> bool:
    return not r.get("mismatches") and r.get("restored_step") == STEPS


def failures(results: dict) -> list[str]:
    bad = [f"{c['check']}: {c['detail']}" for c in results["cli"] if not c["ok"]]
    if not results["save"].get("saved"):
        bad.append("torchtitan's CheckpointManager did not save")
    for r in results["restores"]:
        if not _restore_ok(r):
            bad.append(f"restore at {r['world']}: step {r.get('restored_step')}, "
                       f"{r.get('mismatches', [])[:5]}")  # fmt: skip
    refused = results["refused"]
    if not (refused["untouched"] and "dataloader" in refused["said"]
            and "nothing was restored" in refused["said"]):  # fmt: skip
        bad.append(f"dataloader at 4 ranks: {refused}")
    return bad + moe_failures(results.get("moe"))


def moe_failures(moe: dict | None) -> list[str]:
    if moe is None:
        return ["MoE case: not run"]
    save = moe["save"]
    if not save.get("saved"):
        return [f"MoE: torchtitan's CheckpointManager did not save: {save.get('error')}"]
    bad = [] if save.get("hf", {}).get("saved") else ["MoE: torchtitan's HF export not saved"]
    bad += [f"MoE: {c['check']}: {c['detail']}"
            for c in moe["cli"] + moe["hf_cli"] if not c["ok"]]  # fmt: skip
    for r in moe["restores"]:
        if not _restore_ok(r):
            bad.append(f"MoE restore at {r['world']}, EP {r['ep']}: step "
                       f"{r.get('restored_step')}, {r.get('mismatches', [])[:5]}")  # fmt: skip
    compare = moe.get("hf_compare", {})
    if "error" in compare:
        bad.append(f"MoE: HF comparison: {compare['error']}")
    for key in HF_COMPARISONS:
        if key in compare and compare[key]["mismatches"]:
            bad.append(f"MoE: {key}: {compare[key]['mismatches'][:5]}")
    return bad


def _count_text(counts: dict) -> str:
    names = {
        "params": "parameters",
        "buffers": "persistent buffers",
        "optimizer": "optimizer entries",
        "param_groups": "param-group values",
        "lr_scheduler": "scheduler fields",
        "train_state": "train-state fields",
        "dataloader": "dataloader values (state and next batch, this rank)",
    }
    return ", ".join(f"{n} {names[k]}" for k, n in counts.items())


def _verdict(r: dict) -> str:
    if _restore_ok(r):
        return "all equal: " + _count_text(r.get("counts", {}))
    return f"**{len(r.get('mismatches', []))} differ**"


def _restore_line(r: dict, where: str) -> str:
    return (
        f"- {'pass' if _restore_ok(r) else '**FAIL**'}: restore at {where} with "
        f"`{r['api']}`: {_count_text(r.get('counts', {}))} bit for bit; train state "
        f"{r.get('train_state')}, scheduler {r.get('lr_scheduler')}; the restore changed "
        f"{r.get('params_changed')} of the fresh model's parameters ({r.get('seconds')} s)"
        + (f"; differ: {', '.join(r['mismatches'][:5])}" if r.get("mismatches") else "")
    )


def _placement_text(placements: dict) -> str:
    return ", ".join(f"{n}× {p}" for p, n in sorted(placements.items()))


def _moe_checks(moe: dict) -> list[str]:
    """The MoE case's lines of "Every check"."""
    save = moe.get("save", {})
    lines = [
        f"- {'pass' if save.get('saved') else '**FAIL**'}: MoE: torchtitan's "
        f"`CheckpointManager.save` writes `{MOE}/checkpoint/step-{STEPS}` at "
        f"{moe.get('save_world')} ranks, EP {moe.get('save_ep')} "
        f"({', '.join(moe.get('files', [])) or save.get('error')})"
    ]
    if not save.get("saved"):
        return lines
    lines += [f"- {'pass' if c['ok'] else '**FAIL**'}: MoE: {c['check']} ({c['detail']})"
              for c in moe["cli"]]  # fmt: skip
    for r in moe["restores"]:
        where = f"{r['world']} process{'es' if r['world'] > 1 else ''}, EP {r['ep']}"
        line = _restore_line(r, where).replace(": restore at", ": MoE: restore at", 1)
        lines.append(line + f"; restored into {_placement_text(r.get('placements', {}))}")
    hf = save.get("hf", {})
    lines.append(
        f"- {'pass' if hf.get('saved') else '**FAIL**'}: MoE: torchtitan's HF export "
        f"(`last_save_in_hf=True`, `{hf.get('adapter')}`) writes `{MOE}/hf/step-{STEPS}` "
        f"({', '.join(moe.get('hf_files', []))})"
    )
    lines += [f"- {'pass' if c['ok'] else '**FAIL**'}: MoE, HF export: {c['check']} "
              f"({c['detail']})" for c in moe.get("hf_cli", [])]  # fmt: skip
    compare = moe.get("hf_compare", {})
    if "error" in compare:
        lines.append(f"- **FAIL**: MoE, HF export: tensor-by-tensor comparison: "
                     f"{compare['error']}")  # fmt: skip
        return lines
    for key, text in HF_COMPARISONS.items():
        got = compare.get(key, {})
        ok = key in compare and not got.get("mismatches")
        lines.append(
            f"- {'pass' if ok else '**FAIL**'}: MoE, HF export, tensor by tensor: {text}: "
            f"{got.get('count')} of {compare.get('export_tensors')} tensors "
            f"({compare.get('expert_tensors')} of them one expert's weight each) bit for bit"
            + (f"; differ: {', '.join(got['mismatches'][:5])}" if got.get("mismatches") else "")
        )
    dropped = compare.get("dropped_by_to_hf", [])
    if dropped:
        lines[-1] += (f"; `to_hf` leaves out {', '.join(f'`{k}`' for k in dropped)} (no HF "
                      "name), which the export lacks too")  # fmt: skip
    return lines


def _moe_coverage() -> list[str]:
    """The MoE case's bullets of "What this covers and what it does not"."""
    return [
        "- The MoE model: of torchtitan 0.3.0's MoE models, Qwen3 is the one that runs on CPU "
        "as it ships: the Llama 3 path's GQA attention (fused QKV; SDPA set as above) and the "
        "common `MoE` module, whose grouped GEMMs call `torch._grouped_mm` in bfloat16, which "
        "has a CPU kernel. gpt-oss's sink attention needs the log-sum-exp that only its "
        "flex attention (through `torch.compile`) and varlen attention (CUDA flash "
        "attention) return; DeepSeek V3 uses the same MoE module behind MLA attention, so it "
        "would add nothing here but a config.",
        "- Expert parallelism runs on CPU over gloo: the `standard` dispatcher's all-to-alls "
        "(`all_to_all_single`) are gloo ops, and `ParallelDims` builds the sparse `efsdp`×`ep` "
        "mesh, on which FSDP2 shards each 3-D expert weight as `(_StridedShard(0), Shard(0))`. "
        "The script sets torchtitan's SPMD backend to `partial_dtensor` as its `Trainer` does "
        "(the dispatcher reads it; its default expects `spmd_types` meshes). Saved at EP 2, "
        "the checkpoint is restored without EP (1 process), at 4 processes with EP 2 (the "
        "experts then split over both efsdp and ep) and with EP 4, into fresh "
        "`parallelize_qwen3` models: every expert weight, its AdamW moments, the router, the "
        "load-balancing buffer `expert_bias_E` (persistent, updated by torchtitan's "
        "optimizer pre-step hook), scheduler and train state, bit for bit. The dataloader is "
        "not restored in the MoE case (the Llama 3 rows cover it); no tensor, sequence or "
        "context parallelism, no DeepEP/HybridEP dispatchers (CUDA only).",
        "- The HF export: torchtitan's `Qwen3StateDictAdapter.to_hf` splits each rank's "
        "local experts into one 2-D tensor per expert (`mlp.experts.N.gate_proj` ...), "
        "written per rank into `sharded/` and consolidated into the indexed files. shardstream "
        "inspects, verifies (safetensors files carry no checksums: their headers and "
        "extents are what is checked), merges and tests it like any HF-writer output; merged, "
        "it equals the export and torchtitan's own `to_hf` of the trained model, bit for bit. "
        "The DCP checkpoint holds torchtitan's names (3-D experts, `expert_bias_E`, which the "
        "adapter drops), so `shardstream test` of the checkpoint against the export reports "
        "the names as missing and unexpected, as it should: only torchtitan's adapter maps "
        "them, and mapped by it, shardstream's merge of the checkpoint equals the export. "
        "Restoring the HF export into torchtitan's model is not covered (see the "
        "tool-written section: refused, as the names differ).",
    ]


def render(results: dict) -> str:
    v, save = results["versions"], results["save"]
    lines = [
        "## Interop with torchtitan 0.3.0's own checkpoint manager",
        "",
        generated_note("bench/titan_interop.py", "bench/results/titan_interop.json"),
        "",
        "Checkpoints saved by torchtitan's `CheckpointManager.save` (the DCP train state its "
        "trainer writes), restored by shardstream into torchtitan's own objects at other world "
        "sizes: a dense Llama 3 and a Qwen3 mixture-of-experts model with expert parallelism, "
        "whose HF export (`last_save_in_hf=True`) shardstream also reads. Reproduce with "
        "`make interop` (`bench/titan_interop.py`).",
        "",
        f"- **Run:** {results['started']}, shardstream @ {results['commit']}; torchtitan "
        f"{v.get('torchtitan')}, torch {v.get('torch')}, torchdata {v.get('torchdata')}, "
        f"datasets {v.get('datasets')}",
        "- **How torchtitan trains:** its components built as `Trainer.__init__` builds them, "
        f"on {results['save_world']} CPU ranks over gloo: a tiny Llama 3 "
        "(`Llama3Model.Config`, fused QKV as in its default models, torchtitan's "
        "`ScaledDotProductAttention`) on the meta device, FSDP2 through `parallelize_llama` "
        "with a CPU mesh from `ParallelDims`, `init_weights`; `OptimizersContainer` (AdamW, "
        "`default_adamw`), `LRSchedulersContainer` (warm-up, linear decay), "
        "`HuggingFaceTextDataLoader` over a local text file and a small BPE tokenizer.json, "
        "the train state through the `Trainer`'s own `state_dict`/`load_state_dict` (step, "
        f"ntokens_seen). {STEPS} steps, then `CheckpointManager.save` writes "
        f"`checkpoint/step-{STEPS}` ({save.get('seconds')} s).",
        "- **Placements torchtitan wrote:** "
        + ", ".join(f"{n}× {p}" for p, n in sorted(save.get("placements", {}).items())),
        f"- **Saved train state:** `train_state` {save.get('train_state')}, `lr_scheduler` "
        f"{save.get('lr_scheduler')}; the model's keys are the hook-presented ones "
        "(`attention.qkv_linear.wq/wk/wv.weight`), its parameter is the fused `wqkv`.",
    ]
    moe = results.get("moe") or {}
    moe_save = moe.get("save", {})
    if moe_save.get("saved"):
        hf = moe_save.get("hf", {})
        lines += [
            "- **The MoE case:** torchtitan's Qwen3 MoE (`Qwen3Model.Config` from its "
            "`_build_qwen3_moe_layers`, as its `debugmodel_moe` flavour: fused QKV with q/k "
            f"norms, a softmax top-2 router over {MOE_EXPERTS} `GroupedExperts` with 3-D "
            "weights, the `standard` all-to-all token dispatcher, auxiliary-loss-free load "
            "balancing; 64 wide, 2 layers) built and trained the same way on "
            f"{moe['save_world']} ranks, FSDP2 with expert parallelism {moe['save_ep']} "
            "through `parallelize_qwen3` and `register_moe_load_balancing_hook` (its model "
            "spec's `parallelize_fn` and `post_optimizer_build_fn`); `CheckpointManager.save` "
            f"writes `{MOE}/checkpoint/step-{STEPS}` ({moe_save.get('seconds')} s), then "
            "torchtitan's last-step save with `last_save_model_only`, `last_save_in_hf=True` "
            f"and `{hf.get('adapter')}` (an index in `hf_assets_path` naming two files) writes "
            f"its HF export `{MOE}/hf/step-{STEPS}` ({hf.get('seconds')} s: "
            f"{', '.join(moe.get('hf_files', []))}).",
            "- **Placements torchtitan wrote (MoE):** " + _placement_text(moe_save["placements"])
            + f"; persistent buffers {', '.join(f'`{b}`' for b in moe_save.get('buffers', []))}",
        ]  # fmt: skip
    lines.append("")
    rows = [("Llama 3", r["world"], f"`{r['api']}`", ", ".join(r["states"]) + " (states=)",
             r.get("restored_step"), _verdict(r), r.get("seconds", "–"))
            for r in results["restores"]]  # fmt: skip
    rows += [("Qwen3 MoE", f"{r['world']}, EP {r['ep']}", f"`{r['api']}`",
              ", ".join(r["states"]) + " (states=)", r.get("restored_step"), _verdict(r),
              r.get("seconds", "–")) for r in moe.get("restores", [])]  # fmt: skip
    lines += table(
        "model | restore at | API | also restored | step returned | compared bit for bit | s",
        "lrllrlr",
        rows,
    )
    lines += ["", "**Every check**", ""]
    lines.append(f"- {'pass' if save.get('saved') else '**FAIL**'}: torchtitan's "
                 f"`CheckpointManager.save` writes `step-{STEPS}` "
                 f"({', '.join(results.get('files', []))})")  # fmt: skip
    for c in results["cli"]:
        lines.append(f"- {'pass' if c['ok'] else '**FAIL**'}: {c['check']} ({c['detail']})")
    for r in results["restores"]:
        lines.append(_restore_line(r, f"{r['world']} process{'es' if r['world'] > 1 else ''}"))
    refused = results["refused"]
    ok = refused["untouched"] and "dataloader" in refused["said"]
    lines.append(
        f"- {'pass' if ok else '**FAIL**'}: the dataloader at 4 processes is refused before "
        f"anything is touched (parameters, scheduler and train state unchanged: "
        f"{refused['untouched']}): `{refused['said'].strip()[-400:]}`"
    )
    lines += _moe_checks(moe)
    lines += [
        "",
        "**What this covers and what it does not**",
        "",
        *_moe_coverage(),
        "- torchtitan 0.3.0 imports `triton` (for its fused kernels) without declaring it; the "
        "script's worker processes put an inert `triton` stub module in `sys.modules` (after "
        "torch's own probes found none), which no code path here calls. Its trainer needs "
        "CUDA, so the components are built as `Trainer.__init__` builds them, not by "
        "`Trainer` itself. 0.3.0 no longer lets language models use SDPA "
        "(`get_attention_config` names flex and varlen only), so the layers' inner attention "
        "is set to its `ScaledDotProductAttention` config; the parameters are the same.",
        "- The fused QKV: torchtitan 0.3.0's `FusedQKVLinear` state-dict hook gathers `wqkv` "
        "to `Replicate`, reshapes it to (kv heads, q heads per kv + 2, head dim, dim) and "
        "copies out `wq`, `wk` and `wv`, so with grouped-query attention each presented "
        "tensor is every few rows of `wqkv`, not one slice. shardstream runs such a hook once "
        "on index tensors of the parameter's global shape (one module at a time) and describes "
        "the saved `wq`/`wk`/`wv` blocks as runs of rows of `wqkv`, which DCP's planner fills "
        "in the sharded parameter directly; no state dict is built.",
        "- On CPU ranks over gloo: the model is sharded with torchtitan's `partial_dtensor` "
        "SPMD backend (its default, `spmd_types`, wants every parameter distributed for tensor "
        "parallelism first), and each FSDP module gets `set_force_sum_reduction_for_comms` "
        "(torchtitan sets a gradient divide factor of 1, which FSDP sends as `PREMUL_SUM`, an "
        "op gloo lacks; a plain sum divided by 1 is the same).",
        "- The optimizer passed to shardstream is the AdamW inside torchtitan's "
        "`OptimizersContainer` (`optimizers.optimizers[0]`, the only one with one model part); "
        "the scheduler is the `LRSchedulersContainer` itself, whose state is `last_epoch`.",
        "- The dataloader: torchtitan's `ParallelAwareDataloader.load_state_dict` asserts that "
        'the data-parallel size is the one saved ("dataloader resharding is not supported '
        'yet"), so it is restored at the saving world size only; at another size shardstream '
        "refuses the restore, naming the dataloader, before any tensor is written. Its state is "
        "a `pickle.dumps` of the loader's state per rank, which torchtitan's own "
        "`load_state_dict` unpickles.",
        "- torchtitan 0.3.0's train state is `{step, ntokens_seen}`. Earlier torchtitan "
        "`TrainState`s kept the step as a tensor and loss histories as `torch.save`d "
        "`BytesIO`; shardstream restores those too (`tests/integration/"
        "test_titan_train_state.py`): each BytesIO's bytes are read from the `.distcp` file "
        "and checked by the restricted loader (weights-only types; code is refused, naming "
        "the file and key) before an `io.BytesIO` of them goes to `load_state_dict`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=RESULTS / "titan_interop")
    parser.add_argument("--render", action="store_true", help="re-render the docs section only")
    args = parser.parse_args(argv)
    if not args.render:
        results = run_all(args.work)
        OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
        OUT_JSON.write_text(json.dumps(results, indent=1, default=str))
    results = json.loads(OUT_JSON.read_text())
    write_section(DOC, SECTION, render(results))
    bad = failures(results)
    for line in bad:
        print(f"!!! {line}")
    print(f"{DOC.relative_to(REPO)}: torchtitan section: "
          f"{'all checks pass' if not bad else f'{len(bad)} failed'}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
