"""A script that ends with an async save in flight (no ``wait()``, no ``close()``): the save
completes before the interpreter exits, or the process exits 1 saying why.

The scripts run in a process of their own, since what is tested is the interpreter's exit. The
save is held until that exit has begun, so it is in flight there however fast the machine.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shardstream.commands.verify import verify
from shardstream.errors import ShardstreamError
from shardstream.storage.collectives import rank, using_group
from shardstream.storage.run_layout import committed_steps, read_latest

SCRIPT = textwrap.dedent(
    """
    import sys
    import threading

    import torch

    from shardstream import CheckpointConfig, CheckpointManager
    from shardstream.formats import native

    root, mode = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    config = CheckpointConfig(root, async_save=True)
    manager = CheckpointManager(config, model=model, optimizer=optimizer)

    release = threading.Event()
    commit = CheckpointManager._commit

    def held(self, prepared):
        assert release.wait(600)
        if mode == "fails":
            raise OSError(5, "disk went away")
        return commit(self, prepared)

    CheckpointManager._commit = held
    # threading's exit functions run last registered first: this one before shardstream's
    threading._register_atexit(release.set)
    manager.save(1)
    print("script done", flush=True)
    """
)


def _run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    root = tmp_path / "run"
    return subprocess.run(
        [sys.executable, str(script), str(root), mode],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_save_in_flight_at_exit_is_finished(tmp_path):
    """It was lost: the writer's thread pools refused work once the interpreter had begun
    to exit ("cannot schedule new futures after interpreter shutdown"), and the exit status
    was 0."""
    proc = _run(tmp_path, "commits")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "script done" in proc.stdout and "failed" not in proc.stderr, proc.stderr[-3000:]
    root = tmp_path / "run"
    assert committed_steps(root) == [1] and read_latest(root) == 1
    assert verify(root).ok


def test_a_save_that_fails_at_exit_exits_1(tmp_path):
    proc = _run(tmp_path, "fails")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "background checkpoint save failed: [Errno 5] disk went away" in proc.stderr
    assert committed_steps(tmp_path / "run") == []


RETIRING = textwrap.dedent(
    """
    import sys
    import threading
    import time

    import torch

    from shardstream import CheckpointConfig, CheckpointManager
    from shardstream.storage import commit

    model = torch.nn.Linear(64, 64)
    config = CheckpointConfig(sys.argv[1], async_save=True, keep_last=1, save_contents=("model",))
    manager = CheckpointManager(config, model=model)
    manager.save(1)
    manager.wait()
    run = commit.Deleter._run

    def after_exit_began(graves, then):  # retention's deletion, once the interpreter exits
        while threading.main_thread().is_alive():
            time.sleep(0.01)
        run(graves, then)

    commit.Deleter._run = staticmethod(after_exit_began)
    manager.save(2)  # committed at exit; retention drops step 1 from the save's thread
    print("script done", flush=True)
    """
)


def test_retention_at_exit_deletes_the_dropped_step_whole(tmp_path):
    """The deletion thread retention starts from an async save's (daemon) thread inherited
    its daemon flag: the interpreter did not wait for it, and a half-deleted
    global_step_N.tmp-* stayed, which verify called a save cut short."""
    script = tmp_path / "train.py"
    script.write_text(RETIRING)
    root = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "script done" in proc.stdout
    assert committed_steps(root) == [2]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "global_step_2",
        "latest_checkpointed_iteration.txt",
    ]
    assert verify(root).ok


def test_collectives_on_a_destroyed_group_are_an_error():
    """A background save's group destroyed under it (destroy_process_group() before wait())
    counted as a world of one: the save went on as a single process."""
    with using_group(object()), pytest.raises(ShardstreamError, match="destroy_process_group"):
        rank()
