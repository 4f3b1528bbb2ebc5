"""Every part of a checkpoint is checked (issue #23): the files beside the data (config,
generation config, tokenizer files of the hf_model export) are checksummed in the manifest,
checked by verify and before merge copies them; verify catches what restore catches.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import shardstream
from shardstream import cli
from shardstream.commands.verify import verify
from shardstream.formats import native

CONFIG = {"model_type": "tiny", "num_hidden_layers": 2, "torch_dtype": "float32"}
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json")


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def exported(tmp_path) -> Path:
    """A step saved with the hf_model export, its config and tokenizer files copied in."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(CONFIG))
    (source / "generation_config.json").write_text(json.dumps({"max_length": 20}))
    (source / "tokenizer.json").write_text(json.dumps({"version": "1.0", "vocab": ["a"]}))
    torch.manual_seed(0)
    step = tmp_path / "global_step_1"
    shardstream.save(
        step,
        model=torch.nn.Linear(8, 4),
        contents=("model", "hf_model"),
        hf_source_dir=source,
        step=1,
    )
    return step


def test_every_file_of_the_export_is_in_the_manifest(exported):
    files = native.read_manifest(exported)["files"]
    for name in SIDE_FILES:
        assert f"huggingface/{name}" in files, sorted(files)
        assert set(files[f"huggingface/{name}"]) == {"size", "xxh3"}
    assert verify(exported).ok


def _flip_layers(step: Path) -> Path:
    """num_hidden_layers 2 -> 3: one bit, same size."""
    config = step / "huggingface" / "config.json"
    text = config.read_text()
    assert '"num_hidden_layers": 2' in text
    config.write_text(text.replace('"num_hidden_layers": 2', '"num_hidden_layers": 3'))
    return config


@pytest.mark.parametrize("damage", ["flipped bit", "deleted"])
def test_damaged_config_is_caught(exported, tmp_path, capsys, damage):
    if damage == "flipped bit":
        config = _flip_layers(exported)
    else:
        config = exported / "huggingface" / "config.json"
        config.unlink()
    report = verify(exported)
    assert not report.ok and any(p.path == str(config) for p in report.problems), report
    target = tmp_path / "merged"
    code, lines = _cli(capsys, "merge", "--local_dir", exported, "--target_dir", target, "--quiet")
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("shardstream merge: error: ") and str(config) in lines[0]
    assert not target.exists()


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_damaged_tokenizer_or_generation_config_is_caught(exported, tmp_path, capsys, name):
    path = exported / "huggingface" / name
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify(exported)
    assert [p.path for p in report.problems] == [str(path)]
    code, lines = _cli(
        capsys, "merge", "--local_dir", exported, "--target_dir", tmp_path / "m", "--quiet"
    )
    assert code == 1 and str(path) in lines[0] and not (tmp_path / "m").exists()


def test_manifest_without_side_file_records_still_reads(exported, tmp_path, capsys):
    """A manifest written before side files were recorded: read, verified and merged as it
    was (nothing recorded, nothing to check)."""
    from .test_hostile import _reseal

    old = tmp_path / "old" / "global_step_1"
    shutil.copytree(exported, old)

    def drop(doc):
        for name in SIDE_FILES:
            doc["files"].pop(f"huggingface/{name}")

    _reseal(old, drop)
    assert verify(old).ok
    code, lines = _cli(
        capsys, "merge", "--local_dir", old, "--target_dir", tmp_path / "m", "--quiet"
    )
    assert (code, lines) == (0, [])
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 2


# --- verify catches what restore catches: swapped verl optimizer rank files --------------------


@pytest.fixture(scope="module")
def verl_actor(tmp_path_factory) -> Path:
    from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoint

    root = tmp_path_factory.mktemp("verl-w2")
    fixture = VerlFixture(world_size=2, train_steps=1, write_reference=False)
    return write_verl_checkpoint(root, fixture, step=1)


def test_verify_catches_swapped_verl_optimizer_files(verl_actor, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(verl_actor, actor)
    assert verify(actor).ok
    a, b = actor / "optim_world_size_2_rank_0.pt", actor / "optim_world_size_2_rank_1.pt"
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    report = verify(actor)
    assert not report.ok
    assert any("rank" in p.line() and "optim_world_size_2_rank_" in p.line() for p in report.problems)
