"""Hostile inputs found by a campaign against inputs the other hostile tests had not tried.

Each once ended in a hang, unbounded memory, a traceback, or a merge that exited 0 with wrong
weights. Each must now end in ``shardstream <cmd>: error: ...`` (or a verify problem) naming
the file or tensor, a non-zero exit, nothing written and the input untouched.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import pickle
import signal
import stat
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shardstream import cli

from .harness import put_in_place_of
from .test_hostile import _plain_state, _verl_dir

MODEL = "model_world_size_1_rank_0.pt"


class Hang(BaseException):
    """Raised by the deadline; a BaseException, so no ``except OSError`` reports it as a
    problem of the file."""


@contextlib.contextmanager
def _deadline(seconds: int = 60) -> Iterator[None]:
    """Fail a command that blocks (a FIFO opened for reading waits for a writer forever)."""

    def expire(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _cli(capsys, *argv: object) -> tuple[int, list[str]]:
    with _deadline():
        code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    output = captured.err + captured.out
    assert "Traceback" not in output, output
    return code, [line for line in captured.err.splitlines() if line.strip()]


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry below ``root``: a file's digest, a link's target, or its kind."""
    found = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha1(path.read_bytes()).hexdigest()
            else:
                found[str(path)] = oct(path.lstat().st_mode)
    return found


def _fails_naming(capsys, argv: list[object], source: Path, *needles: str) -> None:
    """``argv`` exits 1 with a stderr line naming every needle; for merge nothing is written;
    the input directory ``source`` is unchanged."""
    before = _snapshot(source)
    code, lines = _cli(capsys, *argv)
    assert code == 1, lines
    assert any(all(n in line for n in needles) for line in lines), (needles, lines)
    if argv[0] == "merge":
        target = Path(argv[argv.index("--target_dir") + 1])
        assert not target.exists()
        assert not [p for p in target.parent.iterdir() if ".tmp-" in p.name]
    assert _snapshot(source) == before


def _merge_argv(source: Path, tmp_path: Path) -> list[object]:
    return ["merge", "--local_dir", source, "--target_dir", tmp_path / "merged", "--quiet"]


# --- files that are not regular files --------------------------------------------------------


def _hf_dir(directory: Path) -> Path:
    """A two-file HF safetensors model with its index."""
    from safetensors.torch import save_file

    directory.mkdir()
    state = _plain_state()
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    return directory


