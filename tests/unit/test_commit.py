"""staged_directory's owner files: a dead run's leftovers are removed by the next run for the same
target, a live run's (another process, or this one) never are."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardstream.errors import TargetExistsError
from shardstream.storage.commit import (
    OWNER_SUFFIX,
    TMP_MARK,
    remove_stale_staging,
    staged_directory,
)


def _siblings(target: Path) -> list[str]:
    return sorted(
        p.name for p in target.parent.iterdir() if p.name.startswith(target.name + TMP_MARK)
    )


def _dead_leftover(target: Path, token: str, content: str = "somehost 4194303\n") -> Path:
    """What a kill -9'd run leaves: its staged directory and its (no longer locked) owner file."""
    tmp = target.with_name(f"{target.name}{TMP_MARK}{token}")
    tmp.mkdir()
    (tmp / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    tmp.with_name(tmp.name + OWNER_SUFFIX).write_text(content)
    return tmp


def test_owner_file_sits_beside_and_goes_away(tmp_path):
    target = tmp_path / "out"
    with staged_directory(target) as tmp:
        owner = tmp.with_name(tmp.name + OWNER_SUFFIX)
        host, pid = owner.read_text().split()
        assert int(pid) > 0 and host
        (tmp / "a.json").write_text("{}")
    assert sorted(p.name for p in target.iterdir()) == ["a.json"]
    assert _siblings(target) == []


def test_dead_owners_leftovers_are_removed_by_the_next_run(tmp_path):
    target = tmp_path / "out"
    _dead_leftover(target, "0123abcd")
    _dead_leftover(target, "89abcdef")
    other = _dead_leftover(tmp_path / "other", "0123abcd")  # another target's: not ours to touch
    with staged_directory(target) as tmp:
        assert _siblings(target) == sorted([tmp.name, tmp.name + OWNER_SUFFIX])
        (tmp / "a.json").write_text("{}")
    assert _siblings(target) == []
    assert (target / "a.json").is_file()
    assert other.is_dir()


def test_live_owner_in_this_process_is_kept(tmp_path):
    """Two staged runs for one target at once: neither removes the other's directory."""
    target = tmp_path / "out"
    with pytest.raises(TargetExistsError):  # the second run took the target meanwhile
        with staged_directory(target) as first:
            (first / "a").write_text("1")
            assert remove_stale_staging(target) == []
            with staged_directory(tmp_path / "out") as second:
                assert first.is_dir() and (first / "a").read_text() == "1"
                (second / "b").write_text("2")
            assert first.is_dir()
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert _siblings(target) == []


def test_live_owner_in_another_process_is_kept(tmp_path):
    """A run on this host that holds its owner file's lock: alive, whatever its pid."""
    target = tmp_path / "out"
    tmp = _dead_leftover(target, "0123abcd")
    owner = tmp.with_name(tmp.name + OWNER_SUFFIX)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); time.sleep(60)", str(owner)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert remove_stale_staging(target) == []
        with staged_directory(target) as mine:
            (mine / "a").write_text("1")
        assert tmp.is_dir() and owner.is_file()
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.05)
    assert remove_stale_staging(target) == [tmp]  # its owner is dead now
    assert not owner.exists()


def test_unknown_leftovers_are_kept_and_half_created_claims_removed(tmp_path):
    """No owner file (an older shardstream, or not ours): not provably dead, so left alone. An
    empty, unlocked owner file: a run killed between creating and writing it (kill -9 in the
    soak left one beside the target), or one about to lock it, which then claims again."""
    target = tmp_path / "out"
    legacy = target.with_name(f"{target.name}{TMP_MARK}fedcba98")
    legacy.mkdir()
    empty = _dead_leftover(target, "0123abcd", content="")
    assert remove_stale_staging(target) == [empty]
    assert legacy.is_dir() and not empty.exists()
    assert not empty.with_name(empty.name + OWNER_SUFFIX).exists()


