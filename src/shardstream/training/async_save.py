"""Async save: ``save()`` returns at once; a background thread streams the live tensors.

Nothing is copied up front. Parameters and optimizer state only change in ``optimizer.step()``,
so an optimizer step pre-hook calls ``SourceGuard.freeze()``: tensors the writer has not started
yet are staged into host memory while the staging budget lasts (the last ones to be written
first), and the step waits only for the rest. That memory (``StagingMemory``: as much as the
budget allows, at most the bytes a save reads live) is faulted in on a thread of its own after
the first optimizer step, when the optimizer's state exists and can be sized, and reused by
every save: a copy into fresh pages runs at page-fault speed, 5 to 10 times slower here than
into touched ones. It is held while the manager saves asynchronously. An
hf_model export that reads live weights (not the rank file: ``saving.execute_save``) registers
them too, after the rank file's. The background save runs on a process group of its own, so
its collectives never interleave with training's.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engine.endpoints import TensorEndpoint
from ..engine.memory import anonymous_memory
from ..errors import COMMITTED_ATTR, ShardstreamError
from ..storage import collectives as coll
from ..units import staging_limit

log = logging.getLogger(__name__)


@dataclass
class _Source:
    live: TensorEndpoint
    begin: int
    end: int
    staged: TensorEndpoint | None = None
    claimed: bool = False  # its copy into staging memory is made or being made


class SourceGuard:
    """Coordinates the background save's reads of live tensors with optimizer steps.

    Sources are ordered as the save reads them: the rank file's tensors at their data offsets,
    then the hf_model export's (when it reads live tensors) from ``EXPORT_START`` on, in the
    order it reads them. The readers report which range they are reading (``window``).
    """

    EXPORT_START = 1 << 60  # the export's sources come after every rank-file byte

    def __init__(self, staging_bytes: int):
        self.cond = threading.Condition()
        self.staging_bytes = staging_bytes
        self.sources: dict[str, _Source] = {}
        self.ready = False  # every source of this save is registered
        self.reading_upto = 0  # sources below reading_upto are read or being read
        self.done_upto = 0  # sources below done_upto are read
        self.staged_bytes = 0
        # The memory freeze() copies into, when reserve_staging() runs: allocated and faulted
        # in before a step needs it. Without it (or if it failed) freeze() allocates per copy.
        self.reserving = False
        self.arena: torch.Tensor | None = None
        self.arena_used = 0
        self.arena_ready = False
        # Copies of everything the save has yet to read in progress (a step's, or made ahead
        # of it): the writer waits at its next window instead of competing for memory
        # bandwidth and cores.
        self.writer_holds = 0
        self.finished = False
        # Set once a step calls freeze(). A test seam: tests hold a save's writer on it, so that
        # the save is certainly in flight when the step comes, whatever the machine's load.
        self.entered = threading.Event()
        # The saved tensors' version counters as save() was called (``watch``), and the names
        # of those changed in place by the time the save read no live tensor (``_release``):
        # a write outside optimizer.step() (an EMA swap, load_state_dict) that the save may
        # have read. None until then.
        self.watched: dict[str, Any] | None = None
        self.versions: dict[str, tuple[int, ...]] = {}
        self.changed: list[str] | None = None

    # --- the save's side -----------------------------------------------------------------------

    def register(
        self, items: list[tuple[str, TensorEndpoint, int, int]], ready: bool = True
    ) -> None:
        """Add (location, live endpoint, begin, end) sources; ``ready``: none will follow."""
        with self.cond:
            for location, live, begin, end in items:
                self.sources[location] = _Source(live, begin, end)
            self.ready = self.ready or ready
            self.cond.notify_all()

    def register_export(self, items: list[tuple[str, TensorEndpoint]]) -> None:
        """The export's live sources, in the order it reads them; registered before the rank
        file's, which make the set ready."""
        at, placed = self.EXPORT_START, []
        for location, live in items:
            placed.append((location, live, at, at + live.nbytes))
            at += live.nbytes
        self.register(placed, ready=False)

    def mark_ready(self) -> None:
        self.register([], ready=True)

    def watch(self, tensors: dict[str, Any]) -> None:
        """Note the version counters of the tensors the save will read, on the training
        thread as save() is called: torch counts each in-place write to a tensor there."""
        with self.cond:
            self.watched = dict(tensors)
            self.versions = {name: _version(t) for name, t in tensors.items()}

    def _release(self) -> None:
        """Under the lock, once the save reads no live tensor (every source staged or read,
        or about to be): the watched tensors changed in place since save() was called."""
        if self.watched is None:
            return
        self.changed = sorted(n for n, t in self.watched.items() if _version(t) != self.versions[n])
        self.watched = None  # the live tensors are not the save's to hold any longer

    def reads_done(self) -> list[str]:
        """This rank's save has read every live tensor: the names of those changed in place
        meanwhile (outside optimizer.step(), which ``freeze`` holds back), if any."""
        self.window(1 << 62, 1 << 62)
        with self.cond:
            self._release()
            return list(self.changed or ())

    def endpoint(self, location: str) -> TensorEndpoint:
        with self.cond:
            source = self.sources[location]
            return source.staged or source.live

    def reading(self, location: str) -> None:
        """The export starts reading ``location``: every source before it is read."""
        with self.cond:
            source = self.sources[location]
        self.window(source.begin, source.end)

    def window(self, lo: int, hi: int) -> None:
        """The save has read everything before ``lo`` and starts on [lo, hi); while a step
        copies the rest out (``writer_holds``), it waits here first."""
        with self.cond:
            self.done_upto = lo
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.writer_holds or self.finished)
            self.reading_upto = hi
            self.cond.notify_all()

    def rank_file_read(self) -> None:
        """The rank file is written: only the export's sources may still be read."""
        self.window(self.EXPORT_START, self.EXPORT_START)

    def all_read(self) -> None:
        self.window(1 << 62, 1 << 62)

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.arena = None  # staged copies keep their part alive until the save is dropped
            self.cond.notify_all()

    _ALIGN = 64  # staged copies start at this alignment in the arena
    _COPY_THREADS = 4  # at most, for a step's copies

    def start_reserving(self, provide: Callable[[int, bool], torch.Tensor]) -> threading.Thread:
        """Run ``reserve_staging(provide)`` on a thread of its own."""
        self.reserving = True
        thread = threading.Thread(
            target=self.reserve_staging, args=(provide,), name="shardstream-staging", daemon=True
        )
        thread.start()
        return thread

    def reserve_staging(self, provide: Callable[[int, bool], torch.Tensor]) -> None:
        """Once the sources are known, take the host memory ``freeze`` copies into from
        ``provide(nbytes, pinned)``: the staging budget, or the sources' bytes when fewer."""
        arena, holds_all = None, False
        try:
            with self.cond:
                self.cond.wait_for(lambda: self.finished or self.ready)
                sources = list(self.sources.values())
            need = sum(s.live.nbytes + self._ALIGN for s in sources)
            size = min(self.staging_bytes + self._ALIGN * len(sources), need)
            if size > 0 and not self.finished:
                pinned = any(s.live.device.type == "cuda" for s in sources)
                arena = provide(size, pinned)[:size]
                holds_all = size == need
        except Exception as exc:  # noqa: BLE001  (a step then copies into fresh memory)
            log.warning("shardstream: could not reserve async staging memory: %s", exc)
        finally:
            with self.cond:
                self.arena = None if self.finished else arena
                self.arena_ready = True
                self.cond.notify_all()
        if holds_all and self.arena is not None:  # every source fits: staged ahead of the step
            self._stage_ahead()

    def _stage_ahead(self) -> None:
        """With memory for every source: copy them all now, on this thread, so that the next
        step finds them staged and waits for nothing. The writer waits at its next window
        meanwhile (the copies have the cores and memory bandwidth; a step that comes first
        waits for them alone), then reads the copies. A copy that fails is left to the step."""
        with self.cond:
            if self.finished:
                return
            chosen, _ = self._choose()
            self.writer_holds += 1  # a step coming meanwhile waits for these copies alone
        try:
            self._stage(chosen)
        except Exception as exc:  # noqa: BLE001  (the step copies or waits for what is left)
            log.warning("shardstream: could not stage the save's tensors ahead: %s", exc)
            with self.cond:
                for source, _ in chosen:
                    if source.staged is None:
                        source.claimed = False
                        self.staged_bytes -= source.live.nbytes
        finally:
            with self.cond:
                self.writer_holds -= 1
                if self.ready and all(s.staged for s in self.sources.values()):
                    self._release()  # copied whole: later writes cannot reach the save
                self.cond.notify_all()

    def _staging_space(self, size: int) -> torch.Tensor | None:
        """``size`` bytes of the arena for one staged copy (under the lock), or None."""
        if self.arena is None:
            return None
        at = -(-self.arena_used // self._ALIGN) * self._ALIGN
        if at + size > self.arena.numel():
            return None
        self.arena_used = at + size
        return self.arena[at : at + size]

    # --- the trainer's side --------------------------------------------------------------------

    def freeze(self) -> float:
        """Return once no live tensor will be read again; the seconds this stalled."""
        started = time.perf_counter()
        self.entered.set()
        with self.cond:
            self.cond.wait_for(
                lambda: self.finished or (self.ready and (self.arena_ready or not self.reserving))
            )
            if self.finished:
                return time.perf_counter() - started
            chosen, everything = self._choose()
            # Everything left fits: the writer has nothing the step waits for beyond its
            # current window, so it pauses while the copies run at full speed.
            self.writer_holds += everything
        try:
            self._stage(chosen)
        finally:
            with self.cond:
                self.writer_holds -= everything
                self.cond.notify_all()
        with self.cond:
            self.cond.wait_for(
                lambda: (
                    self.finished
                    or all(s.staged or s.end <= self.done_upto for s in self.sources.values())
                )
            )
            self._release()  # before the step writes: what changed until now, did so unfenced
        return time.perf_counter() - started

    def _choose(self) -> tuple[list[tuple[_Source, torch.Tensor | None]], bool]:
        """Under the lock: the sources the writer has not started that the staging budget
        still holds, what the save would reach last first, each with its arena space (None:
        new memory); and whether that is all of them."""
        chosen, everything = [], True
        for source in sorted(self.sources.values(), key=lambda s: -s.begin):
            size = source.live.nbytes
            if source.claimed or source.begin < self.reading_upto:
                continue
            if self.staged_bytes + size > self.staging_bytes:
                everything = False
                continue
            self.staged_bytes += size
            source.claimed = True
            chosen.append((source, self._staging_space(size)))
        return chosen, everything

    def _stage(self, chosen: list[tuple[_Source, torch.Tensor | None]]) -> None:
        """Copy out the ``chosen`` sources, on several threads (torch's copies release the
        GIL, and ranks often run torch on one thread), each marked staged as it completes."""

        def stage(item: tuple[_Source, torch.Tensor | None]) -> None:
            source, space = item
            if self.finished:
                return  # the save has read everything
            # Copied without the lock: the writer, unless held, goes on reading meanwhile (the
            # step has not started, so the live tensor and its copy hold the same bytes).
            staged = source.live.snapshot(space)
            with self.cond:
                source.staged = staged
                self.cond.notify_all()

        threads = min(self._COPY_THREADS, len(os.sched_getaffinity(0)), len(chosen))
        if threads <= 1:
            for item in chosen:
                stage(item)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="shardstream-stage") as pool:
            for _ in pool.map(stage, chosen):  # in order; the first error is raised
                pass


