"""FSDP1 saves read the flat parameters' shards in place (training/fsdp1_shards.py): the same
names, bytes and param groups as torch's sharded state dict, with no copy, restoring bit for
bit at other world sizes and into FSDP2, and the same hf_model as a merge."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from shardstream.commands.verify import verify
from shardstream.testing.cli import run_cli
from shardstream.testing.distributed import run

from . import fsdp1_workers as workers
from . import workers as training

pytestmark = pytest.mark.slow


def _assert_same(got, want, where=""):
    """The param groups list parameters in the live model's order: FSDP1 lists a unit's first."""
    training.assert_nested_equal(got, want, where, unordered=("params",))


@pytest.fixture(scope="module", params=[(False, True), (True, False)], ids=["flat", "orig"])
def saved(request, tmp_path_factory):
    """Saved at 4 ranks; use_orig_params False with tied embeddings, True without."""
    use_orig_params, tie = request.param
    root = tmp_path_factory.mktemp("fsdp1")
    presented = run(workers.save_run, 4, str(root), use_orig_params, tie)
    return root, presented, tie


def test_presents_what_torch_presents_as_views_of_the_shards(saved):
    """The model as torch names it on every rank; the optimizer state split over the ranks
    that hold it, which together present torch's names."""
    _, presented, _ = saved
    held = set()
    for rank in presented:
        ours, theirs = rank["model_keys"]
        assert ours == theirs
        ours, theirs = rank["optim_keys"]
        assert set(ours) <= set(theirs)
        held |= set(ours)
        ours, theirs = rank["groups"]
        assert ours == theirs
        assert rank["model_views"]  # no copy of the model was made
        assert rank["fresh_views"]  # also before FSDP's lazy init (no forward yet)
        assert rank["pieces"] > 0
    assert held == set(presented[0]["optim_keys"][1])


def test_checkpoint_verifies_and_holds_the_state_bit_for_bit(saved):
    root, _, tie = saved
    path = root / "ckpt"
    assert verify(str(path)).ok
    reference = torch.load(root / "reference.pt", weights_only=False)
    for world, kind in ((1, "fsdp2"), (2, "fsdp1"), (4, "fsdp1-fresh")):
        for state in run(workers.load_run, world, str(path), kind, tie):
            _assert_same(state, reference, f"{kind}@{world}")


def _assert_export_equals_merge(path, target) -> None:
    """The hf_model export of the checkpoint at ``path`` equals ``shardstream merge`` of it."""
    result = run_cli("merge", "--local_dir", path, "--target_dir", target)
    assert result.returncode == 0, result.stderr
    exported = {}
    for file in sorted((path / "huggingface").glob("*.safetensors")):
        exported.update(load_file(file))
    merged = {}
    for file in sorted(target.glob("*.safetensors")):
        merged.update(load_file(file))
    assert exported.keys() == merged.keys() and exported
    for key in exported:
        assert torch.equal(exported[key], merged[key]), key


def test_hf_model_equals_a_merge_of_the_same_step(saved, tmp_path):
    root, _, _ = saved
    _assert_export_equals_merge(root / "ckpt", tmp_path / "merged")


@pytest.mark.parametrize(
    "world, strategy, orig, loads, merges",
    [
        (4, "HYBRID_SHARD", False, ((2, "fsdp2"), (4, "fsdp1-hybrid")), True),
        (4, "_HYBRID_SHARD_ZERO2", True, ((2, "fsdp1"),), False),
        (2, "NO_SHARD", False, ((1, "fsdp2"),), False),
    ],
    ids=["hybrid-flat", "hybrid-zero2-orig", "no-shard"],
)
def test_replicated_strategies_save_once_from_the_shards(
    tmp_path, world, strategy, orig, loads, merges
):
    """Hybrid sharding (pairs of ranks shard, the pairs replicate) and no sharding take the
    flat-shard path too: the first replica writes its boxes, the others none, so the manifest
    lists every element once; the checkpoint verifies, restores bit for bit at other world
    sizes and strategies, and (in the first case) its hf_model equals a merge."""
    presented = run(workers.save_replicated_run, world, str(tmp_path), strategy, orig)
    shards = 2 if "HYBRID" in strategy else 1
    for rank, result in enumerate(presented):
        writes = rank < shards
        assert result["writes"] == writes
        assert (result["boxes"] > 0) == writes
    path = tmp_path / "ckpt"
    assert verify(str(path)).ok
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["tensors"].items():
        if "chunks" in entry:  # every element listed once: the boxes tile the tensor
            held = sum(math.prod(c["sizes"]) for c in entry["chunks"])
            assert held == math.prod(entry["shape"]), name
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    for load_world, kind in loads:
        for state in run(workers.load_run, load_world, str(path), kind, False):
            _assert_same(state, reference, f"{kind}@{load_world}")
    if merges:
        _assert_export_equals_merge(path, tmp_path / "merged")


@pytest.mark.parametrize(
    "hf_model, budget",
    [("export", "1MiB"), ("export", "64MiB"), ("shared", "1MiB")],
    ids=["wait-for-writer", "stage-all", "shared-live-reads"],
)
def test_async_saves_hold_the_state_of_their_step(tmp_path, hf_model, budget):
    """The boxes are views of live shards: an optimizer step during a save waits for them or
    has them staged first, as with FSDP2. The hf_model export reads the rank files, or with
    share_hf_weights the live boxes themselves."""
    root = tmp_path / "run"
    results = run(training.async_run, 2, str(root), 3, budget, hf_model, workers.fsdp1_flat)
    expected = results[0]["expected"]
    for result in results:
        assert sorted(result["restored"]) == [1, 2, 3]
        for step, state in result["restored"].items():
            _assert_same(state, expected[step], f"step {step}")
        assert result["stalls"]  # the optimizer met a save in flight
    for step in (1, 2, 3):
        exported = {}
        for file in (root / f"global_step_{step}" / "huggingface").glob("*.safetensors"):
            exported.update(load_file(file))
        assert exported.keys() == expected[step]["model"].keys()
        for name, tensor in expected[step]["model"].items():
            assert torch.equal(exported[name], tensor), (step, name)
