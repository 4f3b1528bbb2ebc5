"""Rank-local save planning (formats/local_save.py) writes the manifest DCP's planner would."""

from __future__ import annotations

import pytest
import torch

from shardstream import load, verify
from shardstream.testing.distributed import run

from . import workers


@pytest.mark.parametrize("world, layout", [(2, "fsdp"), (3, "fsdp"), (4, "hsdp")])
def test_rank_local_planning_matches_dcp(tmp_path, world, layout):
    results = run(workers.planning_paths_run, world, str(tmp_path), layout)
    # FSDP2 on a 1-D mesh plans locally; HSDP replicas need DCP's dedup, so it falls back.
    assert all(r["planned_used_dcp"] == (layout == "hsdp") for r in results)
    planned, reference = results[0]["planned"], results[0]["dcp"]
    assert planned["tensors"] == reference["tensors"]
    assert sorted(planned["files"]) == sorted(reference["files"])
    assert planned["objects"] == reference["objects"]
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
