"""Damaged checkpoints of the other tools shardstream reads: DCP's ``.metadata`` edited in ways
its pickle stays well-formed, DCP's HuggingFaceStorageWriter files, accelerate's save_state.

Each case is written by the tool's own code, then damaged. Each once ended in a traceback, a
message naming neither file nor tensor, or a merge that exited 0 with wrong weights; now the
CLI exits non-zero with one line naming the file (and tensor), and merge writes nothing.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from pathlib import Path

import pytest
import torch

from shardstream import cli

COMMANDS = ("merge", "inspect", "verify")


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # two tensors of one shape and dtype: either could pass for the other
    return {"q.weight": torch.randn(4, 3), "k.weight": torch.randn(4, 3), "b": torch.ones(3)}


def _dcp_save(state: dict, directory: Path, **kwargs) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save(state, checkpoint_id=str(directory), **kwargs)
    return directory


def _edit_metadata(directory: Path, edit) -> Path:
    """Unpickle torch's own Metadata (trusted: written above), ``edit`` it, pickle it back."""
    with open(directory / ".metadata", "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return directory


def _storage(meta, fqn: str):
    return next(info for index, info in meta.storage_data.items() if index.fqn == fqn)


def _set(obj, field: str, value) -> None:
    object.__setattr__(obj, field, value)  # DCP's StorageInfo is a frozen dataclass


def _run(capsys, command: str, source: Path, target: Path) -> tuple[int, str]:
    argv = {
        "merge": ["merge", "--local_dir", source, "--target_dir", target, "--quiet"],
        "inspect": ["inspect", source],
        "verify": ["verify", "--quiet", source],
    }[command]
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _refused(capsys, command: str, source: Path, tmp_path: Path, *needles: str) -> str:
    """``command`` exits non-zero with stderr naming every needle, no traceback, no target."""
    target = tmp_path / "merged"
    code, err = _run(capsys, command, source, target)
    assert code != 0, (command, err)
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (command, needle, err)
    assert not target.exists()
    return err


# --- DCP: .metadata whose pickle is sound but whose content is not ------------------------------


def _swap_paths(meta) -> None:
    paths, q, k = meta.planner_data, "model.q.weight", "model.k.weight"
    paths[q], paths[k] = paths[k], paths[q]


def _path_into_optimizer(meta) -> None:
    meta.planner_data["model.q.weight"] = ("optimizer", "q.weight")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "edit", [_swap_paths, _path_into_optimizer], ids=["swapped", "moved_out_of_the_model"]
)
def test_planner_data_path_that_is_not_its_key(tmp_path, capsys, command, edit):
    """DCP names every key by joining its planner_data path: a path naming another tensor made
    merge write q's weights as k's (or drop q as optimizer state), with exit 0."""
    source = _dcp_save({"model": _state(), "optimizer": {"lr": torch.tensor(0.1)}}, tmp_path / "ck")
    _edit_metadata(source, edit)
    _refused(capsys, command, source, tmp_path, str(source / ".metadata"), "'model.q.weight'")


def _same_range(meta) -> None:
    index = next(i for i in meta.storage_data if i.fqn == "k.weight")
    meta.storage_data[index] = _storage(meta, "q.weight")


def _range_into_the_next(meta) -> None:
    q, k = _storage(meta, "q.weight"), _storage(meta, "k.weight")
    first, second = (q, k) if q.offset < k.offset else (k, q)
    _set(first, "length", second.offset + second.length - first.offset)  # ends at second's end


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "edit", [_same_range, _range_into_the_next], ids=["same_range", "into_the_next"]
)
def test_items_sharing_bytes_are_refused(tmp_path, capsys, command, edit):
    """zipfile finds an archive by its end: a range running into the next item's archive (or
    naming it) read that item's tensor; merge wrote it under the other name, exit 0."""
    source = _edit_metadata(_dcp_save(_state(), tmp_path / "ck"), edit)
    err = _refused(capsys, command, source, tmp_path, str(source / ".metadata"), "share bytes")
    assert "'q.weight'" in err and "'k.weight'" in err and "__0_0.distcp" in err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("alias", ["hard_link", "symlink", "linked_folder"])
