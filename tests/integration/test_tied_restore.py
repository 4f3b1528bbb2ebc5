"""Restore into a model that ties two parameters (an embedding and its head): the one live
tensor takes the checkpoint's values only if the checkpoint holds the same under both names."""

from __future__ import annotations

import pytest
import torch

import shardstream
from shardstream.errors import CheckpointFormatError, ShardstreamError
from shardstream.testing.distributed import run
from shardstream.training.native_storage import box_windows

VOCAB, WIDTH = 300, 64  # 75 KiB a weight: a 64 KiB buffer compares it in windows


class Lm(torch.nn.Module):
    def __init__(self, tied: bool, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def _save(path, model):
    shardstream.save(path, model=model, contents=("model",))


def _load(path, model):
    return shardstream.load(path, model=model, contents=("model",), buffer_size="64KiB")


def test_tied_checkpoint_restores_into_a_tied_model(tmp_path):
    saved = Lm(tied=True, seed=1)
    _save(tmp_path / "ckpt", saved)
    live = Lm(tied=True, seed=2)
    _load(tmp_path / "ckpt", live)
    assert torch.equal(live.embed.weight, saved.embed.weight)
    assert live.head.weight is live.embed.weight


def test_untied_checkpoint_with_equal_values_restores_into_a_tied_model(tmp_path):
    saved = Lm(tied=False, seed=1)
    with torch.no_grad():
        saved.head.weight.copy_(saved.embed.weight)
    _save(tmp_path / "ckpt", saved)
    live = Lm(tied=True, seed=2)
    _load(tmp_path / "ckpt", live)
    assert torch.equal(live.embed.weight, saved.embed.weight)


@pytest.mark.parametrize("row", [0, VOCAB - 1], ids=["first-window", "last-window"])
def test_untied_checkpoint_with_other_values_is_refused_untouched(tmp_path, row):
    saved = Lm(tied=False, seed=1)
    with torch.no_grad():
        saved.head.weight.copy_(saved.embed.weight)
        saved.head.weight[row, 3] += 1.0  # one element apart, in the first or last window
    _save(tmp_path / "ckpt", saved)
    live = Lm(tied=True, seed=2)
    before = live.embed.weight.detach().clone()
    with pytest.raises(CheckpointFormatError) as caught:
        _load(tmp_path / "ckpt", live)
    message = str(caught.value)
    assert "'embed.weight'" in message and "'head.weight'" in message, message
    assert "different values" in message
    assert torch.equal(live.embed.weight, before)


def fsdp1_tied_restore(rank: int, world: int, path: str) -> dict:
    """Restore ``path`` into the tied model wrapped by FSDP1 (one flat parameter holding the
    tied weight once); what the rank then sees of the whole weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel

    live = Lm(tied=True, seed=2)
    before = live.embed.weight.detach().clone()
    model = FullyShardedDataParallel(
        live,
        device_mesh=init_device_mesh("cpu", (world,)),
        device_id=torch.device("cpu"),
        use_orig_params=False,
    )
    refused = None
    try:
        _load(path, model)
    except ShardstreamError as exc:  # the rank holding the difference, or told of it
        refused = str(exc)
    with FullyShardedDataParallel.summon_full_params(model):
        weight = model.module.embed.weight.detach().clone()
        tied = model.module.head.weight is model.module.embed.weight
    return {"refused": refused, "weight": weight, "before": before, "tied": tied}


@pytest.mark.parametrize("differ", [False, True], ids=["equal", "different"])
def test_fsdp1_flat_parameter_holding_a_tied_weight(tmp_path, differ):
    """FSDP1 keeps the tied weight once in its flat parameter: an untied checkpoint restores
    into it when both names hold the same values, and is refused on every rank, untouched,
    when they differ."""
    saved = Lm(tied=False, seed=1)
    with torch.no_grad():
        saved.head.weight.copy_(saved.embed.weight)
        if differ:
            saved.head.weight[VOCAB // 2, 7] -= 0.5
    _save(tmp_path / "ckpt", saved)
    for report in run(fsdp1_tied_restore, 2, str(tmp_path / "ckpt")):
        assert report["tied"]
        if differ:
            message = report["refused"]
            assert message and "'embed.weight'" in message and "'head.weight'" in message
            assert torch.equal(report["weight"], report["before"])
        else:
            assert report["refused"] is None
            assert torch.equal(report["weight"], saved.embed.weight)


def test_box_windows_cover_the_box_in_row_major_order():
    start, shape = (2, 5, 1), (7, 3, 4)
    for limit in (1, 3, 4, 5, 12, 13, 84, 1000):
        windows = box_windows(start, shape, limit)
        cells = []
        for w_start, w_shape in windows:
            assert 0 < torch.Size(w_shape).numel() <= limit
            grid = torch.cartesian_prod(
                *[torch.arange(s, s + n) for s, n in zip(w_start, w_shape)]
            ).tolist()
            cells.extend(tuple(c) for c in grid)
        every = torch.cartesian_prod(
            *[torch.arange(s, s + n) for s, n in zip(start, shape)]
        ).tolist()
        assert cells == [tuple(c) for c in every], limit
