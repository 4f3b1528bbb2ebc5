"""safetensors headers: build/parse round trips, agreement with the safetensors library, and
every validation error (fuzzed: parsing arbitrary bytes either succeeds or raises a
``CheckpointFormatError``)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardstream.engine.checksum import ALGORITHM, DIGEST_WIDTH
from shardstream.engine.dtypes import ITEMSIZE
from shardstream.errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from shardstream.formats.safetensors import (
    CHECKSUM_PREFIX,
    MAX_HEADER_BYTES,
    UNPRINTABLE,
    build_header,
    checksum_metadata,
    entries_digest,
    parse_header,
    read_header,
    stored_checksums,
    tensors_in_range,
)

# Names the writer takes: no control or text-direction characters (UNPRINTABLE), never empty
names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(
    lambda name: not UNPRINTABLE.search(name)
)
layouts = st.lists(
    st.tuples(names, st.sampled_from(sorted(ITEMSIZE)), st.lists(st.integers(0, 5), max_size=3)),
    max_size=8,
    unique_by=lambda t: t[0],
).filter(lambda ts: all(n != "__metadata__" for n, _, _ in ts))
metadata = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4)


def body(prefix: bytes) -> bytes:
    (n,) = struct.unpack("<Q", prefix[:8])
    return prefix[8 : 8 + n]


@settings(max_examples=150, deadline=None)
@given(layouts, metadata)
def test_build_parse_round_trip(tensors, meta):
    tensors = [(n, d, tuple(s)) for n, d, s in tensors]
    prefix, entries = build_header(tensors, meta)
    assert len(prefix) % 8 == 0
    data_size = entries[-1].end if entries else 0
    header = parse_header("f", body(prefix), len(prefix) + data_size)
    assert header.data_start == len(prefix)
    assert header.metadata == meta
    assert list(header.tensors) == [e.name for e in sorted(entries, key=lambda e: (e.begin, e.end))]
    for e in entries:
        assert header.tensors[e.name] == e
        assert header.absolute(e.name) == len(prefix) + e.begin
    offset = 0
    for (name, dtype, shape), e in zip(tensors, entries):
        assert (e.name, e.dtype, e.shape, e.begin) == (name, dtype, shape, offset)
        offset = e.end


def test_round_trip_with_safetensors_library(tmp_path):
    """Our header + zero bytes is a file safetensors reads; its files parse here."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    layout = [("b.weight", "BF16", (3, 4)), ("a", "F32", (5,)), ("s", "I64", ()), ("e", "U8", (0,))]
    prefix, entries = build_header(layout, {"format": "pt"})
    path = tmp_path / "ours.safetensors"
    path.write_bytes(prefix + bytes(entries[-1].end))
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {n for n, _, _ in layout}
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("b.weight").dtype == torch.bfloat16
        assert tuple(f.get_tensor("b.weight").shape) == (3, 4)
        assert tuple(f.get_tensor("s").shape) == ()

    theirs = tmp_path / "theirs.safetensors"
    tensors = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(4, dtype=torch.float16)}
    save_file(tensors, str(theirs), metadata={"k": "v"})
    header = read_header(theirs)
    assert header.metadata == {"k": "v"}
    assert header.tensors["x"].shape == (2, 3) and header.tensors["x"].dtype == "F32"
    raw = theirs.read_bytes()
    x = header.tensors["x"]
    start = header.data_start + x.begin
    value = torch.frombuffer(bytearray(raw[start : header.data_start + x.end]), dtype=torch.float32)
    assert value.tolist() == [0, 1, 2, 3, 4, 5]


def test_build_header_rejects_duplicate_names():
    with pytest.raises(CheckpointFormatError, match="duplicate tensor name 'a'"):
        build_header([("a", "F32", (1,)), ("a", "F32", (1,))])


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_build_header_refuses_a_tensor_named_as_the_metadata_key(metadata):
    with pytest.raises(CheckpointFormatError, match="'__metadata__' is the safetensors metadata"):
        build_header([("__metadata__", "F32", (1,))], metadata)


