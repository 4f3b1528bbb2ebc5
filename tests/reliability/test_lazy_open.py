"""A restoring rank opens only the data files holding the rows it restores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardstream.commands.merge import merge
from shardstream.errors import CheckpointFormatError
from shardstream.formats import native, writer


def test_regions_open_only_the_files_they_overlap(saved_run):
    doc = json.loads((saved_run.step / native.MANIFEST).read_bytes())
    grids = {n: t for n, t in doc["tensors"].items() if "grid" in t and t["shape"][0] >= 2}
    assert grids
    rank0_rows = {
        name: ((0,) * len(t["shape"]), (-(-t["shape"][0] // t["grid"]), *t["shape"][1:]))
        for name, t in grids.items()
    }
    ckpt = native.open_native(saved_run.step, rank0_rows)
    assert sorted(ckpt.all_tensors) == sorted(grids)
    assert list(ckpt.headers) == [str(saved_run.step / native.rank_file(0))]
    for tensor in ckpt.all_tensors.values():
        assert [b.start[0] for b in tensor.blocks] == [0]
    # The whole checkpoint, opened without regions, reads every header.
    full = native.open_native(saved_run.step)
    assert len(full.headers) == sum("header_xxh3" in f for f in doc["files"].values())


def test_a_merge_opens_only_model_tensors(saved_run):
    """A merge describes model tensors only, the same as a full open does, and reads only the
    headers of the files holding them."""
    doc = json.loads((saved_run.step / native.MANIFEST).read_bytes())
    model = sorted(n for n in doc["tensors"] if n.startswith(native.MODEL_PREFIX))
    assert model and len(model) < len(doc["tensors"])  # the run saved optimizer state too
    merge_view = native.open_native(saved_run.step, model_only=True)
    full = native.open_native(saved_run.step)
    assert sorted(merge_view.all_tensors) == model
    assert {t.name: t for t in merge_view.tensors} == {t.name: t for t in full.tensors}
    holding = {b.location for n in model for b in full.all_tensors[n].blocks}
    assert set(merge_view.digests) == holding
    assert len(merge_view.digests) < len(full.digests)  # extra-state files are not opened
    assert not merge_view.headers  # the blocks hold the offsets; the headers are let go


def test_a_merge_holds_one_offset_per_grid_chunk(saved_run):
    """A merge keeps a grid tensor as one byte offset per rank; the blocks it hands out on
    demand are the ones a full open builds, by index, slice and iteration alike."""
    merge_view = native.open_native(saved_run.step, model_only=True)
    full = native.open_native(saved_run.step)
    grids = [t for t in merge_view.all_tensors.values() if isinstance(t.blocks, native.GridBlocks)]
    assert grids and all(len(t.blocks) == 2 for t in grids if t.shape[0] >= 2)
    for tensor in grids:
        eager = full.all_tensors[tensor.name].blocks
        assert tuple(tensor.blocks) == eager
        assert tensor.blocks[-1] == eager[-1] and tensor.blocks[:1] == eager[:1]
        assert tensor.blocks.offsets.itemsize == 8
        with pytest.raises(IndexError):
            tensor.blocks[len(eager)]
    # in the order rank 0's file holds them, so a merge reads each rank file front to back
    first = [t.blocks[0] for t in merge_view.all_tensors.values()]
    assert {b.location for b in first} == {str(saved_run.step / native.rank_file(0))}
    assert [b.offset for b in first] == sorted(b.offset for b in first)


def _resealed(saved_run, tmp_path, change) -> Path:
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    doc = native.read_manifest(step)
    change(doc)
    native.write_manifest(step, doc)
    return step


def _first_grid(doc: dict) -> tuple[str, dict]:
    return next(
        (n, t)
        for n, t in doc["tensors"].items()
        if n.startswith(native.MODEL_PREFIX) and "grid" in t and t["shape"][0] >= 2
    )


def test_a_grid_that_disagrees_with_a_rank_file_names_tensor_and_file(saved_run, tmp_path):
    def grow(doc):
        _, entry = _first_grid(doc)
        entry["shape"][0] += 2  # every rank's chunk now has other rows than its file holds

    step = _resealed(saved_run, tmp_path, grow)
    name, _ = _first_grid(native.read_manifest(step))
    with pytest.raises(CheckpointFormatError) as caught:
        native.open_native(step, model_only=True)
    message = str(caught.value)
    assert repr(name) in message and "rank-00000.safetensors" in message, message


def test_a_grid_over_more_ranks_than_files_is_refused(saved_run, tmp_path):
    def widen(doc):
        _first_grid(doc)[1]["grid"] = 64

    step = _resealed(saved_run, tmp_path, widen)
    with pytest.raises(CheckpointFormatError, match="malformed entry"):
        native.open_native(step, model_only=True)


def test_a_merge_plans_one_output_file_at_a_time(saved_run, tmp_path, monkeypatch):
    """With the model split over several files, no more than one file's copy runs are held
    at once, and the merged files are the same as before."""
    jobs = []
    real = writer.FileJob.copy_runs

    def watched(job):
        jobs.append(job)
        assert sum(j.runs is not None for j in {id(j): j for j in jobs}.values()) <= 1
        return real(job)

    monkeypatch.setattr(writer.FileJob, "copy_runs", watched)
    out = tmp_path / "hf-sharded"
    merge(saved_run.step, out, hf_model_path=saved_run.hf.parent / "config", max_shard_size="2KB")
    assert len({j.path for j in jobs}) > 1
    names = sorted(p.name for p in saved_run.hf_sharded.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (saved_run.hf_sharded / name).read_bytes(), name