def _replace(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "FIFO":
        os.mkfifo(path)
    else:  # a symlink to itself
        os.symlink(path.name, path)


@pytest.mark.parametrize("kind", ["FIFO", "symlink loop"])
def test_dcp_config_json_that_is_no_regular_file(tmp_path, capsys, kind):
    """A FIFO as config.json beside a DCP checkpoint was taken for no config.json: merge wrote
    the weights alone and said it found none."""
    import warnings

    import torch.distributed.checkpoint as dcp

    source = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save({"model": _plain_state()}, checkpoint_id=str(source))
    (source / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    _replace(source / "config.json", kind)
    said = {"FIFO": "is a FIFO", "symlink loop": "symbolic link"}[kind]
    _fails_naming(capsys, _merge_argv(source, tmp_path), source, "config.json", said)


@pytest.mark.parametrize("kind", ["FIFO", "symlink loop"])
@pytest.mark.parametrize("command", ["inspect", "test"])
def test_hf_shard_that_is_no_regular_file(tmp_path, capsys, command, kind):
    """inspect and test once blocked forever opening a FIFO shard, and printed a traceback
    for a symlink loop."""
    model = _hf_dir(tmp_path / "hf")
    shard = model / "model-00002-of-00002.safetensors"
    _replace(shard, kind)
    if command == "inspect":
        argv = ["inspect", model]
    else:
        source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
        argv = ["test", "--local_dir", source, "--test_hf_dir", model, "--quiet"]
    _fails_naming(capsys, argv, model, str(shard))


def test_test_hf_dir_that_is_a_fifo(tmp_path, capsys):
    """A FIFO given as the reference model ended in a NotADirectoryError traceback."""
    fifo = tmp_path / "reference"
    os.mkfifo(fifo)
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    argv = ["test", "--local_dir", source, "--test_hf_dir", fifo, "--quiet"]
    _fails_naming(capsys, argv, source, str(fifo))


def test_verify_verl_rank_file_that_is_a_fifo(tmp_path, capsys):
    """verify read every ``*.pt`` file without asking what it is: a FIFO blocked it."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    _replace(source / MODEL, "FIFO")
    _fails_naming(capsys, ["verify", "--quiet", source], source, str(source / MODEL), "FIFO")


def test_verify_verl_rank_file_linked_to_dev_zero(tmp_path):
    """zipfile looks for the end of the archive by reading to EOF: through a link to
    /dev/zero verify read until the kernel killed it (22 GiB). Run in a child under an
    address-space cap, so a regression fails instead of exhausting the machine."""
    from .test_hostile_pickles import _cli as guarded_cli

    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    (source / MODEL).unlink()
    os.symlink("/dev/zero", source / MODEL)
    proc = guarded_cli("verify", "--quiet", str(source))
    output = proc.stderr + proc.stdout
    assert proc.returncode == 1 and "Traceback" not in output, output[-2000:]
    assert f"{source / MODEL}: is a character device" in output, output


# --- zip archives and pickles that lie about where a tensor's bytes are ---------------------


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rezip(raw: bytes, transform: Callable[[str, bytes], list[tuple[str, bytes, int]]]) -> bytes:
    """The archive ``raw`` with each record replaced by ``transform(name, data)``: a list of
    (name, data, compression)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            for name, data, compression in transform(info.filename, src.read(info)):
                record = zipfile.ZipInfo(name)
                record.compress_type = compression
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "Duplicate name", on purpose
                    dst.writestr(record, data)
    return out.getvalue()


def _deflated(name: str, data: bytes) -> list[tuple[str, bytes, int]]:
    return [(name, data, zipfile.ZIP_DEFLATED)]


def _record_twice(name: str, data: bytes) -> list[tuple[str, bytes, int]]:
    """data/0 twice, the second copy zeros: torch and zipfile read different ones."""
    first = [(name, data, zipfile.ZIP_STORED)]
    if not name.endswith("/data/0"):
        return first
    return first + [(name, bytes(len(data)), zipfile.ZIP_STORED)]


class _Storage:
    def __init__(self, numel: int):
        self.numel = numel


class _Tensor:
    """Pickles as torch pickles a tensor, with whatever offset, size and stride it is given."""

    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple):
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_tensor_v2, self.args)


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
        return None


def _lying_pt(numel: int, offset: int, size: tuple, stride: tuple, data_bytes: int = 96) -> bytes:
    """A torch archive holding tensor ``w`` over storage record data/0 of ``data_bytes``
    bytes, whose pickle claims ``numel`` floats and the given view of them."""
    pickled = io.BytesIO()
    _TorchPickler(pickled, protocol=2).dump({"w": _Tensor(_Storage(numel), offset, size, stride)})

    def swap(name: str, data: bytes) -> list[tuple[str, bytes, int]]:
        if name.endswith("/data.pkl"):
            return [(name, pickled.getvalue(), zipfile.ZIP_STORED)]
        if name.endswith("/data/0"):
            return [(name, bytes(range(data_bytes)), zipfile.ZIP_STORED)]
        return [(name, data, zipfile.ZIP_STORED)]

    return _rezip(_torch_bytes({"w": torch.zeros(1)}), swap)


ARCHIVES: dict[str, tuple[Callable[[], bytes], str]] = {
    # the merge wrote the deflated bytes as the weights, exit 0
    "records deflated": (
        lambda: _rezip(_torch_bytes(_plain_state()), _deflated),
        "is compressed; torch.save stores every record uncompressed",
    ),
    # the merge read one copy, torch.load the other
    "a record twice": (
        lambda: _rezip(_torch_bytes(_plain_state()), _record_twice),
        "twice",
    ),
    # torch grows a meta storage to fit any view: the merge read the zip records after it
    "storage offset past the record": (
        lambda: _lying_pt(24, 100, (4, 6), (6, 1)),
        "tensor 'w'",
    ),
    "view ending past the record": (lambda: _lying_pt(24, 2, (4, 6), (6, 1)), "tensor 'w'"),
    "record shorter than the storage": (
        lambda: _lying_pt(24, 0, (4, 6), (6, 1), data_bytes=40),
        "tensor 'w'",
    ),
    # torch.load refuses negative strides; the merge wrote bytes from before the storage
    "negative stride": (lambda: _lying_pt(24, 23, (24,), (-1,)), "tensor 'w'"),
}


