"""Format version 1 manifests (chunk lists only) still open, restore and verify."""

from __future__ import annotations

import json
import shutil

import pytest

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.commands.verify import verify
from shardstream.formats import native

from .forkserver import build_model, build_optimizer


@pytest.fixture
def manager(tmp_path):
    model = build_model()
    config = CheckpointConfig(directory=str(tmp_path / "scratch-root"))
    with CheckpointManager(config, model=model, optimizer=build_optimizer(model)) as mgr:
        yield mgr


def test_saved_manifest_uses_grid_entries(saved_run):
    doc = json.loads((saved_run.step / native.MANIFEST).read_bytes())
    assert doc["version"] == native.FORMAT_VERSION == 2
    grids = [t for t in doc["tensors"].values() if "grid" in t]
    assert grids and all(t["grid"] == doc["world_size"] for t in grids)


def test_version_1_manifest_still_reads(tmp_path, saved_run, manager):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    doc = json.loads((step / native.MANIFEST).read_bytes())
    doc.pop("checksum")
    for fqn, tensor in doc["tensors"].items():
        if "grid" in tensor:
            tensor["chunks"] = list(native.grid_chunks(fqn, tensor["shape"], tensor.pop("grid")))
    doc["version"] = 1
    native.write_manifest(step, doc)
    ours = native.open_native(saved_run.step).all_tensors
    theirs = native.open_native(step).all_tensors
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert [b.start for b in tensor.blocks] == [b.start for b in theirs[name].blocks], name
    manager.restore(path=step)
    assert verify(step).ok
