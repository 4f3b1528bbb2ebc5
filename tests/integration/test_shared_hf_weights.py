"""share_hf_weights: a weight exported in its own dtype is stored once, in huggingface/, and the
manifest points there; restore at other world sizes, merge, verify and transformers read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shardstream import merge, verify
from shardstream.formats import native
from shardstream.testing.distributed import run

from . import workers
from .test_manager_roundtrip import assert_state_equal

STEP = "global_step_2"


def chunk_files(step_dir: Path) -> dict[str, set[str]]:
    """Model tensor name -> the files its chunks name (grid entries: the rank files)."""
    manifest = json.loads((step_dir / native.MANIFEST).read_text())
    files = {}
    for name, entry in manifest["tensors"].items():
        if name.startswith(native.MODEL_PREFIX):
            chunks = entry.get("chunks") or native.grid_chunks(name, entry["shape"], entry["grid"])
            files[name] = {chunk["file"] for chunk in chunks}
    return files


def rank_file_keys(step_dir: Path) -> set[str]:
    keys = set()
    for path in step_dir.glob("rank-*.safetensors"):
        with safe_open(path, "pt") as f:
            keys.update(f.keys())
    return keys


@pytest.fixture(scope="module", params=[("fsdp", 2, False), ("hsdp", 4, True)], ids=str)
def saved(request, tmp_path_factory):
    layout, world, tie = request.param
    root = tmp_path_factory.mktemp(f"shared-{layout}")
    results = run(workers.shared_hf_save_run, world, str(root), layout, tie, None)
    reference = torch.load(root / "reference.pt", weights_only=False)
    return {"root": root, "layout": layout, "tie": tie, "results": results, "reference": reference}


def test_model_weights_are_stored_once_in_huggingface(saved):
    step_dir = saved["root"] / STEP
    files = chunk_files(step_dir)
    assert files.keys() == {native.MODEL_PREFIX + k for k in saved["reference"]["model"]}
    for name, where in files.items():
        if saved["tie"] and name == "model.lm_head.weight":  # not exported: kept in rank files
            assert all(f.startswith("rank-") for f in where), where
        else:
            assert len(where) == 1 and next(iter(where)).startswith("huggingface/"), (name, where)
    stored = rank_file_keys(step_dir)
    in_rank_files = {k.split("@")[0] for k in stored if k.startswith(native.MODEL_PREFIX)}
    assert in_rank_files == ({"model.lm_head.weight"} if saved["tie"] else set())
    assert any(k.startswith(native.OPTIMIZER_PREFIX) for k in stored)
    report = verify(saved["root"])
    assert report.ok, report.problems
    placements = native.open_native(step_dir).placements  # what `shardstream inspect` shows
    saved_layout = "fsdp:S(0)" if saved["layout"] == "fsdp" else "ddp:R, fsdp:S(0)"
    assert placements["model.embed_tokens.weight"] == (
        f"{saved_layout}; in huggingface/ (shared with the export)"
    )


@pytest.mark.parametrize("layout, world", [("fsdp", 3), ("plain", 1)])
def test_restore_reads_the_weights_from_huggingface(saved, layout, world):
    results = run(
        workers.restore_run,
        world,
        str(saved["root"]),
        layout,
        3,
        1,
        ("model", "optimizer", "extra"),
        None,
        saved["tie"],
    )
    for result in results:
        assert result["restored"][0] == 2
        assert result["restored"][1]["data"] == {"epoch": 1, "offset": 14}
        assert_state_equal(result["state"], saved["reference"])
        assert result["after"] == pytest.approx(saved["results"][0]["after"], rel=1e-5, abs=1e-6)


def test_merge_and_transformers_read_the_shared_weights(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    step_dir = saved["root"] / STEP
    merge(step_dir, tmp_path / "merged")
    model, info = AutoModelForCausalLM.from_pretrained(
        step_dir / "huggingface", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for name, tensor in saved["reference"]["model"].items():
        assert torch.equal(model.state_dict()[name], tensor), name
        assert torch.equal(merged.state_dict()[name], tensor), name


def test_nothing_is_shared_when_the_export_converts(tmp_path):
    root = tmp_path / "run"
    result = run(workers.shared_hf_save_run, 2, str(root), "fsdp", False, "bfloat16")[0]
    assert any("converts the weights to bfloat16" in w for w in result["warnings"])
    files = chunk_files(root / STEP)
    assert files and all(f.startswith("rank-") for where in files.values() for f in where)
    assert verify(root).ok


def test_a_missing_export_is_named_as_holding_the_weights(saved, tmp_path):
    import shutil

    from shardstream.errors import CheckpointNotFoundError

    step_dir = tmp_path / STEP
    shutil.copytree(saved["root"] / STEP, step_dir)
    shutil.rmtree(step_dir / "huggingface")
    report = verify(step_dir)
    assert any("holds model weights" in p.line() for p in report.problems), report.problems
    with pytest.raises(CheckpointNotFoundError, match="holds model weights"):
        merge(step_dir, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