@pytest.mark.parametrize("case", sorted(ARCHIVES))
@pytest.mark.parametrize("command", ["merge", "verify", "inspect"])
def test_archive_that_lies_about_its_tensors(tmp_path, capsys, case, command):
    build, needle = ARCHIVES[case]
    source = _verl_dir(tmp_path / "actor", {})
    (source / MODEL).write_bytes(build())
    argv = {
        "merge": _merge_argv(source, tmp_path),
        "verify": ["verify", "--quiet", source],
        "inspect": ["inspect", source],
    }[command]
    _fails_naming(capsys, argv, source, str(source / MODEL), needle)


def test_storage_as_torch_writes_it_still_merges(tmp_path, capsys):
    """The builder above, telling the truth: the checks refuse the lies, not the format."""
    source = _verl_dir(tmp_path / "actor", {})
    (source / MODEL).write_bytes(_lying_pt(24, 0, (4, 6), (6, 1)))
    code, lines = _cli(capsys, *_merge_argv(source, tmp_path), "--dtype", "float32")
    assert (code, lines) == (0, [])
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "merged" / "model.safetensors")["w"]
    expected = torch.frombuffer(bytearray(range(96)), dtype=torch.float32).reshape(4, 6)
    assert torch.equal(merged.float(), expected)


# --- state dicts with keys and names no output can hold -------------------------------------


@pytest.mark.parametrize("key", [7, None, ("a", "b")], ids=["int", "None", "tuple"])
@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_state_dict_key_that_is_no_name(tmp_path, capsys, command, key):
    """A non-string key ended in a TypeError or AttributeError traceback."""
    source = _verl_dir(tmp_path / "actor", {MODEL: {key: torch.ones(3), "b": torch.ones(2)}})
    argv = _merge_argv(source, tmp_path) if command == "merge" else ["inspect", source]
    _fails_naming(capsys, argv, source, str(source / MODEL), "not a tensor name")


def test_tensor_name_with_a_lone_surrogate(tmp_path, capsys):
    """The merge wrote a header no safetensors reader parses ("lone leading surrogate")."""
    source = _verl_dir(tmp_path / "actor", {MODEL: {"a\udc80": torch.ones(3)}})
    argv = _merge_argv(source, tmp_path)
    _fails_naming(capsys, argv, source, "'a\\udc80'", "not valid Unicode")


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("", "name is empty"),
        ("model.norm.weight\x00", "U+0000"),
        ("lm_head.weight\n", "U+000A"),
        ("a.\u202egnp.weight", "U+202E"),
        ("a.\x1b[2J", "U+001B"),
    ],
    ids=["empty", "NUL", "newline", "right-to-left override", "escape sequence"],
)
def test_tensor_name_no_module_holds_is_refused(tmp_path, capsys, name, said):
    """Written into the output as it was: a name that prints as other text, or none."""
    source = _verl_dir(tmp_path / "actor", {MODEL: {name: torch.ones(3), "b": torch.ones(2)}})
    _fails_naming(capsys, _merge_argv(source, tmp_path), source, said)


def test_expanded_tensor_too_large_for_any_file(tmp_path, capsys):
    """One float viewed 2**62 times (stride 0): planning the output's checksum list raised
    MemoryError."""
    source = _verl_dir(tmp_path / "actor", {})
    (source / MODEL).write_bytes(_lying_pt(1, 0, (2**62,), (0,), data_bytes=4))
    _fails_naming(capsys, _merge_argv(source, tmp_path), source, "tensor 'w'", "more than")


