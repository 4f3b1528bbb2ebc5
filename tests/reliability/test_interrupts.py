"""A merge told to stop (SIGTERM, Ctrl-C), or beaten to its target, leaves the target as it was
and nothing staged; one stopped after its output is in place says so; an old output it cannot
delete is named."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

import shardstream
from shardstream import cli
from shardstream.errors import TargetExistsError
from shardstream.formats import hf
from shardstream.storage import commit

from .test_hostile import _plain_state, _verl_dir

MODEL = "model_world_size_1_rank_0.pt"


def _merge(source: Path, target: Path, *flags: str) -> int:
    return cli.main(["merge", "--local_dir", str(source), "--target_dir", str(target), *flags])


def _staged(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


def test_sigterm_mid_merge_removes_what_was_staged(tmp_path, capsys, monkeypatch):
    """SIGTERM's default action ended the process where it was: the staged output (as large
    as the model) stayed until a later merge into the same target."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    target = tmp_path / "merged"
    write_configs = hf.write_configs

    def terminated_while_writing(*args, **kwargs):
        write_configs(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread, here

    monkeypatch.setattr(hf, "write_configs", terminated_while_writing)
    assert _merge(source, target, "--quiet") == 128 + signal.SIGTERM
    assert "terminated; nothing was committed" in capsys.readouterr().err
    assert not target.exists() and _staged(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_an_interrupt_once_the_output_is_in_place_says_so(tmp_path, capsys, monkeypatch):
    """Ctrl-C while --overwrite deleted the old output said "nothing was committed", though
    the target already held the new output."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    target = tmp_path / "merged"
    assert _merge(source, target, "--quiet", "--dtype", "float32") == 0

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(commit, "_remove", interrupted)
    assert _merge(source, target, "--quiet", "--overwrite", "--dtype", "bfloat16") == 130
    err = capsys.readouterr().err
    assert f"interrupted after {target} was put in place" in err, err
    assert "nothing was committed" not in err
    assert {str(t.dtype) for t in load_file(target / "model.safetensors").values()} == {
        "torch.bfloat16"
    }


@contextlib.contextmanager
def _warnings_logged() -> Iterator[list[str]]:
    """shardstream's warnings for the block (``make soak`` runs pytest without its logging
    plugin, so not its log-capturing fixture)."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("shardstream")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def test_an_old_output_that_cannot_be_deleted_is_named(tmp_path, monkeypatch):
    """--overwrite left the old output under a temporary name, with no owner file for a later
    run to sweep it by, without a word."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    target = tmp_path / "merged"
    assert _merge(source, target, "--quiet") == 0
    monkeypatch.setattr(commit, "_remove", lambda path: None)  # as a refused deletion leaves it
    with _warnings_logged() as said:
        assert _merge(source, target, "--quiet", "--overwrite") == 0
    (left,) = [name for name in _staged(tmp_path) if (tmp_path / name).is_dir()]
    assert any(f"its old output, now {tmp_path / left}, could not be deleted" in s for s in said)
    monkeypatch.undo()  # its owner file stayed, unlocked: the next write sweeps it
    assert _merge(source, target, "--quiet", "--overwrite") == 0
    assert _staged(tmp_path) == []


@pytest.fixture(autouse=True)
def _default_sigterm():
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_target_filled_by_another_merge_meanwhile_is_named_so(tmp_path, capsys, monkeypatch):
    """Two merges into one target: the one that finished second was told the target "is not
    empty; pass --overwrite", as if it had been when it started."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    target = tmp_path / "merged"
    write_configs = hf.write_configs

    def another_merge_finishes_first(*args, **kwargs):
        write_configs(*args, **kwargs)
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"the other merge's")

    monkeypatch.setattr(hf, "write_configs", another_merge_finishes_first)
    with pytest.raises(TargetExistsError, match="was filled by another process while this"):
        shardstream.merge(source, target)  # the Python API refuses a non-empty target
    assert (target / "model.safetensors").read_bytes() == b"the other merge's"
    assert _staged(tmp_path) == []


def test_what_a_failed_merge_cannot_remove_is_swept_by_the_next(tmp_path, capsys, monkeypatch):
    """A staged output its failed merge could not remove lost its owner file anyway, so no
    later merge removed it (a model-sized directory left for good)."""
    from shardstream.errors import CheckpointFormatError

    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    target = tmp_path / "merged"

    def fails(*args, **kwargs):
        raise CheckpointFormatError("config.json: refused for the test")

    monkeypatch.setattr(hf, "write_configs", fails)
    monkeypatch.setattr(commit, "_remove", lambda path: None)
    assert _merge(source, target, "--quiet") == 1
    assert len([n for n in _staged(tmp_path) if (tmp_path / n).is_dir()]) == 1
    monkeypatch.undo()
    assert _merge(source, target, "--quiet") == 0
    assert _staged(tmp_path) == [] and (target / "model.safetensors").is_file()


def test_a_sigterm_while_a_failed_merge_removes_its_staging_waits_for_the_removal(
    tmp_path, capsys, monkeypatch
):
    """torchrun sends SIGTERM to the processes left when one dies, often while they remove
    what they staged after losing it: the removal was cut short, its folder left behind."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    target = tmp_path / "merged"
    write_configs, abandon = hf.write_configs, commit.Staged.abandon

    def a_peer_is_lost(*args, **kwargs):
        write_configs(*args, **kwargs)
        raise ConnectionError("Connection closed by peer")

    def terminated_while_removing(self):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the removal
        abandon(self)

    monkeypatch.setattr(hf, "write_configs", a_peer_is_lost)
    monkeypatch.setattr(commit.Staged, "abandon", terminated_while_removing)
    assert _merge(source, target, "--quiet") == 128 + signal.SIGTERM
    assert "terminated; nothing was committed" in capsys.readouterr().err
    assert not target.exists() and _staged(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
