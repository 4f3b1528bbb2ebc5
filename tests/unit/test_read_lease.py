"""Read leases: retention does not delete a checkpoint a reader holds, and a reader does not
lease one being deleted or already renamed away."""

from __future__ import annotations

import os

from shardstream.storage import locks


def test_a_lease_keeps_retention_off_until_released(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    first, second = locks.lease(manifest), locks.lease(manifest)
    assert first is not None and second is not None  # readers share
    assert locks.claim_unread(manifest) == (False, None)
    locks.release(first)
    assert locks.claim_unread(manifest) == (False, None)
    locks.release(second)
    free, fd = locks.claim_unread(manifest)
    assert free and fd is not None
    try:
        assert locks.lease(manifest) is None  # retention holds it: being deleted
    finally:
        locks.release(fd)


def test_no_lease_on_a_checkpoint_gone(tmp_path):
    assert locks.lease(tmp_path / "missing.json") is None
    assert locks.claim_unread(tmp_path / "missing.json") == (True, None)


def test_no_lease_on_a_checkpoint_renamed_away_between_open_and_lock(tmp_path, monkeypatch):
    step = tmp_path / "global_step_1"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    real_flock = locks.fcntl.flock

    def retention_buries_it_first(fd, operation):
        if step.exists():
            os.rename(step, tmp_path / "global_step_1.tmp-0")
        return real_flock(fd, operation)

    monkeypatch.setattr(locks.fcntl, "flock", retention_buries_it_first)
    assert locks.lease(step / "manifest.json") is None


def test_without_locks_readers_read_unprotected_and_retention_deletes(tmp_path, monkeypatch):
    import errno

    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locks.fcntl, "flock", no_locks)
    fd = locks.lease(manifest)
    assert fd is not None
    os.close(fd)
    assert locks.claim_unread(manifest) == (True, None)