def test_items_sharing_bytes_through_another_name_of_the_file_are_refused(
    tmp_path, capsys, command, alias
):
    """The same range named through another name of the data file (a hard link, a symlink, a
    folder linked to the checkpoint's own): the check compared file names, so merge wrote q's
    weights as k's, exit 0."""
    source = _dcp_save(_state(), tmp_path / "ck")
    if alias == "hard_link":
        os.link(source / "__0_0.distcp", source / "alias.distcp")
        name = "alias.distcp"
    elif alias == "symlink":
        os.symlink("__0_0.distcp", source / "alias.distcp")
        name = "alias.distcp"
    else:
        os.symlink(".", source / "sub")
        name = "sub/__0_0.distcp"

    def through_the_alias(meta) -> None:
        index = next(i for i in meta.storage_data if i.fqn == "k.weight")
        q = _storage(meta, "q.weight")
        meta.storage_data[index] = type(q)(name, q.offset, q.length)

    _edit_metadata(source, through_the_alias)
    err = _refused(capsys, command, source, tmp_path, str(source / ".metadata"), "share bytes")
    assert "'q.weight'" in err and "'k.weight'" in err and "the same file" in err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("version", ["2.0.0", 1], ids=["major_2", "not_a_string"])
def test_metadata_version_merge_cannot_read(tmp_path, capsys, command, version):
    """A DCP version merge refuses: verify passed it, so a checkpoint it called sound failed
    to merge."""
    source = _edit_metadata(
        _dcp_save(_state(), tmp_path / "ck"), lambda m: _set(m, "version", version)
    )
    _refused(capsys, command, source, tmp_path, str(source / ".metadata"), "is not supported")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _link_out(path: Path) -> None:
    outside = path.parent.parent / "elsewhere.metadata"
    outside.write_bytes(b"")
    path.symlink_to(outside)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "replace, needle",
    [(_fifo, "is a FIFO"), (Path.mkdir, "is a directory"), (_link_out, "outside the checkpoint")],
    ids=["fifo", "directory", "link_out"],
)
def test_metadata_that_is_no_file_of_the_checkpoint(tmp_path, capsys, command, replace, needle):
    """A FIFO or directory in .metadata's place was reported as a save that never finished,
    naming the directory; a .metadata linked out of the checkpoint was read."""
    source = _dcp_save(_state(), tmp_path / "ck")
    metadata = source / ".metadata"
    saved = metadata.read_bytes()
    metadata.unlink()
    replace(metadata)
    if replace is _link_out:
        metadata.resolve().write_bytes(saved)  # the genuine metadata, just elsewhere
    _refused(capsys, command, source, tmp_path, str(metadata), needle)


# --- DCP's HuggingFaceStorageWriter ------------------------------------------------------------


def _hf_save(directory: Path, **kwargs) -> Path:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = _state()
    writer = HuggingFaceStorageWriter(
        path=str(directory), save_distributed=True, fqn_to_index_mapping=dict.fromkeys(state, 1)
    )
    return _dcp_save(state, directory, storage_writer=writer, **kwargs)


def _rank_file(directory: Path) -> Path:
    (path,) = directory.glob("shard-*.safetensors")
    return path


def _rewrite_metadata(path: Path, key: str, value: str) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"][key] = value
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


@pytest.mark.parametrize("command", COMMANDS)
def test_sharding_info_nested_too_deep(tmp_path, capsys, command):
    """A DCP_SHARDING_INFO of nested arrays raised RecursionError from json, a traceback."""
    source = _hf_save(tmp_path / "hf")
    path = _rank_file(source)
    _rewrite_metadata(path, "DCP_SHARDING_INFO", "[" * 100_000)
    _refused(capsys, command, source, tmp_path, str(path), "DCP_SHARDING_INFO", "not valid JSON")


