"""Two writers, and readers during writes.

- A second ``CheckpointManager`` on a directory another live process saves to gets
  ``CheckpointLockedError`` when it tries to save (the lock is taken by the first save, or
  ``acquire_lock()``); once that process is killed (-9), its lock no longer blocks.
- Two training runs started on one directory at the same moment: exactly one saves, the other
  gets ``CheckpointLockedError`` at its first save.
- A manager that only restores needs no lock: it works while another process saves.
- ``restore``, ``verify`` and ``merge`` running in a loop while a run saves every step see
  committed checkpoints only: whatever they read equals that step's state, and the only failure
  allowed is a step that retention deleted while it was being read (a clean error, and the
  directory is then gone).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from shardstream.commands.merge import merge
from shardstream.commands.verify import verify
from shardstream.errors import CheckpointLockedError, ShardstreamError
from shardstream.manager import LOCK_FILE, CheckpointConfig, CheckpointManager, read_latest
from shardstream.training import load as loading

from .forkserver import build_model, build_optimizer
from .harness import (
    check_root_after_crash,
    durable_step,
    full_state,
    kill,
    record,
    state_differences,
    trials,
    wait_for,
)


def test_second_manager_is_refused_and_a_dead_holders_lock_is_not(forkserver, tmp_path):
    root = tmp_path / "run"
    refused = 0
    for round_ in range(trials(3, 20)):
        ready = tmp_path / f"ready-{round_}"
        pids = forkserver.spawn("hold", {"root": str(root), "ready": str(ready)})
        wait_for(ready, forkserver, pids)
        in_progress = root / f"global_step_{round_ + 1}.tmp-0123abcd"  # as if the holder saved
        in_progress.mkdir()
        second = CheckpointManager(CheckpointConfig(directory=str(root)))  # no lock yet
        assert in_progress.is_dir(), "a manager start removed a live saver's directory"
        with pytest.raises(CheckpointLockedError) as caught:
            second.acquire_lock()
        assert str(pids[0]) in str(caught.value), str(caught.value)
        with pytest.raises(CheckpointLockedError):
            second.save(round_ + 1)
        second.close()
        refused += 1
        kill(pids)
        forkserver.wait(pids, 30)
        assert (root / LOCK_FILE).exists()  # the dead holder's lock file is still there
        with CheckpointManager(CheckpointConfig(directory=str(root))) as third:
            assert not in_progress.exists(), "the dead holder's partial save was left behind"
            third.acquire_lock()  # ...and does not block
    (root / LOCK_FILE).write_text('{"pid": 999999, "host": "elsewhere"}')  # stale, unlocked
    with CheckpointManager(CheckpointConfig(directory=str(root))) as fourth:
        fourth.acquire_lock()
    record(
        "concurrency: second manager refused, stale lock of a killed holder ignored",
        trials=refused,
        message=str(caught.value).replace(str(root), "ROOT"),
    )


def test_two_runs_start_on_one_directory(forkserver, tmp_path):
    root, side = tmp_path / "run", tmp_path / "side"
    outcomes: Counter = Counter()
    for attempt in range(trials(2, 10)):
        specs = [
            {
                "world": 1,
                "init": str(tmp_path / f"gloo-{attempt}-{i}"),
                "root": str(root),
                "side": str(side),
                "run": f"run-{attempt}-{i}",
                "keep_last": 2,
                # Half the runs fail fast (acquire_lock() at start-up); the others restore
                # first, racing the winner's retention, and get the error at their first save.
                "lock_at_start": attempt % 2 == 1,
            }
            for i in range(2)
        ]
        pids = [forkserver.spawn("train", spec)[0] for spec in specs]
        try:
            # Generous: the loop ends as soon as one run saved and the other left; on a loaded
            # machine two runs' start-up and first save took over a minute (make soak beside CI).
            deadline = time.monotonic() + 900
            exited: dict[int, int | None] = {}
            while time.monotonic() < deadline:
                alive = [p for p in pids if p not in exited]
                exited.update(forkserver.wait(alive, 0.05)[0] if alive else {})
                saved = [(side / s["run"] / "saved").exists() for s in specs]
                if exited and any(saved):
                    break
            assert len(exited) == 1 and sum(saved) == 1, (exited, saved, forkserver.logs(pids))
            loser = next(iter(exited))
            assert exited[loser] == 1
            assert "CheckpointLockedError" in forkserver.logs([loser])
            time.sleep(0.5)  # the winner saves a few steps
        finally:
            kill(pids)
            forkserver.wait(pids, 30)
        winner = specs[pids.index(next(p for p in pids if p != loser))]
        check_root_after_crash(root, side, durable_step(side / winner["run"]), 2)
        outcomes["one saved, the other got CheckpointLockedError"] += 1
    record(
        "concurrency: two runs started on one directory",
        trials=sum(outcomes.values()),
        stats=dict(outcomes),
    )


HIDDEN, DEPTH = 256, 2  # saves of about 1.6 MB: long enough for readers to overlap them


def _step_of(path: str) -> int | None:
    for part in Path(path).parts:
        if part.startswith("global_step_") and part[12:].isdigit():
            return int(part[12:])
    return None


def test_readers_during_saves_see_committed_checkpoints(forkserver, tmp_path):
    root, side = tmp_path / "run", tmp_path / "side"
    spec = {
        "world": 1,
        "init": str(tmp_path / "gloo"),
        "root": str(root),
        "side": str(side),
        "run": "writer",
        "keep_last": 2,
        "hidden": HIDDEN,
        "depth": DEPTH,
    }
    rng = random.Random(7)
    stats: Counter = Counter()
    duration = trials(8, 90)
    pids = forkserver.spawn("train", spec)
    try:
        wait_for(side / "writer" / "ready", forkserver, pids)
        while read_latest(root) is None:
            time.sleep(0.01)
        model = build_model(0, HIDDEN, DEPTH)
        optimizer = build_optimizer(model)
        # An evaluation job's manager: it restores while the run saves, but may not save.
        reader = CheckpointManager(
            CheckpointConfig(directory=str(root), keep_last=2), model=model, optimizer=optimizer
        )
        with pytest.raises(CheckpointLockedError):
            reader.save(10**6)
        stats["CheckpointManager.save refused to a second manager while the run saves"] += 1
        end = time.monotonic() + duration
        while time.monotonic() < end:
            op = rng.choice(("restore", "manager restore", "manager latest", "verify", "merge"))
            step = read_latest(root)
            step_dir = root / f"global_step_{step}"
            try:
                if op == "restore":
                    loading.load(step_dir, model=model, optimizer=optimizer, restore_rng=False)
                    expected = torch.load(side / "writer" / f"step_{step}.pt", weights_only=True)
                    diffs = state_differences(full_state(model, optimizer), expected)
                    assert not diffs, f"restore of step {step} during saves: {diffs[:5]}"
                elif op == "manager latest":  # retried if retention deletes it mid-read
                    try:
                        got, extra = reader.restore()
                    except ShardstreamError as exc:
                        # Every retry may lose the race on a starved machine: then the step it
                        # read last is gone, and the error says so cleanly.
                        last = re.search(r"global_step_(\d+)", str(exc))
                        if last and not (root / f"global_step_{last.group(1)}").exists():
                            stats["manager latest: retention won every retry (clean error)"] += 1
                            continue
                        raise AssertionError(f"restore() of the latest step failed: {exc}") from exc
                    assert extra.get("step") == got, (got, extra)
                    expected = torch.load(side / "writer" / f"step_{got}.pt", weights_only=True)
                    diffs = state_differences(full_state(model, optimizer), expected)
                    assert not diffs, f"restore() of step {got} during saves: {diffs[:5]}"
                elif op == "manager restore":
                    got, extra = reader.restore(step=step)
                    assert got == step and extra.get("step") == step, (got, extra)
                    expected = torch.load(side / "writer" / f"step_{step}.pt", weights_only=True)
                    diffs = state_differences(full_state(model, optimizer), expected)
                    assert not diffs, f"manager restore of step {step} during saves: {diffs[:5]}"
                elif op == "merge":
                    out = tmp_path / "merged"
                    shutil.rmtree(out, ignore_errors=True)
                    merge(step_dir, out)
                    from safetensors.torch import load_file

                    merged = load_file(out / "model.safetensors")
                    expected = torch.load(side / "writer" / f"step_{step}.pt", weights_only=True)
                    diffs = state_differences(merged, expected["model"])
                    assert not diffs, f"merge of step {step} during saves: {diffs[:5]}"
                else:
                    report = verify(root)
                    for problem in report.problems:
                        gone = _step_of(problem.path)
                        assert gone is not None and not (root / f"global_step_{gone}").exists(), (
                            f"verify during saves: {problem.line()}"
                        )
                    if not report.ok:
                        stats["verify: raced with retention (step gone)"] += 1
                        continue
                stats[f"{op}: consistent with the committed step"] += 1
            except ShardstreamError as exc:
                if step_dir.exists():
                    raise AssertionError(
                        f"{op} of step {step} failed while it exists: {exc}"
                    ) from exc
                stats[f"{op}: raced with retention (step gone, clean error)"] += 1
        reader.close()
        exited, _ = forkserver.wait(pids, 0)
        assert not exited, f"the writer died: {forkserver.logs(pids)}"
    finally:
        kill(pids)
        forkserver.wait(pids, 30)
    saves = durable_step(side / "writer")
    check_root_after_crash(root, side, saves, 2, hidden=HIDDEN, depth=DEPTH)
    ops = ("restore", "manager restore", "manager latest", "verify", "merge")
    reads = sum(n for k, n in stats.items() if k.split(":")[0] in ops)
    record(
        "concurrency: readers during saves",
        seconds=duration,
        saves=saves,
        reads=reads,
        stats=dict(stats),
    )
    assert os.path.exists(root)
