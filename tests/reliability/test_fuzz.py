"""Fuzzing every reader of untrusted bytes: the only acceptable outcomes are success or a
``ShardstreamError``; any other exception, or an example running past its time limit, fails.

Readers: the manifest (``read_manifest``, ``open_native``), safetensors headers (``read_header``,
``stored_checksums``), verl ``.pt`` files (``load_layout``, ``open_verl``) and DCP metadata
(``load_metadata``, ``open_dcp``). Inputs are mutations of real files (byte edits, truncations,
splices) and, for the JSON formats, structural edits re-sealed with a valid checksum so they get
past it to the checks behind. ``make test`` runs a bounded, derandomized number of examples;
``make soak`` runs many more with fresh randomness. Memory is watched too: an input that makes a
reader allocate more than ``ALLOC_LIMIT`` (traced), or run out of a capped address space, fails.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import resource
import shutil
import signal
import struct
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardstream.engine.checksum import digest
from shardstream.errors import ShardstreamError
from shardstream.formats import dcp as dcp_format
from shardstream.formats import native, verl
from shardstream.formats.safetensors import read_header, stored_checksums, tensors_in_range
from shardstream.formats.torch_pt import load_layout

from .harness import SOAK, record, trials

EXAMPLE_LIMIT_S = 20  # per example; a hang is a bug
ALLOC_LIMIT = 256 * 2**20  # Python allocations per example; inputs here are a few kB to 1 MB
ADDRESS_SPACE_HEADROOM = 4 * 2**30  # beyond the process's size when the example starts
COUNTS: Counter = Counter()

FUZZ = settings(
    max_examples=trials(120, 3000),
    deadline=None,
    derandomize=not SOAK,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(what: str):
    """Fail an example that runs too long; a hard backstop dumps stacks and exits if stuck in C."""

    def expired(signum, frame):
        raise Hang(f"{what}: no result within {EXAMPLE_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(EXAMPLE_LIMIT_S)
    faulthandler.dump_traceback_later(EXAMPLE_LIMIT_S * 6, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def memory_limit():
    """Cap the address space (so a memory bomb cannot get the test run OOM-killed) and trace
    Python allocations (so one that stays under the cap is still seen); yields a function
    giving the peak of what was allocated since."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + ADDRESS_SPACE_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
    tracemalloc.reset_peak()
    # Tracing started with the module: what earlier tests and fixtures left allocated (imports)
    # is the baseline, not the example's.
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield lambda: tracemalloc.get_traced_memory()[1] - base
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def outcome(target: str, call, must_reject: bool = False) -> None:
    """Run ``call``: success and ShardstreamError are fine; anything else fails the example, and
    so does an input that makes the reader allocate more than ``ALLOC_LIMIT`` (or try to).

    ``must_reject``: the input is known to be damaged, so success is a missed detection.
    """
    rejected = None
    with time_limit(target), memory_limit() as allocated:
        try:
            call()
        except ShardstreamError as exc:
            rejected = exc
        peak = allocated()
    if rejected is not None:
        bomb = any(isinstance(e, MemoryError) for e in _chain(rejected))
        assert not bomb, f"{target}: the input made the reader run out of memory: {rejected}"
    assert peak < ALLOC_LIMIT, f"{target}: the input made the reader allocate {peak >> 20} MiB"
    if rejected is not None:
        COUNTS[f"{target}: rejected with a ShardstreamError"] += 1
        return
    assert not must_reject, f"{target}: damaged input accepted"
    COUNTS[f"{target}: accepted"] += 1


@pytest.fixture(scope="module", autouse=True)
def figures():
    COUNTS.clear()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
    by_target: dict[str, dict[str, int]] = {}
    for key, n in COUNTS.items():
        target, _, result = key.partition(": ")
        by_target.setdefault(target, {})[result] = n
    record(
        "fuzz: readers of untrusted bytes",
        examples=sum(COUNTS.values()),
        max_examples_per_test=FUZZ.max_examples,
        targets=by_target,
    )


