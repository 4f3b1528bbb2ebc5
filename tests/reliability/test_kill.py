"""kill -9 during multi-rank FSDP2 saves, and during ``shardstream merge``.

Save trials: 2 or 3 ranks (gloo, ``fully_shard`` on a ("fsdp",) mesh) train and save every
step through ``CheckpointManager(save_interval=1, keep_last=2)`` until SIGKILL hits one rank
(the others are left to notice, then killed) or all of them, at a random moment: mostly during
the save loop, sometimes during start-up and restore. Runs are chained: each trial resumes the
directory the previous one crashed in, at a random world size, so a partial save, a half-done
retention or a stale lock is always there for the next start to cope with. After every kill:

- ``latest`` names a committed checkpoint, never older than the newest ``save()`` that returned;
- ``verify`` passes on the manager root and on the latest step;
- a new ``CheckpointManager`` removes every ``*.tmp-*`` leftover, and its ``restore()`` gives
  the model and optimizer state of that step bit for bit (written aside before the save began);
- retention never kept more than ``keep_last`` + 1 steps, and never dropped the latest.

Merge trials: the ``shardstream`` CLI merges a 2-rank checkpoint and is killed at a random
moment; the target is then absent or complete (verify passes, bytes equal a clean merge),
never partial, and a rerun of the same command succeeds and removes the killed run's staged
directory (nothing named ``TARGET.tmp-*`` is left).
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from .harness import (
    check_root_after_crash,
    classify_debris,
    durable_step,
    kill,
    record,
    trials,
    violation,
    wait_for,
)
from .harness import trial as checked

KEEP_LAST = 2
CHAIN = 6  # trials per run directory before starting a fresh one
WINDOW_S = 1.5  # kill within this long after the ranks are ready (about 8-12 saves)
EARLY_S = 1.0  # or, one trial in ten, this long after the fork (start-up, restore)
GRACE_S = 5.0  # after killing one rank, how long the others get to fail by themselves


def _kill_save_trials(
    forkserver,
    base: Path,
    count: int,
    seed: int,
    async_save: bool,
    hf_source: str | None = None,
    worlds: tuple[int, ...] = (2, 3),
    modes: tuple[str, ...] | None = None,
    after_save: float = 0.0,
) -> dict:
    """``modes``: kill "one" or "all" in this order, cyclically (default: at random).
    ``after_save``: the share of trials (in the save loop) that first wait for a ``save()`` to
    return, so slow starts (4 ranks on 2 cores) still get kills after a commit."""
    rng = random.Random(seed)
    stats: Counter = Counter()
    debris: Counter = Counter()
    survivors: Counter = Counter()
    root = side = None
    floor = None
    chain = 0
    for trial in range(count):
        if root is None or chain == CHAIN:
            root, side, floor, chain = base / f"root-{trial}", base / f"side-{trial}", None, 0
        chain += 1
        world = rng.choice(worlds)
        mode = rng.choice(("all", "one")) if modes is None else modes[trial % len(modes)]
        early = rng.random() < 0.1
        later = not early and rng.random() < after_save
        run = f"run-{trial}"
        spec = {
            "world": world,
            "init": str(base / f"gloo-{trial}"),
            "root": str(root),
            "side": str(side),
            "run": run,
            "keep_last": KEEP_LAST,
            "async_save": async_save,
            "hf_source": hf_source,
        }
        pids = forkserver.spawn("train", spec, nprocs=world)
        try:
            if early:
                time.sleep(rng.uniform(0, EARLY_S))
            else:
                wait_for(side / run / ("saved" if later else "ready"), forkserver, pids)
                time.sleep(rng.uniform(0, WINDOW_S))
            if mode == "all":
                order = pids[:]
                rng.shuffle(order)
                kill(order)
            else:
                victim = rng.choice(pids)
                kill([victim])
                exited, running = forkserver.wait([p for p in pids if p != victim], GRACE_S)
                survivors["exited by themselves"] += len(exited)
                survivors["still running after 5 s (killed)"] += len(running)
                survivors.update(
                    f"exit code {code}" for code in exited.values() if code is not None
                )
                kill(running)
            _, running = forkserver.wait(pids, 30)
            if running:
                violation(f"trial {trial}: ranks {running} survived SIGKILL")
        finally:
            forkserver.kill_all()
        done = durable_step(side / run)
        if done is not None:
            floor = done if floor is None else max(floor, done)
        stats["saves returned"] += len(
            (side / run / "saved").read_text().split() if (side / run / "saved").exists() else []
        )
        info = None
        label = (
            f"trial {trial} (seed {seed}, world {world}, kill {mode}, "
            f"{'early' if early else 'in the save loop'}{', after a save' if later else ''})"
        )
        with checked(label):
            try:
                info = check_root_after_crash(root, side, floor, KEEP_LAST)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nlogs:\n{forkserver.logs(pids)}") from None
        stats["trials"] += 1
        if info is None:  # counted as a violation; the next trial starts a fresh directory
            stats["invariant violated"] += 1
            root = None
            continue
        stats[f"world size {world}"] += 1
        stats[f"killed {mode}"] += 1
        stats["killed during start-up/restore" if early else "killed in the save loop"] += 1
        if later:
            stats["killed after a save had returned"] += 1
        stats["partial directory left, then removed"] += bool(info["debris"])
        stats["step committed, latest not yet moved"] += bool(info.get("ahead_of_pointer"))
        stats["restored bit for bit"] += info["restored"] is not None
        stats["nothing committed yet"] += info["restored"] is None
        debris.update(classify_debris(info["debris"]))
    return {"stats": dict(stats), "debris": dict(debris), "survivors": dict(survivors)}


@pytest.mark.parametrize("seed", [20240601])
def test_kill9_during_save(forkserver, tmp_path, seed):
    count = trials(12, 120)
    figures = _kill_save_trials(forkserver, tmp_path, count, seed, async_save=False)
    record("kill -9 during save", seed=seed, trials=count, **figures)
    assert figures["stats"]["trials"] == count


@pytest.mark.skipif(
    importlib.util.find_spec("shardstream.training.async_save") is None,
    reason="shardstream.training.async_save does not exist yet",
)
def test_kill9_during_async_save(forkserver, tmp_path):
    seed = 20240602
    count = trials(6, 60)
    figures = _kill_save_trials(forkserver, tmp_path, count, seed, async_save=True)
    record("kill -9 during async save", seed=seed, trials=count, **figures)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill9_during_save_with_shared_hf_weights(forkserver, tmp_path, async_save):
    """Saves with hf_model and share_hf_weights, whose model weights live only in
    huggingface/: the same guarantees, restore reading the weights from there. Async: the
    export reads the live weights under the guard while training goes on."""
    source = tmp_path / "config"
    source.mkdir()
    config = {"architectures": ["TinyMLP"], "model_type": "tiny-mlp", "torch_dtype": "float32"}
    (source / "config.json").write_text(json.dumps(config))
    seed = 20240604 if async_save else 20240603
    count = trials(6, 60)
    figures = _kill_save_trials(forkserver, tmp_path, count, seed, async_save, str(source))
    kind = "async save" if async_save else "save"
    record(f"kill -9 during {kind} (hf_model, share_hf_weights)", seed=seed, trials=count,
           **figures)  # fmt: skip
    assert figures["stats"]["trials"] == count


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill9_four_ranks(forkserver, tmp_path, async_save):
    """4 gloo ranks, killing one (the others are left to fail) and all of them in turn."""
    seed = 20240611 + async_save
    count = trials(2, 30)
    figures = _kill_save_trials(
        forkserver,
        tmp_path,
        count,
        seed,
        async_save,
        worlds=(4,),
        modes=("one", "all"),
        after_save=0.5,
    )
    kind = "async save" if async_save else "save"
    record(f"kill -9 during {kind} (4 ranks)", seed=seed, trials=count, **figures)
    assert figures["stats"]["trials"] == count


# --- merge ---------------------------------------------------------------------------------------


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def merge_source(forkserver, tmp_path_factory):
    """A 2-rank FSDP2 checkpoint large enough (8 x 4 MB matrices) that a merge takes a while."""
    base = tmp_path_factory.mktemp("merge-source")
    spec = {
        "world": 2,
        "init": str(base / "gloo"),
        "root": str(base / "root"),
        "side": str(base / "side"),
        "run": "source",
        "steps": 1,
        "hidden": 1024,
        "depth": 8,
        "record": False,
    }
    assert forkserver.run("train", spec, nprocs=2) == [0, 0], forkserver.logs()
    return base / "root" / "global_step_1"


def _merge_argv(source: Path, target: Path, overwrite: bool) -> list[str]:
    argv = ["merge", "--local_dir", str(source), "--target_dir", str(target)]
    argv += ["--dtype", "bfloat16", "--max-shard-size", "4MB", "--buffer-size", "256KiB"]
    return argv + ["--quiet"] + (["--overwrite"] if overwrite else [])


def _spawn_merge(forkserver, argv: list[str], world: int, init: Path) -> list[int]:
    """``shardstream merge`` in one forked process, or ``--distributed`` over ``world`` gloo
    ranks (what torchrun would start)."""
    if world == 1:
        return forkserver.spawn("cli", {"argv": argv})
    spec = {"argv": argv + ["--distributed"], "world": world, "init": str(init)}
    return forkserver.spawn("dist_cli", spec, nprocs=world)


def _run_merge(forkserver, argv: list[str], world: int, init: Path) -> list[int]:
    pids = _spawn_merge(forkserver, argv, world, init)
    exited, running = forkserver.wait(pids, 120)
    if running:
        kill(running)
        forkserver.wait(running, 30)
        raise AssertionError(f"merge did not finish in 120 s:\n{forkserver.logs(pids)}")
    return [exited[p] for p in pids]


def _kill_merge_trials(forkserver, tmp_path: Path, source: Path, count: int, seed: int,
                       world: int = 1) -> dict:  # fmt: skip
    """Kill a merge (all its ranks, or with ``world`` > 1 sometimes one, the others given
    ``GRACE_S`` to fail by themselves) at a random moment; then the target must be absent or
    complete, and the same command again must succeed and leave nothing beside the target."""
    from shardstream.commands.verify import verify

    rng = random.Random(seed)
    clean = tmp_path / "clean"
    started = time.monotonic()
    codes = _run_merge(forkserver, _merge_argv(source, clean, False), world, tmp_path / "gloo-c")
    assert codes == [0] * world, forkserver.logs()
    duration = time.monotonic() - started
    reference = _tree(clean)
    assert len(reference) > 3  # several shards and the index: many kill points
    stats: Counter = Counter()
    survivors: Counter = Counter()
    for trial in range(count):
        target = tmp_path / f"out-{trial}"
        overwrite = rng.random() < 0.3
        if overwrite:  # an older, complete output that --overwrite replaces
            shutil.copytree(clean, target)
            (target / "marker-old-output.json").write_text("{}")
        argv = _merge_argv(source, target, overwrite)
        pids = _spawn_merge(forkserver, argv, world, tmp_path / f"gloo-{trial}")
        time.sleep(rng.uniform(0, 1.2 * duration))
        mode = "all" if world == 1 else ("one", "all")[trial % 2]
        if mode == "all":
            kill(pids)
        else:
            victim = rng.choice(pids)
            kill([victim])
            exited, running = forkserver.wait([p for p in pids if p != victim], GRACE_S)
            survivors["exited by themselves"] += len(exited)
            survivors["still running after 5 s (killed)"] += len(running)
            kill(running)
        exited, running = forkserver.wait(pids, 30)
        stats[f"killed {mode}"] += world > 1
        with checked(f"trial {trial} (seed {seed}, {world} rank(s), kill {mode})"):
            assert not running, f"ranks {running} survived SIGKILL"
            finished = all(code == 0 for code in exited.values())
            leftovers = [
                p.name for p in tmp_path.iterdir() if p.name.startswith(f"out-{trial}.tmp-")
            ]
            if target.exists():
                files = _tree(target)
                old = "marker-old-output.json" in files
                files.pop("marker-old-output.json", None)
                assert files == reference, f"target {target} exists but is not complete"
                report = verify(target)
                assert report.ok, "\n".join(p.line() for p in report.problems)
                stats[
                    "target complete (old output)" if old else "target complete (new output)"
                ] += 1
            else:
                assert not overwrite or leftovers, "the old output vanished"
                stats["target absent"] += 1
            stats["killed before exit" if not finished else "finished before the kill"] += 1
            stats["temporary directory left behind"] += bool(leftovers)
            # The same command again (with --overwrite if a complete target is there now).
            rerun = _merge_argv(source, target, overwrite or target.exists())
            codes = _run_merge(forkserver, rerun, world, tmp_path / f"gloo-{trial}-rerun")
            assert codes == [0] * world, forkserver.logs()
            assert _tree(target) == reference
            stats["rerun succeeded"] += 1
            # The rerun removed the killed run's staged directory (its owner is dead): nothing
            # of either run is left beside the target.
            stale = [p.name for p in tmp_path.iterdir() if p.name.startswith(f"out-{trial}.tmp-")]
            assert not stale, f"left beside the target after the rerun: {stale}"
            stats["temporary directory removed by the rerun"] += bool(leftovers)
        stats["trials"] += 1
    figures = {"clean_merge_s": round(duration, 3), "stats": dict(stats)}
    return {**figures, "survivors": dict(survivors)} if world > 1 else figures


def test_kill9_during_merge(forkserver, tmp_path, merge_source):
    seed = 20240603
    count = trials(10, 100)
    figures = _kill_merge_trials(forkserver, tmp_path, merge_source, count, seed)
    record("kill -9 during merge", seed=seed, trials=count, **figures)


def test_kill9_during_distributed_merge(forkserver, tmp_path, merge_source):
    """``merge --distributed`` over 4 gloo ranks: one rank killed (the others stuck in a
    collective or failing), or all of them."""
    seed = 20240613
    count = trials(2, 40)
    figures = _kill_merge_trials(forkserver, tmp_path, merge_source, count, seed, world=4)
    record("kill -9 during merge --distributed (4 ranks)", seed=seed, trials=count, **figures)


def test_kill9_real_cli_process_during_merge(tmp_path, merge_source):
    """The same through an exec'd ``python -m shardstream`` (not forked), killed mid-run."""
    import os
    import subprocess
    import sys

    from shardstream.commands.verify import verify

    rng = random.Random(20240604)
    target = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "shardstream", *_merge_argv(merge_source, target, False)]
    started = time.monotonic()
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    duration = time.monotonic() - started
    shutil.rmtree(target)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(0.5, 1.0) * duration)
    proc.kill()
    proc.wait()
    assert not target.exists() or verify(target).ok
    rerun = cmd + (["--overwrite"] if target.exists() else [])
    subprocess.run(rerun, check=True, env=env, capture_output=True)
    assert verify(target).ok
    stale = [p.name for p in tmp_path.iterdir() if p.name.startswith("out.tmp-")]
    assert not stale, f"left beside the target after the rerun: {stale}"