def test_a_claim_whose_file_a_cleaner_removed_claims_again(tmp_path):
    """The claimant created its owner file, a cleaner locked it (empty: taken for dead) and
    removed it; the claimant, blocked on the lock meanwhile, makes a new one and owns that."""
    import fcntl
    import os
    import threading

    from shardstream.storage import commit

    tmp = tmp_path / f"out{TMP_MARK}0123abcd"
    owner = tmp.with_name(tmp.name + OWNER_SUFFIX)
    real_open, cleaner = os.open, {}

    def open_then_cleaner_locks(path, flags, *args):
        fd = real_open(path, flags, *args)
        if path == owner and "fd" not in cleaner:  # the cleaner gets in right after the create
            cleaner["fd"] = real_open(path, os.O_RDWR)
            fcntl.flock(cleaner["fd"], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd

    claimed = {}
    commit.os.open = open_then_cleaner_locks
    try:
        claimant = threading.Thread(target=lambda: claimed.update(fd=commit._claim(tmp)))
        claimant.start()
        deadline = time.monotonic() + 60  # a guard, not a timing assumption
        while "fd" not in cleaner and time.monotonic() < deadline:
            time.sleep(0.01)
        # The cleaner holds the lock, so the claimant is blocked on it (or about to be).
        assert claimant.is_alive()
        owner.unlink()  # the cleaner removes the "dead" claim, then lets go
        os.close(cleaner["fd"])
        claimant.join(10)
    finally:
        commit.os.open = real_open
    fd = claimed["fd"]
    assert fd is not None and owner.is_file() and os.fstat(fd).st_nlink == 1
    assert owner.read_text().split()[1] == str(os.getpid())
    commit.Staged(tmp_path / "out", tmp, fd).abandon()
    assert not owner.exists()


def test_swap_cut_between_renames_gets_the_old_target_back(tmp_path):
    """Killed after moving the old target aside, before moving the new one in: the old output
    is restored, not deleted with the rest."""
    target = tmp_path / "out"
    tmp = _dead_leftover(target, "0123abcd")
    old = tmp.with_name(tmp.name + ".old")
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"old output")
    removed = remove_stale_staging(target)
    assert removed == [tmp]
    assert (target / "model.safetensors").read_bytes() == b"old output"
    assert _siblings(target) == []


# --- the swap, and the rule a directory lock's holder applies -----------------------------------


def _tree(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir()}


@pytest.mark.parametrize("exchange", [True, False])
def test_swap_replaces_a_target_and_leaves_nothing_beside_it(tmp_path, monkeypatch, exchange):
    import errno

    from shardstream.storage import commit

    if not exchange:

        def refuse(src, dst, flags):
            raise OSError(errno.EINVAL, "exchange unsupported here")

        monkeypatch.setattr(commit, "_renameat2", refuse)
    target = tmp_path / "out"
    target.mkdir()
    (target / "a").write_text("old")
    for content in ("new", "newer"):
        staged = commit.stage(target)
        (staged.path / "a").write_text(content)
        staged.commit()
        assert _tree(target) == {"a": content}
        assert _siblings(target) == []


def test_exchange_failing_otherwise_is_raised(tmp_path):
    from shardstream.storage import commit

    with pytest.raises(FileNotFoundError):
        commit._exchange(tmp_path / "missing", tmp_path / "also-missing")


def test_directory_lock_holder_recovers_old_copies_and_takes_the_rest(tmp_path):
    from shardstream.storage import commit

    def tree(name: str, content: str) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "a").write_text(content)
        return tmp_path / name

    tree(f"s1{TMP_MARK}0123abcd", "new, unfinished")  # cut between the renames: s1 is missing
    tree(f"s1{TMP_MARK}0123abcd.old", "old s1")
    tree("s2", "s2")  # cut after them: s2 is in place, its old copy is debris
    tree(f"s2{TMP_MARK}89abcdef.old", "old s2")
    tree(f"s3{TMP_MARK}deleted", "an older shardstream's retention")
    (tmp_path / f"latest{TMP_MARK}fedcba98").write_text("3")
    tree(f"other{TMP_MARK}01234567", "not this caller's")
    live = tree(f"s4{TMP_MARK}76543210", "a live writer's")
    with staged_directory(tmp_path / "s5") as mine:  # holds its owner file's lock
        taken = commit.take_debris(tmp_path, lambda name: name != "other")
        assert mine.is_dir()
    for path in taken:
        assert TMP_MARK in path.name and path.is_dir()
        commit.remove(path)
    assert _tree(tmp_path / "s1") == {"a": "old s1"}
    assert _tree(tmp_path / "s2") == {"a": "s2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["s1", "s2", "s5", f"other{TMP_MARK}01234567"]
    )
    assert not live.exists()  # ownerless: dead to the holder of the directory's lock


def test_discard_leaves_nothing(tmp_path):
    from shardstream.storage import commit

    step = tmp_path / "global_step_1"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    commit.discard(step)
    assert list(tmp_path.iterdir()) == []


