"""Damaged Hugging Face models saved with ``torch.save`` given to merge, inspect and verify.

A ``pytorch_model.bin`` (or ``pytorch_model.bin.index.json`` and its shard files), as
transformers 4 and accelerate write it, is read file by file as a whole state dict: the pickle
through the restricted unpickler onto the meta device, the tensor bytes from the zip records,
each checked against its CRC-32. Each case below builds a small real Qwen2 model with
``torch.save`` (or accelerate's ``save_model``), damages it, and runs the CLI in-process: a
refusal exits non-zero with the file (or tensor) named, no traceback, no target nor ``.tmp-``
leftover, the source untouched and no pickle's code run; what merge refuses, verify reports.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .harness import tree_contents
from .test_hostile_hf_source import _refused, _run, write_halves

transformers = pytest.importorskip("transformers")

SINGLE = "pytorch_model.bin"
INDEX = "pytorch_model.bin.index.json"
FIRST, SECOND = "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"
CONFIG = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False,
)  # fmt: skip
COMMANDS = ["merge", "inspect", "verify"]
_STATE: dict[str, torch.Tensor] = {}


# --- building and damaging models ---------------------------------------------------------------


def _state() -> dict[str, torch.Tensor]:
    """Qwen2ForCausalLM's state dict for CONFIG (built once; a fresh copy each call)."""
    if not _STATE:
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG))
        _STATE.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {k: v.clone() for k, v in _STATE.items()}


def _config(directory: Path) -> None:
    transformers.Qwen2Config(**CONFIG).save_pretrained(directory)


def _single(directory: Path, state: object = None) -> Path:
    """``pytorch_model.bin`` (``state``, default the model's) and config.json."""
    directory.mkdir(parents=True)
    torch.save(_state() if state is None else state, directory / SINGLE)
    _config(directory)
    return directory


def _sharded(directory: Path) -> Path:
    """Two shard files and their index, as transformers 4 writes them."""
    write_halves(directory, _state(), (FIRST, SECOND), INDEX, torch.save)
    _config(directory)
    return directory


def _edit_index(source: Path, change) -> None:
    index = json.loads((source / INDEX).read_text())
    change(index)
    (source / INDEX).write_text(json.dumps(index))


def _first_of_second(index: dict) -> str:
    return min(n for n, f in index["weight_map"].items() if f == SECOND)


