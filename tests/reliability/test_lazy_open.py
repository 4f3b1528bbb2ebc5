"""A restoring rank opens only the data files holding the rows it restores."""

from __future__ import annotations

import json

from shardstream.formats import native


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
    assert merge_view.tensors == full.tensors
    holding = {b.location for n in model for b in full.all_tensors[n].blocks}
    assert set(merge_view.digests) == holding
    assert len(merge_view.digests) < len(full.digests)  # extra-state files are not opened
    assert not merge_view.headers  # the blocks hold the offsets; the headers are let go
