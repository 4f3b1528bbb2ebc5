"""A torchtitan-style TrainState in a DCP train state: the step as a tensor, ntokens_seen, and
loss histories as ``torch.save``'d ``BytesIO`` (as torchtitan's ``TrainState`` saved them),
restored whole; a BytesIO holding code is refused before anything is touched."""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardstream
from shardstream.errors import CheckpointFormatError


class TrainState:
    """Built like torchtitan's ``TrainState`` (its checkpoint.py): ``state_dict`` keeps the step
    as a tensor and each history as a BytesIO of ``torch.save(list)``."""

    def __init__(self, step=0, ntokens_seen=0, avg=(), max_=(), log_steps=()):
        self.step, self.ntokens_seen = step, ntokens_seen
        self.global_avg_losses, self.global_max_losses = list(avg), list(max_)
        self.log_steps = list(log_steps)

    def state_dict(self):
        out = {"step": torch.tensor(self.step, dtype=torch.int32),
               "ntokens_seen": self.ntokens_seen}  # fmt: skip
        for name in ("global_avg_losses", "global_max_losses", "log_steps"):
            buffer = io.BytesIO()
            torch.save(getattr(self, name), buffer)
            out[name] = buffer
        return out

    def load_state_dict(self, state):
        self.step = state["step"].item()
        self.ntokens_seen = state["ntokens_seen"]
        for name in ("global_avg_losses", "global_max_losses", "log_steps"):
            state[name].seek(0)
            setattr(self, name, torch.load(state[name], weights_only=False))


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def _save(path, model, train_state) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when used without a process group
        dcp.save({"model": model.state_dict(), "train_state": train_state},
                 checkpoint_id=str(path))  # fmt: skip


def _load(path, model, train_state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return shardstream.load(path, model=model, states={"train_state": train_state})


def test_whole_train_state_with_bytesio_histories_restores_bit_for_bit(tmp_path):
    avg = [2.5, 1.25, 0.1 + 0.2, float.fromhex("0x1.fffffffffffffp-2")]
    saved = TrainState(7, 4096, avg, [3.0, 2.0, 1.5, 1.0], [1, 3, 5, 7])
    model = _model(0)
    _save(tmp_path / "step-7", model, saved)

    fresh, state = _model(1), TrainState()
    result = _load(tmp_path / "step-7", fresh, state)
    assert result.step == 7
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(got, want), name
    assert (state.step, state.ntokens_seen) == (7, 4096)
    assert [x.hex() for x in state.global_avg_losses] == [x.hex() for x in avg]
    assert state.global_max_losses == [3.0, 2.0, 1.5, 1.0]
    assert state.log_steps == [1, 3, 5, 7]


def test_bytesio_holding_code_is_refused_before_anything_is_touched(tmp_path):
    marker = tmp_path / "pwned"
    hostile = TrainState(3, 10, [1.0])
    hostile_dict = hostile.state_dict()
    buffer = io.BytesIO()
    torch.save([1.0, _RunsCode(str(marker))], buffer)  # a pickle with GLOBAL os.system
    hostile_dict["global_avg_losses"] = buffer
    holder = type("Holder", (), {"state_dict": lambda self: hostile_dict,
                                 "load_state_dict": lambda self, s: None})()  # fmt: skip
    _save(tmp_path / "step-3", _model(0), holder)
    assert not marker.exists()

    fresh, state = _model(1), TrainState(1, 2, [9.0], [8.0], [1])
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointFormatError) as info:
        _load(tmp_path / "step-3", fresh, state)
    message = str(info.value)
    assert "\n" not in message
    assert ".distcp" in message and "train_state.global_avg_losses" in message
    assert "system" in message
    assert not marker.exists()  # never ran
    for name, tensor in fresh.state_dict().items():  # nothing touched
        assert torch.equal(tensor, before[name]), name
    assert (state.step, state.ntokens_seen, state.global_avg_losses) == (1, 2, [9.0])


class Dataloader:
    """Like torchtitan's ParallelAwareDataloader: its state is ``pickle.dumps`` of the inner
    loader's, keyed by rank, and ``load_state_dict`` unpickles it."""

    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return {"rank_0": pickle.dumps(self.state), "world_size": 1}

    def load_state_dict(self, saved):
        self.state = pickle.loads(saved["rank_0"])  # what torchtitan's own code does