def _rezip(path: Path, transform: Callable[[str, bytes], list[tuple[str, bytes]]]) -> None:
    """Rewrite the archive ``path``, each record replaced by ``transform(name, data)``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            for name, data in transform(info.filename, src.read(info)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "Duplicate name", on purpose
                    dst.writestr(zipfile.ZipInfo(name), data)
    path.write_bytes(out.getvalue())


def _set_pickle(path: Path, pickled: bytes) -> None:
    _rezip(path, lambda n, d: [(n, pickled if n.endswith("/data.pkl") else d)])


def _central_entries(raw: bytes):
    """(offset, name) of every central directory entry of the zip archive ``raw``."""
    at = raw.find(b"PK\x01\x02")
    while at != -1:
        (length,) = struct.unpack("<H", raw[at + 28 : at + 30])
        yield at, raw[at + 46 : at + 46 + length].decode()
        at = raw.find(b"PK\x01\x02", at + 1)


def _merged(target: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(target.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _merge_ok(capsys, source: Path, target: Path, *extra: str) -> dict[str, torch.Tensor]:
    code, err = _run(capsys, "merge", source, target, *extra)
    assert code == 0, err
    return _merged(target)


# --- pickles that would run code -----------------------------------------------------------------


class _System:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w')",))


def _text(value: str) -> bytes:
    return b"X" + struct.pack("<I", len(value)) + value.encode()


def _getattr_chain(marker: Path) -> bytes:
    """builtins.getattr(builtins.__import__('os'), 'system')('touch marker'), as raw opcodes."""
    return (
        b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\n" + _text("os") + b"\x85R"
        + _text("system") + b"\x86R" + _text(f"touch {marker}") + b"\x85R."
    )  # fmt: skip


def _torch_load_global(marker: Path) -> bytes:
    return b"\x80\x02ctorch\nload\n" + _text(str(marker)) + b"\x85R."


PAYLOADS = {
    "os_system_value": (lambda m: {**_state(), "evil": _System(m)}, "GLOBAL posix.system"),
    "eval_at_top_level": (lambda m: _Eval(m), ".eval"),
    "getattr_chain": (_getattr_chain, "GLOBAL builtins.getattr"),
    "torch_load": (_torch_load_global, "GLOBAL torch.load"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("where", ["single", "shard"])
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_pickle_that_would_run_code(tmp_path, capsys, payload, where, command):
    """Refused by the allowlist, naming the file and the global; the code never runs."""
    marker = tmp_path / "marker"
    build, needle = PAYLOADS[payload]
    source = _single(tmp_path / "hf") if where == "single" else _sharded(tmp_path / "hf")
    bad = source / (SINGLE if where == "single" else SECOND)
    content = build(marker)
    if isinstance(content, bytes):
        _set_pickle(bad, content)
    else:
        torch.save(content, bad)
    _refused(capsys, source, tmp_path, str(bad), "refused to unpickle", needle, command=command)
    assert not marker.exists()


# --- pickles of other things than a state dict of tensors ---------------------------------------


CONTENTS = {
    "int_value": (lambda s: {**s, "step": 3}, "entry 'step' is a int, not a tensor"),
    "none_value": (lambda s: {**s, "x": None}, "entry 'x' is a NoneType, not a tensor"),
    "nested_dict": (lambda s: {"model": s}, "entry 'model' is a dict, not a tensor"),
    "top_level_list": (lambda s: list(s.values()), "expected a state dict, got list"),
    "int_key": (lambda s: {0: s["lm_head.weight"], **s}, "state dict key 0 is a int"),
    "tuple_key": (lambda s: {("a", "b"): s["lm_head.weight"]}, "key ('a', 'b') is a tuple"),
    "quantized": (
        lambda s: {**s, "q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)},
        "holds a quantized (qint8, quint8...) tensor, which shardstream does not read",
    ),
    "sparse": (
        lambda s: {**s, "sp": torch.eye(4).to_sparse()},
        "holds a sparse tensor, which shardstream does not read",
    ),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantize_per_tensor is deprecated
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(CONTENTS))
def test_state_dict_of_other_things(tmp_path, capsys, case, command):
    build, needle = CONTENTS[case]
    source = _single(tmp_path / "hf", build(_state()))
    _refused(capsys, source, tmp_path, str(source / SINGLE), needle, command=command)


# --- tensors with odd storages and dtypes: the merge writes exactly what torch.load gives -------


def _odd_storages() -> dict[str, torch.Tensor]:
    base = torch.arange(1000, dtype=torch.float32)
    return {
        "offset_view": base[100:116],
        "transposed": torch.arange(128, dtype=torch.float32).reshape(8, 16).T,
        "strided_slice": base[::3],
        "stride_0": torch.arange(16, dtype=torch.float32).reshape(1, 16).expand(4, 16),
        "overlap_a": base[0:10],
        "overlap_b": base[5:15],
        "empty_rows": torch.empty(0, 16),
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "parameter": torch.nn.Parameter(torch.ones(3, 2)),
    }


def test_tensors_with_odd_storages_merge_to_their_values(tmp_path, capsys):
    """Views at an offset, transposed, strided, expanded (stride 0), overlapping, empty,
    0-dim, a Parameter, and two names over one storage (save_pretrained's tied weights):
    each written with the values torch.load gives."""
    state = {**_state(), **_odd_storages()}
    state["alias_of_head"] = state["lm_head.weight"]  # the same tensor under two names
    source = _single(tmp_path / "hf", state)
    loaded = torch.load(source / SINGLE)
    got = _merge_ok(capsys, source, tmp_path / "merged", "--keep-names")
    assert got.keys() == loaded.keys()
    for name, tensor in loaded.items():
        assert torch.equal(got[name], tensor.detach()), name


def test_tied_embedding_saved_once_merges(tmp_path, capsys):
    """tie_word_embeddings: lm_head.weight and embed_tokens.weight share one storage record."""
    config = transformers.Qwen2Config(**{**CONFIG, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    source = tmp_path / "hf"
    source.mkdir()
    torch.save(model.state_dict(), source / SINGLE)
    config.save_pretrained(source)
    got = _merge_ok(capsys, source, tmp_path / "merged")
    assert "lm_head.weight" not in got
    assert torch.equal(got["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert _run(capsys, "verify", source, tmp_path / "unused")[0] == 0


DTYPES = [torch.bool, torch.int8, torch.int64, torch.bfloat16, torch.float16, torch.float64]
DTYPES += [torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_merges_exactly(tmp_path, capsys, dtype):
    value = (torch.arange(12, dtype=torch.float64).reshape(3, 4) - 5).to(dtype)
    source = _single(tmp_path / "hf", {**_state(), "extra": value})
    got = _merge_ok(capsys, source, tmp_path / "merged", "--keep-names")
    assert got["extra"].dtype == dtype and torch.equal(got["extra"], value)


UNTYPED = [
    *(torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz),
    *(torch.float8_e8m0fnu, torch.uint16, torch.uint32, torch.uint64),
]


@pytest.mark.parametrize("dtype", UNTYPED, ids=str)
def test_dtype_without_a_typed_storage_merges_exactly(tmp_path, capsys, dtype):
    """torch pickles these dtypes' storages as UntypedStorage (bytes), the dtype coming with
    ``_rebuild_tensor_v3``: merged in their own dtype, bit for bit, and verified."""
    value = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * 7 + 3).to(dtype)
    source = _single(tmp_path / "hf", {**_state(), "extra": value, "view": value[1:, ::2]})
    code, err = _run(capsys, "merge", source, tmp_path / "merged", "--keep-names")
    assert code == 0, err
    got = _merged(tmp_path / "merged")
    for name, want in (("extra", value), ("view", value[1:, ::2].contiguous())):
        assert got[name].dtype == dtype and got[name].shape == want.shape
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
    assert _run(capsys, "verify", source, tmp_path / "unused")[0] == 0


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu], ids=str
)
def test_float8_codes_safetensors_writes_merge_exactly(tmp_path, capsys, dtype):
    """F8_E4M3FNUZ, F8_E5M2FNUZ and F8_E8M0 (MX scales): safetensors and torch load them; merge
    refused the file as of an unknown dtype."""
    from safetensors.torch import save_file

    value = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1).to(dtype)
    source = tmp_path / "hf"
    source.mkdir()
    save_file({"w": torch.ones(2, 2), "scale": value}, str(source / "model.safetensors"))
    code, err = _run(capsys, "merge", source, tmp_path / "merged", "--keep-names")
    assert code == 0, err
    got = _merged(tmp_path / "merged")["scale"]
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), value.view(torch.uint8))


def test_building_onto_the_untyped_storage_type_is_refused(tmp_path, capsys):
    """The storage type a pickle names is a token: BUILD cannot set attributes on it (nor on
    torch's class), and the file is refused in one line naming it."""
    source = _single(tmp_path / "hf")
    pickled = (
        b"\x80\x02ctorch.storage\nUntypedStorage\n"  # GLOBAL
        b"N}X\x05\x00\x00\x00dtypeK\x01s\x86b."  # (None, {"dtype": 1}) BUILD STOP
    )
    _set_pickle(source / SINGLE, pickled)
    before = tree_contents(tmp_path)
    for command in COMMANDS:
        code, err = _run(capsys, command, source, tmp_path / "merged")
        assert code != 0 and "Traceback" not in err and str(source / SINGLE) in err, err
        assert "refused to unpickle: it tries to modify a storage type" in err, err
    assert torch.UntypedStorage.__dict__.get("dtype") is None
    assert tree_contents(tmp_path) == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        lambda: torch._neg_view(torch.tensor([1.0, -2.0, 3.0])),
    ],
    ids=["conj_view", "neg_view"],
)
def test_view_with_a_conj_or_neg_bit_merges_to_its_values_or_is_refused(tmp_path, capsys, make):
    value = make()
    source = _single(tmp_path / "hf", {**_state(), "extra": value})
    code, err = _run(capsys, "merge", source, tmp_path / "merged", "--keep-names")
    if code == 0:
        expected = value.resolve_conj().resolve_neg()
        assert torch.equal(_merged(tmp_path / "merged")["extra"], expected)
    else:
        assert str(source / SINGLE) in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("attribute", "value", "make"),
    [
        ("is_neg", set, lambda: torch._neg_view(torch.tensor([1.0, -2.0, 3.0]))),
        ("is_conj", set, lambda: torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()),
        ("stride", torch.Size, lambda: torch.arange(12.0).view(3, 4)),
        ("numel", 0, lambda: torch.arange(4.0)),
    ],
    ids=["is_neg", "is_conj", "stride", "numel"],
)
def test_a_pickle_that_hides_a_tensor_method_is_refused(tmp_path, capsys, attribute, value, make):
    """A tensor's pickled state may set its attributes (``_rebuild_from_type_v2``), and one
    that hides a method of torch.Tensor lied to the checks: ``is_neg = set`` merged the
    stored bytes of a negated view (exit 0, verify OK), ``numel = 0`` gave a traceback."""
    tensor = make()
    tensor.__dict__[attribute] = value
    source = tmp_path / "hf"
    source.mkdir()
    torch.save({**_state(), "extra": tensor}, source / SINGLE, pickle_protocol=3)
    _config(source)
    before = tree_contents(tmp_path)
    for command in COMMANDS:
        code, err = _run(capsys, command, source, tmp_path / "merged")
        assert code != 0 and "Traceback" not in err, err
        assert f"tensor 'extra': its pickle sets the attribute {attribute!r}" in err, err
    assert tree_contents(tmp_path) == before