# --- output dtypes and target names ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bool", "I64", "F8_E4M3"])
def test_merge_dtype_that_is_not_floating(tmp_path, capsys, dtype):
    """--dtype bool cast every weight to True/False and exited 0; test already refused it."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    argv = [*_merge_argv(source, tmp_path), "--dtype", dtype]
    before = _snapshot(source)
    code, lines = _cli(capsys, *argv)
    assert code == 2 and lines == [
        f"shardstream merge: error: --dtype {dtype}: expected a floating dtype "
        "(bfloat16, float16, float32, float64)"
    ]
    assert not (tmp_path / "merged").exists() and _snapshot(source) == before


def test_values_beyond_float16s_range_are_said_by_name(tmp_path, capsys):
    """--dtype float16 made a norm weight of 1e6 inf without a word (verl casts the same)."""
    from safetensors.torch import load_file

    state = _plain_state()
    big = next(iter(state))
    state[big] = torch.full_like(state[big], 1e6)
    state[big].view(-1)[0] = float("inf")  # already infinite: not counted
    source = _verl_dir(tmp_path / "actor", {MODEL: state})
    argv = ["merge", "--local_dir", source, "--target_dir", tmp_path / "merged"]
    code, lines = _cli(capsys, *argv, "--dtype", "float16")  # not --quiet: the notes
    assert code == 0, lines
    count = state[big].numel() - 1
    note = f"note: {count} values of 1 tensor were beyond float16's range and became inf: "
    assert any(line.startswith(note) and repr(big) in line for line in lines), lines
    assert torch.isinf(load_file(tmp_path / "merged" / "model.safetensors")[big]).all()
    code, lines = _cli(capsys, *argv, "--dtype", "bfloat16", "--overwrite")
    assert code == 0 and not any("range" in line for line in lines), lines


@pytest.mark.parametrize(
    "stray", ["model_world_size_1_rank_00.pt", "model_world_size_01_rank_0.pt"]
)
def test_a_stray_rank_file_with_leading_zeros_is_not_the_ranks(tmp_path, capsys, stray):
    """int() read rank_00 as rank 0, and whichever file the listing gave last was merged and
    verified in its place; verl opens model_world_size_1_rank_0.pt by its exact name."""
    from safetensors.torch import load_file

    state = _plain_state()
    source = _verl_dir(tmp_path / "actor", {MODEL: state})
    torch.save({k: torch.zeros_like(v) for k, v in state.items()}, source / stray)
    code, lines = _cli(capsys, "verify", source)
    assert code == 0, lines
    code, lines = _cli(capsys, *_merge_argv(source, tmp_path), "--dtype", "float32")
    assert code == 0, lines
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged.keys() == state.keys()
    assert all(torch.equal(merged[k], state[k]) for k in state)
    # alone, it is no rank's file at all
    (source / MODEL).unlink()
    code, lines = _cli(capsys, *_merge_argv(source, tmp_path), "--overwrite")
    assert code == 1 and f"{source}: no model files found" in lines[-1]


def test_values_beyond_float16s_range_are_counted_under_their_own_tensors(tmp_path, capsys):
    """Neighbouring tensors of one file are copied as one run: the note named the run's first
    tensor (here 'a', which holds none) for every value, and '1 values of 1 tensor'."""
    from safetensors.torch import save_file

    state = {n: torch.ones(4, 8) for n in ("a", "b", "c", "d")}
    state["b"][1, 2] = 1e6
    state["d"][0, :3] = -1e6
    source = tmp_path / "hf"
    source.mkdir()
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    argv = ["merge", "--local_dir", source, "--target_dir", tmp_path / "merged", "--dtype"]
    code, lines = _cli(capsys, *argv, "float16")
    assert code == 0, lines
    said = [line for line in lines if "range" in line]
    assert said == [
        "note: 4 values of 2 tensors were beyond float16's range and became inf: 'd' (3), "
        "'b' (1); a wider dtype (--dtype bfloat16) keeps them"
    ]
    state["d"][0, :3] = 1.0
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    code, lines = _cli(capsys, *argv, "float16", "--overwrite")
    assert code == 0 and any(
        line == "note: 1 value of 1 tensor was beyond float16's range and became inf: 'b' (1); "
        "a wider dtype (--dtype bfloat16) keeps it"
        for line in lines
    ), lines


@pytest.mark.parametrize("named", ["bool", "int8", "float128"])
@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_config_dtype_that_is_not_floating(tmp_path, capsys, command, named):
    """config.json's torch_dtype "bool" cast every weight to bool with exit 0, and an unknown
    one was a usage error that did not name config.json."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    config = source / "huggingface" / "config.json"
    config.write_text(json.dumps({"model_type": "tiny", "torch_dtype": named}))
    argv = _merge_argv(source, tmp_path) if command == "merge" else ["inspect", source]
    _fails_naming(capsys, argv, source, f"{config}: dtype {named!r}", "--dtype")


