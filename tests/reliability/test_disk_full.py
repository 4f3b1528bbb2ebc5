"""A full disk during a save or a merge: a clear ``OutOfSpaceError``, nothing lost, nothing left.

The disk is a small tmpfs (or a loop-mounted image); a ballast file takes all free space but a
chosen amount, swept from nothing to more than a checkpoint needs, so the space runs out at every
stage in turn: the rank files, the extra state, the manifest, the ``latest`` pointer.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from shardstream import cli
from shardstream.commands.verify import verify
from shardstream.errors import OutOfSpaceError, ShardstreamError
from shardstream.manager import CheckpointConfig, CheckpointManager, committed_steps, read_latest
from shardstream.storage.commit import TMP_MARK
from shardstream.testing.compare import clone_nested
from shardstream.training import load as loading

from .forkserver import build_model, build_optimizer, train_step
from .harness import full_state, record, state_differences, trials
from .mounts import fill, small_filesystem, snapshot


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARK in p.name)


def _restored_state(step_dir: Path) -> dict:
    model = build_model(seed=99)  # different initial values: every byte must come from disk
    optimizer = build_optimizer(model)
    loading.load(step_dir, model=model, optimizer=optimizer, restore_rng=False)
    return full_state(model, optimizer)


def test_save_on_a_full_disk(tmp_path):
    with small_filesystem(tmp_path / "disk", "4M") as disk:
        root = disk / "run"
        model = build_model()
        optimizer = build_optimizer(model)
        config = CheckpointConfig(directory=str(root), save_interval=1, keep_last=2)
        stats: Counter = Counter()
        with CheckpointManager(config, model=model, optimizer=optimizer) as manager:
            train_step(model, optimizer, 0, 1)
            manager.save(1)
            good = {1: clone_nested(full_state(model, optimizer))}
            size = sum(p.stat().st_size for p in (root / "global_step_1").iterdir())
            step_bytes = trials(4096, 512)
            levels = list(range(0, size + 4 * 4096, step_bytes))
            step = 1
            for leave in levels:
                step += 1
                train_step(model, optimizer, 0, step)
                latest = read_latest(root)
                fill(disk / "ballast", leave)
                try:
                    manager.save(step)
                except OutOfSpaceError as exc:
                    message = str(exc)
                    assert "no space left" in message, message
                    stats["save failed with OutOfSpaceError"] += 1
                    stats[f"  ...raised at {_stage(message)}"] += 1
                    assert read_latest(root) == latest, "latest moved after a failed save"
                    if (root / f"global_step_{step}").is_dir():
                        # Committed, but the latest pointer could not be replaced: complete.
                        stats["  step committed, pointer not moved (complete, verified)"] += 1
                        good[step] = clone_nested(full_state(model, optimizer))
                else:
                    stats["save succeeded"] += 1
                    good[step] = clone_nested(full_state(model, optimizer))
                finally:
                    (disk / "ballast").unlink()
                manager.wait()  # retention's background deletion too
                assert _leftovers(root) == [], f"partial output left: {_leftovers(root)}"
                report = verify(root)
                assert report.ok, [p.line() for p in report.problems]
                now = read_latest(root)
                diffs = state_differences(_restored_state(root / f"global_step_{now}"), good[now])
                assert not diffs, f"latest step {now} does not restore as saved: {diffs[:5]}"
                assert now in committed_steps(root)
            train_step(model, optimizer, 0, step + 1)
            manager.save(step + 1)  # space is back: saving works again
            assert read_latest(root) == step + 1
    assert stats["save failed with OutOfSpaceError"] > 0 and stats["save succeeded"] > 0
    record(
        "disk full during save (1 rank)",
        trials=len(levels),
        levels_bytes=[levels[0], levels[-1], step_bytes],
        checkpoint_bytes=size,
        stats=dict(stats),
    )


def _stage(message: str) -> str:
    stages = {
        "manifest": "the manifest",
        "latest_checkpointed": "the latest pointer",
        "extra-rank-": "the extra state",
        "rank-": "a rank file",
        "global_step_": "the step directory",
    }
    return next((name for marker, name in stages.items() if marker in message), "elsewhere")


def _two_rank_save(forkserver, tmp_path: Path, disk: Path, leave: int, **spec) -> tuple:
    """Run ``scenarios.disk_full_ranks`` on 2 ranks; (its root, each rank's save outcome)."""
    root, out = disk / f"run-{leave}", tmp_path / "out"
    out.mkdir(exist_ok=True)
    spec = {
        "target": "scenarios:disk_full_ranks",
        "world": 2,
        "init": str(tmp_path / f"gloo-{leave}"),
        "root": str(root),
        "ballast": str(disk / "ballast"),
        "leave": leave,
        "out": str(out),
        **spec,
    }
    assert forkserver.run("call", spec, nprocs=2) == [0, 0], forkserver.logs()
    (disk / "ballast").unlink()
    return root, [json.loads((out / f"save-{r}.json").read_text()) for r in (0, 1)]


def _failed_together(root: Path, ranks: list[dict]) -> None:
    """Every rank raised a ShardstreamError, one for the full disk; step 1 is intact."""
    assert all(not r["ok"] and r["shardstream"] for r in ranks), ranks
    assert any(r["out_of_space"] for r in ranks), ranks
    assert read_latest(root) == 1 and committed_steps(root) == [1]
    assert _leftovers(root) == []
    assert verify(root).ok


def test_two_ranks_save_on_a_full_disk(forkserver, tmp_path):
    with small_filesystem(tmp_path / "disk", "4M") as disk:
        outcomes = []
        for leave in (0, 24 * 1024):
            root, ranks = _two_rank_save(forkserver, tmp_path, disk, leave)
            _failed_together(root, ranks)
            assert all("no space left" in r["message"] for r in ranks), ranks
            outcomes.append([f"{r['type']}: {r['message']}" for r in ranks])
    record("disk full during save (2 ranks)", trials=2, errors=outcomes)


@pytest.mark.parametrize("share", [False, True], ids=["export", "share_hf_weights"])
def test_two_ranks_hf_export_on_a_full_disk(forkserver, tmp_path, share):
    """Space runs out around the hf_model export, whose files rank 0 creates alone: every
    rank fails with the error (none is left waiting), step 1 stays the latest, nothing is
    left. (Before this test, rank 0 failing alone left rank 1 waiting in the export.) With
    ``share_hf_weights`` the export holds the only copy of the weights: the same holds."""
    source = tmp_path / "config"
    source.mkdir()
    config = {"architectures": ["TinyMLP"], "model_type": "tiny-mlp", "torch_dtype": "float32"}
    (source / "config.json").write_text(json.dumps(config))
    with small_filesystem(tmp_path / "disk", "4M") as disk:
        in_export = 0
        for leave in (0, 4096, 16384):
            root, ranks = _two_rank_save(
                forkserver, tmp_path, disk, leave, hf=True, hf_source=str(source), share=share
            )
            if all(r["ok"] for r in ranks):
                continue
            _failed_together(root, ranks)
            in_export += "huggingface" in ranks[0]["message"]
            shutil.rmtree(root)
    assert in_export > 0


def test_merge_on_a_full_disk(saved_run, tmp_path, capsys):
    with small_filesystem(tmp_path / "disk", "2M") as disk:
        source = saved_run.step
        old = disk / "old"  # a complete earlier output that --overwrite would replace
        assert (
            cli.main(["merge", "--local_dir", str(source), "--target_dir", str(old), "--quiet"])
            == 0
        )
        before = snapshot(old)
        size = sum(p.stat().st_size for p in old.iterdir())
        stats: Counter = Counter()
        levels = list(range(0, size + 8192, trials(1024, 256)))
        for leave in levels:
            for target, overwrite in ((disk / "new", False), (old, True)):
                fill(disk / "ballast", leave)
                argv = ["merge", "--local_dir", str(source), "--target_dir", str(target), "--quiet"]
                code = cli.main(argv + (["--overwrite"] if overwrite else []))
                err = capsys.readouterr().err
                (disk / "ballast").unlink()
                assert _leftovers(disk) == [], _leftovers(disk)
                if code == 0:
                    stats["merge succeeded"] += 1
                    assert verify(target).ok
                    if not overwrite:
                        shutil.rmtree(target)
                    else:
                        before = snapshot(old)
                    continue
                assert code == 1 and err.startswith("shardstream merge: error:"), err
                assert "no space left" in err, err
                # named as the user named it, not as the staging directory removed by now
                assert str(target) in err and ".tmp-" not in err, err
                stats["merge failed with OutOfSpaceError"] += 1
                if overwrite:
                    assert snapshot(old) == before, "the old output changed"
                    assert verify(old).ok
                else:
                    assert not target.exists()
    assert stats["merge failed with OutOfSpaceError"] > 0
    record(
        "disk full during merge",
        trials=2 * len(levels),
        output_bytes=size,
        stats=dict(stats),
    )


def test_out_of_space_error_is_a_shardstream_error():
    assert issubclass(OutOfSpaceError, ShardstreamError) and issubclass(OutOfSpaceError, OSError)


def test_hf_model_export_on_a_full_disk(tmp_path):
    """Space runs out while the export creates or fills its HF files: OutOfSpaceError, no
    partial step left, the previous step still the latest and intact."""
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2")
    model = build_tiny_model(config, seed=1)
    hf_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with small_filesystem(tmp_path / "disk", "4M") as disk:
        root = disk / "run"
        cfg = CheckpointConfig(
            directory=str(root), save_contents=("model", "hf_model"), keep_last=1
        )
        outcomes: Counter = Counter()
        with CheckpointManager(cfg, model=model, hf_config=config) as manager:
            manager.save(1)
            size = sum(p.stat().st_size for p in (root / "global_step_1").rglob("*") if p.is_file())
            assert size > hf_bytes  # the sharded copy and the export
            for step, leave in enumerate(range(hf_bytes // 4, 2 * size, max(1, size // 8)), 2):
                latest = read_latest(root)
                fill(disk / "ballast", leave)
                try:
                    manager.save(step)
                except OutOfSpaceError as exc:
                    assert "no space left" in str(exc), exc
                    outcomes["out of space"] += 1
                    if "huggingface" in str(exc):
                        outcomes["  in the hf export"] += 1
                    assert not (root / f"global_step_{step}").exists()
                    assert read_latest(root) == latest
                else:
                    outcomes["saved"] += 1
                finally:
                    (disk / "ballast").unlink()
                manager.wait()  # retention's background deletion too
                assert _leftovers(root) == [], f"partial output left: {_leftovers(root)}"
                assert verify(root).ok
    assert outcomes["  in the hf export"] > 0 and outcomes["saved"] > 0, outcomes
