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
    (source / "generation_config.json").write_text("{}")  # none to derive for a "tiny" model
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


# --- 6. values JSON allows that no checkpoint holds; unreadable files; absurd sizes; links -----


def _manifest_world_size(value):
    return lambda doc: doc.update(world_size=value)


def _manifest_shape(value):
    return lambda doc: doc["tensors"]["model.0.weight"].update(shape=[value, 24])


RESEALED = {
    "shape Infinity": _manifest_shape(float("inf")),
    "shape NaN": _manifest_shape(float("nan")),
    "shape 2.5": _manifest_shape(2.5),
    "world_size 1.5": _manifest_world_size(1.5),
    "world_size '2'": _manifest_world_size("2"),
    "world_size 0": _manifest_world_size(0),
}


@pytest.mark.parametrize("case", sorted(RESEALED))
def test_resealed_manifest_with_values_no_checkpoint_holds(saved_run, tmp_path, capsys, case):
    step = _native_step(saved_run, tmp_path)
    _reseal(step, RESEALED[case])
    target = tmp_path / "merged"
    code, lines = _merge(capsys, step, target)
    _one_error_line("merge", lines, str(step))
    assert code == 1 and not target.exists()
    code, lines = _cli(capsys, "inspect", step)
    _one_error_line("inspect", lines, str(step))
    report = verify(step)
    assert not report.ok and all("Traceback" not in p.line() for p in report.problems)


@pytest.mark.parametrize("entry", ["model.0.weight", "optimizer.state.0.weight.exp_avg"])
def test_resealed_manifest_that_lost_an_entry_is_refused(saved_run, tmp_path, capsys, entry):
    """The rank file still holds the tensor's records: verify and merge name the file and a
    record, where before verify passed and merge wrote the model without the tensor."""
    step = _native_step(saved_run, tmp_path)
    _reseal(step, lambda doc: doc["tensors"].pop(entry))
    report = verify(step)
    assert not report.ok
    lines = [p.line() for p in report.problems]
    assert any("rank-0000" in line and f"'{entry}@" in line for line in lines), lines
    code, lines = _cli(capsys, "verify", step)
    assert code == 1
    target = tmp_path / "merged"
    code, lines = _merge(capsys, step, target)
    assert code == 1 and not target.exists()
    _one_error_line("merge", lines, "rank-0000")
    assert f"'{entry}@" in lines[0]


JSON_FILES = {
    "a list": "[1, 2]",
    "a string": '"config"',
    "Infinity": '{"torch_dtype": "float32", "rope_theta": Infinity}',
    "1e999": '{"torch_dtype": "float32", "rope_theta": 1e999}',
    "a 200-digit integer": '{"torch_dtype": "float32", "vocab_size": 1' + "0" * 200 + "}",
    "a 5000-digit integer": '{"torch_dtype": "float32", "vocab_size": 1' + "0" * 5000 + "}",
}


# transformers itself writes Infinity into config.json (4.x: Mamba2's time_step_limit) and
# reads it back: a config may hold one (tests/unit/test_config_nonfinite.py)
@pytest.mark.parametrize("case", sorted(set(JSON_FILES) - {"Infinity"}))
def test_config_json_that_is_no_config(saved_run, tmp_path, capsys, case):
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.json").write_text(JSON_FILES[case])
    target = tmp_path / "merged"
    code, lines = _merge(capsys, saved_run.step, target, "--hf_model_path", config)
    _one_error_line("merge", lines, str(config / "config.json"))
    assert code == 1 and not target.exists()


def test_config_json_of_megabytes_of_keys_is_refused_unread(saved_run, tmp_path, capsys):
    """A 58 MB config.json (under the 64 MiB cap of any JSON file) took merge 144 s and 2 GB
    as transformers copied it to write generation_config.json; real ones hold kilobytes."""
    import json

    config = tmp_path / "config"
    config.mkdir()
    keys = {f"key_{i:07d}": i for i in range(250_000)}  # about 5 MB
    (config / "config.json").write_text(json.dumps({"model_type": "qwen2", **keys}))
    target = tmp_path / "merged"
    code, lines = _merge(capsys, saved_run.step, target, "--hf_model_path", config)
    _one_error_line("merge", lines, str(config / "config.json"), "byte limit of a config")
    assert code == 1 and not target.exists()


@pytest.mark.parametrize("case", sorted(JSON_FILES))
def test_index_that_is_no_index(saved_run, tmp_path, capsys, case):
    model = tmp_path / "hf"
    shutil.copytree(saved_run.hf_sharded, model)
    index = model / "model.safetensors.index.json"
    text = JSON_FILES[case]
    if text.startswith("{"):  # keep the weight map, damage the metadata
        doc = json.loads(index.read_text())
        text = text.replace("{", '{"weight_map": ' + json.dumps(doc["weight_map"]) + ", ", 1)
        text = text.replace('"torch_dtype": "float32", ', "")
        text = text.replace('"rope_theta"', '"total_size"').replace('"vocab_size"', '"total_size"')
    index.write_text(text)
    code, lines = _cli(capsys, "verify", "--quiet", model)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(str(index)), lines
    code, lines = _cli(capsys, "inspect", model)
    _one_error_line("inspect", lines, str(index))