def test_pickled_dataloader_state_of_plain_data_is_passed_on(tmp_path):
    saved = {"_num_yielded": 12, "dataset_state": {"sample_idx": 24, "tokens": [5, 6, 7]}}
    _save_with_loader(tmp_path / "step-2", _model(0), Dataloader(saved))
    loader = Dataloader()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shardstream.load(tmp_path / "step-2", model=_model(1), states={"dataloader": loader})
    assert loader.state == saved


def test_pickled_dataloader_state_naming_code_is_refused_before_anything_runs(tmp_path):
    marker = tmp_path / "pwned"
    hostile = Dataloader()
    hostile.state = _RunsCode(str(marker))  # pickle.dumps -> GLOBAL posix.system + REDUCE
    _save_with_loader(tmp_path / "step-2", _model(0), hostile)
    assert not marker.exists()

    fresh, loader = _model(1), Dataloader({"untouched": True})
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointFormatError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shardstream.load(tmp_path / "step-2", model=fresh, states={"dataloader": loader})
    message = str(info.value)
    assert "\n" not in message and "dataloader.rank_0" in message and "system" in message
    assert not marker.exists()
    assert loader.state == {"untouched": True}
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def _save_with_loader(path, model, loader) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "dataloader": loader}, checkpoint_id=str(path))


class OptimizersContainer(torch.optim.Optimizer):
    """Shaped like torchtitan's: a torch Optimizer over every parameter whose own state stays
    empty; the optimizers it holds (here AdamW for the first layer, Adam with amsgrad for the
    second) do the work, and its state_dict is their states flattened under parameter names."""

    def __init__(self, model: torch.nn.Module, kinds: int = 2):
        params = list(model.parameters())
        if kinds == 1:
            self.optimizers = [torch.optim.AdamW(params, lr=1e-2)]
        else:
            self.optimizers = [
                torch.optim.AdamW(model[0].parameters(), lr=1e-2, weight_decay=0.1),
                torch.optim.Adam(model[1].parameters(), lr=1e-3, amsgrad=True),
            ]
        self.model = model
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        out = {}
        for optimizer in self.optimizers:
            out.update(get_optimizer_state_dict(self.model, optimizer, options=flat))
        return out


def _trained(seed: int, kinds: int = 2):
    model = _model(seed)
    container = OptimizersContainer(model, kinds)
    for _ in range(3):
        model(torch.randn(4, 6)).pow(2).sum().backward()
        container.step()
        container.zero_grad()
    return model, container


def test_torchtitans_container_of_optimizers_restores_each_bit_for_bit(tmp_path):
    model, container = _trained(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optimizer": container.state_dict()},
                 checkpoint_id=str(tmp_path / "step-3"))  # fmt: skip
    fresh = _model(1)
    live = OptimizersContainer(fresh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shardstream.load(tmp_path / "step-3", model=fresh, optimizer=live)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    for want, got in zip(container.optimizers, live.optimizers):
        want, got = want.state_dict(), got.state_dict()
        assert want["param_groups"] == got["param_groups"]
        assert want["state"].keys() == got["state"].keys()
        for pid, entries in want["state"].items():
            assert entries.keys() == got["state"][pid].keys()
            for kind, value in entries.items():
                assert torch.equal(got["state"][pid][kind], value), (pid, kind)


def test_a_container_of_one_optimizer_saves_and_one_of_several_is_refused(tmp_path):
    from shardstream.errors import UsageError

    model, single = _trained(0, kinds=1)
    shardstream.save(tmp_path / "one", model=model, optimizer=single, step=3)
    fresh = _model(1)
    live = OptimizersContainer(fresh, kinds=1)
    shardstream.load(tmp_path / "one", model=fresh, optimizer=live)
    want, got = single.optimizers[0].state_dict(), live.optimizers[0].state_dict()
    for pid, entries in want["state"].items():
        for kind, value in entries.items():
            assert torch.equal(got["state"][pid][kind], value), (pid, kind)

    model, several = _trained(0)
    with pytest.raises(UsageError, match="OptimizersContainer, holding 2 optimizers"):
        shardstream.save(tmp_path / "two", model=model, optimizer=several, step=3)
    assert not (tmp_path / "two").exists()
