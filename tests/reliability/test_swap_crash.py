"""kill -9 inside the commit swap: replacing step N (or a merge target) never loses it.

A child process replaces an existing directory and SIGKILLs itself at exactly one point of the
swap: right after the atomic exchange (the new directory is in, the old one not yet removed),
or, with the exchange refused as on a filesystem without it, between moving the old directory
aside and moving the new one in. The next manager start (or the next merge's sweep) must find
the directory committed, old or new, and leave no temporary behind. Retention killed between
its rename and its delete must not bring the dropped step back.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.commands.verify import verify
from shardstream.storage.commit import OLD_SUFFIX, TMP_MARK, remove_stale_staging, staged_directory

CONTENTS = ("model", "extra")

# Patches the child applies before its last write: ``die_at`` names where it kills itself.
INJECT = textwrap.dedent(
    """
    import errno, os, signal, sys
    from shardstream.storage import commit

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def inject(die_at, victim):
        if die_at == "after-exchange":
            real_exchange = commit._exchange

            def exchange_then_die(tmp, target):
                assert real_exchange(tmp, target), "this filesystem cannot exchange"
                die()

            commit._exchange = exchange_then_die
            return
        if die_at == "mid-delete":  # retention's background deletion, cut half way
            real_remove_tree = commit.remove_tree

            def delete_one_file_then_die(path, *args, **kwargs):
                if not os.path.basename(path).startswith(os.path.basename(victim) + ".tmp-"):
                    return real_remove_tree(path, *args, **kwargs)
                os.unlink(min(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs))
                die()

            commit.remove_tree = delete_one_file_then_die
            return
        real_rename = os.rename

        def rename_then_die(src, dst):
            real_rename(src, dst)
            if os.fspath(src) == victim:
                die()

        if die_at == "between-renames":
            def no_exchange(src, dst, flags):
                raise OSError(errno.EINVAL, "exchange unsupported here")

            commit._renameat2 = no_exchange
        commit.os.rename = rename_then_die
    """
)

SAVE = INJECT + textwrap.dedent(
    """
    import torch
    from shardstream import CheckpointConfig, CheckpointManager

    root, die_at, value, keep_last = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    step = int(sys.argv[5])
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, value)
    config = CheckpointConfig(
        root, save_contents=("model", "extra"), keep_last=int(keep_last) if keep_last else None
    )
    with CheckpointManager(config, model=model) as manager:
        inject(die_at, os.path.join(root, "global_step_1"))
        manager.save(step, extra={"value": value})
    """
)

MERGE = INJECT + textwrap.dedent(
    """
    from pathlib import Path

    target = Path(sys.argv[1])
    inject(sys.argv[2], str(target))
    with commit.staged_directory(target, overwrite=True) as tmp:
        (tmp / "data").write_text("new")
    """
)


def _child(script: str, *args: object) -> int:
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode in (0, -signal.SIGKILL), done.stderr
    return done.returncode


def _save(root: Path, value: float, step: int = 1, keep_last: int | None = None) -> None:
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, value)
    config = CheckpointConfig(str(root), save_contents=CONTENTS, keep_last=keep_last)
    with CheckpointManager(config, model=model) as manager:
        manager.save(step, extra={"value": value})


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARK in p.name)


def _restored(root: Path, keep_last: int | None = None) -> tuple[list[int], int, float]:
    """What a new manager finds: its steps, and the step and value it restores."""
    model = torch.nn.Linear(3, 2)
    config = CheckpointConfig(str(root), save_contents=CONTENTS, keep_last=keep_last)
    with CheckpointManager(config, model=model) as manager:
        assert _temporaries(root) == [], "the manager start left temporaries behind"
        steps = manager.all_steps()
        step, extra = manager.restore()
    assert torch.all(model.weight == extra["value"])
    return steps, step, extra["value"]


@pytest.mark.parametrize("die_at", ["after-exchange", "between-renames"])
def test_resave_of_step_killed_mid_swap_keeps_the_step(tmp_path, die_at):
    root = tmp_path / "run"
    _save(root, 1.0)
    assert _child(SAVE, root, die_at, 2.0, "", 1) == -signal.SIGKILL
    left = _temporaries(root)
    if die_at == "between-renames":  # the window itself: no global_step_1 at all
        assert not (root / "global_step_1").exists()
        assert any(name.endswith(OLD_SUFFIX) for name in left), left
    else:  # the new step is in; the old one waits under the temporary name
        assert (root / "global_step_1").is_dir() and left
    steps, step, value = _restored(root)
    # Cut between the renames the old step comes back; after the exchange the new one stays.
    assert (steps, step, value) == ([1], 1, 1.0 if die_at == "between-renames" else 2.0)
    assert verify(root).ok
    _save(root, 3.0)  # and the run goes on: the step can be replaced again
    assert _restored(root) == ([1], 1, 3.0)


@pytest.mark.parametrize("die_at", ["retention", "mid-delete"])
def test_retention_killed_between_rename_and_delete_drops_the_step(tmp_path, die_at):
    """Killed right after the rename, or in the middle of the background deletion."""
    root = tmp_path / "run"
    _save(root, 1.0, step=1, keep_last=1)
    assert _child(SAVE, root, die_at, 2.0, 1, 2) == -signal.SIGKILL
    assert not (root / "global_step_1").exists() and _temporaries(root)
    assert _restored(root, keep_last=1) == ([2], 2, 2.0)
    assert verify(root).ok


@pytest.mark.parametrize("die_at", ["after-exchange", "between-renames"])
def test_merge_target_replaced_and_killed_mid_swap_is_never_lost(tmp_path, die_at):
    target = tmp_path / "merged"
    with staged_directory(target) as tmp:
        (tmp / "data").write_text("old")
    assert _child(MERGE, target, die_at) == -signal.SIGKILL
    assert target.exists() == (die_at == "after-exchange")
    remove_stale_staging(target)  # what the next merge into this target does first
    expected = "old" if die_at == "between-renames" else "new"
    assert (target / "data").read_text() == expected
    assert _temporaries(tmp_path) == []
    with staged_directory(target, overwrite=True) as tmp:  # the rerun
        (tmp / "data").write_text("rerun")
    assert (target / "data").read_text() == "rerun" and _temporaries(tmp_path) == []