def test_target_name_longer_than_the_file_system_allows(tmp_path, capsys):
    """A 300-byte target name ended in an ENAMETOOLONG traceback from the target checks."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    target = tmp_path / ("x" * 300)
    argv = ["merge", "--local_dir", source, "--target_dir", target, "--quiet"]
    before = _snapshot(tmp_path)
    code, lines = _cli(capsys, *argv)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"shardstream merge: error: target {target}: its name is too long")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["broken link", "symlink loop", "FIFO", "directory"])
def test_config_json_that_is_no_regular_file_is_no_missing_config(tmp_path, capsys, kind):
    """A config.json that cannot be read (a broken link, a loop, a FIFO, a directory) is an
    error naming it: a merge without it would write a model with no config and exit 0."""
    source = _verl_dir(tmp_path / "ckpt", {MODEL: _plain_state()})
    config = source / "huggingface" / "config.json"
    config.unlink()
    put_in_place_of(config, kind)
    _fails_naming(capsys, _merge_argv(source, tmp_path), source, str(config))


@pytest.mark.parametrize(
    "kind", ["file", "broken link", "symlink loop", "FIFO", "link out", "no config.json"]
)
def test_huggingface_folder_that_is_no_config_folder_is_refused(tmp_path, capsys, kind):
    """verl's huggingface/ folder, where config.json lives, as anything but a folder of the
    checkpoint holding config.json is an error naming it, not a merge without a config."""
    source = _verl_dir(tmp_path / "ckpt", {MODEL: _plain_state()})
    folder = source / "huggingface"
    if kind == "no config.json":
        (folder / "config.json").unlink()
    else:
        folder.rename(tmp_path / "elsewhere")
        put_in_place_of(folder, kind, tmp_path / "elsewhere")
    _fails_naming(capsys, _merge_argv(source, tmp_path), source, str(folder))


# --- checkpoints with nothing in them ---------------------------------------------------------


@pytest.mark.parametrize("command", ["merge", "test"])
def test_verl_checkpoint_without_model_tensors(tmp_path, capsys, command):
    """A verl rank file holding an empty state dict merged into a model of no tensors and
    exited 0; merge and test now refuse a checkpoint with nothing to write or compare."""
    source = _verl_dir(tmp_path / "actor", {MODEL: {}})
    if command == "merge":
        argv = _merge_argv(source, tmp_path)
    else:
        reference = _hf_dir(tmp_path / "hf")
        argv = ["test", "--local_dir", source, "--test_hf_dir", reference, "--quiet"]
    _fails_naming(capsys, argv, source, str(source), "holds no model tensors")


# --- a config.json that does not describe the checkpoint's model ------------------------------


def _moe_dir(directory: Path, tamper: Callable[[dict, dict], None]) -> Path:
    """A verl checkpoint of a tiny Qwen3-MoE (fused experts), ``tamper(state, config)`` applied."""
    import transformers

    from shardstream.testing.tiny_models import tiny_moe_config

    config = tiny_moe_config()
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    state = {k: torch.ones(v.shape) for k, v in model.state_dict().items()}
    tamper(state, config)
    source = _verl_dir(directory, {MODEL: state})
    (source / "huggingface" / "config.json").write_text(json.dumps(config))
    return source


FUSED = "model.layers.0.mlp.experts.gate_up_proj"


def _gate_up(shape: tuple[int, ...]) -> Callable[[dict, dict], None]:
    def tamper(state: dict, config: dict) -> None:
        state[FUSED] = torch.ones(shape)

    return tamper


@pytest.mark.parametrize(
    "shape",
    [(3, 11, 8), (12, 8), (1, 3, 12, 8), (2, 12, 8), (3, 0, 8)],
    ids=["odd rows", "2-D", "4-D", "fewer experts", "zero rows"],
)
@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_fused_experts_of_another_shape_than_the_config_are_refused(
    tmp_path, capsys, monkeypatch, shape, command
):
    """A fused expert tensor the config's model does not hold was split as given (rc 0, files
    no model of that config loads), or failed with a ZeroDivisionError traceback."""
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    source = _moe_dir(tmp_path / "actor", _gate_up(shape))
    needles = (FUSED, str(list(shape)), "[3, 12, 8]", "describe different models")
    if command == "merge":
        _fails_naming(capsys, _merge_argv(source, tmp_path), source, *needles)
    else:  # inspect describes the checkpoint and says merge would refuse it
        with _deadline():
            code = cli.main(["inspect", str(source)])
        captured = capsys.readouterr()
        assert code == 0 and "Traceback" not in captured.err + captured.out
        refusal = [line for line in captured.out.splitlines() if "merge would refuse" in line]
        assert refusal and all(n in refusal[0] for n in needles), captured.out


@pytest.mark.parametrize(
    "field, value", [("hidden_size", 8.5), ("rope_parameters", [1, 2])], ids=["float", "list"]
)
def test_a_config_transformers_rejects_is_one_line_naming_config_json(
    tmp_path, capsys, monkeypatch, field, value
):
    monkeypatch.setenv("SHARDSTREAM_CACHE_DIR", "")
    source = _moe_dir(tmp_path / "actor", lambda state, config: config.update({field: value}))
    code, lines = _cli(capsys, *_merge_argv(source, tmp_path))
    assert code == 1 and len(lines) == 1, lines
    config = source / "huggingface" / "config.json"
    assert lines[0].startswith(f"shardstream merge: error: {config}: transformers' 'qwen3_moe'")
    assert field in lines[0]


def test_a_reference_with_both_a_single_file_and_an_index_is_refused(tmp_path, capsys):
    """transformers loads model.safetensors, vLLM the files the index names: test compared
    the index's files and said OK while transformers would load the other file."""
    from safetensors.torch import save_file

    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    reference = _hf_dir(tmp_path / "hf")
    zeros = {k: torch.zeros_like(v) for k, v in _plain_state().items()}
    save_file(zeros, str(reference / "model.safetensors"), metadata={"format": "pt"})
    argv = ["test", "--local_dir", source, "--test_hf_dir", reference, "--quiet"]
    needles = (str(reference), "model.safetensors and model.safetensors.index.json", "ambiguous")
    _fails_naming(capsys, argv, source, *needles)
    code, lines = _cli(capsys, "verify", reference, "--quiet")
    assert code == 1 and any("ambiguous" in line for line in lines), lines