def test_build_header_names_a_tensor_whose_name_is_not_unicode():
    with pytest.raises(CheckpointFormatError, match="not valid Unicode"):
        build_header([("ok", "F32", (1,)), ("bad\ud800", "F32", (1,))])


# ---------------------------------------------------------------------------- validation errors


def doc_bytes(doc) -> bytes:
    return json.dumps(doc).encode()


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def parse(doc, data_size=8, raw=None):
    raw = doc_bytes(doc) if raw is None else raw
    return parse_header("m.safetensors", raw, 8 + len(raw) + data_size)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"{not json", "header is not valid JSON"),
        (b"\xff\xfe{}", "header is not valid JSON"),
        (b"[" * 50_000, "header is not valid JSON"),
        (b'{"a": 1, "a": 2}', "header is not valid JSON.*duplicate key 'a'"),
        (b"[]", "header is not a JSON object"),
        (b'"text"', "header is not a JSON object"),
    ],
)
def test_parse_rejects_bad_json(raw, message):
    with pytest.raises(CheckpointFormatError, match=message):
        parse(None, raw=raw, data_size=0)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"__metadata__": {"a": 1}}, "__metadata__ must map strings to strings"),
        ({"__metadata__": "x"}, "__metadata__ must map strings to strings"),
        ({"__metadata__": []}, "__metadata__ must map strings to strings"),
        ({"__metadata__": 0}, "__metadata__ must map strings to strings"),
        ({"w": [1, 2]}, "entry for tensor 'w' is not an object"),
        ({"w": entry(dtype="F33")}, "tensor 'w' has unknown dtype 'F33'"),
        ({"w": entry(dtype=None)}, "tensor 'w' has unknown dtype None"),
        ({"w": entry(dtype=["F32"])}, "tensor 'w' has unknown dtype"),
        ({"w": {**entry(), "shape": "2"}}, "tensor 'w' has invalid shape '2'"),
        ({"w": entry(shape=(-2,))}, "tensor 'w' has invalid shape"),
        ({"w": entry(shape=(2.0,))}, "tensor 'w' has invalid shape"),
        ({"w": entry(shape=(True, 2))}, "tensor 'w' has invalid shape"),
        ({"w": {**entry(), "data_offsets": None}}, "tensor 'w' has invalid data_offsets"),
        ({"w": entry(offsets=(0,))}, "tensor 'w' has invalid data_offsets"),
        ({"w": entry(offsets=(0, 8, 8))}, "tensor 'w' has invalid data_offsets"),
        ({"w": entry(offsets=(8, 0))}, "tensor 'w' has invalid data_offsets"),
        ({"w": entry(offsets=(-8, 0))}, "tensor 'w' has invalid data_offsets"),
        ({"w": entry(offsets=(False, 8))}, "tensor 'w' has invalid data_offsets"),
        ({"w": entry(offsets=(0, 8.0))}, "tensor 'w' has invalid data_offsets"),
        ({"w": entry(offsets=(0, 12))}, r"tensor 'w' of shape \[2\] and dtype F32 needs 8 bytes"),
        (
            {"a": entry(), "b": entry(offsets=(4, 12))},
            r"tensor 'b' at bytes \[4, 12\) overlaps the previous tensor",
        ),
        ({"w": entry(offsets=(4, 12))}, r"tensor 'w' at bytes \[4, 12\) leaves a hole"),
    ],
)
def test_parse_rejects_bad_entries(doc, message):
    with pytest.raises(CheckpointFormatError, match=message):
        parse(doc, data_size=16)


@pytest.mark.parametrize("data_size, what", [(4, "truncated"), (12, "trailing")])
def test_parse_checks_data_size_against_file(data_size, what):
    with pytest.raises(
        CheckpointFormatError, match=f"cover 8 data bytes but the file holds {data_size}.*{what}"
    ):
        parse({"w": entry()}, data_size=data_size)


def test_parse_accepts_empty_and_zero_sized_tensors():
    header = parse({"__metadata__": None, "e": entry(shape=(0, 3), offsets=(0, 0))}, data_size=0)
    assert header.tensors["e"].nbytes == 0
    assert header.metadata == {}