@pytest.mark.parametrize("command", ["merge", "inspect"])
@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_dcp_hf_config_files_linked_outside(tmp_path, capsys, command, name):
    """merge copied a config or tokenizer file linked out of the checkpoint into its output, as
    it refuses to for every other format."""
    source = _hf_save(tmp_path / "hf")
    if name != "config.json":
        (source / "config.json").write_text(json.dumps({"model_type": "llama"}))
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"model_type": "llama", "secret": 1}))
    (source / name).symlink_to(secret)
    _refused(capsys, command, source, tmp_path, str(source / name), "outside the checkpoint")


@pytest.mark.parametrize("command", COMMANDS)
def test_dcp_hf_rank_file_that_is_a_fifo(tmp_path, capsys, command):
    """A FIFO under a rank file's name was skipped: the merge of the others exited 0."""
    source = _hf_save(tmp_path / "hf")
    fifo = source / "shard-00002-model-00001-of-00001.safetensors"
    os.mkfifo(fifo)
    _refused(capsys, command, source, tmp_path, str(fifo), "is a FIFO")


@pytest.mark.parametrize("command", COMMANDS)
def test_dcp_hf_rank_files_of_two_saves(tmp_path, capsys, command):
    """A rank file of another save (another output file count) beside them: its tensors were
    merged in, exit 0."""
    source = _hf_save(tmp_path / "hf")
    other = _hf_save(tmp_path / "other")
    _rank_file(other).rename(source / "shard-00002-model-00002-of-00002.safetensors")
    _refused(capsys, command, source, tmp_path, str(source), "two saves", "of-00002")


# --- accelerate's save_state ---------------------------------------------------------------------


def _accelerate_state(directory: Path) -> Path:
    """accelerate's own save_accelerator_state (scheduler, RNG) beside the model's DCP dir."""
    from accelerate.checkpointing import save_accelerator_state

    directory.mkdir()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_accelerator_state(str(directory), [], [], [scheduler], [], 0, 0)
    _dcp_save({"model": _state()}, directory / "pytorch_model_fsdp_0")
    return directory


@pytest.mark.parametrize("name", ["random_states_0.pkl", "scheduler.bin"])
@pytest.mark.parametrize("replace", [_fifo, Path.mkdir], ids=["fifo", "directory"])
def test_verify_accelerate_state_file_that_is_no_file(tmp_path, capsys, name, replace):
    """A FIFO or directory in place of the RNG or scheduler file passed verify (restore
    fails on it): it was skipped as a name no state file has."""
    source = _accelerate_state(tmp_path / "checkpoint_1")
    (source / name).unlink()
    replace(source / name)
    _refused(capsys, "verify", source, tmp_path, str(source / name), "expected a regular file")


def test_records_saved_with_crc32_off_count_as_unchecked(tmp_path, capsys):
    """torch.save with ``set_crc32_options(False)`` writes 0 as every record's CRC-32, which
    checks nothing: verify said OK with 0 bytes unchecked, so a flipped bit there passed
    unsaid. Their bytes now count as unchecked, with the reason."""
    from shardstream.commands.verify import verify

    torch.serialization.set_crc32_options(False)
    try:
        source = _dcp_save(_state(), tmp_path / "ck")
        torch.save(_state(), tmp_path / "state.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    for path in (source, tmp_path / "state.pt"):
        report = verify(path)
        assert report.ok and report.unchecked_bytes >= 2 * 4 * 3 * 4 + 3 * 4, report
        assert report.bytes_checked == 0, report  # every record's CRC-32 is 0: none checked
        assert any("CRC-32 off" in why for why in report.unchecked_why), report
    code = cli.main(["verify", str(source)])
    out = capsys.readouterr().out
    assert code == 0 and "not checked: torch.save records saved with CRC-32 off" in out, out
