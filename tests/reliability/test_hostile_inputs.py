"""Hostile and damaged inputs that once ended in a traceback or in a silent success (issue #23):
config files linked out of a checkpoint, a damaged latest pointer, manifests and JSON files
with values JSON allows but a checkpoint cannot hold, unreadable files, absurd buffer sizes and
symlinked merge targets.

Every CLI case must end in one line ``shardstream <cmd>: error: ...`` naming the file, a
non-zero exit, and nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from shardstream import cli
from shardstream.commands.verify import verify
from shardstream.errors import ShardstreamError
from shardstream.storage.run_layout import LATEST_FILE, read_latest

from .test_hostile import _plain_state, _reseal, _verl_dir


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def _merge(capsys, source: Path, target: Path, *extra) -> tuple[int, list[str]]:
    return _cli(capsys, "merge", "--local_dir", source, "--target_dir", target, "--quiet", *extra)


def _one_error_line(cmd: str, lines: list[str], *needles: str) -> str:
    """The only line of stderr is ``shardstream CMD: error: ...`` and holds every needle."""
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"shardstream {cmd}: error: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def _dcp_dir(directory: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save(_plain_state(), checkpoint_id=str(directory))
    return directory


def _native_step(saved_run, tmp_path: Path) -> Path:
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    return step


# --- 1. config files (and verl rank files) linked out of the checkpoint --------------------------


def _checkpoint(kind: str, saved_run, tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint of ``kind`` and the directory merge copies config files from."""
    if kind == "native":
        step = _native_step(saved_run, tmp_path)
        hf = step / "huggingface"
        hf.mkdir(exist_ok=True)
        return step, hf
    if kind == "verl":
        source = _verl_dir(tmp_path / "actor", {"model_world_size_1_rank_0.pt": _plain_state()})
        return source, source / "huggingface"
    source = _dcp_dir(tmp_path / "dcp")
    return source, source


@pytest.mark.parametrize("link", ["config.json", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["native", "verl", "dcp"])
def test_config_file_linked_outside_is_refused(saved_run, tmp_path, capsys, kind, link):
    source, config_dir = _checkpoint(kind, saved_run, tmp_path)
    if link != "config.json" and not (config_dir / "config.json").exists():
        (config_dir / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    if (config_dir / link).exists():
        (config_dir / link).unlink()
    os.symlink("/etc/passwd", config_dir / link)
    target = tmp_path / "merged"
    code, lines = _merge(capsys, source, target)
    _one_error_line("merge", lines, str(config_dir / link), "outside the checkpoint")
    assert code == 1 and not target.exists()


def test_dcp_config_linked_inside_is_copied(tmp_path, capsys):
    source = _dcp_dir(tmp_path / "dcp")
    (source / "real-config.json").write_text(json.dumps({"model_type": "tiny"}))
    os.symlink("real-config.json", source / "config.json")
    code, lines = _merge(capsys, source, tmp_path / "merged")
    assert (code, lines) == (0, [])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "tiny"


@pytest.mark.parametrize("which", ["model", "optim"])
def test_verl_rank_file_linked_outside_is_refused(tmp_path, capsys, which):
    elsewhere = tmp_path / "elsewhere"
    name = f"{which}_world_size_1_rank_0.pt"
    files = {"model_world_size_1_rank_0.pt": _plain_state()}
    if which == "optim":
        files[name] = {"state": {}, "param_groups": [{"params": []}]}
    source = _verl_dir(tmp_path / "actor", files)
    elsewhere.mkdir()
    shutil.move(source / name, elsewhere / name)
    os.symlink(elsewhere / name, source / name)
    if which == "model":
        target = tmp_path / "merged"
        code, lines = _merge(capsys, source, target)
        _one_error_line("merge", lines, str(source / name), "outside the checkpoint")
        assert code == 1 and not target.exists()
    from shardstream.formats import verl

    with pytest.raises(ShardstreamError, match="outside the checkpoint"):
        if which == "model":
            verl.open_verl(source)
        else:
            verl.optimizer_files(source, 1)


# --- 5. a damaged latest pointer -------------------------------------------------------------


def _flip_high_bit(data: bytes) -> bytes:
    return bytes([data[0] | 0x80]) + data[1:]


POINTERS = {
    "invalid UTF-8": lambda text: _flip_high_bit(text),
    "5000 digits": lambda text: b"9" * 5000 + b"\n",
    "negative": lambda text: b"-3\n",
    "empty": lambda text: b"",
}


@pytest.mark.parametrize("case", sorted(POINTERS))
def test_damaged_latest_pointer_falls_back(saved_run, tmp_path, capsys, case):
    root = tmp_path / "root"
    shutil.copytree(saved_run.root, root)
    pointer = root / LATEST_FILE
    pointer.write_bytes(POINTERS[case](pointer.read_bytes()))
    assert read_latest(root) is None

    from shardstream.manager import CheckpointConfig, CheckpointManager

    from .forkserver import build_model, build_optimizer

    model = build_model()
    config = CheckpointConfig(directory=str(root))
    with CheckpointManager(config, model=model, optimizer=build_optimizer(model)) as manager:
        assert manager.latest_step() == 3
        assert manager.restore()[0] == 3  # the highest committed step

    report = verify(root)
    assert [p.path for p in report.problems] == [str(pointer)]
    assert "damaged" in report.problems[0].message
    code, lines = _cli(capsys, "verify", "--quiet", root)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{pointer}: damaged")
    code, _ = _cli(capsys, "inspect", root)
    assert code == 0