# --- strategies --------------------------------------------------------------------------------

SPECIAL_STRINGS = [
    "../outside",
    "/etc/passwd",
    "huggingface/config.json",
    "rank-00000.safetensors",
    "manifest.json",
    "F32",
    "BF16",
    "",
    "..",
    "a" * 300,
    "\x00",
]
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(SPECIAL_STRINGS),
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def mutate_json(doc, data, depth: int = 0):
    """Replace, drop or add one thing somewhere inside ``doc`` (a JSON value)."""
    containers = isinstance(doc, (dict, list)) and doc
    if containers and depth < 8 and data.draw(st.integers(0, 3), "descend") > 0:
        if isinstance(doc, dict):
            key = data.draw(st.sampled_from(sorted(doc)), "key")
            op = data.draw(st.sampled_from(["descend", "delete", "add"]), "op")
            if op == "delete":
                del doc[key]
            elif op == "add":
                doc[data.draw(st.text(max_size=8), "new key")] = data.draw(json_values, "value")
            else:
                doc[key] = mutate_json(doc[key], data, depth + 1)
        else:
            index = data.draw(st.integers(0, len(doc) - 1), "index")
            op = data.draw(st.sampled_from(["descend", "delete", "duplicate"]), "op")
            if op == "delete":
                del doc[index]
            elif op == "duplicate":
                doc.append(doc[index])
            else:
                doc[index] = mutate_json(doc[index], data, depth + 1)
        return doc
    return data.draw(json_values, "replacement")


def mutate_bytes(raw: bytes, data) -> bytes:
    op = data.draw(st.sampled_from(["flip", "truncate", "splice", "insert", "zero-run"]), "op")
    if not raw:
        return data.draw(st.binary(max_size=64), "bytes")
    at = data.draw(st.integers(0, len(raw) - 1), "at")
    if op == "flip":
        out = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4), "flips")):
            i = data.draw(st.integers(0, len(raw) - 1), "where")
            out[i] ^= data.draw(st.integers(1, 255), "xor")
        return bytes(out)
    if op == "truncate":
        return raw[:at]
    if op == "splice":
        return raw[:at] + data.draw(st.binary(max_size=64), "splice") + raw[at + 1 :]
    if op == "insert":
        return raw[:at] + data.draw(st.binary(min_size=1, max_size=16), "insert") + raw[at:]
    n = data.draw(st.integers(1, 64), "run")
    return raw[:at] + b"\0" * n + raw[at + n :]


# --- the manifest ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step_copy(saved_run, tmp_path_factory) -> Path:
    step = tmp_path_factory.mktemp("fuzz") / "global_step_3"
    shutil.copytree(saved_run.step, step)
    return step


@contextlib.contextmanager
def replaced(path: Path, content: bytes):
    original = path.read_bytes()
    path.write_bytes(content)
    try:
        yield
    finally:
        path.write_bytes(original)


def _open(step: Path) -> None:
    ckpt = native.open_native(step)
    for tensor in ckpt.tensors:  # what merge and inspect look at next
        assert tensor.shape is not None


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_structure(step_copy, data):
    """Structural edits, re-sealed: the checks behind the checksum must hold on their own."""
    doc = json.loads((step_copy / native.MANIFEST).read_bytes())
    doc.pop("checksum")
    mutated = mutate_json(doc, data)
    body = mutated if isinstance(mutated, dict) else {"not": mutated}
    sealed = native.canonical({**body, "checksum": digest(native.canonical(body))})
    with replaced(step_copy / native.MANIFEST, sealed):
        outcome("manifest (re-sealed structure)", lambda: native.read_manifest(step_copy))
        outcome("open_native (re-sealed structure)", lambda: _open(step_copy))


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_bytes(step_copy, data):
    """Byte edits without re-sealing: each one is damage and must be rejected, not accepted."""
    raw = (step_copy / native.MANIFEST).read_bytes()
    mutated = mutate_bytes(raw, data)
    if mutated == raw:
        COUNTS["manifest (bytes): edit left the bytes unchanged"] += 1
        return
    with replaced(step_copy / native.MANIFEST, mutated):
        outcome("manifest (bytes)", lambda: native.read_manifest(step_copy), must_reject=True)
        outcome("open_native (bytes)", lambda: _open(step_copy), must_reject=True)


