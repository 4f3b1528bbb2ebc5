"""The test ranks' runner (``shardstream.testing.distributed.run``): what every multi-process
test stands on. Its fork server must hold a single thread when it forks ranks (a thread a
preloaded library leaves running, such as pyarrow's jemalloc background thread, makes the
forked ranks crash at random), and a rank that crashes natively must leave its stack."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

import pytest

from shardstream.testing.distributed import PRELOADED, run


def _parent_threads(rank: int, world: int) -> list[str]:
    """The names of the threads of this rank's parent, the fork server."""
    tasks = f"/proc/{os.getppid()}/task"
    return [open(f"{tasks}/{t}/comm").read().strip() for t in sorted(os.listdir(tasks))]


def _crash_in_native_code(rank: int, world: int, peer_waits: bool) -> None:
    """Rank 1 crashes; rank 0 returns, or waits for it in a collective (then fails too, its
    peer gone, and may report that before the runner sees the crash)."""
    import torch.distributed as dist

    if rank == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    elif peer_waits:
        dist.barrier()


def _killed_while_writing_its_error(rank: int, world: int) -> None:
    """Rank 0 fails, and is killed halfway through writing its error record (as run() stops
    the other ranks of a failed run at any point)."""
    if rank == 0:

        def write_half_then_die(self, data):
            with open(self, "wb") as f:
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        Path.write_bytes = write_half_then_die
        raise ValueError("rank 0 fails")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_fork_server_forks_ranks_from_a_single_thread():
    threads = run(_parent_threads, 2)
    assert threads[0] == threads[1]
    assert len(threads[0]) == 1, (
        f"the fork server runs threads {threads[0]} after importing {PRELOADED}: "
        "a preloaded module started one; import it in the ranks instead"
    )


@pytest.mark.parametrize("peer_waits", [False, True])
def test_a_rank_that_crashes_natively_leaves_its_stack(peer_waits):
    with pytest.raises(RuntimeError) as raised:
        run(_crash_in_native_code, 2, peer_waits, timeout=120)
    text = str(raised.value)
    assert "process 1 terminated with signal SIGSEGV" in text, text
    assert "--- rank 1: its threads' stacks ---" in text and "Fatal Python error" in text, text
    assert "in _crash_in_native_code" in text, text


def test_a_rank_killed_while_writing_its_result_still_fails_the_run_clearly():
    with pytest.raises(RuntimeError) as raised:
        run(_killed_while_writing_its_error, 2, timeout=120)
    assert "process 0 terminated with signal SIGKILL" in str(raised.value), str(raised.value)
