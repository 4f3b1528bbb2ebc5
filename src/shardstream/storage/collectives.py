"""How ranks agree: small collectives on the checkpoint's process group.

Saves run on the default group, or, for background (async) saves, on a group of their own so
their collectives never interleave with training's. The group is set per thread.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import ShardstreamError

_local = threading.local()
T = TypeVar("T")
R = TypeVar("R")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group() -> Any:
    """The process group this thread's checkpoint collectives use (None: the default group)."""
    return getattr(_local, "group", None)


@contextlib.contextmanager
def quiet_without_group() -> Iterator[None]:
    """DCP warns when used without a process group; that is a supported mode here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def using_group(process_group: Any) -> Iterator[None]:
    previous = group()
    _local.group = process_group
    try:
        yield
    finally:
        _local.group = previous


def _grouped() -> bool:
    """Whether collectives run on a process group. A background save's group gone (the
    default group destroyed while the save ran) is an error, not a world of one."""
    if initialized():
        return True
    if group() is not None:
        raise ShardstreamError(
            "the process group was destroyed while a background save was using it, so the "
            "save was not committed: call CheckpointManager.wait() or close() before "
            "torch.distributed.destroy_process_group()"
        )
    return False


def rank() -> int:
    return dist.get_rank(group()) if _grouped() else 0


def world() -> int:
    return dist.get_world_size(group()) if _grouped() else 1


def global_rank(group_rank: int) -> int:
    """The global rank of ``group_rank`` in this thread's group (for send/recv)."""
    if group() is None or not initialized():
        return group_rank
    return dist.get_global_rank(group(), group_rank)


def barrier() -> None:
    if world() > 1:
        dist.barrier(group=group())


def broadcast(value: Any) -> Any:
    if world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=global_rank(0), group=group())
    return box[0]


def gather(value: Any) -> list[Any]:
    if world() == 1:
        return [value]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, value, group=group())
    return out


def gather_to_root(value: Any) -> list[Any] | None:
    """Every rank's ``value`` on rank 0 (None elsewhere): for what only rank 0 needs, which
    would cost every rank world x its size with ``gather``."""
    if world() == 1:
        return [value]
    out: list[Any] | None = [None] * world() if rank() == 0 else None
    dist.gather_object(value, out, dst=global_rank(0), group=group())
    return out


def agree_or_raise(error: BaseException | None, what: str = "save") -> None:
    """Make every rank fail together, so no rank waits forever on a collective."""
    gather_or_raise(None, error, what)


def gather_or_raise(value: Any, error: BaseException | None, what: str = "save") -> list[Any]:
    """Every rank's ``value`` in one collective, or, if any rank has an ``error``, that
    error raised on every rank (its own where it has one)."""
    message = None if error is None else f"rank {rank()}: {error}"
    outcomes = gather((value if error is None else None, message))
    failed = [m for _, m in outcomes if m]
    if error is not None:
        raise error
    if failed:
        raise ShardstreamError(f"{what} failed on another rank: {failed[0]}")
    return [v for v, _ in outcomes]


def in_turns(
    items: Sequence[T], work: Callable[[int, T], R], shared: bool = True
) -> Iterator[tuple[int, T, R]]:
    """``(i, item, work(i, item))`` for every item, in order.

    ``shared``: every process of the group calls this together; item ``i`` is worked on by
    rank ``i % K`` and the results (plain, picklable data) are exchanged K items at a time,
    so each process does 1/K of the work and holds K results at once. An item that fails
    raises the same error on every process, before anyone goes on to the next K.
    """
    ways = world() if shared else 1
    if ways == 1:
        for index, item in enumerate(items):
            yield index, item, work(index, item)
        return
    for first in range(0, len(items), ways):
        mine, result, error = first + rank(), None, None
        if mine < len(items):
            try:
                result = work(mine, items[mine])
            except Exception as exc:  # noqa: BLE001  (every process must raise it)
                if not isinstance(exc, ShardstreamError):
                    exc = ShardstreamError(f"{items[mine]}: {type(exc).__name__}: {exc}")
                error = exc
        for index, (theirs, failure) in enumerate(gather((result, error)), start=first):
            if failure is not None:
                raise failure
            if index < len(items):
                yield index, items[index], theirs


def init_from_environment() -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT), on gloo.

    Returns True when this call created it (the caller then destroys it when done)."""
    import os

    from ..errors import UsageError

    if initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError(
            "--distributed needs torchrun: torchrun --nproc_per_node=K -m shardstream merge ... "
            "--distributed"
        )
    dist.init_process_group("gloo")
    return True


def leave(failed: bool = False) -> None:
    """Leave a process group this process created, after everyone is done with it; ``failed``:
    at once (the others may be gone, and the failure is what the caller says)."""
    if not initialized():
        return
    if failed:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        return
    dist.barrier()
    dist.destroy_process_group()


def lost_peer(exc: BaseException) -> str | None:
    """One line for a collective that failed because another process of the group stopped
    (gloo: "Connection closed by peer", a reset, a timeout); None for any other error."""
    error_types = tuple(
        t for t in (getattr(dist, "DistError", None), RuntimeError) if isinstance(t, type)
    )
    if not isinstance(exc, error_types):
        return None
    text = str(exc)
    if not any(s in text for s in ("gloo", "Connection", "connection", "Timed out", "timeout")):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), text)
    return (
        "lost contact with another process of the group, which stopped (its own error says "
        f"why): {first[:200]}"
    )
