"""verl's merge flags that publish or default the output: ``--hf_upload_path`` / ``--private``
(the Hub itself stands in as a recording fake: tests reach no network) and ``--target_dir``
defaulting to ``tmp``."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from recording_hub import RecordingHub
from safetensors.torch import load_file

import shardstream
from shardstream.cli import main


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "run" / "global_step_1"
    shardstream.save(path, model=torch.nn.Linear(8, 4), contents=("model",))
    return path


def _merge(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["merge", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_upload_after_the_merge_is_complete(capsys, monkeypatch, checkpoint, tmp_path):
    hub = RecordingHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", hub)
    target = tmp_path / "merged"
    rc, out, err = _merge(
        capsys, "--backend", "fsdp", "--local_dir", str(checkpoint), "--target_dir", str(target),
        "--hf_upload_path", "me/tiny-linear", "--private",
    )  # fmt: skip
    assert rc == 0, err
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[0][1] == {
        "repo_id": "me/tiny-linear", "private": True, "exist_ok": True, "repo_type": "model",
    }  # fmt: skip
    assert hub.calls[1][1]["folder_path"] == str(target)
    merged = {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*")}
    assert hub.uploaded == merged and "model.safetensors" in merged
    assert "uploaded to me/tiny-linear: https://huggingface.co/me/tiny-linear/commit/" in out


def test_upload_reported_in_json(capsys, monkeypatch, checkpoint, tmp_path):
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHub())
    rc, out, err = _merge(
        capsys, "--local_dir", str(checkpoint), "--target_dir", str(tmp_path / "m"),
        "--hf_upload_path", "me/tiny", "--json",
    )  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["uploaded"].startswith("https://huggingface.co/me/tiny/commit/")


def test_failed_upload_is_one_line_and_keeps_the_merged_directory(
    capsys, monkeypatch, checkpoint, tmp_path
):
    hub = RecordingHub(fail=OSError("Network is unreachable"))
    monkeypatch.setattr(huggingface_hub, "HfApi", hub)
    target = tmp_path / "merged"
    rc, _, err = _merge(
        capsys, "--local_dir", str(checkpoint), "--target_dir", str(target),
        "--hf_upload_path", "me/tiny", "--quiet",
    )  # fmt: skip
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "uploading it to me/tiny failed" in lines[0] and "Network is unreachable" in lines[0]
    assert f"`hf upload me/tiny {target}`" in lines[0]
    assert (target / "model.safetensors").is_file()


def test_a_failed_private_upload_suggests_a_private_one(capsys, monkeypatch, checkpoint, tmp_path):
    """``hf upload`` creates a missing repository public: the command suggested after a failed
    ``--private`` upload left out ``--private``, and copying it published the weights."""
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHub(fail=OSError("offline")))
    target = tmp_path / "merged"
    rc, _, err = _merge(
        capsys, "--local_dir", str(checkpoint), "--target_dir", str(target),
        "--hf_upload_path", "me/tiny", "--private", "--quiet",
    )  # fmt: skip
    assert rc == 1 and f"`hf upload --private me/tiny {target}`" in err, err


def test_invalid_repository_id_is_refused_before_merging(capsys, monkeypatch, checkpoint, tmp_path):
    hub = RecordingHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", hub)
    target = tmp_path / "merged"
    rc, _, err = _merge(
        capsys, "--local_dir", str(checkpoint), "--target_dir", str(target),
        "--hf_upload_path", "not a repo//id",
    )  # fmt: skip
    assert rc == 2 and "--hf_upload_path 'not a repo//id'" in err, err
    assert not target.exists() and hub.calls == []


def test_target_dir_defaults_to_tmp_as_verls_merger(capsys, monkeypatch, checkpoint, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc, _, err = _merge(capsys, "--backend", "fsdp", "--local_dir", str(checkpoint), "--quiet")
    assert rc == 0, err
    merged = load_file(work / "tmp" / "model.safetensors")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)  # the fixture's weights
    assert merged.keys() == {"weight", "bias"}
    assert torch.equal(merged["weight"], model.weight) and torch.equal(merged["bias"], model.bias)
