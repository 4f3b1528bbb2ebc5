"""Which part of an FSDP1 flat tensor each saving rank held, from the model's saved mesh."""

from __future__ import annotations

import pytest

from shardstream.errors import CheckpointFormatError
from shardstream.formats.torch_pt import MeshLayout
from shardstream.formats.verl import flat_shard_of_ranks


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