# --- safetensors headers ----------------------------------------------------------------------


def _header_checks(path: Path) -> None:
    header = read_header(path)
    stored_checksums(header)
    tensors_in_range(header, 0, header.file_size)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header_structure(step_copy, data):
    """A real header's JSON edited, re-framed with a correct length, over the real data."""
    path = step_copy / "rank-00001.safetensors"
    raw = path.read_bytes()
    header = read_header(path)
    doc = json.loads(raw[8 : header.data_start])
    mutated = json.dumps(mutate_json(doc, data)).encode()
    mutated += b" " * (-len(mutated) % 8)
    framed = struct.pack("<Q", len(mutated)) + mutated + raw[header.data_start :]
    with replaced(path, framed):
        outcome("safetensors header (structure)", lambda: _header_checks(path))
        outcome("open_native over a fuzzed header", lambda: _open(step_copy))


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_bytes(step_copy, data):
    path = step_copy / "extra-rank-00000.safetensors"
    raw = path.read_bytes()
    with replaced(path, mutate_bytes(raw, data)):
        outcome("safetensors file (bytes)", lambda: _header_checks(path))


# --- verl .pt files ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl_copy(tmp_path_factory) -> Path:
    from torch.distributed.tensor import DTensor  # noqa: F401  (DTensor pickles are realistic)

    directory = tmp_path_factory.mktemp("fuzz-verl") / "actor"
    directory.mkdir()
    from .forkserver import build_model

    state = {k: v.detach().clone() for k, v in build_model().state_dict().items()}
    state["0.weight.view"] = state["0.weight"][:, 3:9]  # a strided view of shared storage
    torch.save(state, directory / "model_world_size_1_rank_0.pt")
    (directory / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 1}')
    return directory


@FUZZ
@given(data=st.data())
def test_fuzz_verl_pt(verl_copy, data):
    path = verl_copy / "model_world_size_1_rank_0.pt"
    raw = path.read_bytes()
    with replaced(path, mutate_bytes(raw, data)):
        outcome("verl .pt load_layout", lambda: load_layout(str(path)))
        outcome("open_verl", lambda: verl.open_verl(verl_copy))