def split_budget(budget: int) -> tuple[int, int]:
    """An async save's staging budget as (the copy engine's buffer, memory for staged copies)."""
    buffer_bytes = max(1 << 20, min(64 << 20, budget // 4))
    return buffer_bytes, budget - buffer_bytes


def live_state_bytes(model: Any, optimizer: Any) -> tuple[int, int, bool]:
    """What a save of this rank reads live, estimated from the rank's own tensors: (bytes,
    tensors, whether any is on a GPU). Parameters, buffers and optimizer state, local shards
    only; the save reads each of them once."""
    tensors: dict[int, torch.Tensor] = {}

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            tensors.setdefault(id(value), local)

    if model is not None:
        for value in list(model.parameters()) + list(model.buffers()):
            add(value)
    for state in optimizer.state.values() if optimizer is not None else ():
        for value in state.values() if isinstance(state, dict) else ():
            add(value)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    on_gpu = any(t.device.type == "cuda" for t in tensors.values())
    return nbytes, len(tensors), on_gpu


def staged_state_bytes(model: Any, optimizer: Any, twice_model: bool) -> tuple[int, int, bool]:
    """What an async save of this rank stages at most: (bytes, room for placing them, whether
    any source is on a GPU). Its parameters, buffers and optimizer state, the model twice when
    an hf_model export reads it live as well; the room covers each copy's aligned offset and
    tensors read in several pieces (FSDP1's boxes)."""
    model_bytes, model_count, model_gpu = live_state_bytes(model, None)
    nbytes, count, on_gpu = live_state_bytes(None, optimizer)
    copies = 2 if twice_model else 1
    nbytes, count = nbytes + copies * model_bytes, (count + model_count) * copies
    return nbytes, (1 << 20) + 4 * SourceGuard._ALIGN * count, on_gpu or model_gpu


class StagingMemory:
    """Touched host memory an async save copies into, reused by every save of one saver.

    ``take`` gives it to a save (faulting in new memory when what is held is too small);
    ``prefault_after_first_step`` faults it in ahead of the first save, on a thread of its own,
    sized from the state the optimizer's first step created. A save starts only after the
    previous one has ended, so one save at a time uses it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: torch.Tensor | None = None
        self._filling: threading.Thread | None = None
        self._hook: Any = None  # removed on the training thread only: torch iterates its hooks
        self._armed = False  # the hook still has to size and start the fault-in

    @property
    def held_bytes(self) -> int:
        self.join()
        held = self._held
        return 0 if held is None else held.numel()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """At least ``nbytes`` of touched host memory (pinned for GPU sources)."""
        while True:
            self.join()
            with self._lock:
                if self._filling is not None:
                    continue  # the first step's fault-in started meanwhile
                self._armed = False
                held = self._held
                if held is None or held.numel() < nbytes or held.is_pinned() != pinned:
                    self._held = None  # dropped before the new memory is faulted in
                    self._held = held = _touched_memory(nbytes, pinned)
                return held

    def _start_filling(self, nbytes: int, pinned: bool) -> None:
        """Under the lock: fault in ``nbytes`` on a background thread."""
        self._held = None
        self._filling = threading.Thread(
            target=self._fill, args=(nbytes, pinned), name="shardstream-prefault", daemon=True
        )
        self._filling.start()

    def _fill(self, nbytes: int, pinned: bool) -> None:
        try:
            memory = _touched_memory(nbytes, pinned)
        except Exception as exc:  # noqa: BLE001  (the first save then faults its own in)
            log.warning("shardstream: could not fault in async staging memory: %s", exc)
            return
        with self._lock:
            self._held = memory

    def join(self) -> None:
        filling = self._filling
        if filling is not None:
            filling.join()
            with self._lock:
                if self._filling is filling:
                    self._filling = None

    def prefault_after_first_step(
        self, model: Any, optimizer: Any, budget: int | None, twice_model: bool = False
    ) -> None:
        """After the optimizer's next step, fault in what a save will copy into: the staging
        part of ``budget``, or the live state's bytes when fewer or ``budget`` is None
        (``staged_state_bytes``)."""

        def after_step(*_: Any) -> None:
            if not self._armed:
                return
            nbytes, room, on_gpu = staged_state_bytes(model, optimizer, twice_model)
            if budget is not None:
                nbytes = min(split_budget(budget)[1], nbytes)
            with self._lock:
                if self._armed:  # not done yet, and no save has taken memory meanwhile
                    self._armed = False
                    self._start_filling(nbytes + room, on_gpu)

        if not hasattr(optimizer, "register_step_post_hook"):
            return  # not a torch optimizer: the first save faults its memory in
        with self._lock:
            if self._held is not None or self._filling is not None:
                return  # sized already
            self._remove_hook()
            self._hook = optimizer.register_step_post_hook(after_step)
            self._armed = True

    def _remove_hook(self) -> None:
        """Under the lock."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def drop(self) -> None:
        """Let the memory go (it returns to the kernel once no staged copy uses it). On the
        training thread."""
        self.join()
        with self._lock:
            self._remove_hook()
            self._armed = False
            self._held = None


def _version(tensor: Any) -> tuple[int, ...]:
    """The version counters (counts of in-place writes) of a saved tensor: a DTensor's own
    and its local shard's (a write through ``to_local()`` counts only there), FSDP1's flat
    shard's (its views share one); () where none is kept. Writes through ``.data`` and
    foreach kernels on a DTensor count nowhere."""
    if isinstance(tensor, tuple):  # a state dict's tensor and the parameter it is
        return tuple(v for part in tensor for v in _version(part))
    pieces = getattr(tensor, "pieces", None)  # fsdp1_shards.FlatShard
    if pieces is not None:
        tensor = pieces[0][1] if pieces else None
    if not isinstance(tensor, torch.Tensor):
        return ()
    local = getattr(tensor, "_local_tensor", None)
    try:
        own = (tensor._version,)
        return own + (local._version,) if isinstance(local, torch.Tensor) else own
    except RuntimeError:  # an inference-mode tensor
        return ()


def _touched_memory(nbytes: int, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.from_numpy(anonymous_memory(nbytes, touch=True, huge=False))


class AsyncSaver:
    """Runs one background save at a time for a CheckpointManager."""

    def __init__(self, manager: Any, staging: StagingMemory | None = None):
        self.manager = manager
        # A group of its own: background collectives must not interleave with training's.
        self.group = dist.new_group(backend="gloo") if coll.initialized() else None
        self.thread: threading.Thread | None = None
        self.guard: SourceGuard | None = None
        self.step: int | None = None
        self.error: BaseException | None = None
        self.stalls: list[float] = []
        self.staging = staging if staging is not None else StagingMemory()
        self.hook = None
        optimizer = manager.optimizer
        if optimizer is not None:
            self.hook = optimizer.register_step_pre_hook(self._before_step)
            config = manager.config
            self.staging.prefault_after_first_step(
                manager.model,
                optimizer,
                staging_limit(config.staging_budget),
                twice_model="hf_model" in config.save_contents,
            )
        _SAVERS.add(self)

    def submit(self, step: int, extra: Any) -> None:
        """Wait for the previous save (raising its error, this step not started), then start
        this one."""
        try:
            self.wait()
        except ShardstreamError as exc:
            raise _restated(exc, f"{exc}; step {step} was not saved") from exc
        config = self.manager.config
        if config.stages_whole_state:
            state, room, _ = staged_state_bytes(
                self.manager.model, self.manager.optimizer, "hf_model" in config.save_contents
            )
            buffer_bytes, staging_bytes = config.staging_budget_bytes, state + room
        else:
            buffer_bytes, staging_bytes = split_budget(config.staging_budget_bytes)
        prepared = self.manager._prepare(step, extra, buffer_bytes, background=True)
        prepared.guard = SourceGuard(staging_bytes)
        prepared.guard.watch(prepared.live)
        prepared.guard.start_reserving(self.staging.take)
        self.guard, self.step = prepared.guard, step
        self.thread = threading.Thread(
            target=self._run, args=(prepared,), name=f"shardstream-save-{step}", daemon=True
        )
        self.thread.start()

    def _run(self, prepared: Any) -> None:
        try:
            with coll.using_group(self.group):
                self.manager._commit(prepared)
        except ShardstreamError as exc:  # surfaced on the next call, as this step's
            self.error = _background_failure(exc, self.manager.step_dir(self.step))
        except BaseException as exc:  # noqa: BLE001  (surfaced on the next call)
            self.error = exc
        finally:
            prepared.guard.finish()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guard = self.guard
        if guard is not None and not guard.finished:
            self.stalls.append(guard.freeze())

    def release_live(self) -> float:
        """Return once the save in flight reads no live tensor; the seconds that took."""
        guard = self.guard
        if guard is None or guard.finished:
            return 0.0
        return guard.freeze()

    def in_flight_steps(self) -> set[int]:
        alive = self.thread is not None and self.thread.is_alive()
        return {self.step} if alive and self.step is not None else set()

    def raise_pending_error(self) -> None:
        if self.thread is not None and not self.thread.is_alive():
            self.wait()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            self.guard = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def shutdown(self) -> None:
        try:
            self.wait()
        finally:
            self.staging.drop()
            if self.hook is not None:
                self.hook.remove()
                self.hook = None
            _SAVERS.discard(self)


def _background_failure(exc: ShardstreamError, step_dir: Path) -> ShardstreamError:
    """``exc`` of a background save, said as that step's: its temporary directory (gone by
    now) named as the step's."""
    said = re.sub(re.escape(step_dir.name) + r"\.tmp-[0-9a-f]+", step_dir.name, str(exc))
    return _restated(exc, f"the background save of {step_dir} failed: {said}")


def _restated(exc: ShardstreamError, message: str) -> ShardstreamError:
    """An error of ``exc``'s kind saying ``message`` (a plain ``ShardstreamError`` where that
    kind takes other arguments)."""
    try:
        again = type(exc)(message)
    except Exception:  # noqa: BLE001
        again = ShardstreamError(message)
    if hasattr(exc, COMMITTED_ATTR):
        setattr(again, COMMITTED_ATTR, getattr(exc, COMMITTED_ATTR))
    return again


_SAVERS: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()  # not shut down yet


def _finish_saves_at_exit() -> None:
    """A script that ends with a save in flight (no ``wait()`` or ``close()``): finish it.
    Runs before the interpreter's thread pools stop taking work (the save's writers are
    pools), which an ``atexit`` function would run after. A save that fails here makes the
    process exit 1: a run's last checkpoint is not lost behind an exit status of 0."""
    failed = False
    for saver in list(_SAVERS):
        try:
            saver.wait()
        except BaseException as exc:  # noqa: BLE001 - said, then the exit status says it
            log.error("shardstream: background checkpoint save failed: %s", exc)
            failed = True
    if failed:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(1)


# threading's exit functions run in reverse order of registration, and before the
# interpreter joins its threads: this one before concurrent.futures' (imported above).
getattr(threading, "_register_atexit", atexit.register)(_finish_saves_at_exit)