# --- LoRA settings that would fuse or export wrong weights ------------------------------------


@pytest.fixture(scope="module")
def _lora_checkpoint(tmp_path_factory) -> Path:
    from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoint

    fixture = VerlFixture(world_size=1, lora=True, lora_layout="both", train_steps=1)
    return Path(write_verl_checkpoint(tmp_path_factory.mktemp("lora"), fixture))


def _lora_copy(source: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the LoRA checkpoint with ``changes`` made to both of its settings files."""
    import shutil

    copy = tmp_path / "actor"
    shutil.copytree(source, copy)
    for path in (copy / "lora_train_meta.json", copy / "lora_adapter" / "adapter_config.json"):
        settings = json.loads(path.read_text())
        settings.update(changes)
        path.write_text(json.dumps(settings))
    return copy


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"r": 0}, ("r is 0, not a positive integer",)),  # was a ZeroDivisionError traceback
        ({"r": -3}, ("r is -3, not a positive integer",)),  # fused with a negative scale
        ({"r": "3"}, ("r is '3', not a positive integer",)),
        ({"r": 5}, ("are not [5, in] and [out, 5]",)),  # rank-3 factors fused with alpha / 5
        ({"lora_alpha": 0}, ("lora_alpha is 0, not a positive finite number",)),
        ({"lora_alpha": 1e308}, ("is not finite in float32",)),  # fused weights were NaN
        ({"use_rslora": "yes"}, ("use_rslora is yes, not true or false",)),
        ({"alpha_pattern": {"q_proj": 64}}, ("alpha_pattern is set",)),
    ],
    ids=["r0", "r negative", "r string", "r not the rank", "alpha 0", "alpha huge",
         "rslora not a bool", "alpha pattern"],
)  # fmt: skip
def test_lora_settings_merge_cannot_apply_are_refused(
    _lora_checkpoint, tmp_path, capsys, changes, needles
):
    source = _lora_copy(_lora_checkpoint, tmp_path, **changes)
    argv = [*_merge_argv(source, tmp_path), "--fuse-lora"]
    _fails_naming(capsys, argv, source, *needles)
    if "lora_alpha" not in changes or changes["lora_alpha"] != 1e308:  # fusing only
        _fails_naming(capsys, _merge_argv(source, tmp_path), source, *needles)


def test_lora_settings_files_that_disagree_are_refused(_lora_checkpoint, tmp_path, capsys):
    source = _lora_copy(_lora_checkpoint, tmp_path)
    meta = source / "lora_train_meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "lora_alpha": 99.0}))
    _fails_naming(capsys, _merge_argv(source, tmp_path), source, "lora_alpha=99.0", "says")


@pytest.mark.parametrize("recorded", [[3, 6.0], "r=3", None], ids=["list", "string", "null"])
def test_recorded_lora_settings_that_are_no_object_are_refused(tmp_path, recorded):
    """A manifest's ``objects.lora`` is read as given: a list was an AttributeError."""
    from shardstream.errors import CheckpointFormatError
    from shardstream.formats import lora

    if recorded is None:  # null: no settings recorded, so verl's files are looked for
        with pytest.raises(CheckpointFormatError, match="nothing says their r and lora_alpha"):
            lora.lora_settings(tmp_path, recorded)
        return
    with pytest.raises(CheckpointFormatError, match="recorded LoRA settings.*not a JSON object"):
        lora.lora_settings(tmp_path, recorded)


def test_verify_passes_the_lora_checkpoint_as_saved(_lora_checkpoint, capsys):
    code, lines = _cli(capsys, "verify", _lora_checkpoint, "--quiet")
    assert code == 0, lines


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"r": 5}, "are not [5, in] and [out, 5]"),  # verify passed it; merge refused it
        ({"r": 0}, "r is 0, not a positive integer"),
        ({"use_dora": True}, "use_dora is set"),
    ],
    ids=["r not the rank", "r0", "dora"],
)
def test_verify_reports_lora_settings_merge_refuses(
    _lora_checkpoint, tmp_path, capsys, changes, needle
):
    source = _lora_copy(_lora_checkpoint, tmp_path, **changes)
    code, lines = _cli(capsys, "verify", source, "--quiet")
    assert code == 1 and any(needle in line and str(source) in line for line in lines), lines


