"""Non-tensor training state of a DCP checkpoint: read as weights-only records, never run."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardstream.errors import CheckpointFormatError
from shardstream.formats.dcp import open_dcp_train_state


class _WritesMarker:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when used without a process group
        dcp.save(state, checkpoint_id=str(path))


def test_optimizer_tensors_and_nested_objects(tmp_path):
    state = {
        "model": {"w": torch.arange(6.0)},
        "optimizer": {
            "state": {"w": {"exp_avg": torch.ones(6), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}],
        },
        "lr_scheduler": {"last_epoch": 3, "base_lrs": [0.5]},
    }
    _save(state, tmp_path / "ckpt")
    train = open_dcp_train_state(tmp_path / "ckpt")
    names = sorted(t.name for t in train.optimizer_tensors)
    assert names == ["optimizer.state.w.exp_avg", "optimizer.state.w.step"]
    assert train.objects["optimizer"]["param_groups"] == [
        {"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}
    ]
    assert train.objects["lr_scheduler"] == {"last_epoch": 3, "base_lrs": [0.5]}


def test_hostile_object_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    state = {"model": {"w": torch.zeros(2)}, "lr_scheduler": {"x": _WritesMarker(str(marker))}}
    _save(state, tmp_path / "ckpt")
    if marker.exists():  # torch.save itself does not run __reduce__'s result; be sure
        os.remove(marker)
    with pytest.raises(CheckpointFormatError, match=r"lr_scheduler\.x"):
        open_dcp_train_state(tmp_path / "ckpt")
    assert not marker.exists()
