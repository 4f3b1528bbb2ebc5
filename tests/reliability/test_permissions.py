"""Read-only filesystems and forbidden directories: a clear error, and nothing lost.

Root ignores permission bits, so the trials use a tmpfs remounted read-only (``EROFS``) and a
process that dropped to uid 65534 ("nobody") for ``EACCES``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from shardstream import cli
from shardstream.commands.verify import verify
from shardstream.errors import ShardstreamError, UsageError
from shardstream.manager import CheckpointConfig, CheckpointManager, read_latest
from shardstream.training import load as loading
from shardstream.training import save as saving

from .forkserver import build_model, build_optimizer, train_step
from .harness import record
from .mounts import remount, small_filesystem, snapshot

NOBODY = 65534


def test_read_only_filesystem(saved_run, tmp_path, capsys):
    with small_filesystem(tmp_path / "disk", "8M") as disk:
        root = disk / "run"
        model = build_model()
        optimizer = build_optimizer(model)
        config = CheckpointConfig(directory=str(root), save_interval=1, keep_last=2)
        with CheckpointManager(config, model=model, optimizer=optimizer) as manager:
            for step in (1, 2):
                train_step(model, optimizer, 0, step)
                manager.save(step)
        merged = disk / "merged"
        argv = ["merge", "--local_dir", str(root / "global_step_2"), "--quiet"]
        assert cli.main([*argv, "--target_dir", str(merged)]) == 0
        remount(disk, "ro")
        before = snapshot(disk)
        errors = {}

        # A manager restores from the read-only root (it takes no lock for that); saving fails.
        reader_model = build_model(seed=5)
        reader = CheckpointManager(
            config, model=reader_model, optimizer=build_optimizer(reader_model)
        )
        assert reader.restore()[0] == 2
        assert reader.latest_step() == 2
        with pytest.raises(ShardstreamError) as caught:
            reader.save(3)
        reader.close()
        errors["CheckpointManager.save on the read-only root"] = str(caught.value)
        assert "read-only file system" in str(caught.value).lower()
        assert not isinstance(caught.value, UsageError)

        with pytest.raises(ShardstreamError) as caught:
            saving.save(root / "global_step_3", model=model, optimizer=optimizer, step=3)
        errors["save into the read-only root"] = str(caught.value)
        assert "read-only file system" in str(caught.value).lower()

        for target, overwrite in ((disk / "merged-2", False), (merged, True)):
            code = cli.main([*argv, "--target_dir", str(target)] + ["--overwrite"] * overwrite)
            err = capsys.readouterr().err
            # 1, an error of the environment; 2 is for a usage error
            assert code == 1 and err.startswith("shardstream merge: error:"), (code, err)
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
            errors[f"merge into the read-only disk{' (--overwrite)' if overwrite else ''}"] = (
                err.strip()
            )

        assert snapshot(disk) == before, "something changed on the read-only disk"
        # Reading works: verify, restore and merge out of the read-only disk.
        assert verify(root).ok and verify(merged).ok
        fresh = build_model(seed=7)
        loaded = loading.load(root / "global_step_2", model=fresh, optimizer=build_optimizer(fresh))
        assert loaded.step == 2
        assert cli.main([*argv, "--target_dir", str(tmp_path / "out")]) == 0
    record(
        "read-only filesystem",
        trials=len(errors),
        errors={k: v.replace(str(disk), "DISK") for k, v in errors.items()},
    )


@pytest.fixture
def shared_dir():
    """A directory outside root's private pytest tree that uid 65534 can reach."""
    if os.geteuid() != 0:
        pytest.skip("dropping privileges needs root")
    base = Path(tempfile.mkdtemp(prefix="shardstream-perm-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _open_up(tree: Path) -> None:
    for dirpath, _, files in os.walk(tree):
        os.chmod(dirpath, 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)


def test_unprivileged_user_in_a_forbidden_directory(forkserver, saved_run, shared_dir):
    readable = shared_dir / "readable" / "global_step_3"
    shutil.copytree(saved_run.step, readable)
    _open_up(shared_dir / "readable")
    denied = shared_dir / "denied"  # root's, mode 0755: nobody may read but not write
    denied.mkdir(mode=0o755)
    out = shared_dir / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    before = snapshot(shared_dir / "readable")
    spec = {
        "target": "unprivileged:denied",
        "uid": NOBODY,
        "denied": str(denied),
        "readable": str(readable),
        "out": str(out),
    }
    assert forkserver.run("call", spec) == [0], forkserver.logs()
    result = json.loads((out / "denied-0.json").read_text())
    assert result["uid"] == NOBODY
    for what in ("manager", "save"):
        assert not result[what]["ok"] and result[what]["shardstream"], result[what]
        assert "ermission denied" in result[what]["message"], result[what]
    assert result["merge"] == {"ok": True, "value": 1}  # exit 1: may not write, not misused
    assert list(denied.iterdir()) == [], "something was written into the forbidden directory"
    assert result["restore_readable"] == {"ok": True, "value": 3}
    assert result["verify_readable"] == {"ok": True, "value": "True"}
    assert snapshot(shared_dir / "readable") == before
    logs = forkserver.logs()
    assert "Traceback" not in logs, logs
    record(
        "permission denied (uid 65534, directory owned by root)",
        trials=3,
        errors={
            "CheckpointManager": result["manager"]["message"],
            "save": result["save"]["message"],
            "merge exit code": result["merge"].get("value"),
        },
    )


def test_unprivileged_user_loses_write_permission_mid_run(forkserver, shared_dir):
    out = shared_dir / "out"
    out.mkdir()
    out.chmod(0o777)
    home = shared_dir / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    spec = {
        "target": "unprivileged:mid_run",
        "uid": NOBODY,
        "root": str(home / "run"),
        "out": str(out),
    }
    assert forkserver.run("call", spec) == [0], forkserver.logs()
    result = json.loads((out / "mid-run-0.json").read_text())
    failed = result["save_read_only_dir"]
    assert not failed["ok"] and failed["shardstream"] and "ermission denied" in failed["message"]
    assert not any(".tmp-" in name for name in result["entries_while_read_only"]), result
    assert result["latest_after"] == 1 and result["verify_after"] == "True"
    assert result["save_after_regaining"]["ok"]
    unreadable = result["restore_unreadable_file"]
    assert not unreadable["ok"] and unreadable["shardstream"], unreadable
    assert "rank-00000.safetensors" in unreadable["message"]
    problems = result["verify_unreadable_file"]
    assert problems["ok"] and any("rank-00000.safetensors" in p for p in problems["value"])
    extra = result["restore_unreadable_extra"]
    assert not extra["ok"] and extra["shardstream"], extra
    assert "extra-rank-00000.json" in extra["message"]
    extra_problems = result["verify_unreadable_extra"]
    assert extra_problems["ok"], extra_problems
    assert any("extra-rank-00000.json" in p for p in extra_problems["value"])
    assert read_latest(home / "run") == 3
    record(
        "permission lost mid-run (uid 65534)",
        trials=3,
        errors={
            "save into a directory made read-only": failed["message"],
            "restore with an unreadable rank file": unreadable["message"],
            "verify with an unreadable rank file": problems["value"],
            "restore with an unreadable extra-state file": extra["message"],
        },
    )


@pytest.mark.parametrize(
    "error, line",
    [
        (OSError(5, "Input/output error", "/ckpt/rank_0.safetensors"), "/ckpt/rank_0.safetensors"),
        (
            OSError(18, "Invalid cross-device link", "/a", None, "/b"),
            "/a: /b: Invalid cross-device link",
        ),
        (OSError(5, "Input/output error"), "error: Input/output error"),
    ],
    ids=["named", "two-names", "unnamed"],
)
def test_other_system_errors_are_one_line_naming_the_file(monkeypatch, capsys, error, line):
    """An OSError the permission and disk-full rules do not name (an I/O error, a refused
    rename) is still one line with its file(s) and exit 1, not a traceback."""

    def failing(args):
        raise error

    monkeypatch.setattr(cli, "run_verify", failing)
    assert cli.main(["verify", "/ckpt"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("shardstream verify: error: ") and line in err
    assert len(err.strip().splitlines()) == 1


def test_a_bug_keeps_its_traceback(monkeypatch):
    def failing(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "run_verify", failing)
    with pytest.raises(KeyError):
        cli.main(["verify", "/ckpt"])
