"""Which part of an FSDP1 flat tensor each saving rank held, from the model's saved mesh, and
which rank's file each part is read from."""

from __future__ import annotations

import pytest

from shardstream.errors import CheckpointFormatError
from shardstream.formats.torch_pt import LocalTensor, MeshLayout
from shardstream.formats.verl import _first_of_each_part, flat_shard_of_ranks


def _mesh(shape, rank_map=None) -> MeshLayout:
    names = ("ddp", "fsdp")[-len(shape) :]
    return MeshLayout(tuple(shape), names, None, None, rank_map)


def test_without_a_mesh_or_with_a_flat_one_each_rank_holds_its_own_part():
    assert flat_shard_of_ranks(None, 3) == [0, 1, 2]
    assert flat_shard_of_ranks(_mesh((4,)), 4) == [0, 1, 2, 3]


def test_hybrid_rows_are_replicas_of_one_another():
    assert flat_shard_of_ranks(_mesh((2, 2)), 4) == [0, 1, 0, 1]
    assert flat_shard_of_ranks(_mesh((3, 2)), 6) == [0, 1, 0, 1, 0, 1]
    assert flat_shard_of_ranks(_mesh((2, 3)), 6) == [0, 1, 2, 0, 1, 2]


def test_a_recorded_rank_order_places_each_rank():
    # mesh positions 0..3 (row-major) hold ranks 0, 2, 1, 3: each row is (0, 2) and (1, 3)
    assert flat_shard_of_ranks(_mesh((2, 2), (0, 2, 1, 3)), 4) == [0, 0, 1, 1]


def test_a_mesh_of_other_ranks_than_saved_is_refused():
    with pytest.raises(CheckpointFormatError, match="does not hold the 4 ranks"):
        flat_shard_of_ranks(_mesh((2, 4)), 4)


def _held(*sizes: int) -> list[tuple[int, str, LocalTensor]]:
    """(rank, file, run) of ranks 0, 1, ... whose flat runs hold ``sizes`` elements."""
    return [(r, f"r{r}.pt", LocalTensor("F32", (n,), (1,), 64)) for r, n in enumerate(sizes)]


def test_each_part_is_read_from_the_first_rank_holding_it():
    held = _held(5, 5, 5, 5)[::-1]  # in any order
    parts = _first_of_each_part(held, [0, 1, 0, 1], "optim.0.exp_avg")
    assert [(part, path) for part, path, _ in parts] == [(0, "r0.pt"), (1, "r1.pt")]


def test_a_replica_of_another_size_is_refused_naming_both_files():
    with pytest.raises(CheckpointFormatError, match=r"r2.pt: .*exp_avg holds \(4,\).*r0.pt holds"):
        _first_of_each_part(_held(5, 5, 4, 5), [0, 1, 0, 1], "optim.0.exp_avg")
