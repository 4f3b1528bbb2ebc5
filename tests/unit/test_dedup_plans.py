"""Which rank writes a tensor several ranks hold: small ones the lowest, large ones balanced."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardstream.training.native_storage import SMALL_REPLICATED_BYTES, dedup_plans


def _item(name: str, numel: int) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(name, torch.Size([0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([numel])),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([numel]),
        ),
    )


def _writers(plans: list[SavePlan]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            out.setdefault(item.index.fqn, []).append(rank)
    return out


def test_small_replicas_go_to_the_lowest_rank_large_ones_are_balanced():
    big = SMALL_REPLICATED_BYTES // 4 + 1  # one element past the small limit
    plans = [
        SavePlan([_item("own0", 10 * big), _item("step", 1), _item("bias", 16), _item("w", big)]),
        SavePlan([_item("step", 1), _item("bias", 16), _item("w", big), _item("v", big)]),
        SavePlan([_item("step", 1), _item("bias", 16), _item("w", big), _item("v", big)]),
    ]
    writers = _writers(dedup_plans(plans))
    assert writers["step"] == [0] and writers["bias"] == [0]
    assert writers["own0"] == [0]
    # Large replicas: each written once, by one of the less loaded ranks 1 and 2.
    assert len(writers["w"]) == 1 and writers["w"][0] in (1, 2)
    assert len(writers["v"]) == 1 and writers["v"] != writers["w"]
