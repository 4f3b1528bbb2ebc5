"""Grid entries in the manifest: FSDP2's Shard(0) split stored as one number, not a chunk list."""

from __future__ import annotations

from shardstream.engine.plan import chunk_extent
from shardstream.formats import native


def _chunks(fqn, shape, world, file_of=native.rank_file):
    out = []
    for r in range(world):
        start, rows = chunk_extent(shape[0], world, r)
        offsets = [start] + [0] * (len(shape) - 1)
        out.append(
            {
                "offsets": offsets,
                "sizes": [rows, *shape[1:]],
                "file": file_of(r),
                "key": f"{fqn}@{','.join(map(str, offsets))}",
            }
        )
    return out


def test_grid_spells_out_torch_chunk_split_without_empty_ranks():
    # 10 rows over 4 ranks: 3/3/3/1; over 8 ranks: 2/2/2/2/2 and three empty ranks.
    assert [c["sizes"] for c in native.grid_chunks("w", [10, 4], 4)] == [[3, 4]] * 3 + [[1, 4]]
    chunks = list(native.grid_chunks("w", [10, 4], 8))
    assert len(chunks) == 5 and chunks[-1]["file"] == "rank-00004.safetensors"
    assert chunks[1]["key"] == "w@2,0" and chunks[1]["offsets"] == [2, 0]


def test_regular_shard0_layout_is_a_grid():
    chunks = _chunks("w", [10, 4], 8)
    assert native._is_grid("w", [10, 4], chunks, 8)
    assert native._is_grid("w", [10, 4], list(reversed(chunks)), 8)  # order does not matter


def test_other_layouts_keep_their_chunk_list():
    shape = [10, 4]
    # HSDP: DCP keeps one replica of each shard, not necessarily the rank of the grid.
    assert not native._is_grid("w", shape, _chunks("w", shape, 4, lambda r: "rank-00000.x"), 4)
    # A different world size, a missing chunk, a scalar, another key.
    assert not native._is_grid("w", shape, _chunks("w", shape, 4), 2)
    assert not native._is_grid("w", shape, _chunks("w", shape, 4)[:3], 4)
    assert not native._is_grid("s", [], [{"offsets": [], "sizes": [], "file": "f", "key": "s@"}], 1)
    renamed = _chunks("w", shape, 2)
    renamed[0]["key"] = "other@0,0"
    assert not native._is_grid("w", shape, renamed, 2)