def test_parse_error_names_the_file():
    with pytest.raises(CheckpointFormatError, match=r"^m\.safetensors: "):
        parse({"w": entry(dtype="X")})


# ---------------------------------------------------------------------------- read_header (files)


def write(tmp_path, content: bytes, name="f.safetensors"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_read_header_reads_a_valid_file(tmp_path):
    prefix, entries = build_header([("w", "F16", (3,))], {"format": "pt"})
    header = read_header(write(tmp_path, prefix + bytes(6)))
    assert header.tensors["w"].shape == (3,)
    assert header.file_size == len(prefix) + 6


def test_read_header_short_file(tmp_path):
    with pytest.raises(
        CheckpointFormatError, match=r"f\.safetensors: not a safetensors file \(3 bytes\)"
    ):
        read_header(write(tmp_path, b"abc"))


def test_read_header_length_beyond_limit(tmp_path):
    content = struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}"
    with pytest.raises(UnsafeCheckpointError, match="exceeds the 100000000-byte limit"):
        read_header(write(tmp_path, content))


def test_read_header_length_past_end(tmp_path):
    content = struct.pack("<Q", 100) + b"{}"
    with pytest.raises(
        CheckpointFormatError, match="header length 100 runs past the end of the file"
    ):
        read_header(write(tmp_path, content))


def test_read_header_missing_and_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope.safetensors: no such file"):
        read_header(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointFormatError, match="is a directory"):
        read_header(tmp_path)


# ---------------------------------------------------------------------------- fuzzing


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.integers(0, 400))
def test_fuzz_parse_header_random_bytes(raw, extra):
    try:
        parse_header("fuzz", raw, 8 + len(raw) + extra)
    except CheckpointFormatError:
        pass


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=6)
    | st.sampled_from(sorted(ITEMSIZE)),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
entries_like = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(sorted(ITEMSIZE)) | json_values,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-4, 200), min_size=2, max_size=2) | json_values,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.text(max_size=6), entries_like | json_values, max_size=5),
    st.one_of(st.none(), json_values, metadata),
    st.integers(0, 300),
)
def test_fuzz_parse_header_structured(doc, meta, data_size):
    if meta is not None:
        doc = {**doc, "__metadata__": meta}
    raw = json.dumps(doc).encode()
    try:
        header = parse_header("fuzz", raw, 8 + len(raw) + data_size)
    except CheckpointFormatError:
        return
    # Whatever was accepted is self-consistent.
    covered = sum(e.nbytes for e in header.tensors.values())
    assert covered == data_size


# ---------------------------------------------------------------------------- checksum metadata