def test_verl_fsdp_config_that_is_no_object(tmp_path, capsys):
    source = _verl_dir(tmp_path / "actor", {"model_world_size_1_rank_0.pt": _plain_state()})
    (source / "fsdp_config.json").write_text("[2]")
    code, lines = _merge(capsys, source, tmp_path / "merged")
    _one_error_line("merge", lines, str(source / "fsdp_config.json"))
    assert code == 1 and not (tmp_path / "merged").exists()


@pytest.mark.parametrize("size", ["100TB", "9" * 20])
def test_buffer_size_beyond_memory(saved_run, tmp_path, capsys, size):
    target = tmp_path / "merged"
    code, lines = _merge(capsys, saved_run.step, target, "--buffer-size", size)
    _one_error_line("merge", lines, "--buffer-size", "memory available")
    assert code == 2 and not target.exists()


@pytest.mark.parametrize("empty", [True, False], ids=["empty", "holding-a-model"])
def test_symlinked_target_is_refused(saved_run, tmp_path, capsys, empty):
    real = tmp_path / "real"
    if empty:
        real.mkdir()
    else:
        shutil.copytree(saved_run.hf, real)
    link = tmp_path / "link"
    os.symlink(real, link)
    before = sorted(p.name for p in real.iterdir())
    code, lines = _merge(capsys, saved_run.step, link, "--overwrite")
    _one_error_line("merge", lines, str(link), "symlink", str(real))
    assert code == 2
    assert link.is_symlink() and sorted(p.name for p in real.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no T.tmp-* left


# --- 6. unreadable files: "permission denied", naming the file --------------------------------

NOBODY = 65534


def _as_nobody(argv: list[str]) -> tuple[int, list[str]]:
    """``cli.main(argv)`` in a forked child that dropped to uid 65534 (root reads every file,
    whatever its mode); its exit code and stderr lines."""
    import shardstream.commands.inspect  # noqa: F401  (nothing can be imported after the drop)
    import shardstream.commands.merge  # noqa: F401
    import shardstream.commands.verify  # noqa: F401
    import shardstream.formats.dcp  # noqa: F401
    import shardstream.formats.verl  # noqa: F401

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 99
        try:
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            import sys

            sys.stderr = os.fdopen(write, "w")
            sys.stdout = open(os.devnull, "w")
            code = cli.main(argv)
            sys.stderr.flush()
        except BaseException as exc:  # noqa: BLE001
            os.write(write, f"child raised {type(exc).__name__}: {exc}\n".encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def open_dir():
    """A directory uid 65534 may enter (pytest's tmp_path lies under a 0700 directory)."""
    import tempfile

    if os.getuid() != 0:
        pytest.skip("needs root to drop to another user")
    base = Path(tempfile.mkdtemp(prefix="shardstream-perm-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _unreadable(kind: str, saved_run, base: Path) -> tuple[list[str], Path]:
    """argv and the file made unreadable (mode 000) for one case."""
    if kind in ("manifest", "pointer"):
        root = base / "root"
        shutil.copytree(saved_run.root, root)
        if kind == "manifest":
            path = root / "global_step_3" / "manifest.json"
            argv = ["merge", "--local_dir", str(path.parent), "--target_dir", str(base / "out")]
        else:
            path, argv = root / LATEST_FILE, ["inspect", str(root)]
    elif kind in ("config.json", "fsdp_config.json"):
        source = _verl_dir(base / "actor", {"model_world_size_1_rank_0.pt": _plain_state()})
        path = source / ("huggingface/config.json" if kind == "config.json" else kind)
        argv = ["merge", "--local_dir", str(source), "--target_dir", str(base / "out")]
    else:  # .metadata, .distcp
        source = _dcp_dir(base / "dcp")
        path = source / ".metadata" if kind == ".metadata" else next(source.glob("*.distcp"))
        argv = ["merge", "--local_dir", str(source), "--target_dir", str(base / "out")]
    path.chmod(0)
    return [*argv, "--quiet"] if argv[0] == "merge" else argv, path


@pytest.mark.parametrize(
    "kind", ["manifest", "pointer", "config.json", "fsdp_config.json", ".metadata", ".distcp"]
)
def test_unreadable_file_is_named(saved_run, open_dir, kind):
    argv, path = _unreadable(kind, saved_run, open_dir)
    code, lines = _as_nobody(argv)
    _one_error_line(argv[0], lines, str(path), "permission denied")
    assert code == 1 and not (open_dir / "out").exists()
    if kind in ("manifest", "pointer", ".metadata", ".distcp"):
        target = path.parent if kind != "pointer" else path.parent
        code, lines = _as_nobody(["verify", "--quiet", str(target)])
        assert code == 1 and lines, lines
        assert all("Traceback" not in line and "child raised" not in line for line in lines)
        assert any(str(path) in line and "permission denied" in line for line in lines), lines


PARAM_GROUPS = {
    "params a number": lambda groups: groups[0].update(params=406),
    "params of no live group": lambda groups: groups[0].update(params=["0.weight"]),
    "a group too many": lambda groups: groups.append(dict(groups[0])),
    "not a list": lambda groups: groups.clear() or groups.append(7),
}


@pytest.mark.parametrize("case", sorted(PARAM_GROUPS))
def test_resealed_param_groups_are_refused_before_the_model_changes(saved_run, tmp_path, case):
    """Found by the soak's structure-aware fuzzer: torch's set_optimizer_state_dict raised a
    TypeError after the model had already been loaded."""
    from shardstream.manager import CheckpointConfig, CheckpointManager

    from .forkserver import build_model, build_optimizer

    step = _native_step(saved_run, tmp_path)
    _reseal(step, lambda doc: PARAM_GROUPS[case](doc["objects"]["optimizer"]["param_groups"]))
    model = build_model()
    optimizer = build_optimizer(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = CheckpointConfig(directory=str(tmp_path / "scratch-root"))
    with CheckpointManager(config, model=model, optimizer=optimizer) as manager:
        with pytest.raises(ShardstreamError) as caught:
            manager.restore(path=step)
    message = str(caught.value)
    assert "\n" not in message and "param_groups" in message and str(step) in message, message
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def _flag_every_record_encrypted(path: Path) -> int:
    """Set the 'encrypted' bit (general purpose flag bit 0) of every central-directory entry
    of the zip archives in ``path``, as one flipped bit does; returns how many."""
    raw = bytearray(path.read_bytes())
    count, at = 0, raw.find(b"PK\x01\x02")
    while at >= 0:
        raw[at + 8] |= 1
        count += 1
        at = raw.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(raw))
    return count


@pytest.mark.parametrize("command", ["merge", "inspect", "verify"])
@pytest.mark.parametrize("kind", ["dcp", "verl"])
def test_zip_records_flagged_encrypted_are_one_error_line(tmp_path, capsys, kind, command):
    """zipfile raises RuntimeError for a record flagged as encrypted: named, not a traceback
    (make soak's fuzzing found it in a DCP data file)."""
    if kind == "dcp":
        source = _dcp_dir(tmp_path / "dcp")
        target = next(source.glob("*.distcp"))
    else:
        source = _verl_dir(tmp_path / "actor", {"model_world_size_1_rank_0.pt": _plain_state()})
        target = source / "model_world_size_1_rank_0.pt"
    assert _flag_every_record_encrypted(target) > 0
    argv = {
        "merge": ("merge", "--local_dir", source, "--target_dir", tmp_path / "out", "--quiet"),
        "inspect": ("inspect", source),
        "verify": ("verify", source),
    }[command]
    try:
        code, lines = _cli(capsys, *argv)
    except RuntimeError as exc:  # the defect: zipfile's error escaped
        pytest.fail(f"{command} raised {exc!r}")
    if command == "inspect" and code == 0:
        return  # inspect reads layouts only (the zip directory), not the records
    assert code != 0
    if command == "verify":
        assert any(str(target) in line for line in lines), lines
    else:
        _one_error_line(command, lines, str(target))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("listed", ["../outside.json", "{outside}", "sub/../../outside.json"])
def test_a_file_list_naming_files_out_of_the_model_is_refused(tmp_path, capsys, listed):
    """merge's output lists the files it wrote beside the weights, with their digests, in the
    first file's header: verify hashed whatever that list named, any file on the machine
    (``../../etc/hostname``, an absolute path), and said only that it differed."""
    import json
    import struct

    from shardstream.formats.safetensors import FILES_KEY

    source = _dcp_dir(tmp_path / "dcp")
    code, _ = _merge(capsys, source, tmp_path / "merged")
    assert code == 0
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    weights = tmp_path / "merged" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    name = listed.format(outside=outside)
    header["__metadata__"][FILES_KEY] = f"{name}=0000000000000000"
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[8 : 8 + length] = text + b" " * (length - len(text))
    weights.write_bytes(bytes(data))
    report = verify(tmp_path / "merged")
    assert not report.ok
    assert any("lies outside the checkpoint" in p.message for p in report.problems), report
    assert not any("differs from what merge wrote" in p.message for p in report.problems)
