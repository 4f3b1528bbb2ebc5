"""Async save: ``save()`` returns at once; a background thread streams the live tensors.

Nothing is copied up front. Parameters and optimizer state only change in ``optimizer.step()``,
so an optimizer step pre-hook calls ``SourceGuard.freeze()``: tensors the writer has not started
yet are staged into host memory while the staging budget lasts (the last ones to be written
first), and the step waits only for the rest. An hf_model export that reads live weights (not
the rank file: ``saving.execute_save``) registers them too, after the rank file's. The
background save runs on a process group of its own, so its collectives never interleave with
training's.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..engine.endpoints import TensorEndpoint
from ..storage import collectives as coll

log = logging.getLogger(__name__)


@dataclass
class _Source:
    live: TensorEndpoint
    begin: int
    end: int
    staged: TensorEndpoint | None = None


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
        self.finished = False
        # Set once a step calls freeze(). A test seam: tests hold a save's writer on it, so that
        # the save is certainly in flight when the step comes, whatever the machine's load.
        self.entered = threading.Event()

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
        with self.cond:
            self.done_upto, self.reading_upto = lo, hi
            self.cond.notify_all()

    def rank_file_read(self) -> None:
        """The rank file is written: only the export's sources may still be read."""
        self.window(self.EXPORT_START, self.EXPORT_START)

    def all_read(self) -> None:
        self.window(1 << 62, 1 << 62)

    def finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    # --- the trainer's side --------------------------------------------------------------------

    def freeze(self) -> float:
        """Return once no live tensor will be read again; the seconds this stalled."""
        started = time.perf_counter()
        self.entered.set()
        with self.cond:
            self.cond.wait_for(lambda: self.finished or self.ready)
            if self.finished:
                return time.perf_counter() - started
            # What the save would reach last is staged first.
            pending = sorted(self.sources.values(), key=lambda s: -s.begin)
        for source in pending:
            with self.cond:
                if self.finished:
                    break
                size = source.live.nbytes
                if source.staged or source.begin < self.reading_upto:
                    continue
                if self.staged_bytes + size > self.staging_bytes:
                    continue
                self.staged_bytes += size
            # Copied without the lock: the writer goes on reading meanwhile (the step has not
            # started, so the live tensor and its copy hold the same bytes).
            staged = source.live.snapshot()
            with self.cond:
                source.staged = staged
        with self.cond:
            self.cond.wait_for(
                lambda: (
                    self.finished
                    or all(s.staged or s.end <= self.done_upto for s in self.sources.values())
                )
            )
        return time.perf_counter() - started


class AsyncSaver:
    """Runs one background save at a time for a CheckpointManager."""

    def __init__(self, manager: Any):
        self.manager = manager
        # A group of its own: background collectives must not interleave with training's.
        self.group = dist.new_group(backend="gloo") if coll.initialized() else None
        self.thread: threading.Thread | None = None
        self.guard: SourceGuard | None = None
        self.step: int | None = None
        self.error: BaseException | None = None
        self.stalls: list[float] = []
        self.hook = None
        if manager.optimizer is not None:
            self.hook = manager.optimizer.register_step_pre_hook(self._before_step)
        atexit.register(self._at_exit)

    def submit(self, step: int, extra: Any) -> None:
        """Wait for the previous save (raising its error), then start this one."""
        self.wait()
        config = self.manager.config
        budget = config.staging_budget_bytes
        buffer_bytes = max(1 << 20, min(64 << 20, budget // 4))
        prepared = self.manager._prepare(step, extra, buffer_bytes)
        prepared.guard = SourceGuard(budget - buffer_bytes)
        self.guard, self.step = prepared.guard, step
        self.thread = threading.Thread(
            target=self._run, args=(prepared,), name=f"shardstream-save-{step}", daemon=True
        )
        self.thread.start()

    def _run(self, prepared: Any) -> None:
        try:
            with coll.using_group(self.group):
                self.manager._commit(prepared)
        except BaseException as exc:  # noqa: BLE001  (surfaced on the next call)
            self.error = exc
        finally:
            prepared.guard.finish()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        guard = self.guard
        if guard is not None and not guard.finished:
            self.stalls.append(guard.freeze())

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
            if self.hook is not None:
                self.hook.remove()
                self.hook = None
            atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            log.error("shardstream: background checkpoint save failed: %s", exc)
            raise
