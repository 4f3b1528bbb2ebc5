"""Optimizer settings that are tensors (``AdamW(lr=torch.tensor(...))``, which torch allows)
restore with their saved values from every layout that saves them: shardstream's own, DCP's
``get_state_dict``, and the torch.save optimizer files of PyTorch's FSDP2 example. They had
come back as meta tensors, been dropped from the param group, or made the checkpoint
unreadable."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import shardstream
from shardstream.errors import CheckpointFormatError
from shardstream.formats import native
from shardstream.training import schedulers

SAVED_LR, LIVE_LR = 0.0123, 0.5


def _build(lr: float, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(lr), betas=(0.8, 0.95))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(layout: str, path, model, optimizer) -> None:
    if layout == "shardstream":
        shardstream.save(path, model=model, optimizer=optimizer, step=1)
    elif layout == "dcp":
        model_state, optim_state = get_state_dict(model, optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns without a process group
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    else:  # PyTorch's FSDP2 example, written whole by torch.save
        path.mkdir()
        torch.save(model.state_dict(), path / "model_state_dict.pt")
        torch.save(optimizer.state_dict(), path / "optim_state_dict.pt")


@pytest.mark.parametrize("layout", ["shardstream", "dcp", "torch.save"])
def test_a_tensor_learning_rate_restores_its_value(tmp_path, layout):
    saved_model, saved_optimizer = _build(SAVED_LR, seed=0)
    _save(layout, tmp_path / "ckpt", saved_model, saved_optimizer)
    model, optimizer = _build(LIVE_LR, seed=1)
    shardstream.load(tmp_path / "ckpt", model=model, optimizer=optimizer)
    (group,) = optimizer.param_groups
    assert isinstance(group["lr"], torch.Tensor) and group["lr"].device.type == "cpu"
    assert torch.equal(group["lr"], torch.tensor(SAVED_LR))
    assert group["betas"] == (0.8, 0.95)
    for name, tensor in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()  # the restored optimizer steps


@pytest.mark.parametrize(
    "entry", [{"__tensor__": "nope"}, {"__float__": "abc"}, {"__int_keys__": 5},
              {"__inline_tensor__": {"dtype": "F32", "shape": [2], "hex": "00"}}],
)  # fmt: skip
def test_a_malformed_objects_entry_names_the_manifest(tmp_path, entry):
    model, optimizer = _build(SAVED_LR, seed=0)
    shardstream.save(tmp_path / "ckpt", model=model, optimizer=optimizer, step=1)
    doc = json.loads((tmp_path / "ckpt" / native.MANIFEST).read_text())
    doc["objects"]["optimizer"]["param_groups"][0]["lr"] = entry
    native.write_manifest(tmp_path / "ckpt", doc)
    live, live_optimizer = _build(LIVE_LR, seed=1)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match="manifest.json: objects entry 'optimizer'"):
        shardstream.load(tmp_path / "ckpt", model=live, optimizer=live_optimizer)
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())
    assert torch.equal(live_optimizer.param_groups[0]["lr"], torch.tensor(LIVE_LR))


def _edit_group(doc: dict, edit: str) -> None:
    group = doc["objects"]["optimizer"]["param_groups"][0]
    if edit == "no-lr":
        del group["lr"]
    elif edit == "betas-a-string":
        group["betas"] = "ab"
    elif edit == "three-betas":
        group["betas"] = {"__tuple__": [0.9, 0.99, 0.5]}
    else:  # one base learning rate more than the optimizer has groups
        doc["objects"]["lr_scheduler"]["base_lrs"] *= 2


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ("no-lr", r"param_groups\[0\]: no 'lr' saved"),
        ("betas-a-string", r"param_groups\[0\]: betas is saved as str"),
        ("three-betas", r"param_groups\[0\]: betas is saved as tuple '\(0.9, 0.99, 0.5\)'"),
        ("two-base-lrs", r"lr_scheduler.base_lrs: 2 saved entries for the live scheduler's 1"),
    ],
)
def test_settings_the_next_step_would_fail_on_are_refused(tmp_path, edit, needle):
    """Each restored without a word before, and the next optimizer or scheduler step raised."""
    model, optimizer = _build(SAVED_LR, seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    shardstream.save(tmp_path / "c", model=model, optimizer=optimizer,
                     lr_scheduler=scheduler, step=1)  # fmt: skip
    doc = json.loads((tmp_path / "c" / native.MANIFEST).read_text())
    _edit_group(doc, edit)
    native.write_manifest(tmp_path / "c", doc)
    live, live_optimizer = _build(LIVE_LR, seed=1)
    live_scheduler = torch.optim.lr_scheduler.StepLR(live_optimizer, step_size=2)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match=needle):
        shardstream.load(tmp_path / "c", model=live, optimizer=live_optimizer,
                         lr_scheduler=live_scheduler)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())
    assert live_scheduler.base_lrs == [torch.tensor(LIVE_LR)]


def test_a_plain_number_of_a_kind_the_optimizer_lacks_is_refused(tmp_path):
    """Tensors of a kind AdamW keeps none of were refused; the same as a plain number went
    into its state."""
    model, optimizer = _build(SAVED_LR, seed=0)
    shardstream.save(tmp_path / "c", model=model, optimizer=optimizer, step=1)
    doc = json.loads((tmp_path / "c" / native.MANIFEST).read_text())
    doc["objects"]["optimizer"]["scalars"]["optimizer.state.0.weight.momentum_buffer"] = 3
    native.write_manifest(tmp_path / "c", doc)
    live, live_optimizer = _build(LIVE_LR, seed=1)
    with pytest.raises(CheckpointFormatError, match="the live optimizer lacks \\(momentum_buffer"):
        shardstream.load(tmp_path / "c", model=live, optimizer=live_optimizer)
    assert all("momentum_buffer" not in s for s in live_optimizer.state.values())


def _restored_beside(tmp_path, caplog, saved_kind, live_kind, steps: int = 0):
    """Save after ``steps`` steps with the scheduler ``saved_kind(optimizer)`` builds (None:
    without one), restore beside ``live_kind(optimizer)``; the live scheduler, and the log."""
    model, optimizer = _build(SAVED_LR, seed=0)
    saved = saved_kind(optimizer) if saved_kind is not None else None
    for _ in range(steps):
        optimizer.step()
        saved.step()
    shardstream.save(tmp_path / "c", model=model, optimizer=optimizer, lr_scheduler=saved,
                     step=1)  # fmt: skip
    live, live_optimizer = _build(LIVE_LR, seed=1)
    scheduler = live_kind(live_optimizer)
    with caplog.at_level("WARNING", logger="shardstream"):
        shardstream.load(tmp_path / "c", model=live, optimizer=live_optimizer,
                         lr_scheduler=scheduler)  # fmt: skip
    return scheduler, caplog.text


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)


def test_a_checkpoint_without_scheduler_state_says_so(tmp_path, caplog):
    """A live scheduler given, a train state saved without one: restored as before, and a
    warning says the scheduler starts afresh (it said nothing)."""
    scheduler, log = _restored_beside(tmp_path, caplog, None, _step_lr)
    assert "holds no LR scheduler state" in log
    assert scheduler.last_epoch == 0


def test_a_scheduler_state_of_another_kind_says_so(tmp_path, caplog):
    """A StepLR's state restored into an ExponentialLR: its step count is restored, and a warning
    names the saved settings the live scheduler does not follow (it said nothing)."""

    def exponential(optimizer):
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)

    scheduler, log = _restored_beside(tmp_path, caplog, _step_lr, exponential, steps=1)
    assert "holds step_size, which the live ExponentialLR does not keep" in log
    assert scheduler.last_epoch == 1


def test_a_scheduler_state_of_the_same_kind_restores_quietly(tmp_path, caplog):
    _, log = _restored_beside(tmp_path, caplog, _step_lr, _step_lr)
    assert "LR scheduler" not in log


def test_checking_a_scheduler_state_leaves_the_scheduler_as_it_was():
    """The trial load of ``check`` set attributes from saved keys the scheduler lacked."""
    _, optimizer = _build(LIVE_LR, seed=1)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    before = dict(vars(scheduler))
    schedulers.check(scheduler, {"step_size": 2, "last_epoch": 3})
    assert vars(scheduler) == before