def test_lora_factors_must_fit_a_base_weight():
    from shardstream.engine.plan import GlobalTensor
    from shardstream.errors import CheckpointFormatError
    from shardstream.formats import lora

    def split(**base: tuple[int, int]) -> lora.LoraSplit:
        tensors = [
            GlobalTensor(f"base_model.model.{m}.base_layer.weight", "F32", shape, ())
            for m, shape in base.items()
        ]
        for module in ("q", "k"):
            for which, shape in (("A", (2, 4)), ("B", (8, 2))):
                name = f"base_model.model.{module}.lora_{which}.default.weight"
                tensors.append(GlobalTensor(name, "F32", shape, ()))
        return lora.split_lora(tensors)

    lora.check_factors(split(), 2)  # an adapter saved alone: no base to fit
    with pytest.raises(CheckpointFormatError, match="module 'k' has no base weight 'k.weight'"):
        lora.check_factors(split(q=(8, 4)), 2)
    with pytest.raises(CheckpointFormatError, match=r"do not fit its base weight \[8, 6\]"):
        lora.check_factors(split(q=(8, 6), k=(8, 4)), 2)
    lora.check_factors(split(q=(8, 4), k=(8, 4)), 2)


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_latest_pointer_that_is_no_regular_file(saved_run, tmp_path, capsys, kind):
    """A FIFO as the run's latest pointer blocked verify, inspect and every rank's restore
    forever; a directory there ended in an IsADirectoryError. Both are a damaged
    pointer now: readers fall back to the highest committed step."""
    import shutil

    from shardstream.manager import CheckpointConfig, CheckpointManager
    from shardstream.storage.run_layout import LATEST_FILE, read_latest

    from .forkserver import build_model, build_optimizer

    root = tmp_path / "root"
    shutil.copytree(saved_run.root, root)
    pointer = root / LATEST_FILE
    pointer.unlink()
    os.mkfifo(pointer) if kind == "FIFO" else pointer.mkdir()
    with _deadline():
        assert read_latest(root) is None
        model = build_model()
        config = CheckpointConfig(directory=str(root))
        with CheckpointManager(config, model=model, optimizer=build_optimizer(model)) as manager:
            assert manager.restore()[0] == 3  # the highest committed step
    code, lines = _cli(capsys, "verify", "--quiet", root)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{pointer}: damaged"), lines
    assert _cli(capsys, "inspect", root)[0] == 0