def test_buried_step_is_debris_to_the_run_sweep(tmp_path):
    """What retention leaves if the process dies before its background deletion ends."""
    from shardstream.storage import commit
    from shardstream.storage.run_layout import is_run_entry

    step = tmp_path / "global_step_1"
    (step / "sub").mkdir(parents=True)
    (step / "sub" / "rank-00000.safetensors").write_bytes(b"x")
    grave = commit.bury(step)
    assert not step.exists() and grave.parent == tmp_path and grave.is_dir()
    assert grave.name.startswith(f"global_step_1{TMP_MARK}")
    taken = commit.take_debris(tmp_path, is_run_entry)
    assert len(taken) == 1 and not grave.exists()
    commit.remove(taken[0])
    assert list(tmp_path.iterdir()) == []


def test_deleter_deletes_in_the_background_then_calls_back_and_logs_failures(tmp_path, caplog):
    import logging

    from shardstream.storage import commit

    graves = []
    for name in ("a", "b"):
        (tmp_path / "step" / name / "deep").mkdir(parents=True)
        (tmp_path / "step" / name / "deep" / "f").write_text(name)
        graves.append(commit.bury(tmp_path / "step" / name))
    seen = []

    def then(grave):
        seen.append((grave.name, grave.exists()))
        raise OSError("callback failed")

    deleter = commit.Deleter()
    with caplog.at_level(logging.WARNING, logger="shardstream"):
        deleter.submit(graves, then)
        deleter.join()
    assert seen == [(g.name, False) for g in graves]
    assert list((tmp_path / "step").iterdir()) == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("callback failed" in m for m in warned)
    deleter.submit([])  # nothing to delete: no thread
    deleter.join()


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("ENOSPC", "no space left on device"),
        ("EDQUOT", "disk quota exceeded"),
        ("EFBIG", "file size limit exceeded (ulimit -f, or the largest file the file system"),
    ],
)
def test_a_full_disk_is_out_of_space_naming_the_path(code, said):
    """Out of space, each cause said as it is: a file-size limit (``ulimit -f``) was reported
    as a full disk."""
    import errno

    from shardstream.errors import OutOfSpaceError, out_of_space

    full = OSError(getattr(errno, code), "full")
    assert str(out_of_space(full, "/x/y")).startswith(f"/x/y: {said}")
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("a wrapper, as DCP's") from exc
    except RuntimeError as wrapped:
        error = out_of_space(wrapped, "/x", "no space left on device while writing {path}")
    assert isinstance(error, OutOfSpaceError)
    assert str(error).startswith(said) and str(error).endswith(" while writing /x")
    assert out_of_space(OSError(errno.EIO, "I/O error"), "/x") is None
    # the file the write met, inside the path named (a save's extra-rank-00000.json)
    met = OSError(getattr(errno, code), "full", "/x/y.tmp-1/extra-rank-00000.json")
    assert str(out_of_space(met, "/x/y")).startswith(
        f"/x/y (writing /x/y.tmp-1/extra-rank-00000.json): {said}"
    )


def test_a_forbidden_target_directory_is_named_not_the_owner_file(tmp_path, monkeypatch):
    """The message named shardstream's own ``<target>.tmp-<hex>.owner`` file."""
    import os

    from shardstream.errors import CheckpointPermissionError
    from shardstream.storage import commit

    real_open = os.open

    def refused(path, *args, **kwargs):
        if str(path).endswith(commit.OWNER_SUFFIX):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(commit.os, "open", refused)
    with pytest.raises(CheckpointPermissionError) as caught:
        commit.stage(tmp_path / "merged")
    assert str(caught.value) == f"cannot write the target merged in {tmp_path}: permission denied"


def test_a_read_only_file_system_is_an_error_of_the_environment_not_of_usage(tmp_path, monkeypatch):
    """A read-only target filesystem was a usage error (exit 2); it is refused as one that
    may not be written (exit 1), and said so."""
    import errno
    import os

    from shardstream.errors import CheckpointPermissionError, UsageError
    from shardstream.storage import commit

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(commit.os, "mkdir", read_only)
    with pytest.raises(CheckpointPermissionError) as caught:
        commit.stage(tmp_path / "merged")
    assert not isinstance(caught.value, UsageError)
    assert (
        str(caught.value) == f"cannot write the target {tmp_path / 'merged'}: read-only file system"
    )
    assert not list(tmp_path.iterdir())  # the claim is given back