def header_with_checksums(meta_overrides=None, data_size=10, chunk_bytes=4):
    prefix, entries = build_header([("w", "U8", (data_size,))])
    chunks = [f"{i:016x}" for i in range(-(-data_size // chunk_bytes))]
    meta = checksum_metadata(entries, chunk_bytes, chunks, data_size)
    meta.update(meta_overrides or {})
    prefix, _ = build_header([("w", "U8", (data_size,))], meta)
    return parse_header("c.safetensors", body(prefix), len(prefix) + data_size), chunks, entries


def test_stored_checksums_round_trip():
    header, chunks, entries = header_with_checksums()
    stored = stored_checksums(header)
    assert stored.chunk_bytes == 4 and stored.chunks == chunks
    assert stored.entries == entries_digest(entries)
    assert header.metadata[f"{CHECKSUM_PREFIX}algorithm"] == ALGORITHM


def test_placeholder_checksums_keep_the_header_length():
    _, entries = build_header([("w", "U8", (10,))])
    a = checksum_metadata(entries, 4, None, 10)
    b = checksum_metadata(entries, 4, ["f" * DIGEST_WIDTH] * 3, 10)
    assert len(a[f"{CHECKSUM_PREFIX}chunks"]) == len(b[f"{CHECKSUM_PREFIX}chunks"])


def test_foreign_file_has_no_checksums():
    prefix, _ = build_header([("w", "U8", (2,))], {"format": "pt"})
    assert stored_checksums(parse_header("x", body(prefix), len(prefix) + 2)) is None


@pytest.mark.parametrize(
    "override, message",
    [
        ({f"{CHECKSUM_PREFIX}algorithm": "md5"}, "unknown algorithm"),
        ({f"{CHECKSUM_PREFIX}chunk_bytes": "four"}, "damaged checksum metadata"),
        ({f"{CHECKSUM_PREFIX}chunk_bytes": "0"}, "bad chunk table"),
        ({f"{CHECKSUM_PREFIX}chunks": "abc"}, "bad chunk table"),
        ({f"{CHECKSUM_PREFIX}chunks": "0" * 16}, "checksum table has 1 chunks for 10 data bytes"),
    ],
)
def test_damaged_checksum_metadata(override, message):
    header, _, _ = header_with_checksums(override)
    with pytest.raises(CheckpointFormatError, match=f"c.safetensors: .*{message}"):
        stored_checksums(header)


def test_missing_checksum_key():
    prefix, entries = build_header([("w", "U8", (4,))])
    meta = checksum_metadata(entries, 4, ["0" * 16], 4)
    del meta[f"{CHECKSUM_PREFIX}entries"]
    prefix, _ = build_header([("w", "U8", (4,))], meta)
    with pytest.raises(CheckpointFormatError, match="damaged checksum metadata"):
        stored_checksums(parse_header("c", body(prefix), len(prefix) + 4))


def test_entries_digest_sees_header_edits():
    _, a = build_header([("w", "F32", (2, 3))])
    _, b = build_header([("w", "F32", (3, 2))])
    _, c = build_header([("v", "F32", (2, 3))])
    assert len({entries_digest(a), entries_digest(b), entries_digest(c)}) == 3


def test_tensors_in_range():
    prefix, _ = build_header([("a", "U8", (4,)), ("b", "U8", (4,)), ("c", "U8", (4,))])
    header = parse_header("r", body(prefix), len(prefix) + 12)
    start = header.data_start
    assert tensors_in_range(header, start, start + 4) == ["a"]
    assert tensors_in_range(header, start + 3, start + 5) == ["a", "b"]
    assert tensors_in_range(header, start + 12, start + 20) == []


@settings(max_examples=100, deadline=None)
@given(
    names.filter(lambda name: name != "__metadata__"),  # refused as the metadata key first
    st.sampled_from(["\x00", "\n", "\x1b", "\x7f", "\x85", "\u202e", "\u2066"]),
)
def test_a_name_with_a_control_or_direction_character_is_refused(name, char):
    bad = name[: len(name) // 2] + char + name[len(name) // 2 :]
    with pytest.raises(CheckpointFormatError, match=f"U\\+{ord(char):04X}"):
        build_header([(name + "x", "F32", (1,)), (bad, "F32", (2,))])
    with pytest.raises(CheckpointFormatError, match="empty"):
        build_header([(name, "F32", (1,)), ("", "F32", (2,))])


def test_a_header_listing_more_tensors_than_a_file_may_hold_is_refused_before_parsing(
    tmp_path, monkeypatch
):
    """A legal header of a million empty tensors took merge to 3.5 GB (planning holds
    ~2.4 KiB per tensor); the entries are counted in the raw bytes, before the JSON is
    parsed, and the file refused by name. A file at the limit reads."""
    from shardstream.formats import safetensors as st_format

    monkeypatch.setattr(st_format, "MAX_TENSORS", 8)
    doc = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(8)}
    body = json.dumps(doc).encode()
    at_limit = write(tmp_path, struct.pack("<Q", len(body)) + body)
    assert len(read_header(at_limit).tensors) == 8

    def parse_forbidden(*args, **kwargs):
        raise AssertionError("the header was parsed")

    doc["t8"] = doc["t0"]
    body = json.dumps(doc).encode()
    over = write(tmp_path, struct.pack("<Q", len(body)) + body)
    monkeypatch.setattr(st_format.json, "loads", parse_forbidden)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"f\.safetensors: header lists about 9 tensors, more than the 8",
    ):
        read_header(over)