def test_folder_nested_past_the_recursion_limit(saved_run, tmp_path, capsys):
    """verify walked a checkpoint with os.walk, which recurses once per level: a file 1,500
    folders down (its path under PATH_MAX) ended in a RecursionError traceback."""
    import shutil

    from shardstream.storage.tree import remove_tree

    step = tmp_path / "step"
    shutil.copytree(saved_run.step, step)
    deep = step
    for _ in range(1500):
        deep = deep / "a"
        os.mkdir(deep)
    (deep / "x").write_bytes(b"added")
    try:
        code, lines = _cli(capsys, "verify", "--quiet", step)
    finally:  # pytest's rmtree of its temporary folders recurses too
        remove_tree(step / "a")
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"{deep / 'x'}: not in the manifest"), lines


@pytest.mark.parametrize("kind", ["FIFO", "device"])
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_verify_verl_config_file_that_is_no_regular_file(tmp_path, capsys, kind, name):
    """merge refuses a FIFO or device under huggingface/'s config or tokenizer file; verify
    checked the rank files only and said OK."""
    source = _verl_dir(tmp_path / "actor", {MODEL: _plain_state()})
    hf_dir = source / "huggingface"
    assert (hf_dir / "config.json").is_file()
    (hf_dir / name).unlink(missing_ok=True)
    if kind == "FIFO":
        os.mkfifo(hf_dir / name)
    else:
        try:  # a device node of its own (a link to /dev/zero leads out of the checkpoint)
            os.mknod(hf_dir / name, stat.S_IFCHR | 0o600, os.stat("/dev/zero").st_rdev)
        except PermissionError:
            pytest.skip("making a device node needs root")
    what = "is a FIFO" if kind == "FIFO" else "is a character device"
    _fails_naming(capsys, ["verify", "--quiet", source], source, f"{hf_dir / name}: {what}")
    _fails_naming(capsys, _merge_argv(source, tmp_path), source, f"{hf_dir / name}: {what}")


def test_native_data_file_that_is_a_fifo_is_named_so(saved_run, tmp_path, capsys):
    """A native step's data file replaced by a FIFO was refused as "missing"."""
    import shutil

    step = tmp_path / "step"
    shutil.copytree(saved_run.step, step)
    data = step / "rank-00001.safetensors"
    data.unlink()
    os.mkfifo(data)
    _fails_naming(capsys, ["verify", "--quiet", step], step, f"{data}: is a FIFO")
    _fails_naming(capsys, ["inspect", step], step, f"{data}: is a FIFO")
    _fails_naming(capsys, _merge_argv(step, tmp_path), step, f"{data}: is a FIFO")


def test_native_manifest_that_is_a_fifo_is_refused_without_waiting(saved_run, tmp_path):
    """verify and merge waited forever opening a manifest.json replaced by a FIFO (a reader's
    lease opened it before any check): run apart, under a timeout the old code ran into."""
    import shutil

    from shardstream.testing.cli import run_cli

    step = tmp_path / "step"
    shutil.copytree(saved_run.step, step)
    manifest = step / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    verified = run_cli("verify", "--quiet", step, timeout=120)
    said = verified.stdout + verified.stderr
    assert verified.returncode == 1 and f"{manifest}: is a FIFO" in said, verified
    merged = run_cli(*_merge_argv(step, tmp_path), timeout=120)
    assert merged.returncode == 1 and "Traceback" not in merged.stderr, merged
    assert f"{manifest}: is a FIFO" in merged.stderr and not (tmp_path / "merged").exists()


@pytest.mark.parametrize("command", ["merge", "inspect", "verify"])
def test_native_header_altered_into_another_valid_shape_is_a_checksum_mismatch(
    saved_run, tmp_path, capsys, command
):
    """A byte flipped in a rank file's header was parsed before its digest was compared:
    "tensor '__metadata^_' has unknown dtype None" instead of the checksum mismatch."""
    import shutil

    step = tmp_path / "step"
    shutil.copytree(saved_run.step, step)
    data = step / "rank-00001.safetensors"
    raw = data.read_bytes()
    assert raw.count(b'"__metadata__"') == 1
    data.write_bytes(raw.replace(b'"__metadata__"', b'"__metadata^_"'))
    argv = {
        "merge": _merge_argv(step, tmp_path),
        "inspect": ["inspect", step],
        "verify": ["verify", "--quiet", step],
    }[command]
    _fails_naming(capsys, argv, step, str(data), "header")
    if command != "verify":
        _fails_naming(capsys, argv, step, f"{data}: header checksum mismatch")