# --- DCP metadata -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_copy(tmp_path_factory) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    from .forkserver import build_model

    directory = tmp_path_factory.mktemp("fuzz-dcp") / "dcp"
    state = {k: v.detach().clone() for k, v in build_model().state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": state}, checkpoint_id=str(directory))
    return directory


@FUZZ
@given(data=st.data())
def test_fuzz_dcp_metadata(dcp_copy, data):
    path = dcp_copy / ".metadata"
    raw = path.read_bytes()
    with replaced(path, mutate_bytes(raw, data)):
        outcome("DCP load_metadata", lambda: dcp_format.load_metadata(path))
        outcome("open_dcp (metadata)", lambda: dcp_format.open_dcp(dcp_copy))


@FUZZ
@given(data=st.data())
def test_fuzz_dcp_data_file(dcp_copy, data):
    path = next(dcp_copy.glob("*.distcp"))
    raw = path.read_bytes()
    with replaced(path, mutate_bytes(raw, data)):
        outcome("open_dcp (data file)", lambda: dcp_format.open_dcp(dcp_copy))


def _opcode_positions(raw: bytes) -> list[tuple[str, int]]:
    import pickletools

    return [(op.name, pos) for op, _, pos in pickletools.genops(raw)]


@FUZZ
@given(data=st.data())
def test_fuzz_dcp_metadata_lengths(dcp_copy, data):
    """Overwrite the argument of a real opcode (a length, a frame size, a memo index) with an
    extreme value: the reader must refuse it without allocating what it declares."""
    path = dcp_copy / ".metadata"
    raw = path.read_bytes()
    name, pos = data.draw(st.sampled_from(_opcode_positions(raw)), "opcode")
    width = data.draw(st.sampled_from([1, 2, 4, 8]), "width")
    value = data.draw(
        st.one_of(
            st.integers(0, 2 ** (8 * width) - 1),
            st.sampled_from([2 ** (8 * width) - 1, 2 ** (8 * width - 1), 2 ** (8 * width - 1) - 1]),
        ),
        "value",
    )
    opcode = data.draw(
        st.sampled_from(
            [None, b"\x8e", b"\x8d", b"\x96", b"\x8b", b"X", b"B", b"T", b"\x95", b"r"]
        ),
        "replace the opcode with",
    )
    head = raw[:pos] + (opcode if opcode is not None else raw[pos : pos + 1])
    mutated = head + value.to_bytes(width, "little") + raw[pos + 1 + width :]
    with replaced(path, mutated):
        outcome("DCP load_metadata (opcode arguments)", lambda: dcp_format.load_metadata(path))
        outcome("open_dcp (opcode arguments)", lambda: dcp_format.open_dcp(dcp_copy))


GIANT_DECLARATIONS = {
    # opcode: (its name, bytes in its length field, a giant length)
    b"\x95": ("FRAME", 8, 2**63 + 2**62),
    b"\x8e": ("BINBYTES8", 8, 2**62),
    b"\x8d": ("BINUNICODE8", 8, 2**62),
    b"\x96": ("BYTEARRAY8", 8, 2**40),
    b"\x8b": ("LONG4", 4, 2**31 - 1),
    b"X": ("BINUNICODE", 4, 2**32 - 1),
    b"B": ("BINBYTES", 4, 2**32 - 1),
    b"r": ("LONG_BINPUT", 4, 2**31),  # a memo index sizes the memo table
}


@pytest.mark.parametrize(
    "opcode", list(GIANT_DECLARATIONS), ids=lambda op: GIANT_DECLARATIONS[op][0]
)
def test_dcp_metadata_giant_declared_length(dcp_copy, opcode):
    """Regression (found by ``make soak``): one opcode of a real ``.metadata`` declaring a giant
    length made the unpickler allocate it (MemoryError) or overflow; now it is refused at once,
    with the file named, before anything is allocated."""
    import time

    from shardstream.errors import UnsafeCheckpointError

    path = dcp_copy / ".metadata"
    raw = path.read_bytes()
    assert raw[0] == 0x80 and raw[2:3] == b"\x95", "expected a protocol 4+ pickle in frames"
    name, width, giant = GIANT_DECLARATIONS[opcode]
    length = giant.to_bytes(width, "little")
    if name == "FRAME":  # the first frame's own length
        damaged = raw[:3] + length + raw[11:]
    else:  # inserted first thing in the frame; LONG_BINPUT memoizes a None pushed before it
        damaged = raw[:11] + (b"N" if name == "LONG_BINPUT" else b"") + opcode + length + raw[11:]
    with replaced(path, damaged):
        for call in (lambda: dcp_format.load_metadata(path), lambda: dcp_format.open_dcp(dcp_copy)):
            started = time.monotonic()
            with memory_limit() as allocated, pytest.raises(UnsafeCheckpointError) as info:
                call()
            peak = allocated()
            assert str(info.value).startswith(str(path)), info.value
            assert str(giant) in str(info.value), info.value
            assert not any(isinstance(e, (MemoryError, OverflowError)) for e in _chain(info.value))
            assert peak < 32 * 2**20, f"{name}: allocated {peak >> 20} MiB before refusing"
            # Refused before the work, not after it: far below what reading `giant` would take,
            # with room for a loaded machine.
            assert time.monotonic() - started < 30, f"{name}: took {time.monotonic() - started} s"
    COUNTS["DCP giant declared lengths: rejected with a ShardstreamError"] += 2
