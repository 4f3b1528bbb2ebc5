"""Async save: training goes on while live tensors stream out; every checkpoint still holds
exactly the state of the step it was requested at."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.async_save import SourceGuard
from shardstream.endpoints import TensorEndpoint
from shardstream.formats import native
from shardstream.testing.distributed import run

from . import workers
from .test_manager_roundtrip import assert_state_equal


@pytest.mark.parametrize("budget", ["1MiB", "64MiB"], ids=["wait-for-writer", "stage-all"])
def test_async_checkpoints_hold_the_state_of_their_step(tmp_path, budget):
    results = run(workers.async_run, 2, str(tmp_path / "run"), 4, budget)
    for result in results:
        assert sorted(result["restored"]) == [1, 2, 3, 4]
        for step, state in result["restored"].items():
            assert_state_equal(state, result["expected"][step])
        assert len(result["stalls"]) >= 3  # the optimizer pre-hook ran while saves were live


@pytest.mark.parametrize("hf_model", ["export", "shared"])
def test_async_hf_model_export_holds_the_state_of_its_step(tmp_path, hf_model):
    from safetensors.torch import load_file

    root = tmp_path / "run"
    results = run(workers.async_run, 2, str(root), 3, "64MiB", hf_model)
    expected = results[0]["expected"]
    for result in results:
        if hf_model == "export":  # read back from the rank files: no step waits for the export
            assert result["held_steps"] == 0
        for step, state in result["restored"].items():
            assert_state_equal(state, expected[step])
    for step in (2, 3):  # keep_last is None: every step is there
        exported = load_file(root / f"global_step_{step}" / "huggingface" / "model.safetensors")
        assert exported.keys() == expected[step]["model"].keys()
        for name, tensor in expected[step]["model"].items():
            assert torch.equal(exported[name], tensor), (step, name)


def _endpoint(n: int) -> TensorEndpoint:
    return TensorEndpoint("t", torch.arange(n, dtype=torch.uint8))


def _freeze_in_thread(guard: SourceGuard) -> tuple[threading.Thread, threading.Event]:
    """An optimizer step's pre-hook, in a thread; the event is set once ``freeze`` returns.
    Returns after giving the thread 0.2 s to block."""
    released = threading.Event()

    def trainer():
        guard.freeze()
        released.set()

    thread = threading.Thread(target=trainer)
    thread.start()
    time.sleep(0.2)
    return thread, released


def test_guard_stages_what_the_writer_has_not_reached():
    guard = SourceGuard(staging_bytes=150)
    a, b, c = _endpoint(100), _endpoint(100), _endpoint(100)
    guard.register([("a", a, 0, 100), ("b", b, 100, 200), ("c", c, 200, 300)])
    guard.window(0, 100)  # the writer is reading a
    thread, released = _freeze_in_thread(guard)
    # c (written last) was staged; b did not fit the budget, so the step waits for it.
    assert guard.endpoint("c") is not c and guard.endpoint("b") is b
    assert not released.is_set()
    guard.window(100, 200)
    time.sleep(0.1)
    assert not released.is_set()
    guard.window(200, 300)  # a and b are written; c comes from its staged copy
    thread.join(timeout=5)
    assert released.is_set()
    # The staged copy holds the bytes as they were when staged.
    c.bytes.zero_()
    out = __import__("numpy").empty(100, dtype="uint8")
    guard.endpoint("c").read_into(0, out)
    assert out.tolist() == list(range(100))


def test_background_error_surfaces_on_next_call(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = CheckpointConfig(str(tmp_path), async_save=True, save_contents=("model", "optimizer"))
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer)

    def broken(*args, **kwargs):
        raise OSError(5, "disk went away")

    monkeypatch.setattr(native, "write_manifest", broken)
    manager.save(1)
    with pytest.raises(OSError, match="disk went away"):
        manager.wait()
    monkeypatch.undo()
    manager.save(2)
    manager.close()
    assert manager.all_steps() == [2] and manager.latest_step() == 2


def test_held_step_goes_once_the_save_reads_no_live_tensor():
    """hf_model saves hold the optimizer step (nothing is staged) until ``release()``, which
    the export calls after its last read of the weights, not until the save is committed."""
    guard = SourceGuard(staging_bytes=1 << 20, hold_until_finished=True)
    guard.register([("a", _endpoint(100), 0, 100)])
    guard.written()  # the rank file is done; the export still reads the weights
    thread, released = _freeze_in_thread(guard)
    assert not released.is_set() and guard.staged_bytes == 0
    guard.release()
    thread.join(timeout=5)
    assert released.is_set() and not guard.finished and guard.held


def test_step_held_before_the_save_starts_stages_once_the_export_reads_the_rank_file():
    """A step that meets an hf_model save before it has begun waits for the hold; once the
    save finds that the export can read the rank file (``stop_holding``), the step stages and
    waits as for a save without hf_model."""
    guard = SourceGuard(staging_bytes=100, hold_until_finished=True)
    thread, released = _freeze_in_thread(guard)
    assert not released.is_set()
    guard.stop_holding()
    a, b = _endpoint(100), _endpoint(100)
    guard.register([("a", a, 0, 100), ("b", b, 100, 200)])
    guard.window(0, 100)  # the writer reads a; b is staged within the budget
    time.sleep(0.1)
    assert not released.is_set() and guard.endpoint("b") is not b
    guard.window(100, 200)  # a is written: nothing live is read again, long before release
    thread.join(timeout=5)
    assert released.is_set() and not guard.held and not guard.released
