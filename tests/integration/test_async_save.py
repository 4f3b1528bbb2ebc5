"""Async save: training goes on while live tensors stream out; every checkpoint still holds
exactly the state of the step it was requested at."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.engine.endpoints import TensorEndpoint
from shardstream.errors import UsageError
from shardstream.formats import native
from shardstream.testing.distributed import run
from shardstream.training.async_save import SourceGuard, StagingMemory, split_budget

from . import workers
from .test_manager_roundtrip import assert_state_equal


def held_async_run(rank: int, world: int, root: str, steps: int, budget: str) -> dict:
    """``workers.async_run`` with the writer of every save but the last held, before its first
    read and before it finishes, until the next optimizer step is in ``freeze()``
    (``SourceGuard.entered``): each step meets a live save, however loaded the machine."""
    created = []
    init, window, finish = SourceGuard.__init__, SourceGuard.window, SourceGuard.finish

    def counted_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        created.append(self)
        self.held = len(created) < steps  # the last save meets no later step

    def hold(self) -> None:
        if self.held:
            assert self.entered.wait(timeout=600), "no optimizer step met the save"
            self.held = False

    def held_window(self, lo, hi):
        hold(self)
        window(self, lo, hi)

    def held_finish(self):
        hold(self)
        finish(self)

    SourceGuard.__init__, SourceGuard.window, SourceGuard.finish = (
        counted_init,
        held_window,
        held_finish,
    )
    try:
        result = workers.async_run(rank, world, root, steps, budget)
    finally:
        SourceGuard.__init__, SourceGuard.window, SourceGuard.finish = init, window, finish
    assert len(created) == steps
    return result


@pytest.mark.parametrize("budget", ["1MiB", "64MiB"], ids=["wait-for-writer", "stage-all"])
def test_async_checkpoints_hold_the_state_of_their_step(tmp_path, budget):
    results = run(held_async_run, 2, str(tmp_path / "run"), 4, budget)
    for result in results:
        assert sorted(result["restored"]) == [1, 2, 3, 4]
        for step, state in result["restored"].items():
            assert_state_equal(state, result["expected"][step])
        # Steps 2-4 each ran their optimizer pre-hook while the save before them was live.
        assert len(result["stalls"]) == 3


@pytest.mark.parametrize(
    "hf_model, budget",
    [("export", "64MiB"), ("shared", "64MiB"), ("shared", "1MiB")],
    # export: read back from the rank files; shared: live weights, staged or waited for
    ids=["export", "shared-stage-all", "shared-wait-for-export"],
)
def test_async_hf_model_export_holds_the_state_of_its_step(tmp_path, hf_model, budget):
    from safetensors.torch import load_file

    root = tmp_path / "run"
    results = run(workers.async_run, 2, str(root), 3, budget, hf_model)
    expected = results[0]["expected"]
    for result in results:
        for step, state in result["restored"].items():
            assert_state_equal(state, expected[step])
    for step in (2, 3):  # keep_last is None: every step is there
        exported = load_file(root / f"global_step_{step}" / "huggingface" / "model.safetensors")
        assert exported.keys() == expected[step]["model"].keys()
        for name, tensor in expected[step]["model"].items():
            assert torch.equal(exported[name], tensor), (step, name)


def test_async_hf_model_alone_runs_beside_training(tmp_path):
    """The export's tensors are captured when save() is called: a background save that asked
    the model for its state dict while FSDP ran forward got unsharded, freed parameters."""
    from safetensors.torch import load_file

    root = tmp_path / "run"
    expected = run(workers.async_hf_only_run, 2, str(root), 3)[0]["expected"]
    for step, state in expected.items():
        exported = load_file(root / f"global_step_{step}" / "huggingface" / "model.safetensors")
        assert exported.keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(exported[name], tensor), (step, name)


def _endpoint(n: int) -> TensorEndpoint:
    return TensorEndpoint("t", torch.arange(n, dtype=torch.uint8))


def _freeze_in_thread(guard: SourceGuard) -> tuple[threading.Thread, threading.Event]:
    """An optimizer step's pre-hook, in a thread; the event is set once ``freeze`` returns.
    Returns once the thread is in ``freeze``."""
    released = threading.Event()

    def trainer():
        guard.freeze()
        released.set()

    thread = threading.Thread(target=trainer)
    thread.start()
    assert guard.entered.wait(timeout=GUARD_S)
    return thread, released


GUARD_S = 60  # how long a step may take to get where a test expects it; only a failure waits


def _wait_until(condition, what: str) -> None:
    """Poll ``condition`` (the trainer thread's progress), however slow the machine is."""
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {GUARD_S} s: {what}"
        time.sleep(0.005)


def test_guard_stages_what_the_writer_has_not_reached():
    guard = SourceGuard(staging_bytes=150)
    a, b, c = _endpoint(100), _endpoint(100), _endpoint(100)
    guard.register([("a", a, 0, 100), ("b", b, 100, 200), ("c", c, 200, 300)])
    guard.window(0, 100)  # the writer is reading a
    thread, released = _freeze_in_thread(guard)
    # c (written last) is staged; b does not fit the budget, so the step waits for it.
    _wait_until(lambda: guard.endpoint("c") is not c, "c staged")
    assert guard.endpoint("b") is b
    assert not released.is_set()
    guard.window(100, 200)
    time.sleep(0.1)
    assert not released.is_set()
    guard.window(200, 300)  # a and b are written; c comes from its staged copy
    thread.join(timeout=GUARD_S)
    assert released.is_set()
    # The staged copy holds the bytes as they were when staged.
    c.bytes.zero_()
    out = __import__("numpy").empty(100, dtype="uint8")
    guard.endpoint("c").read_into(0, out)
    assert out.tolist() == list(range(100))


def test_staged_copies_land_in_the_memory_reserved_as_the_save_started():
    """With ``reserve_staging`` run, a step copies into the memory it was given (one arena,
    as large as the budget or the sources, whichever is less), at aligned offsets, and each
    copy holds the bytes as they were when staged."""
    guard = SourceGuard(staging_bytes=250)
    a, b, c = _endpoint(100), _endpoint(100), _endpoint(100)
    held = []

    def provide(nbytes: int, pinned: bool) -> torch.Tensor:
        held.append(torch.zeros(nbytes + 10, dtype=torch.uint8))
        return held[-1]

    reserver = guard.start_reserving(provide)
    guard.register([("a", a, 0, 100), ("b", b, 100, 200), ("c", c, 200, 300)])
    reserver.join(timeout=GUARD_S)
    assert guard.arena is not None and guard.arena.numel() == 250 + 3 * SourceGuard._ALIGN
    assert guard.arena.data_ptr() == held[0].data_ptr()
    guard.window(0, 100)  # the writer is reading a: b and c are staged
    thread, released = _freeze_in_thread(guard)
    _wait_until(lambda: guard.staged_bytes == 200, "b and c staged")
    guard.window(100, 100)  # a is read: the step goes on
    thread.join(timeout=GUARD_S)
    assert released.is_set()
    lo = guard.arena.data_ptr()
    for name, live in (("b", b), ("c", c)):
        staged = guard.endpoint(name)
        assert staged is not live
        at = staged.bytes.data_ptr() - lo
        assert 0 <= at and at + 100 <= guard.arena.numel() and at % SourceGuard._ALIGN == 0
        live.bytes.zero_()
        assert staged.bytes.tolist() == list(range(100))
    assert guard.endpoint("a") is a
    guard.finish()
    assert guard.arena is None


class _HeldCopy(TensorEndpoint):
    """A live tensor whose staging copy waits for ``go`` (``copying`` is set meanwhile)."""

    def __init__(self, n: int):
        super().__init__("t", torch.arange(n, dtype=torch.uint8))
        self.copying, self.go = threading.Event(), threading.Event()

    def snapshot(self, into=None):
        self.copying.set()
        assert self.go.wait(timeout=GUARD_S)
        return super().snapshot(into)


@pytest.mark.parametrize("everything_fits", [True, False])
def test_the_writer_waits_only_while_a_step_copies_out_everything_left(everything_fits):
    """When all the save has yet to read fits the staging budget, the writer waits at its next
    window while the step copies (the copies then have the cores and memory to themselves);
    when it does not fit, the step needs the writer's progress, so the writer goes on."""
    guard = SourceGuard(staging_bytes=1000 if everything_fits else 150)
    a, b, c = _endpoint(100), _endpoint(100), _HeldCopy(100)
    guard.register([("a", a, 0, 100), ("b", b, 100, 200), ("c", c, 200, 300)])
    guard.window(0, 100)  # the writer is reading a
    thread, released = _freeze_in_thread(guard)
    assert c.copying.wait(timeout=GUARD_S)  # c (read last) is being copied out
    writer = threading.Thread(target=guard.window, args=(100, 200))
    writer.start()
    _wait_until(lambda: guard.done_upto == 100, "a reported read")
    if everything_fits:
        writer.join(timeout=0.2)
        assert writer.is_alive() and guard.reading_upto == 100  # held before starting b
    else:
        writer.join(timeout=GUARD_S)
        assert not writer.is_alive() and guard.reading_upto == 200
    c.go.set()
    writer.join(timeout=GUARD_S)
    assert not writer.is_alive() and guard.reading_upto == 200
    if not everything_fits:
        guard.window(300, 300)  # b was not staged: the step waits until it is read
    thread.join(timeout=GUARD_S)
    assert released.is_set()
    assert (guard.endpoint("b") is not b) == everything_fits


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


def test_a_failed_background_save_is_said_as_its_step_on_the_next_save(tmp_path, monkeypatch):
    """A background save that ran out of space surfaced at the next save() as a bare error
    naming the step's temporary directory (gone by then): not which step failed, nor that
    the step asked for was not saved."""
    import errno

    from shardstream.errors import OutOfSpaceError

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = CheckpointConfig(str(tmp_path), async_save=True, save_contents=("model", "optimizer"))
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
    manager.save(1)
    manager.wait()
    real = native.write_manifest

    def full(directory, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    monkeypatch.setattr(native, "write_manifest", full)
    manager.save(2)
    with pytest.raises(OutOfSpaceError) as raised:
        manager.save(3)
    said = str(raised.value)
    assert f"the background save of {tmp_path / 'global_step_2'} failed: " in said, said
    assert ".tmp-" not in said and said.endswith("; step 3 was not saved"), said
    monkeypatch.setattr(native, "write_manifest", real)
    manager.save(4)
    manager.close()
    assert manager.all_steps() == [1, 4]


def test_export_reads_are_staged_or_waited_for_after_the_rank_file():
    """An export that reads live tensors registers them before the rank file's, in its read
    order: a step stages those it has not reached (the last first) and waits only for the
    rest, not for the fsync, sealing and commit that follow."""
    guard = SourceGuard(staging_bytes=150)
    e1, e2, e3 = _endpoint(100), _endpoint(100), _endpoint(100)
    guard.register_export([("e1", e1), ("e2", e2), ("e3", e3)])
    thread, released = _freeze_in_thread(guard)
    assert not released.is_set() and guard.staged_bytes == 0  # not ready: the rank file's next
    guard.register([("r", _endpoint(100), 0, 100)])
    guard.window(0, 100)  # the rank file is being written
    # e3 (read last) is staged; e2 does not fit the budget; e1 is not staged either.
    _wait_until(lambda: guard.endpoint("e3") is not e3, "e3 staged")
    assert guard.endpoint("e2") is e2
    assert guard.endpoint("e1") is e1 and not released.is_set()
    guard.rank_file_read()
    guard.reading("e1")
    time.sleep(0.1)
    assert not released.is_set()
    guard.reading("e2")  # e1 is read; e2 is being read
    time.sleep(0.1)
    assert not released.is_set()
    guard.reading("e3")  # e2 is read; e3 comes from its staged copy
    thread.join(timeout=GUARD_S)
    assert released.is_set() and not guard.finished


def test_a_save_with_only_export_reads_is_ready_when_marked():
    """No rank file (hf_model alone): the export's sources are all there is once marked ready."""
    guard = SourceGuard(staging_bytes=1 << 20)
    e1 = _endpoint(100)
    guard.register_export([("e1", e1)])
    thread, released = _freeze_in_thread(guard)
    assert not released.is_set()
    guard.mark_ready()  # e1 is staged: the step goes before the export reads anything
    thread.join(timeout=GUARD_S)
    assert released.is_set() and guard.endpoint("e1") is not e1


def _model_and_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()


def _assert_restores(root, step: int, want: dict) -> None:
    """The model checkpoint ``step`` under ``root`` restores to the state ``want``."""
    restored, _ = _model_and_adamw()
    reader = CheckpointManager(CheckpointConfig(str(root)), model=restored)
    try:
        assert reader.restore(step) is not None
    finally:
        reader.close()
    for name, tensor in restored.state_dict().items():
        assert torch.equal(tensor, want[name]), name


@pytest.mark.parametrize("budget", [1 << 20, 64 << 20], ids=["budget-bound", "state-bound"])
def test_staging_memory_is_faulted_in_after_the_first_step_and_sized_from_the_state(budget):
    """Nothing is held before the optimizer's first step; after it, the staging part of the
    budget or the state's bytes (parameters and AdamW's two moments and step), whichever is
    less, plus room for alignment; later steps change nothing."""
    model, optimizer = _model_and_adamw()
    staging = StagingMemory()
    staging.prefault_after_first_step(model, optimizer, budget)
    assert staging.held_bytes == 0
    _step(model, optimizer)
    held = staging.held_bytes
    params = sum(p.numel() * 4 for p in model.parameters())
    state_bytes = 3 * params + 4 * 4  # AdamW: exp_avg and exp_avg_sq, and a float32 step each
    want = min(split_budget(budget)[1], state_bytes)
    assert want < held <= want + (1 << 20) + 4 * SourceGuard._ALIGN * 16
    memory = staging.take(want, pinned=False)
    _step(model, optimizer)
    assert staging.held_bytes == held and staging.take(want, False).data_ptr() == memory.data_ptr()
    assert staging.take(held + 1, False).numel() == held + 1  # too small: replaced


def test_a_save_before_the_first_step_keeps_its_memory():
    """A save that takes staging memory before the first step ends the fault-in plan: the
    step after it does not replace what the save holds."""
    model, optimizer = _model_and_adamw()
    staging = StagingMemory()
    staging.prefault_after_first_step(model, optimizer, 64 << 20)
    memory = staging.take(1000, pinned=False)
    _step(model, optimizer)
    assert staging.held_bytes == 1000 and staging.take(1000, False).data_ptr() == memory.data_ptr()


def test_first_async_save_copies_into_memory_faulted_in_after_the_first_step(tmp_path):
    """The manager's async saver faults its staging memory in after the first optimizer step,
    and the first save uses that memory: it faults in nothing new."""
    model, optimizer = _model_and_adamw()
    config = CheckpointConfig(str(tmp_path), async_save=True, staging_budget="64MiB")
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    try:
        staging = manager._async.staging
        assert staging.held_bytes == 0
        _step(model, optimizer)
        held = staging.held_bytes
        memory = staging.take(1, False).data_ptr()
        assert held > 0
        want = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(1)
        _step(model, optimizer)  # meets the save, or follows it
        manager.wait()
        assert staging.held_bytes == held and staging.take(1, False).data_ptr() == memory
    finally:
        manager.close()
    _assert_restores(tmp_path, 1, want)


def test_state_budget_stages_the_whole_state_so_a_step_never_waits_for_the_writer(
    tmp_path, monkeypatch
):
    """``staging_budget="state"``: the staging memory is sized from the whole state after the
    first step, and a step that meets a save whose writer has not read anything yet copies
    everything out and goes on; the writer is held until that step has returned."""
    model, optimizer = _model_and_adamw()
    config = CheckpointConfig(str(tmp_path), async_save=True, staging_budget="state")
    assert config.stages_whole_state
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    stepped = threading.Event()
    window = SourceGuard.window

    def held_window(self, lo, hi):
        if not stepped.wait(timeout=300):  # a deadlock guard: fails only if the step waited
            raise AssertionError("the step waited for the held writer")
        window(self, lo, hi)

    monkeypatch.setattr(SourceGuard, "window", held_window)
    try:
        _step(model, optimizer)
        state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())  # weights, 2 moments
        assert manager._async.staging.held_bytes > state_bytes
        want = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(1)
        _step(model, optimizer)
        stepped.set()
        manager.wait()
    finally:
        stepped.set()
        manager.close()
    _assert_restores(tmp_path, 1, want)


def test_staging_budget_is_a_size_or_state():
    whole = CheckpointConfig("/tmp/x", staging_budget=" State ")
    assert whole.stages_whole_state and whole.staging_budget_bytes == 64 << 20
    sized = CheckpointConfig("/tmp/x", staging_budget="512MiB")
    assert not sized.stages_whole_state and sized.staging_budget_bytes == 512 << 20
    with pytest.raises(UsageError, match="staging_budget: invalid size 'lots'.*'state'"):
        CheckpointConfig("/tmp/x", staging_budget="lots")


def test_a_save_whose_memory_holds_everything_stages_it_before_the_next_step(tmp_path, monkeypatch):
    """When the staging memory holds every tensor of the save (here ``staging_budget="state"``)
    they are copied right after ``save()``, in the background, with no step and no writer
    progress needed: the writer is held until every source is staged."""
    model, optimizer = _model_and_adamw()
    config = CheckpointConfig(str(tmp_path), async_save=True, staging_budget="state")
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    staged = threading.Event()
    window = SourceGuard.window

    def held_window(self, lo, hi):
        with self.cond:
            every = self.cond.wait_for(  # a deadlock guard: fails only if nothing staged them
                lambda: self.ready and all(s.staged for s in self.sources.values()), timeout=300
            )
        if every:
            staged.set()
        window(self, lo, hi)

    monkeypatch.setattr(SourceGuard, "window", held_window)
    try:
        _step(model, optimizer)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(1)
        manager.wait()
        assert staged.is_set(), "the save's tensors were not staged ahead of any step"
    finally:
        manager.close()
    _assert_restores(tmp_path, 1, want)


def written_in_place_run(rank: int, world: int, root: str, mode: str) -> dict:
    """One async save whose reads (and copies) are held until the trainer has written every
    parameter and a buffer in place, outside optimizer.step(). ``mode``: "fenced" calls
    ``wait_for_reads()`` first, as the error says to; "to_local" writes through the DTensors'
    local shards; "shared" saves hf_model with share_hf_weights (the export reads the live
    weights); "unfenced" writes the parameters."""
    go = threading.Event()
    window, stage_ahead = SourceGuard.window, SourceGuard._stage_ahead

    def held(method):
        def wrapped(self, *args):
            assert go.wait(timeout=600), "the trainer never wrote"
            return method(self, *args)

        return wrapped

    SourceGuard.window, SourceGuard._stage_ahead = held(window), held(stage_ahead)
    try:
        model, optimizer, scheduler, hf_config = workers._fsdp2(world, 0)
        model.register_buffer("seen", torch.zeros(3))  # as BatchNorm's statistics: no step's
        contents = ("model", "optimizer") + (("hf_model",) if mode == "shared" else ())
        config = CheckpointConfig(
            directory=root,
            async_save=True,
            staging_budget="64MiB",
            save_contents=contents,
            share_hf_weights=mode == "shared",
        )
        manager = CheckpointManager(
            config, model=model, optimizer=optimizer, lr_scheduler=scheduler, hf_config=hf_config
        )
        workers.train_step(model, optimizer, scheduler, 1)
        manager.save(1)
        expected = workers.full_state(model, optimizer, scheduler)
        if mode == "fenced":
            manager.wait_for_reads()
        with torch.no_grad():
            for parameter in model.parameters():
                if mode == "to_local":
                    parameter.to_local().mul_(0.5)
                else:
                    parameter.mul_(0.5)  # an EMA swap, say
            model.seen.add_(1)  # a forward pass's statistics
        go.set()
        error = None
        try:
            manager.wait()
        except UsageError as exc:
            error = str(exc)
        steps = manager.all_steps()
        manager.close()
    finally:
        SourceGuard.window, SourceGuard._stage_ahead = window, stage_ahead
    if not steps:
        return {"error": error, "steps": steps}
    fresh, fresh_opt, fresh_sched, _ = workers._fsdp2(world, 7)
    fresh.register_buffer("seen", torch.full((3,), 9.0))
    checker = CheckpointManager(
        CheckpointConfig(directory=root), model=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched
    )
    checker.restore(step=1)
    restored, seen = workers.full_state(fresh, fresh_opt, fresh_sched), fresh.seen.tolist()
    checker.close()
    return {
        "error": error,
        "steps": steps,
        "expected": expected,
        "restored": restored,
        "seen": seen,
    }


@pytest.mark.parametrize("mode", ["unfenced", "to_local", "shared", "fenced"])
def test_a_save_written_in_place_while_read_is_not_committed(tmp_path, mode):
    """Parameters written in place after save() returned (not by optimizer.step(), which
    waits) went into the async checkpoint, which verify then passed. Such a save is refused
    now, naming a tensor; wait_for_reads() first keeps it whole. Buffers are copied as save()
    is called: they hold their values at save() either way."""
    results = run(written_in_place_run, 2, str(tmp_path / "run"), mode)
    for result in results:
        if mode != "fenced":
            assert result["steps"] == []
            assert "async save of step 1: tensor 'model." in result["error"]
            assert "was written in place outside optimizer.step()" in result["error"]
            assert "wait_for_reads()" in result["error"] and "seen" not in result["error"]
            continue
        assert result["error"] is None and result["steps"] == [1]
        assert_state_equal(result["restored"], result["expected"])
        assert result["seen"] == [0.0, 0.0, 0.0]
