"""Rank-local save planning (formats/local_save.py) writes the manifest DCP's planner would."""

from __future__ import annotations

import pytest
import torch

from shardstream import load, verify
from shardstream.testing.distributed import run

from . import workers


@pytest.mark.parametrize("world", [2, 3])
def test_rank_local_planning_matches_dcp(tmp_path, world):
    """FSDP2 on a 1-D mesh: planned alone, the manifest is the one DCP's planner gives."""
    results = run(workers.planning_paths_run, world, str(tmp_path), "fsdp")
    assert not any(r["planned_used_dcp"] for r in results)
    planned, reference = results[0]["planned"], results[0]["dcp"]
    assert planned["tensors"] == reference["tensors"]
    for manifest in (planned, reference):  # the saving layout, recorded by both paths
        assert manifest["mesh"] == {"shape": [world], "dim_names": ["fsdp"]}
        placements = {name: entry["placement"] for name, entry in manifest["tensors"].items()}
        assert placements["model.model.embed_tokens.weight"] == "fsdp:S(0)"
        assert placements["optimizer.state.model.embed_tokens.weight.exp_avg"] == "fsdp:S(0)"
        assert placements["optimizer.state.model.embed_tokens.weight.step"] == "plain"
    assert sorted(planned["files"]) == sorted(reference["files"])
    assert planned["objects"] == reference["objects"]
    for name in ("planned", "dcp"):
        assert verify(tmp_path / name).ok


def test_hsdp_is_planned_alone_as_grids_over_the_first_replica(tmp_path):
    """HSDP 2 x 2: the first replica (ranks 0, 1) writes; every sharded tensor is a grid over
    the shard group, where DCP's dedup spreads the copies over replicas in chunk lists.
    (Restores of it at other world sizes: test_manager_roundtrip.py.)"""
    results = run(workers.planning_paths_run, 4, str(tmp_path), "hsdp")
    assert not any(r["planned_used_dcp"] for r in results)
    planned, reference = results[0]["planned"], results[0]["dcp"]
    assert planned["tensors"].keys() == reference["tensors"].keys()
    for name, entry in planned["tensors"].items():
        same = {k: reference["tensors"][name][k] for k in ("dtype", "shape")}
        assert {k: entry[k] for k in ("dtype", "shape")} == same
        if name.startswith("model.") or name.endswith(("exp_avg", "exp_avg_sq")):
            assert entry.get("grid") == 2, name
            assert entry["placement"] == "ddp:R, fsdp:S(0)", name
    assert planned["mesh"] == {"shape": [2, 2], "dim_names": ["ddp", "fsdp"]}
    for name in ("planned", "dcp"):
        assert verify(tmp_path / name).ok


def test_rank_local_save_restores_bit_for_bit(tmp_path):
    """A plain module (world 1) saved by the rank-local path restores exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    from shardstream import save

    save(tmp_path / "step", model=model, optimizer=optimizer)
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    load(tmp_path / "step", model=fresh, optimizer=fresh_optimizer)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