def test_a_first_storage_other_than_record_0_is_named(tmp_path, capsys):
    """A pickle whose first storage names record 7: torch's own AssertionError text came out
    ("expected key '0', got '7'")."""
    source = _single(tmp_path / "hf", {"model.w": torch.ones(4)})
    with zipfile.ZipFile(source / SINGLE) as archive:
        pickled = next(archive.read(n) for n in archive.namelist() if n.endswith("/data.pkl"))
    assert pickled.count(b"X\x01\x00\x00\x000") == 1  # the storage key, BINUNICODE '0'
    _set_pickle(source / SINGLE, pickled.replace(b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x007"))
    for command in COMMANDS:
        code, err = _run(capsys, command, source, tmp_path / "merged")
        assert code != 0 and "Traceback" not in err, err
        assert "the pickle's first storage is record data/7, where torch writes data/0" in err


# --- damaged zip archives -----------------------------------------------------------------------


def _truncate(keep: Callable[[int], int]):
    def damage(path: Path) -> None:
        raw = path.read_bytes()
        path.write_bytes(raw[: keep(len(raw))])

    return damage


def _drop_record(path: Path) -> None:
    _rezip(path, lambda n, d: [] if n.endswith("/data/3") else [(n, d)])


def _record_twice(path: Path) -> None:
    _rezip(path, lambda n, d: [(n, d)] + ([(n, bytes(len(d)))] if n.endswith("/data/3") else []))


def _record_outside_the_archive_folder(path: Path) -> None:
    junk = [("x/data/999", b"junk")]
    _rezip(path, lambda n, d: [(n, d)] + (junk if n.endswith("/version") else []))


def _crc_altered(path: Path) -> None:
    """The central directory's CRC-32 of data/3 changed; its bytes as they were."""
    raw = bytearray(path.read_bytes())
    for at, name in list(_central_entries(bytes(raw))):
        if name.endswith("/data/3"):
            raw[at + 16] ^= 0x01
    path.write_bytes(bytes(raw))


def _pickle_byte_flipped(path: Path) -> None:
    """One bit of data.pkl's 11th byte (inside a GLOBAL's name) flipped."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
    at = info.header_offset
    name_len, extra_len = struct.unpack("<HH", raw[at + 26 : at + 30])
    raw[at + 30 + name_len + extra_len + 10] ^= 0x20
    path.write_bytes(bytes(raw))


def _pickle_of_the_other_shard(path: Path) -> None:
    with zipfile.ZipFile(path.with_name(FIRST)) as other:
        (name,) = [n for n in other.namelist() if n.endswith("/data.pkl")]
        _set_pickle(path, other.read(name))


def _zip_in_a_zip(path: Path) -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr(path.name, path.read_bytes())
    path.write_bytes(out.getvalue())


def _deflated(path: Path) -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    path.write_bytes(out.getvalue())


def _huge_size(suffix: str):
    """The record's sizes in both its headers set to 4 GiB - 16."""

    def damage(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        for at, name in list(_central_entries(bytes(raw))):
            if name.endswith(suffix):
                raw[at + 20 : at + 28] = struct.pack("<II", 2**32 - 16, 2**32 - 16)
                (local,) = struct.unpack("<I", raw[at + 42 : at + 46])
                raw[local + 18 : local + 26] = struct.pack("<II", 2**32 - 16, 2**32 - 16)
        path.write_bytes(bytes(raw))

    return damage


# case -> (damage, commands that must refuse it, needle every one of them prints)
ZIP_DAMAGE = {
    "empty": (_truncate(lambda n: 0), COMMANDS, "not a zip file"),
    "first_100_bytes": (_truncate(lambda n: 100), COMMANDS, "not a zip file"),
    "half": (_truncate(lambda n: n // 2), COMMANDS, "not a zip file"),
    "last_10_bytes_cut": (_truncate(lambda n: n - 10), COMMANDS, "not a zip file"),
    "record_missing": (_drop_record, COMMANDS, "is not an uncompressed record"),
    "record_twice": (_record_twice, COMMANDS, "/data/3' twice"),
    "record_outside_folder": (_record_outside_the_archive_folder, COMMANDS, "x/data/999"),
    "crc_altered": (_crc_altered, ["merge", "verify"], "/data/3"),
    "pickle_byte_flipped": (_pickle_byte_flipped, COMMANDS, "data.pkl"),
    "pickle_of_another_shard": (_pickle_of_the_other_shard, COMMANDS, "claims 4096 bytes"),
    "zip_in_a_zip": (_zip_in_a_zip, COMMANDS, "no data.pkl record"),
    "deflated": (_deflated, COMMANDS, "is compressed; torch.save stores every record uncompressed"),
    "huge_tensor_record": (_huge_size("/data/3"), COMMANDS, ""),
    "huge_pickle_record": (_huge_size("/data.pkl"), COMMANDS, ""),
}


@pytest.mark.parametrize(
    "case, command",
    [(case, command) for case in sorted(ZIP_DAMAGE) for command in ZIP_DAMAGE[case][1]],
)
def test_damaged_archive(tmp_path, capsys, case, command):
    """inspect reads the layout only: a record's bytes failing its CRC-32 is merge's and
    verify's to find."""
    damage, _, needle = ZIP_DAMAGE[case]
    source = _sharded(tmp_path / "hf")
    damage(source / SECOND)
    _refused(capsys, source, tmp_path, str(source / SECOND), needle, command=command)


@pytest.mark.parametrize("command", ["merge", "verify"])
def test_crc_altered_is_named_with_its_tensor(tmp_path, capsys, command):
    """data/3 holds the fourth tensor torch.save pickled (the state dict's order)."""
    source = _sharded(tmp_path / "hf")
    _crc_altered(source / SECOND)
    tensor = list(torch.load(source / SECOND))[3]  # torch checks no CRC
    _refused(capsys, source, tmp_path, str(source / SECOND), repr(tensor), command=command)


@pytest.mark.parametrize("command", COMMANDS)
def test_legacy_format_is_named_as_such(tmp_path, capsys, command):
    source = _single(tmp_path / "hf")
    torch.save(_state(), source / SINGLE, _use_new_zipfile_serialization=False)
    _refused(capsys, source, tmp_path, str(source / SINGLE), "the legacy format", command=command)


def _big_endian(path: Path) -> None:
    """The archive as a big-endian machine writes it: byteorder "big", every float32 swapped
    (torch.load of it gives the model's values)."""

    def swap(name: str, data: bytes) -> list[tuple[str, bytes]]:
        if name.endswith("/byteorder"):
            return [(name, b"big")]
        if "/data/" in name and not name.endswith("serialization_id"):
            words = bytearray(data)
            for i in range(0, len(words), 4):
                words[i : i + 4] = words[i : i + 4][::-1]
            return [(name, bytes(words))]
        return [(name, data)]

    _rezip(path, swap)


@pytest.mark.parametrize("command", ["merge", "verify"])
def test_big_endian_archive_is_refused_not_a_crash(tmp_path, command):
    """Run in a child: the crash would take pytest down with it."""
    source = _single(tmp_path / "hf")
    _big_endian(source / SINGLE)
    assert all(
        torch.equal(a, b) for a, b in zip(torch.load(source / SINGLE).values(), _state().values())
    )
    argv = {
        "merge": ["merge", "--local_dir", source, "--target_dir", tmp_path / "merged", "--quiet"],
        "verify": ["verify", "--quiet", source],
    }[command]
    no_core = lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # noqa: E731
    run = subprocess.run(
        [sys.executable, "-m", "shardstream", *map(str, argv)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, preexec_fn=no_core,
    )  # fmt: skip
    assert run.returncode == 1 and str(source / SINGLE) in run.stderr, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr and not (tmp_path / "merged").exists()


# --- indexes that lie ---------------------------------------------------------------------------


def _map_first_of_second_to(name: str):
    return lambda source: _edit_index(
        source, lambda index: index["weight_map"].update({_first_of_second(index): name})
    )


def _second_moved_outside(source: Path) -> None:
    shutil.copyfile(source / SECOND, source.parent / "x.bin")  # what an escape would read
    _edit_index(
        source,
        lambda index: index["weight_map"].update(
            {n: "../x.bin" for n, f in index["weight_map"].items() if f == SECOND}
        ),
    )


def _left_out_of_the_index(source: Path) -> None:
    _edit_index(source, lambda index: index["weight_map"].pop(_first_of_second(index)))


def _in_both_shards(source: Path) -> None:
    """The first shard holds the second's first tensor too; the index lists it in the second."""
    index = json.loads((source / INDEX).read_text())
    state = _state()
    names = [n for n, f in index["weight_map"].items() if f == FIRST] + [_first_of_second(index)]
    torch.save({n: state[n] for n in names}, source / FIRST)


def _listed_twice_in_json(source: Path) -> None:
    """The weight_map names a tensor twice, the second time in the wrong file: JSON readers
    (Python's, transformers') keep the last."""
    index = json.loads((source / INDEX).read_text())
    text = json.dumps(index)[:-2] + f', {json.dumps(_first_of_second(index))}: "{FIRST}"}}}}'
    (source / INDEX).write_text(text)


def _index_replaced(replace):
    def damage(source: Path) -> None:
        (source / INDEX).unlink()
        replace(source / INDEX)

    return damage


def _index_linked_outside(source: Path) -> None:
    shutil.move(source / INDEX, source.parent / "index.json")
    (source / INDEX).symlink_to(source.parent / "index.json")


def _second_linked_outside(source: Path) -> None:
    shutil.move(source / SECOND, source.parent / "elsewhere.bin")
    (source / SECOND).symlink_to(source.parent / "elsewhere.bin")


def _second_broken_link(source: Path) -> None:
    (source / SECOND).unlink()
    (source / SECOND).symlink_to("nowhere")


def _weight_map(value):
    return lambda source: _edit_index(source, lambda index: index.update(weight_map=value))


def _both(source: Path) -> None:
    torch.save(_state(), source / SINGLE)


# case -> (damage, file the messages name (relative to the model), needle)
INDEX_DAMAGE = {
    "second_shard_missing": (lambda s: (s / SECOND).unlink(), SECOND, ""),
    "names_a_missing_file": (_map_first_of_second_to("pytorch_model-00003-of-00003.bin"), "", ""),
    "names_a_file_outside": (_second_moved_outside, INDEX, "not a plain file name"),
    "names_an_absolute_path": (_map_first_of_second_to("/etc/passwd"), INDEX, "not a plain file"),
    "names_config_json": (_map_first_of_second_to("config.json"), "", ""),
    "lists_no_tensor": (_weight_map({}), INDEX, "weight_map lists no tensor"),
    "weight_map_a_list": (_weight_map([]), INDEX, "weight_map must map"),
    "not_json": (lambda s: (s / INDEX).write_text("{not json"), INDEX, "not valid JSON"),
    "a_list": (lambda s: (s / INDEX).write_text("[]"), INDEX, "holds a list"),
    "tensor_left_out": (_left_out_of_the_index, SECOND, "does not list for it"),
    "tensor_in_both_shards": (_in_both_shards, FIRST, "does not list for it"),
    "listed_twice_last_wrong": (_listed_twice_in_json, INDEX, "has no such tensor"),
    "index_is_a_fifo": (_index_replaced(os.mkfifo), INDEX, "is a FIFO"),
    "index_is_a_directory": (_index_replaced(Path.mkdir), INDEX, "is a directory"),
    "index_linked_outside": (_index_linked_outside, INDEX, "outside the checkpoint"),
    "shard_linked_outside": (_second_linked_outside, SECOND, "outside the checkpoint"),
    "shard_broken_link": (_second_broken_link, SECOND, ""),
    "single_file_beside_index": (_both, "", "holds both pytorch_model.bin and"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(INDEX_DAMAGE))
def test_index_that_lies(tmp_path, capsys, case, command):
    damage, named, needle = INDEX_DAMAGE[case]
    source = _sharded(tmp_path / "hf")
    damage(source)
    _refused(capsys, source, tmp_path, str(source / named), needle, command=command)


def test_index_naming_a_missing_file_is_named_by_verify(tmp_path, capsys):
    source = _sharded(tmp_path / "hf")
    missing = "pytorch_model-00003-of-00003.bin"
    _map_first_of_second_to(missing)(source)
    _refused(capsys, source, tmp_path, str(source / missing), "missing", command="verify")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _link_loop(path: Path) -> None:
    path.symlink_to(path.name)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


SHARD_REPLACED = {
    "fifo": (_fifo, "is a FIFO"),
    "directory": (_directory, "is a directory"),
    "link_loop": (_link_loop, "symbolic links"),
    "dev_zero": (_dev_zero, "outside the checkpoint"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(SHARD_REPLACED))
def test_shard_that_is_no_regular_file_is_refused(tmp_path, capsys, case, command):
    """Refused at once (no blocking on the FIFO, no endless read of /dev/zero), named."""
    source = _sharded(tmp_path / "hf")
    (source / SECOND).unlink()
    SHARD_REPLACED[case][0](source / SECOND)
    _refused(capsys, source, tmp_path, str(source / SECOND), command=command)


def _shard_message_cases():
    for case, (_, needle) in sorted(SHARD_REPLACED.items()):
        for command in COMMANDS:
            if case == "dev_zero" and command != "verify":
                continue  # merge and inspect say it (test above)
            yield pytest.param(case, command, needle, id=f"{case}-{command}")


@pytest.mark.parametrize("case, command, needle", list(_shard_message_cases()))
def test_shard_that_is_no_regular_file_is_called_what_it_is(
    tmp_path, capsys, case, command, needle
):
    """As for a safetensors shard (test_hostile_hf_source): the message says what is there
    (it said 'no such file' or 'missing (named in the index)' for all of them)."""
    source = _sharded(tmp_path / "hf")
    (source / SECOND).unlink()
    SHARD_REPLACED[case][0](source / SECOND)
    _refused(capsys, source, tmp_path, str(source / SECOND), needle, command=command)


def test_single_file_that_is_a_link_loop(tmp_path, capsys):
    source = _single(tmp_path / "hf")
    (source / SINGLE).unlink()
    _link_loop(source / SINGLE)
    for command in COMMANDS:
        _refused(capsys, source, tmp_path, str(source / SINGLE), "symbolic links", command=command)


# --- what is fine must stay fine ----------------------------------------------------------------


def test_json_index_naming_a_tensor_twice_merges_as_transformers_loads_it(tmp_path, capsys):
    """The last entry wins in every JSON reader: listed first in the wrong file, last in the
    right one, the model is what the files hold."""
    source = _sharded(tmp_path / "hf")
    index = json.loads((source / INDEX).read_text())
    name = _first_of_second(index)
    body = json.dumps(index["weight_map"])[1:]
    (source / INDEX).write_text(f'{{"weight_map": {{{json.dumps(name)}: "{FIRST}", {body}}}')
    got = _merge_ok(capsys, source, tmp_path / "merged")
    assert torch.equal(got[name], _state()[name])
    assert _run(capsys, "verify", source, tmp_path / "unused")[0] == 0


def test_shard_file_the_index_does_not_name_is_left_out(tmp_path, capsys):
    source = _sharded(tmp_path / "hf")
    torch.save({"extra.weight": torch.ones(3)}, source / "pytorch_model-00003-of-00003.bin")
    got = _merge_ok(capsys, source, tmp_path / "merged")
    assert "extra.weight" not in got and got.keys() == _state().keys()


def test_shard_linked_inside_the_model_merges(tmp_path, capsys):
    source = _sharded(tmp_path / "hf")
    (source / SECOND).rename(source / "real.bin")
    (source / SECOND).symlink_to("real.bin")
    got = _merge_ok(capsys, source, tmp_path / "merged")
    assert all(torch.equal(got[n], t) for n, t in _state().items())


def test_model_without_config_merges_with_hf_model_path(tmp_path, capsys):
    source = _single(tmp_path / "hf")
    (source / "config.json").unlink()
    _config(tmp_path / "config")
    extra = ("--hf_model_path", str(tmp_path / "config"))
    got = _merge_ok(capsys, source, tmp_path / "merged", *extra)
    assert all(torch.equal(got[n], t) for n, t in _state().items())
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "qwen2"


# --- verify reports what merge refuses ----------------------------------------------------------


def test_state_dict_with_no_tensors_is_reported_by_verify(tmp_path, capsys):
    source = _single(tmp_path / "hf", {})
    _refused(capsys, source, tmp_path, str(source), "holds no model tensors")
    _refused(capsys, source, tmp_path, str(source), "no model tensors", command="verify")


# --- accelerate's own save_model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerate_model(tmp_path_factory) -> Path:
    accelerate = pytest.importorskip("accelerate")
    directory = tmp_path_factory.mktemp("accelerate") / "model"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG))
    accelerator = accelerate.Accelerator(cpu=True)
    model = accelerator.prepare(model)
    accelerator.save_model(model, str(directory), max_shard_size="8KB", safe_serialization=False)
    _config(directory)
    assert (directory / INDEX).is_file() and len(list(directory.glob("pytorch_model-*"))) > 2
    return directory


def _accelerate_code(path: Path, marker: Path) -> None:
    state = torch.load(path)
    torch.save({**state, "evil": _System(marker)}, path)


ACCELERATE_DAMAGE = {
    "code_in_a_shard": (_accelerate_code, "refused to unpickle"),
    "shard_truncated": (lambda p, m: _truncate(lambda n: n - 10)(p), "not a zip file"),
    "record_missing": (lambda p, m: _drop_record(p), "not an uncompressed record"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(ACCELERATE_DAMAGE))
def test_damaged_accelerate_save_model(accelerate_model, tmp_path, capsys, case, command):
    source = tmp_path / "model"
    shutil.copytree(accelerate_model, source)
    shard = sorted(source.glob("pytorch_model-*.bin"))[1]
    damage, needle = ACCELERATE_DAMAGE[case]
    damage(shard, tmp_path / "marker")
    _refused(capsys, source, tmp_path, str(shard), needle, command=command)
    assert not (tmp_path / "marker").exists()


def test_accelerate_save_model_as_written_verifies(accelerate_model, capsys):
    code, err = _run(capsys, "verify", accelerate_model, accelerate_model.parent / "unused")
    assert code == 0, err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("case", "needle"), [("fifo", "is a FIFO"), ("device", "is a character")])
def test_a_checkpoint_path_that_is_no_file_nor_directory_is_called_what_it_is(
    tmp_path, capsys, command, case, needle
):
    """verify said "no such directory" of a FIFO or /dev/null, merge and inspect "is a
    file"."""
    source = tmp_path / "ckpt"
    if case == "fifo":
        os.mkfifo(source)
    else:
        source.symlink_to("/dev/null")
    _refused(capsys, source, tmp_path, str(source), needle, command=command)
