"""verl's merger driven from Python: ``FSDPModelMerger(ModelMergerConfig(...))`` from
``shardstream.integrations.verl_merger`` takes verl's config verbatim and writes what verl's own
classes write for it (run side by side where verl is installed), and what ``shardstream merge``
writes for the same flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import huggingface_hub
import pytest
import torch
from recording_hub import RecordingHub
from safetensors.torch import load_file, save_file
from test_merge_verl import merged_tensors

from shardstream.cli import main
from shardstream.errors import ReferenceMismatchError, UsageError
from shardstream.integrations.verl_merger import FSDPModelMerger, ModelMergerConfig
from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoints


@pytest.fixture(scope="module")
def actors(tmp_path_factory) -> dict[str, Path]:
    """verl-layout checkpoints whose config.json names bfloat16 and float32."""
    root = tmp_path_factory.mktemp("verl-merger")
    dtypes = ("bfloat16", "float32")
    jobs = [(root / d, VerlFixture(world_size=2, config_dtype=d), 1) for d in dtypes]
    return dict(zip(dtypes, write_verl_checkpoints(jobs)))


@pytest.fixture
def actor(actors) -> Path:
    return actors["bfloat16"]


def _config(actor: Path, **fields) -> ModelMergerConfig:
    fields.setdefault("hf_model_config_path", str(actor / "huggingface"))
    return ModelMergerConfig(backend="fsdp", local_dir=str(actor), **fields)


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))}


def test_config_has_verls_fields_order_and_defaults():
    verl_config = pytest.importorskip("verl.model_merger.base_model_merger").ModelMergerConfig
    theirs = [(f.name, f.default, f.init) for f in dataclasses.fields(verl_config)]
    ours = [(f.name, f.default, f.init) for f in dataclasses.fields(ModelMergerConfig)]
    assert ours[: len(theirs)] == theirs
    assert [name for name, *_ in ours[len(theirs) :]] == ["overwrite", "dtype"]


def test_config_post_init_as_verls():
    merge = ModelMergerConfig("merge", "fsdp", hf_upload_path="me/model", private=True)
    assert merge.hf_upload and merge.target_dir == "tmp"
    test = ModelMergerConfig("test", "fsdp", target_dir="out", hf_upload_path="me/m", private=True)
    assert (test.target_dir, test.hf_upload_path, test.private, test.hf_upload) == (
        None, None, False, False,
    )  # fmt: skip


@pytest.mark.parametrize("config_dtype", ["bfloat16", "float32"])
def test_merge_writes_what_verls_own_classes_write(actors, config_dtype, tmp_path):
    actor = actors[config_dtype]
    verl_merger = pytest.importorskip("verl.model_merger.fsdp_model_merger")
    verl_base = pytest.importorskip("verl.model_merger.base_model_merger")
    fields = {"operation": "merge", "backend": "fsdp", "local_dir": str(actor)}
    fields["hf_model_config_path"] = str(actor / "huggingface")
    theirs = verl_merger.FSDPModelMerger(
        verl_base.ModelMergerConfig(**fields, target_dir=str(tmp_path / "verl"))
    )
    theirs.merge_and_save()
    theirs.cleanup()
    ours = FSDPModelMerger(ModelMergerConfig(**fields, target_dir=str(tmp_path / "ours")))
    summary = ours.merge_and_save()
    ours.cleanup()
    assert summary.tensors > 0
    want, got = merged_tensors(tmp_path / "verl"), merged_tensors(tmp_path / "ours")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert tensor.dtype == torch.bfloat16, name  # verl's merger always casts
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert {p.name for p in (tmp_path / "ours").iterdir()} == {
        p.name for p in (tmp_path / "verl").iterdir()
    }


@pytest.mark.parametrize(("dtype", "flags"), [("bfloat16", ["--dtype", "bfloat16"]), (None, [])])
def test_merge_writes_the_files_the_command_writes(actors, dtype, flags, tmp_path, capsys):
    """The default (bfloat16, as verl) is the command with --dtype bfloat16; dtype=None is
    the command without it, which writes bfloat16 too, as verl's merger does, though
    config.json names float32 here."""
    actor = actors["float32"]
    config = _config(actor, operation="merge", target_dir=str(tmp_path / "cls"), dtype=dtype)
    FSDPModelMerger(config).merge_and_save()
    argv = ["merge", "--backend", "fsdp", "--local_dir", str(actor), "--quiet", *flags]
    argv += ["--target_dir", str(tmp_path / "cli"), "--hf_model_path", str(actor / "huggingface")]
    assert main(argv) == 0, capsys.readouterr().err
    assert _files(tmp_path / "cls") == _files(tmp_path / "cli")
    assert {t.dtype for t in merged_tensors(tmp_path / "cls").values()} == {torch.bfloat16}


def test_test_operation_passes_against_the_merge_and_fails_naming_the_tensor(actor, tmp_path):
    reference = tmp_path / "reference"
    FSDPModelMerger(_config(actor, operation="merge", target_dir=str(reference))).merge_and_save()
    report = FSDPModelMerger(_config(actor, operation="test", test_hf_dir=str(reference)))
    assert report.merge_and_save().ok
    tensors = load_file(reference / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})
    merger = FSDPModelMerger(_config(actor, operation="test", test_hf_dir=str(reference)))
    with pytest.raises(AssertionError) as raised:  # as verl's check raises
        merger.merge_and_save()
    assert isinstance(raised.value, ReferenceMismatchError) and name in str(raised.value)


def test_upload_follows_the_complete_merge(actor, tmp_path, monkeypatch):
    hub = RecordingHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", hub)
    target = tmp_path / "merged"
    config = _config(
        actor, operation="merge", target_dir=str(target), hf_upload_path="me/m", private=True
    )
    FSDPModelMerger(config).merge_and_save()
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[0][1]["private"] is True and hub.calls[0][1]["repo_id"] == "me/m"
    assert hub.uploaded == _files(target) and "model.safetensors" in hub.uploaded


def test_non_empty_target_is_written_into_as_verl_does_or_replaced_with_overwrite(actor, tmp_path):
    target = tmp_path / "merged"
    target.mkdir()
    (target / "old.txt").write_text("before")
    FSDPModelMerger(_config(actor, operation="merge", target_dir=str(target))).merge_and_save()
    assert _files(target)["old.txt"] == b"before" and (target / "model.safetensors").is_file()
    FSDPModelMerger(_config(actor, operation="merge", target_dir=str(target))).merge_and_save()
    assert _files(target)["old.txt"] == b"before"
    config = _config(actor, operation="merge", target_dir=str(target), overwrite=True)
    FSDPModelMerger(config).merge_and_save()
    assert "old.txt" not in _files(target) and (target / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"operation": "merge", "backend": "megatron"}, "backend 'megatron' is not supported"),
        ({"operation": "convert"}, "operation 'convert'"),
        ({"operation": "test"}, "test_hf_dir must be set"),
        ({"operation": "merge", "target_dir": None}, "target_dir is not set"),
        ({"operation": "merge", "hf_model_config_path": "/nowhere"}, "/nowhere: no config.json"),
        ({"operation": "merge", "hf_upload_path": "not a repo//id"}, "'not a repo//id'"),
    ],
)
def test_bad_config_is_refused_before_any_work(actor, tmp_path, fields, needle):
    fields = {"backend": "fsdp", "target_dir": str(tmp_path / "out"), **fields}
    fields.setdefault("hf_model_config_path", str(actor / "huggingface"))
    with pytest.raises(UsageError) as raised:
        FSDPModelMerger(ModelMergerConfig(local_dir=str(actor), **fields))
    assert needle in str(raised.value)
    assert not (tmp_path / "out").exists()
