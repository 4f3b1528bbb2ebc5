"""merge and the hf_model export write what ``save_pretrained`` writes, for models whose saved
layout differs from their in-memory names: Qwen2.5-VL (renamed), Qwen3-MoE (fused experts
split per expert and per projection), a torch.compile'd Qwen2 (``_orig_mod.``) and a Qwen2
token-classification critic. One FSDP2 save per world size holds every model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shardstream import merge
from shardstream.cli import main
from shardstream.commands.test import compare_with_reference
from shardstream.formats.hf_names import has_weight_conversions
from shardstream.testing.distributed import run

from . import hf_layout_workers as w

WORLDS = (2, 4)
# transformers 5 holds Qwen3-MoE's experts fused (one tensor per projection) and saves them
# per expert; 4.x holds and saves them per expert.
FUSED_EXPERTS = has_weight_conversions()
# What merge's summary says of each model's layout.
LAYOUT_SAID = {
    "qwen2_5_vl": "renamed",
    "qwen3_moe": "4 fused tensors split into 18" if FUSED_EXPERTS else "nothing renamed or split",
    "compiled_qwen2": "wrapper prefixes stripped",
    "qwen2_critic": "nothing renamed or split",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_layout")
    for world in WORLDS:
        run(w.save_run, world, str(root / f"ws{world}"))
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Path]:
    """save_pretrained of each model, cast to bfloat16 (the dtype merge writes here)."""
    root = tmp_path_factory.mktemp("hf_layout_ref")
    out = {}
    for case in w.CASES:
        w.inner(w.build_model(case)).to(torch.bfloat16).save_pretrained(root / case)
        out[case] = root / case
    return out


@pytest.fixture(scope="module")
def merged(saved) -> dict[tuple[str, int], tuple[Path, object]]:
    out = {}
    for world in WORLDS:
        for case in w.CASES:
            target = saved / f"ws{world}" / case / "merged"
            summary = merge(_actor(saved, world, case), target, dtype="bfloat16")
            out[case, world] = (target, summary)
    return out


def _actor(saved: Path, world: int, case: str) -> Path:
    return saved / f"ws{world}" / case / "verl" / "global_step_1" / "actor"


def _files(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            assert f.metadata().get("format") == "pt", path
            out[path.name] = {k: f.get_tensor(k) for k in f.keys()}
    return out


def assert_same_model_files(ours: Path, theirs: Path) -> None:
    """Same files, each with the same tensors (names, dtypes, shapes, bytes); same index."""
    a, b = _files(ours), _files(theirs)
    assert sorted(a) == sorted(b)
    for name in b:
        assert sorted(a[name]) == sorted(b[name]), name
        for key, expected in b[name].items():
            got = a[name][key]
            assert (got.dtype, got.shape) == (expected.dtype, expected.shape), key
            assert got.view(torch.uint8).equal(expected.view(torch.uint8)), key
    index = "model.safetensors.index.json"
    assert (ours / index).is_file() == (theirs / index).is_file()
    if (theirs / index).is_file():
        assert (ours / index).read_bytes() == (theirs / index).read_bytes()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", w.CASES)
def test_merge_writes_what_save_pretrained_writes(merged, reference, case, world):
    target, summary = merged[case, world]
    assert_same_model_files(target, reference[case])
    assert LAYOUT_SAID[case] in summary.layout and not summary.kept_names
    assert 0 < summary.layout_s < summary.wall_s


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", w.CASES)
def test_hf_model_export_writes_what_save_pretrained_writes(saved, reference, case, world):
    export = saved / f"ws{world}" / case / "run" / "global_step_1" / "huggingface"
    assert_same_model_files(export, reference[case])


@pytest.mark.parametrize("case", w.CASES)
def test_merged_model_loads_with_equal_logits(merged, case):
    import transformers

    model = w.inner(w.build_model(case)).to(torch.bfloat16).eval()
    cls = getattr(transformers, model.config.architectures[0])
    loaded, info = cls.from_pretrained(
        merged[case, 4][0], dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(4, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("source", ["verl", "run"])
@pytest.mark.parametrize("case", w.CASES)
def test_shardstream_test_passes_against_save_pretrained(saved, reference, case, source):
    local = (
        _actor(saved, 2, case)
        if source == "verl"
        else saved / "ws2" / case / "run" / "global_step_1"
    )
    report = compare_with_reference(local, reference[case])
    assert report.ok, report.problems
    assert report.compared == sum(len(t) for t in _files(reference[case]).values())


@pytest.mark.parametrize("size", ["5KB", "12KB", "20KB"])
def test_sharded_output_has_save_pretrained_index(saved, tmp_path, size):
    """huggingface_hub counts the storage experts share once and keeps them together."""
    model = w.inner(w.build_model("qwen3_moe")).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ref", max_shard_size=size)
    merge(_actor(saved, 2, "qwen3_moe"), tmp_path / "ours", max_shard_size=size)
    assert len(list((tmp_path / "ref").glob("*.safetensors"))) > 1
    assert_same_model_files(tmp_path / "ours", tmp_path / "ref")


@pytest.mark.skipif(not FUSED_EXPERTS, reason="transformers 4.x: no fused experts")
def test_keep_names_writes_the_in_memory_names(saved, tmp_path, capsys):
    code = main(
        [
            "merge",
            "--local_dir",
            str(_actor(saved, 2, "qwen3_moe")),
            "--target_dir",
            str(tmp_path / "kept"),
            "--keep-names",
            "--json",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kept_names"] and "--keep-names" in summary["layout"]
    assert 0 < summary["layout_s"] < summary["wall_s"]
    (tensors,) = _files(tmp_path / "kept").values()
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 32, 32)


@pytest.mark.skipif(not FUSED_EXPERTS, reason="transformers 4.x: no fused experts")
def test_inspect_shows_the_layout_merge_applies(saved):
    from shardstream.commands.inspect import describe, render

    info = describe(_actor(saved, 2, "qwen3_moe"))
    layout = info["merge"]["layout"]
    assert "4 fused tensors split into 18" in layout["rule"]
    assert layout["split"]["model.layers.0.mlp.experts.gate_up_proj"][:2] == [
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.1.gate_proj.weight",
    ]
    assert "layout: transformers" in render(info)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_5_vl"])
def test_a_cached_layout_merges_what_save_pretrained_writes(
    saved, reference, tmp_path, monkeypatch, case
):
    """A cold merge caches the plan; a warm one (a fresh process's view: no memo, tracing
    made to fail) writes the same files from the cache; an unwritable cache still merges."""
    from shardstream.formats import hf_names, hf_names_cache

    actor = _actor(saved, 2, case)
    monkeypatch.setenv(hf_names_cache.ENV, str(tmp_path / "layouts"))
    monkeypatch.setattr(hf_names, "_PLANS", {})
    cold = merge(actor, tmp_path / "cold", dtype="bfloat16")
    assert len(list((tmp_path / "layouts").glob("*.json"))) == 1
    with monkeypatch.context() as m:
        m.setattr(hf_names, "_PLANS", {})
        m.setattr(hf_names, "_trace_v5", lambda *a, **k: pytest.fail("not read from the cache"))
        warm = merge(actor, tmp_path / "warm", dtype="bfloat16")
    assert warm.layout == cold.layout
    assert_same_model_files(tmp_path / "warm", reference[case])
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(hf_names_cache.ENV, str(tmp_path / "a-file" / "layouts"))
    monkeypatch.setattr(hf_names, "_PLANS", {})
    merge(actor, tmp_path / "unwritable", dtype="bfloat16")
    assert_same_model_files(tmp_path / "unwritable", reference[case])


@pytest.mark.parametrize("case", w.CASES)
def test_a_save_pretrained_model_merges_to_itself(reference, tmp_path, case):
    """A Hugging Face model directory is read as whole tensors: merging save_pretrained's own
    files gives them back (the layout rules leave the saved names as they are)."""
    from shardstream.commands.inspect import describe

    merge(reference[case], tmp_path / "again", dtype="bfloat16")
    assert_same_model_files(tmp_path / "again", reference[case])
    assert "nothing renamed or split" in describe(reference[case])["merge"]["layout"]["rule"]


@pytest.mark.parametrize("case", w.CASES)
def test_a_state_dict_saved_as_safetensors_merges_to_the_save_pretrained_layout(
    reference, tmp_path, case
):
    """``safetensors.torch.save_file(model.state_dict())`` beside config.json, as scripts and
    accelerate's save_state (without FSDP) write it: in-memory names, fused experts, a
    torch.compile prefix, fp32. merge writes what save_pretrained writes."""
    from safetensors.torch import save_file

    model = w.build_model(case)
    source = tmp_path / "state"
    source.mkdir()
    inner = w.inner(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if inner.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
    save_file(state, source / "model.safetensors")
    inner.config.save_pretrained(source)
    summary = merge(source, tmp_path / "merged", dtype="bfloat16")
    assert summary.format == "huggingface" and not summary.kept_names
    assert_same_model_files(tmp_path / "merged", reference[case])
    assert LAYOUT_SAID[case] in summary.layout
    from shardstream.commands.inspect import describe

    assert describe(source)["merge"]["layout"]["rule"] == summary.layout  # inspect says it


def test_a_merged_model_is_checked_against_its_checksums_when_merged_again(reference, tmp_path):
    """merge's own files carry chunk checksums in their headers: merging one again checks every
    byte it reads, and a flipped byte is refused, naming the file."""
    from shardstream.errors import ChecksumMismatchError
    from shardstream.formats.safetensors import read_header, stored_checksums

    merge(reference["qwen3_moe"], tmp_path / "ours", dtype="bfloat16")
    (file,) = (tmp_path / "ours").glob("*.safetensors")
    header = read_header(file)
    assert stored_checksums(header) is not None
    merge(tmp_path / "ours", tmp_path / "again", dtype="bfloat16")
    assert_same_model_files(tmp_path / "again", reference["qwen3_moe"])

    raw = bytearray(file.read_bytes())
    raw[header.data_start + (len(raw) - header.data_start) // 2] ^= 0x10
    file.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=str(file)):
        merge(tmp_path / "ours", tmp_path / "damaged", dtype="bfloat16")
    assert not (tmp_path / "damaged").exists()
