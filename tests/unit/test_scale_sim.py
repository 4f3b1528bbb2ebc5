"""Smoke test of bench/scale_sim.py at small rank counts on a tiny Llama-shaped layout.

The simulation's numbers are only as good as its synthetic inputs, so this checks them against
the real code: FSDP2's shard of each rank, the manifest bytes ``write_manifest`` writes, the
weighting of representative layers, and that load and merge plans cover every byte.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from shardstream.formats import native

PATH = Path(__file__).resolve().parents[2] / "bench" / "scale_sim.py"
TINY = ["--hidden", "64", "--layers", "12", "--intermediate", "96", "--heads", "4"]
TINY += ["--kv-heads", "2", "--vocab", "100"]


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("scale_sim", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_sim"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(sim):
    return sim.Layout(hidden=64, layers=12, intermediate=96, heads=4, kv_heads=2, vocab=100)


@pytest.mark.parametrize("rows,world", [(1024, 8192), (30, 4), (8192, 8192), (100, 7), (3, 16)])
def test_local_chunk_is_fsdp2_shard(sim, rows, world):
    e = sim.Entry("w", (rows, 5), True)
    for rank in sorted({0, 1, world // 2, world - 1}):
        sizes, offsets = _compute_local_shape_and_global_offset(
            (rows, 5), (world,), [rank], [Shard(0)]
        )
        assert sim.local_chunk(e, world, rank) == (tuple(offsets), tuple(sizes))


def test_layout_is_70b(sim):
    layout = sim.Layout()
    assert len(layout.params()) == 723
    assert 70e9 < layout.numel < 71e9
    assert len(sim.state_entries(layout.params())) == 4 * 723


def test_seal_is_what_write_manifest_writes(sim, tiny, tmp_path):
    doc = sim.manifest_skeleton(3, tiny.params(), 12345)
    native.write_manifest(tmp_path, doc)
    assert (tmp_path / native.MANIFEST).read_bytes() == sim.seal(doc)
    assert native.read_manifest(tmp_path)["world_size"] == 3


@pytest.mark.parametrize("world", [4, 8])
def test_weighted_groups_give_the_exact_manifest(sim, tiny, tmp_path, world):
    point = sim.simulate(tiny, world, reshard=4, scratch=tmp_path)
    assert point.manifest_bytes == sim.full_manifest_bytes(tiny, world)
    params = tiny.params()
    sharded = 3 * len(params)
    assert point.chunks == sharded * world + len(params)  # + one chunk per AdamW step
    assert point.manifest_bytes < point.v1_manifest_bytes  # grid entries are smaller
    # the destination rank's plan covers its shards of every tensor, byte for byte
    dest, rank = point.dest_ranks, point.dest_ranks // 2
    expected = 0
    for e in sim.state_entries(params):
        _, sizes = sim.local_chunk(e, dest, rank)
        expected += 4 * math.prod(sizes)
    assert point.load_bytes == expected
    assert point.merge_runs >= len(params)
    assert point.times["save.validate"] > 0 and point.times["merge.open"] > 0
    assert point.times["load.open"] > 0 and 1 <= point.files_read <= world


def test_verdicts_flag_quadratic_growth(sim):
    points = []
    for n in (256, 1024, 4096):
        p = sim.Point(n, n // 8, chunks=n, manifest_bytes=100 * n)
        p.times = {s.name: 1.0 for s in sim.STAGES}
        p.times["save.validate"] = (n / 256) ** 2
        p.times["load.read_manifest"] = n / 256
        points.append(p)
    found = {v["name"]: v for v in sim.verdicts(points, 256, 0.25, 0.05)}
    assert found["save.validate"]["status"] == "SUPER-LINEAR"
    assert found["save.validate"]["exponent"] == pytest.approx(2.0)
    assert found["load.read_manifest"]["status"] == "ok"
    assert found["manifest bytes"]["exponent"] == pytest.approx(1.0)


def test_main_runs_and_writes_json(sim, tmp_path):
    out = tmp_path / "scale.json"
    argv = TINY + ["--ranks", "8,32", "--mem-ranks", "8", "--fit-min-ranks", "8"]
    assert sim.main(argv + ["--floor", "60", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [p["ranks"] for p in result["points"]] == [8, 32]
    assert result["check"]["full"] == result["check"]["extrapolated"]
    assert result["points"][1]["memory"]["load_heap_per_rank"] > 0
    assert not result["failed"]
