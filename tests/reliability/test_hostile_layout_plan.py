"""Hostile inputs to the layout-planning path (``formats.hf_names`` and its plan cache).

Each case is a tiny HF model directory (``model.safetensors`` written with
``safetensors.torch.save_file`` from a real transformers model's in-memory state, beside its
config.json) of a model type transformers converts on save: MoE models with fused experts
(Qwen3-MoE, Mixtral, DeepSeek-V3, GPT-OSS) and Qwen2.5-VL (renamed). config.json, the
stored tensors or the plan cache are then damaged, and ``shardstream merge`` (in-process CLI)
must either

(a) exit 0 and write exactly what ``save_pretrained`` of the matching transformers model
    writes for the same weights (the model built from the config, the stored weights assigned
    with ``load_state_dict``), tensor for tensor, bit for bit; or
(b) exit non-zero with one error line naming config.json's path or a tensor, no traceback, no
    target and no ``.tmp-`` leftover, the source as it was.

``inspect`` of the same source exits 0 or refuses in one line, never with a traceback. Every
test plans under its own ``SHARDSTREAM_CACHE_DIR``. Where shardstream misbehaves the test
keeps asserting the correct behaviour, marked ``xfail(strict=True)`` with what goes wrong.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardstream import cli
from shardstream.testing.tiny_models import randomized

from .harness import put_in_place_of, tree_contents

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

SINGLE = "model.safetensors"
TEXT = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, vocab_size=32, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**TEXT, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**TEXT, "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**TEXT, "num_key_value_heads": 2, "moe_intermediate_size": 8, "n_routed_experts": 4,
         "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
         "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
         "v_head_dim": 8, "n_group": 1, "topk_group": 1},
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {**TEXT, "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        {"text_config": {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
                         "bos_token_id": 0, "eos_token_id": 1},
         "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 16,
                           "num_heads": 2, "out_hidden_size": 16, "patch_size": 2,
                           "spatial_merge_size": 1, "temporal_patch_size": 1,
                           "fullatt_block_indexes": [0], "window_size": 4}},
    ),
}  # fmt: skip
MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
EXPERTS_KEY = {
    "qwen3_moe": "num_local_experts",
    "mixtral": "num_local_experts",
    "deepseek_v3": "n_routed_experts",
    "gpt_oss": "num_local_experts",
}
WRAPPERS = re.compile(r"_orig_mod\.|_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test plans under its own cache directory, and with no plan kept in memory."""
    from shardstream.formats import hf_names

    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", str(tmp_path / "plan-cache"))
    monkeypatch.setattr(hf_names, "_PLANS", {})


# --- models and references ----------------------------------------------------------------------


def _build(family: str, config: dict | None = None) -> torch.nn.Module:
    """The family's model with random weights, from its tiny config (or ``config``)."""
    config_name, class_name, fields = FAMILIES[family]
    if config is None:
        hf_config = getattr(transformers, config_name)(**fields)
    else:
        hf_config = getattr(transformers, config_name).from_dict(config)
    torch.manual_seed(0)
    return randomized(getattr(transformers, class_name)(hf_config))


_BASES: dict[str, tuple[dict, dict[str, torch.Tensor]]] = {}


def _base(family: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A fresh copy of the family's config.json content and in-memory state dict."""
    if family not in _BASES:
        model = _build(family)
        state, seen = {}, set()
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                state[name] = tensor.contiguous().clone()
        config = model.config.to_dict()
        config["architectures"] = [FAMILIES[family][1]]  # as save_pretrained writes it
        config.pop("dtype", None)  # the output keeps the stored dtypes, as save_pretrained does
        _BASES[family] = (json.loads(json.dumps(config)), state)
    config, state = _BASES[family]
    return json.loads(json.dumps(config)), dict(state)


def _saved(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    assert not (directory / "model.safetensors.index.json").exists()
    return load_file(str(directory / SINGLE))


def _strip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    every = all(n.startswith("module.") for n in state)
    return {WRAPPERS.sub("", n[len("module.") :] if every else n): t for n, t in state.items()}


def _reference(family: str, state: dict, directory: Path) -> dict[str, torch.Tensor]:
    """save_pretrained of the family's model (its true config) holding ``state``."""
    model = _build(family)
    model.load_state_dict(_strip(state), strict=True, assign=True)
    return _saved(model, directory)


def _claimed_reference(config: dict, state: dict, directory: Path) -> dict | None:
    """save_pretrained of the model config.json's model type builds (the auto class, as
    ``from_pretrained`` picks it) holding ``state``; None when no such model holds it."""
    hf_config = transformers.CONFIG_MAPPING[config["model_type"]].from_dict(config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    try:
        model.load_state_dict(_strip(state), strict=True, assign=True)
    except RuntimeError:  # missing, unexpected or other-sized tensors
        return None
    return _saved(model, directory)


# --- sources, runs and the two outcomes ---------------------------------------------------------


def _source(directory: Path, state: dict, config: dict | str) -> Path:
    directory.mkdir(parents=True)
    save_file(state, str(directory / SINGLE), metadata={"format": "pt"})
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "config.json").write_text(text)
    return directory


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()  # what building the references printed (save_pretrained's progress)
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _same_tensors(target: Path, expected: dict[str, torch.Tensor]) -> None:
    files = sorted(p.name for p in target.glob("*.safetensors"))
    assert files == [SINGLE], files
    got = load_file(str(target / SINGLE))
    assert sorted(got) == sorted(expected), (
        sorted(set(got) - set(expected))[:4],
        sorted(set(expected) - set(got))[:4],
    )
    for name, tensor in expected.items():
        assert (got[name].dtype, got[name].shape) == (tensor.dtype, tensor.shape), name
        assert (
            got[name].contiguous().view(torch.uint8).equal(tensor.contiguous().view(torch.uint8))
        ), name


def _one_line(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"shardstream {command}: error: "), lines
    return lines[0]


def _check(
    capsys,
    tmp_path: Path,
    source: Path,
    expected: dict[str, torch.Tensor] | None,
    refusal: bool,
    names: set[str] = frozenset(),
) -> tuple[int, str]:
    """merge ``source``: exit 0 writing ``expected`` (None: it must refuse), or, where
    ``refusal`` allows it, a clean refusal naming config.json or one of the tensors (stored,
    stripped or ``expected``'s, and ``names``). inspect never tracebacks."""
    target = tmp_path / "merged"
    before = tree_contents(source)
    code, err = _cli(capsys, "merge", "--local_dir", source, "--target_dir", target, "--quiet")
    assert "Traceback" not in err, err
    if code == 0:
        assert expected is not None, f"merge wrote a layout where it should refuse: {err}"
        _same_tensors(target, expected)
    else:
        line = _one_line(err, "merge")
        assert refusal, f"merge refused what save_pretrained writes: {line}"
        stored = set(load_file(str(source / SINGLE)))
        candidates = {str(source / "config.json")} | stored | set(_strip(dict.fromkeys(stored)))
        candidates |= set(expected or ()) | set(names)
        assert any(c in line for c in candidates), (
            f"the error names neither config.json nor a tensor: {line}"
        )
        assert not target.exists()
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert tree_contents(source) == before
    icode, ierr = _cli(capsys, "inspect", source)
    if icode != 0:
        _one_line(ierr, "inspect")
    assert "Traceback" not in ierr, ierr
    return code, err


# --- config.json that disagrees with the checkpoint -------------------------------------------


def _text(config: dict) -> dict:
    return config["text_config"] if "text_config" in config else config


def _set(**fields) -> Callable[[dict], None]:
    return lambda config: config.update(fields)


def _set_text(**fields) -> Callable[[dict], None]:
    return lambda config: _text(config).update(fields)


def _drop(*keys) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for key in keys:
            _text(config).pop(key, None)

    return edit


def _architecture(rename: Callable[[str], str]) -> Callable[[dict], None]:
    return lambda config: config.update(architectures=[rename(config["architectures"][0])])


def _class_part(suffix: str) -> Callable[[str], str]:
    return lambda name: re.sub(r"For(CausalLM|ConditionalGeneration)$", suffix, name)


def _minimal(config: dict) -> None:
    kept = {k: config[k] for k in ("model_type", "architectures")}
    config.clear()
    config.update(kept)


def _fam(config: dict) -> str:
    return config["model_type"]


def _experts(count: int | None) -> Callable[[dict], None]:
    """The family's expert count set to ``count`` (None: removed, transformers' default)."""

    def edit(config: dict) -> None:
        key = EXPERTS_KEY[_fam(config)]
        if count is None:
            _text(config).pop(key)
        else:
            _text(config)[key] = count

    return edit


# (case, families, edit of config.json, expected: "ref" save_pretrained's layout, "refuse",
# "ref|refuse" either, "identity" the stored names)
CONFIG_CASES = [
    ("experts_more", MOE, _experts(8), "refuse"),
    ("experts_fewer", MOE, _experts(2), "refuse"),
    ("experts_missing", MOE, _experts(None), "refuse"),
    ("experts_alias", ("qwen3_moe",), _set_text(num_experts=8), "ref|refuse"),
    (
        "moe_inter_wrong",
        ("qwen3_moe", "deepseek_v3"),
        _set_text(moe_intermediate_size=12),
        "refuse",
    ),
    ("inter_wrong", ("mixtral", "gpt_oss"), _set_text(intermediate_size=12), "refuse"),
    ("hidden_wrong", tuple(FAMILIES), _set_text(hidden_size=32), "refuse"),
    (  # deepseek_v3: the second layer is its MTP layer then (a test of its own below)
        "fewer_layers",
        ("qwen3_moe", "mixtral", "gpt_oss", "qwen2_5_vl"),
        _set_text(num_hidden_layers=1),
        "refuse",
    ),
    ("more_layers", tuple(FAMILIES), _set_text(num_hidden_layers=3), "refuse"),
    ("layers_1e9", tuple(FAMILIES), _set_text(num_hidden_layers=10**9), "refuse"),
    ("layers_negative", tuple(FAMILIES), _set_text(num_hidden_layers=-1), "refuse"),
    ("layers_float", tuple(FAMILIES), _set_text(num_hidden_layers=2.0), "refuse"),
    ("layers_string", tuple(FAMILIES), _set_text(num_hidden_layers="2"), "refuse"),
    ("hidden_negative", tuple(FAMILIES), _set_text(hidden_size=-16), "refuse"),
    ("hidden_float", tuple(FAMILIES), _set_text(hidden_size=16.5), "refuse"),
    ("hidden_string", tuple(FAMILIES), _set_text(hidden_size="16"), "refuse"),
    ("hidden_null", tuple(FAMILIES), _set_text(hidden_size=None), "refuse"),
    ("sizes_missing", ("qwen3_moe", "mixtral"), _drop("hidden_size", "vocab_size"), "refuse"),
    ("only_type_and_architectures", tuple(FAMILIES), _minimal, "refuse"),
    ("arch_AutoConfig", tuple(FAMILIES), _set(architectures=["AutoConfig"]), "ref"),
    ("arch_logging", tuple(FAMILIES), _set(architectures=["logging"]), "ref"),
    ("arch_pipeline", ("qwen3_moe", "qwen2_5_vl"), _set(architectures=["pipeline"]), "ref"),
    ("arch_unknown", ("qwen3_moe", "qwen2_5_vl"), _set(architectures=["NoSuchModel"]), "ref"),
    ("arch_empty", ("mixtral", "qwen2_5_vl"), _set(architectures=[]), "ref"),
    ("arch_PreTrainedModel", tuple(FAMILIES), _set(architectures=["PreTrainedModel"]), "ref"),
    ("arch_type_base", tuple(FAMILIES), _architecture(_class_part("PreTrainedModel")), "ref"),
    ("arch_backbone", tuple(FAMILIES), _architecture(_class_part("Model")), "ref|refuse"),
    ("arch_llama", tuple(FAMILIES), _set(architectures=["LlamaForCausalLM"]), "ref|refuse"),
    (
        "arch_mixtral",
        ("qwen3_moe", "gpt_oss"),
        _set(architectures=["MixtralForCausalLM"]),
        "ref|refuse",
    ),  # fmt: skip
    ("arch_ints", ("qwen3_moe", "qwen2_5_vl"), _set(architectures=[1]), "refuse"),
    ("arch_string", ("mixtral",), _set(architectures="MixtralForCausalLM"), "refuse"),
    ("model_type_unknown", tuple(FAMILIES), _set(model_type="no_such_model_type"), "identity"),
    ("model_type_int", tuple(FAMILIES), _set(model_type=3), "refuse"),
    ("model_type_list", ("qwen3_moe",), _set(model_type=["qwen3_moe"]), "refuse"),
    ("model_type_dict", ("qwen2_5_vl",), _set(model_type={"a": 1}), "refuse"),
    ("text_config_list", tuple(FAMILIES), _set(text_config=[1, 2]), "refuse"),
    ("text_config_string", ("qwen3_moe", "qwen2_5_vl"), _set(text_config="x"), "refuse"),
    ("vision_config_int", ("qwen3_moe", "qwen2_5_vl"), _set(vision_config=5), "ref|refuse"),
    (
        "text_config_huge",
        ("qwen3_moe", "qwen2_5_vl"),
        _set(text_config={f"k{i}": i for i in range(20000)}),
        "refuse",
    ),  # fmt: skip
]


XFAIL_CONFIG: dict[tuple[str, str], str] = {}  # none left


def _config_params():
    for case, families, edit, expect in CONFIG_CASES:
        for family in families:
            reason = XFAIL_CONFIG.get((case, family))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(family, edit, expect, id=f"{case}-{family}", marks=marks)


@pytest.mark.parametrize("family, edit, expect", list(_config_params()))
def test_config_that_disagrees_with_the_checkpoint(tmp_path, capsys, family, edit, expect):
    config, state = _base(family)
    edit(config)
    source = _source(tmp_path / "hf", state, config)
    if expect == "identity":  # no conversion for a model type transformers does not know
        expected = state
    elif expect.startswith("ref"):
        expected = _reference(family, state, tmp_path / "reference")
    else:
        expected = None
    code, err = _check(capsys, tmp_path, source, expected, refusal=expect.endswith("refuse"))
    if expect == "refuse":
        assert code != 0


def test_deepseek_counts_its_multi_token_prediction_layers(tmp_path, capsys):
    """DeepSeek-V3 stores num_nextn_predict_layers layers past num_hidden_layers: one
    layer less in config.json is a model with one such layer, split like the others."""
    config, state = _base("deepseek_v3")
    config.update(num_hidden_layers=1, num_nextn_predict_layers=1)
    source = _source(tmp_path / "hf", state, config)
    expected = _reference("deepseek_v3", state, tmp_path / "reference")
    _check(capsys, tmp_path, source, expected, refusal=True)


@pytest.mark.parametrize(
    "family, claimed",
    [
        ("qwen3_moe", "mixtral"),
        ("mixtral", "qwen3_moe"),
        ("gpt_oss", "mixtral"),
        ("deepseek_v3", "qwen3_moe"),
        ("qwen2_5_vl", "qwen3_moe"),
        ("qwen3_moe", "qwen2_moe"),
    ],
)
def test_model_type_of_another_family(tmp_path, capsys, family, claimed):
    """config.json's model_type names another MoE type (architectures left as saved): the
    output is what that type's model writes when it holds the weights, else a refusal."""
    config, state = _base(family)
    config["model_type"] = claimed
    source = _source(tmp_path / "hf", state, config)
    try:
        expected = _claimed_reference(config, state, tmp_path / "reference")
    except Exception:  # noqa: BLE001  (no model of the claimed type builds from it)
        expected = None
    _check(capsys, tmp_path, source, expected, refusal=True)


def test_a_config_json_deeper_than_json_parses(tmp_path, capsys):
    config, state = _base("qwen3_moe")
    deep = '"text_config": ' + "[" * 3000 + "]" * 3000 + ', "model_type"'
    text = json.dumps(config).replace('"model_type"', deep, 1)
    source = _source(tmp_path / "hf", state, text)
    code, _ = _check(capsys, tmp_path, source, None, refusal=True)
    assert code != 0


# --- stored tensors that do not fit the rules ---------------------------------------------------


def _fused(state: dict, suffix: str) -> list[str]:
    return sorted(n for n in state if n.endswith(suffix))


def _reshape(suffix: str, change: Callable[[torch.Tensor], torch.Tensor]):
    def edit(state: dict) -> None:
        for name in _fused(state, suffix):
            state[name] = change(state[name]).contiguous()

    return edit


def _stray(state: dict) -> None:
    state["model.extra_buffer"] = torch.arange(6, dtype=torch.float32)


def _missing_down(state: dict) -> None:
    del state[_fused(state, "experts.down_proj")[-1]]


def _wrap(prefix: str, where: str = "") -> Callable[[dict], None]:
    def edit(state: dict) -> None:
        for name in list(state):
            if where in name:
                state[name.replace(where, where + prefix) if where else prefix + name] = state.pop(
                    name
                )

    return edit


def _compose(*edits):
    def edit(state: dict) -> None:
        for one in edits:
            one(state)

    return edit


def _collide(prefix: str):
    def edit(state: dict) -> None:
        name = _fused(state, "experts.down_proj")[0]
        state[prefix + name] = state[name] + 1  # other values: which one is written?

    return edit


# (id, families, config edit or None, state edit, expectation)
STATE_CASES = [
    ("gate_up_2d", ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"), None,
     _reshape("experts.gate_up_proj", lambda t: t[0]), "refuse"),
    ("down_2d", ("qwen3_moe", "mixtral"), None, _reshape("experts.down_proj", lambda t: t[0]),
     "refuse"),
    ("down_4d", ("qwen3_moe", "deepseek_v3"), None,
     _reshape("experts.down_proj", lambda t: t[None]), "refuse"),
    ("down_transposed", ("qwen3_moe", "mixtral"), None,
     _reshape("experts.down_proj", lambda t: t.transpose(1, 2)), "refuse"),
    ("dtype_mix", MOE, None, _compose(
        _reshape("experts.gate_up_proj", lambda t: t.to(torch.float16)),
        _reshape("experts.down_proj", lambda t: t.to(torch.bfloat16))), "ref"),
    ("dtype_mix_layers", ("qwen3_moe",), None, lambda s: s.update(
        {n: s[n].to(torch.bfloat16) for n in _fused(s, "experts.gate_up_proj")[:1]}), "ref"),
    ("zero_experts_stored", ("qwen3_moe", "mixtral"), None, _reshape(
        "experts.gate_up_proj", lambda t: t[:0]), "refuse"),
    ("zero_expert_width", ("qwen3_moe",), _set(moe_intermediate_size=0),
     _compose(_reshape("experts.gate_up_proj", lambda t: t[:, :0]),
              _reshape("experts.down_proj", lambda t: t[..., :0])), "ref"),
    ("stray_tensor", tuple(FAMILIES), None, _stray, "stray"),
    ("missing_fused", MOE, None, _missing_down, "missing"),
    ("orig_mod", tuple(FAMILIES), None, _wrap("_orig_mod."), "ref"),
    ("ddp_module", tuple(FAMILIES), None, _wrap("module."), "ref"),
    ("ddp_and_compile", ("qwen3_moe", "qwen2_5_vl"), None,
     _compose(_wrap("_orig_mod."), _wrap("module.")), "ref"),
    ("fsdp_wrapped_layer", ("qwen3_moe", "mixtral", "deepseek_v3"), None,
     _wrap("_fsdp_wrapped_module.", "layers.1."), "ref"),
    ("checkpoint_wrapped_experts", ("qwen3_moe",), None,
     _wrap("_checkpoint_wrapped_module.", "mlp."), "ref"),
    ("orig_mod_experts_8", ("qwen3_moe", "mixtral"), lambda c: c.update(num_local_experts=8),
     _wrap("_orig_mod."), "refuse"),
    ("module_hidden_32", ("deepseek_v3",), _set(hidden_size=32), _wrap("module."), "refuse"),
    ("orig_mod_gate_up_2d", ("qwen3_moe",), None, _compose(
        _reshape("experts.gate_up_proj", lambda t: t[0]), _wrap("_orig_mod.")), "refuse"),
    ("collide_orig_mod", MOE, None, _collide("_orig_mod."), "refuse"),
    ("collide_fsdp_under_module", ("qwen3_moe",), None, _compose(
        _collide("_fsdp_wrapped_module."), _wrap("module.")), "refuse"),
]  # fmt: skip
XFAIL_STATE: dict[tuple[str, str], str] = {}  # none left


def _state_params():
    for case, families, config_edit, edit, expect in STATE_CASES:
        for family in families:
            reason = XFAIL_STATE.get((case, family))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(
                family, config_edit, edit, expect, id=f"{case}-{family}", marks=marks
            )


@pytest.mark.parametrize("family, config_edit, edit, expect", list(_state_params()))
def test_stored_tensors_that_do_not_fit(tmp_path, capsys, family, config_edit, edit, expect):
    config, state = _base(family)
    if config_edit:
        config_edit(config)
    edit(state)
    source = _source(tmp_path / "hf", state, config)
    expected = None
    if expect == "ref":
        model = _build(family, config if config_edit else None)
        model.load_state_dict(_strip(state), strict=True, assign=True)
        expected = _saved(model, tmp_path / "reference")
    elif expect == "stray":  # written under its name beside save_pretrained's layout
        extra = state.pop("model.extra_buffer")
        expected = {
            **_reference(family, state, tmp_path / "reference"),
            "model.extra_buffer": extra,
        }
    elif expect == "missing":  # the layout of what is stored: the missing tensor's outputs gone
        _, whole = _base(family)
        full = _reference(family, whole, tmp_path / "reference")
        layer = re.escape(_fused(whole, "experts.down_proj")[-1].split(".mlp.")[0])
        gone = re.compile(
            layer + r"\.(mlp|block_sparse_moe)\.experts\.(\d+\.(down_proj|w2)\.weight|down_proj)"
        )
        expected = {k: v for k, v in full.items() if not gone.fullmatch(k)}
    code, _ = _check(capsys, tmp_path, source, expected, refusal=expect != "ref")
    if expect == "refuse":
        assert code != 0


# --- the plan cache -----------------------------------------------------------------------------


def _cached_source(tmp_path: Path, capsys) -> tuple[Path, dict, Path]:
    """The qwen3_moe model merged once (its plan cached): the source, the reference, and
    the plan's file."""
    from shardstream.formats import hf_names

    config, state = _base("qwen3_moe")
    source = _source(tmp_path / "hf", state, config)
    expected = _reference("qwen3_moe", state, tmp_path / "reference")
    first = tmp_path / "first"
    code, err = _cli(capsys, "merge", "--local_dir", source, "--target_dir", first, "--quiet")
    assert code == 0, err
    _same_tensors(first, expected)
    plans = sorted((tmp_path / "plan-cache").glob("*.json"))
    assert len(plans) == 1, plans
    hf_names._PLANS.clear()  # the next merge reads the cache, as a new process would
    return source, expected, plans[0]


def _edit_plan(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))

    return damage


def _piece(doc: dict, pattern: str) -> dict:
    return next(p for p in doc["pieces"] if re.fullmatch(pattern, p["name"]))


def _swap_boxes(doc: dict) -> None:
    """Expert 0's gate and up halves trade places (same shapes: every check holds)."""
    gate = _piece(doc, r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight")
    up = _piece(doc, r"model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight")
    gate["start"], up["start"] = up["start"], gate["start"]


def _expert_digit(doc: dict) -> None:
    """One digit of one box: expert 1's down_proj reads expert 0's."""
    _piece(doc, r"model\.layers\.0\.mlp\.experts\.1\.down_proj\.weight")["start"][0] = 0


def _renamed(new: str) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        _piece(doc, r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight")["name"] = new

    return change


def _piece_dropped(doc: dict) -> None:
    doc["pieces"] = [p for p in doc["pieces"] if not p["name"].endswith("experts.3.up_proj.weight")]


def _replace(text: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(text)


def _sparse_huge(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(65 * 2**20)


def _becomes(kind: str, outside: str | None = None) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        path.unlink()
        put_in_place_of(path, kind, outside)

    return damage


CACHE_DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "not_json": _replace("{not json"),
    "json_list": _replace("[]"),
    "empty": _replace(""),
    "nul_bytes": lambda p: p.write_bytes(b"\0" * 4096),
    "deep_nesting": _replace("[" * 100000 + "]" * 100000),
    "huge_integer": _replace('{"format": 1' + "0" * 5000 + "}"),
    "over_64MiB": _sparse_huge,
    "wrong_format": _edit_plan(lambda d: d.update(format=1)),
    "wrong_key": _edit_plan(lambda d: d.update(key="0" * 64)),
    "pieces_not_list": _edit_plan(lambda d: d.update(pieces={"a": 1})),
    "stored_not_in_request": _edit_plan(
        lambda d: _piece(d, r".*experts\.0\.down_proj\.weight").update(stored="model.ghost")
    ),
    "box_out_of_bounds": _edit_plan(
        lambda d: _piece(d, r".*layers\.0\.mlp\.experts\.3\.down_proj\.weight").update(
            start=[4, 0, 0]
        )
    ),
    "negative_start": _edit_plan(
        lambda d: _piece(d, r".*layers\.0\.mlp\.experts\.1\.down_proj\.weight").update(
            start=[-1, 0, 0]
        )
    ),
    "float_extent": _edit_plan(
        lambda d: _piece(d, r".*layers\.0\.mlp\.experts\.1\.down_proj\.weight").update(
            extent=[1.0, 16, 8]
        )
    ),
    "duplicate_name": _edit_plan(
        lambda d: _piece(d, r".*layers\.0\.mlp\.experts\.1\.down_proj\.weight").update(
            name="model.layers.0.mlp.experts.0.down_proj.weight"
        )
    ),
    "extra_field": _edit_plan(lambda d: d["pieces"][0].update(evil=1)),
    "storage_out_of_range": _edit_plan(lambda d: d["pieces"][0].update(storage=10**6)),
    "piece_dropped": _edit_plan(_piece_dropped),
    "rule_not_string": _edit_plan(lambda d: d.update(rule=["x"])),
    "swapped_boxes": _edit_plan(_swap_boxes),
    "one_digit": _edit_plan(_expert_digit),
    "name_with_path": _edit_plan(_renamed("../../etc/passwd")),
    "name_other": _edit_plan(_renamed("model.layers.0.mlp.experts.0.w2.weight")),
    "fifo": _becomes("FIFO"),
    "directory": _becomes("directory"),
    "link_dev_zero": _becomes("link out", "/dev/zero"),
    "link_dangling": _becomes("broken link"),
    "link_loop": _becomes("symlink loop"),
}
XFAIL_CACHE: dict[str, str] = {}  # every damage is caught (the file's digest)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            marks=[pytest.mark.xfail(strict=True, reason=XFAIL_CACHE[case])]
            if case in XFAIL_CACHE
            else [],
        )
        for case in CACHE_DAMAGE
    ],
)
def test_a_damaged_plan_file_never_changes_the_output(tmp_path, capsys, case):
    source, expected, plan = _cached_source(tmp_path, capsys)
    CACHE_DAMAGE[case](plan)
    _check(capsys, tmp_path, source, expected, refusal=True, names={str(plan)})


def _dir_is_a_file(cache: Path) -> None:
    cache.write_text("not a directory")


def _dir_under_a_file(cache: Path) -> None:
    cache.write_text("x")
    os.environ["SHARDSTREAM_CACHE_DIR"] = str(cache / "sub")


def _dir_links_elsewhere(cache: Path) -> None:
    elsewhere = cache.parent / "elsewhere"
    elsewhere.mkdir()
    cache.symlink_to(elsewhere)


def _dir_dangling(cache: Path) -> None:
    cache.symlink_to(cache.parent / "gone")


def _dir_unreadable(cache: Path) -> None:
    cache.mkdir()
    cache.chmod(0)


def _dir_read_only(cache: Path) -> None:
    cache.mkdir()
    cache.chmod(0o555)


def _dir_disabled(cache: Path) -> None:
    os.environ["SHARDSTREAM_CACHE_DIR"] = ""


def _dir_full_of_junk(cache: Path) -> None:
    cache.mkdir()
    for i in range(70):
        (cache / f"{i:064x}.json").write_text("junk")
    (cache / "README").write_text("not a plan")


CACHE_DIRS = {
    "is_a_file": _dir_is_a_file,
    "under_a_file": _dir_under_a_file,
    "links_elsewhere": _dir_links_elsewhere,
    "dangling_link": _dir_dangling,
    "unreadable": _dir_unreadable,
    "read_only": _dir_read_only,
    "disabled": _dir_disabled,
    "full_of_junk": _dir_full_of_junk,
}
AS_ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes any directory")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=[AS_ROOT] if c in ("unreadable", "read_only") else [])
        for c in CACHE_DIRS
    ],
)
def test_a_hostile_cache_directory_never_changes_the_output(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", os.environ["SHARDSTREAM_CACHE_DIR"])
    cache = tmp_path / "plan-cache"
    CACHE_DIRS[case](cache)
    config, state = _base("qwen3_moe")
    source = _source(tmp_path / "hf", state, config)
    expected = _reference("qwen3_moe", state, tmp_path / "reference")
    before = tree_contents(tmp_path / "reference")
    for attempt in ("first", "second"):  # the second may read what the first cached
        from shardstream.formats import hf_names

        hf_names._PLANS.clear()
        code, err = _cli(
            capsys, "merge", "--local_dir", source, "--target_dir", tmp_path / attempt, "--quiet"
        )
        assert code == 0 and "Traceback" not in err, err
        _same_tensors(tmp_path / attempt, expected)
    assert tree_contents(tmp_path / "reference") == before
    if cache.is_dir() and os.access(cache, os.W_OK):
        assert len(list(cache.glob("*.json"))) <= 64  # pruned to MAX_ENTRIES, junk included
