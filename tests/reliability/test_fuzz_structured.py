"""Structure-aware fuzzing through every entry point: ``inspect``, ``verify``, ``merge``,
``test`` and ``load`` (restore).

Where ``test_fuzz.py`` edits bytes and calls the readers in-process, these cases build inputs
that parse: pickles assembled from opcodes (shared references through the memo, ``BUILD`` and
``SETITEMS`` on objects that are not dicts, deep nesting, big memos, ``GLOBAL``s of torch's,
DCP's and dangerous callables, tensors rebuilt over real storages with fuzzed offsets, sizes and
strides, persistent ids) placed into verl ``.pt`` zips and DCP ``.metadata``; and JSON with a
wrong value in any field (non-objects, NaN, Infinity, huge integers, deep nesting, strings,
lists and objects where numbers belong) in ``manifest.json`` (re-sealed, so its checksum
passes), ``config.json``, ``model.safetensors.index.json``, verl's ``fsdp_config.json`` and
safetensors headers (re-framed with a correct length).

Each entry point runs in a process forked from the warm fork server with its address space
capped (``EXTRA_ADDRESS_SPACE`` beyond the imports) and a generous wall-clock guard. Acceptable:
exit 0, or exit 1 with one line ``shardstream <cmd>: error: ...`` (``verify`` and ``test`` may
instead list the problems they found, one a line). Never a traceback, a signal, a hang. A case
that breaks this is counted as a violation with the input described, and fails its test after
the other examples ran (no shrinking: the description names the field and value).

``make test`` runs 10 derandomized examples per test; ``make soak`` 100, with fresh seeds.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import struct
import sys
import uuid
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from shardstream.engine.checksum import digest
from shardstream.formats import native

from .harness import SOAK, kill, record, trials, violation
from .test_hostile_pickles import _doubling, _get, _global, _put, _str

GUARD_S = 120  # per entry point; a hang is a bug, a slow machine is not
EXTRA_ADDRESS_SPACE = 2 << 30  # beyond what the fork server's imports map
COUNTS: Counter = Counter()

FUZZ = settings(
    max_examples=trials(10, 100),
    deadline=None,
    derandomize=not SOAK,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

VERL_MODEL = "model_world_size_1_rank_0.pt"
TORCH_CONFIG = {"architectures": ["TinyMLP"], "model_type": "tiny-mlp", "torch_dtype": "float32"}


# --- the clean inputs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(saved_run, forkserver, tmp_path_factory) -> dict[str, Path]:
    """One clean checkpoint of each format, and reference HF models for ``test``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from shardstream.commands.merge import merge

    from .forkserver import build_model

    base = tmp_path_factory.mktemp("fuzz-structured")
    state = {k: v.detach().clone() for k, v in build_model().state_dict().items()}
    verl_dir = base / "verl" / "actor"
    verl_dir.mkdir(parents=True)
    torch.save(state, verl_dir / VERL_MODEL)
    (verl_dir / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 1}')
    (verl_dir / "huggingface").mkdir()
    (verl_dir / "huggingface" / "config.json").write_text(json.dumps(TORCH_CONFIG))
    dcp_dir = base / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(dcp_dir))
    (base / "config").mkdir()
    (base / "config" / "config.json").write_text(json.dumps(TORCH_CONFIG))
    merge(verl_dir, base / "verl-hf", hf_model_path=base / "config")
    merge(dcp_dir, base / "dcp-hf", hf_model_path=base / "config")
    return {
        "native": saved_run.step,
        "native-ref": saved_run.hf,
        "hf": saved_run.hf,
        "hf_sharded": saved_run.hf_sharded,
        "verl": verl_dir,
        "verl-ref": base / "verl-hf",
        "dcp": dcp_dir,
        "dcp-ref": base / "dcp-hf",
        "config": base / "config",
        "scratch": base,
    }


def _entry_points(kind: str, path: Path, corpus: dict, out: Path) -> dict[str, dict]:
    """What a user can run on ``path``, a checkpoint of ``kind`` (or an HF model)."""
    if kind == "hf":  # an HF model is read by inspect and verify, and as test's reference
        native_dir = str(corpus["native"])
        return {
            "inspect": {"argv": ["inspect", str(path)]},
            "verify": {"argv": ["verify", "--quiet", str(path)]},
            "test": {
                "argv": ["test", "--local_dir", native_dir, "--test_hf_dir", str(path)]
                + ["--quiet"]
            },  # fmt: skip
            "merge": {
                "argv": ["merge", "--local_dir", native_dir, "--target_dir", str(out)]
                + ["--hf_model_path", str(path), "--quiet"]
            },  # fmt: skip
        }
    ref = str(corpus[f"{kind}-ref"])
    merge = ["merge", "--local_dir", str(path), "--target_dir", str(out), "--quiet"]
    if kind != "native":
        merge += ["--hf_model_path", str(corpus["config"])]
    return {
        "inspect": {"argv": ["inspect", str(path)]},
        "verify": {"argv": ["verify", "--quiet", str(path)]},
        "merge": {"argv": merge},
        "test": {"argv": ["test", "--local_dir", str(path), "--test_hf_dir", ref, "--quiet"]},
        "load": {"load": str(path), "optimizer": kind == "native"},
    }


def _clone(source: Path, scratch: Path) -> Path:
    target = scratch / f"case-{uuid.uuid4().hex[:8]}" / source.name
    shutil.copytree(source, target, symlinks=True)
    return target


def _judge(command: str, code: int | None, output: str) -> str | None:
    """What is wrong with this outcome, or None (success, or a clean refusal)."""
    lines = [line for line in output.splitlines() if line.strip()]
    if code is None or code < 0:
        return f"ended by signal {-code if code else '?'}"
    if "Traceback (most recent call last)" in output:
        return "traceback"
    if code == 0:
        return None
    if code not in (1, 2):
        return f"exit code {code}"
    errors = [line for line in lines if line.startswith(f"shardstream {command}: error: ")]
    if errors:
        return None if len(lines) == 1 else f"{len(lines)} lines of output with the error"
    if command in ("verify", "test") and code == 1 and lines:
        return None  # the problems found, one a line
    return "failed without a one-line error"


def run_entry_points(forkserver, kind: str, path: Path, corpus: dict, described: str) -> None:
    """Every entry point on ``path`` at once, each in its own guarded process; judge each."""
    out = path.parent / "merged"
    jobs = _entry_points(kind, path, corpus, out)
    pids = {}
    for command, spec in jobs.items():
        (pid,) = forkserver.spawn("guarded", {**spec, "extra": EXTRA_ADDRESS_SPACE})
        pids[pid] = command
    exited, running = forkserver.wait(list(pids), GUARD_S)
    if running:
        kill(running)
        forkserver.wait(running, 30)
    for pid, command in pids.items():
        logs = [log for log in [forkserver.log_path(pid)] if log.exists()]
        output = logs[0].read_text(errors="replace") if logs else ""
        for log in logs:
            log.unlink()
        if pid in running:
            problem = f"no result within {GUARD_S} s (a hang)"
        else:
            problem = _judge(command, exited.get(pid), output)
        target = f"{described.split(':', 1)[0]} via {command}"
        if problem is None:
            result = "accepted" if exited[pid] == 0 else "rejected with a ShardstreamError"
            COUNTS[f"{target}: {result}"] += 1
            continue
        COUNTS[f"{target}: VIOLATION"] += 1
        tail = "\n".join(output.strip().splitlines()[-6:])
        violation(f"{command} on {described}: {problem}\n{tail}")
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def figures():
    COUNTS.clear()
    yield
    by_target: dict[str, dict[str, int]] = {}
    for key, n in COUNTS.items():
        target, _, result = key.rpartition(": ")
        by_target.setdefault(target, {})[result] = n
    record(
        "fuzz: structured inputs through every entry point",
        examples=sum(COUNTS.values()),
        max_examples_per_test=FUZZ.max_examples,
        targets=by_target,
    )


def test_clean_corpus_passes_every_entry_point(forkserver, corpus):
    """The unfuzzed inputs: every entry point succeeds (so a refusal below is the fuzz's)."""
    for kind in ("native", "verl", "dcp", "hf", "hf_sharded"):
        path = _clone(corpus[kind], corpus["scratch"])
        out = path.parent / "merged"
        for command, spec in _entry_points(kind.split("_")[0], path, corpus, out).items():
            codes = forkserver.run("guarded", {**spec, "extra": EXTRA_ADDRESS_SPACE})
            assert codes == [0], f"{command} on clean {kind}: {forkserver.logs()}"
        shutil.rmtree(path.parent)


# --- pickles from opcodes -------------------------------------------------------------------

GLOBALS = [
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "FloatStorage"),
    ("torch", "BFloat16Storage"),
    ("torch", "float32"),
    ("torch", "Size"),
    ("torch", "strided"),
    ("torch", "Tensor"),
    ("torch.serialization", "_get_layout"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._api", "DTensor"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor.placement_types", "Shard"),
    ("torch.distributed.tensor.placement_types", "Replicate"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("builtins", "exec"),
    ("builtins", "eval"),
    ("builtins", "getattr"),
    ("builtins", "set"),
    ("os", "system"),
    ("subprocess", "Popen"),
    ("nonexistent.module", "thing"),
]
WORDS = [
    "0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "model", "state_dict_metadata",
    "planner_data", "storage_data", "storage_meta", "version", "properties", "size", "chunks",
    "offsets", "sizes", "dtype", "relative_path", "offset", "length", "fqn", "index",
    "__0_0.distcp", "storage", "cpu", "0", "1", "data/0", "_metadata", "items", "update",
    "../../etc/passwd", "", "\x00", "é" * 3,
]  # fmt: skip
INTS = [0, 1, 2, 3, -1, 24, 40, 960, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63), 2**100]


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _float(value: float) -> bytes:
    return b"G" + struct.pack(">d", value)


def _int_tuple(values) -> bytes:
    return b"(" + b"".join(_int(v) for v in values) + b"t"


@st.composite
def pickled_object(draw, depth: int = 0) -> bytes:
    """Opcodes that push exactly one object (if they run at all)."""
    leaf = st.one_of(
        st.just(b"N"),
        st.sampled_from([b"\x88", b"\x89"]),
        st.sampled_from(INTS).map(_int),
        st.integers(-(2**70), 2**70).map(_int),
        st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1e308]).map(_float),
        st.sampled_from(WORDS).map(_str),
        st.binary(max_size=16).map(lambda b: b"C" + bytes([len(b)]) + b),
        st.sampled_from(GLOBALS).map(lambda g: _global(*g)),
        st.integers(0, 6).map(_get),  # a shared reference (or one that is not there)
    )
    if depth >= 4 or draw(st.integers(0, 3)) == 0:
        return draw(leaf)
    kind = draw(
        st.sampled_from(
            ["list", "tuple", "dict", "set", "reduce", "newobj", "build", "setitems", "appends",
             "put", "persid", "tensor", "deep", "doubling", "big memo"]
        )
    )  # fmt: skip
    child = pickled_object(depth + 1)
    items = st.lists(child, max_size=3)
    if kind == "list":
        return b"(" + b"".join(draw(items)) + b"l"
    if kind == "tuple":
        return b"(" + b"".join(draw(items)) + b"t"
    if kind == "dict":
        pairs = draw(st.lists(st.tuples(child, child), max_size=3))
        return b"}(" + b"".join(k + v for k, v in pairs) + b"u"
    if kind == "set":
        return b"\x8f(" + b"".join(draw(items)) + b"\x90"
    if kind in ("reduce", "newobj"):
        callee = _global(*draw(st.sampled_from(GLOBALS)))
        args = b"(" + b"".join(draw(items)) + b"t"
        return callee + args + (b"R" if kind == "reduce" else b"\x81")
    if kind == "build":  # BUILD on whatever the first object is, with whatever state
        return draw(child) + draw(child) + b"b"
    if kind == "setitems":  # SETITEMS on whatever it is (a list, a global, an int...)
        pairs = draw(st.lists(st.tuples(child, child), min_size=1, max_size=2))
        return draw(child) + b"(" + b"".join(k + v for k, v in pairs) + b"u"
    if kind == "appends":
        return draw(child) + b"(" + b"".join(draw(items)) + b"e"
    if kind == "put":
        index = draw(st.sampled_from([0, 1, 2, 3, 2**31 - 1, 2**32 - 1]))
        return draw(child) + _put(index)
    if kind == "persid":
        return draw(child) + b"Q"
    if kind == "tensor":  # torch's own rebuild over a storage of the archive, fuzzed arguments
        key = draw(st.sampled_from(["0", "1", "2", "9", "../0"]))
        dims = draw(st.lists(st.sampled_from(INTS[:8]), min_size=0, max_size=3))
        strides = draw(st.lists(st.sampled_from(INTS[:8]), min_size=0, max_size=3))
        numel = draw(st.sampled_from([0, 1, 24, 960, 2**40]))
        storage = (
            b"(" + _str("storage") + _global("torch", "FloatStorage") + _str(key) + _str("cpu")
            + _int(numel) + b"tQ"
        )  # fmt: skip
        offset = draw(st.sampled_from([0, 1, 959, 2**40, -1]))
        return (
            _global("torch._utils", "_rebuild_tensor_v2")
            + b"(" + storage + _int(offset) + _int_tuple(dims) + _int_tuple(strides)
            + b"\x89" + _global("collections", "OrderedDict") + b")R" + b"tR"
        )  # fmt: skip
    if kind == "deep":
        n = draw(st.sampled_from([100, 1000, 20_000, 200_000]))
        return b"(" * n + b"N" + b"l" * n if draw(st.booleans()) else b")" + b"\x85" * n
    if kind == "doubling":
        return _doubling(draw(st.sampled_from([8, 20, 40])), draw(st.sampled_from([b"]", b")"])))
    # a big memo: many memoized strings, then a list of references to them
    n = draw(st.sampled_from([1000, 100_000]))
    body = b"".join(_str(f"k{i}") + _put(100 + i) + b"0" for i in range(n))  # put, then POP
    return body + b"(" + b"".join(_get(100 + i) for i in range(0, n, max(1, n // 50))) + b"l"


# The test model's tensors as torch.save wrote them: name, storage key, numel, shape, stride.
REAL_TENSORS = [
    ("0.weight", "0", 960, (40, 24), (24, 1)),
    ("0.bias", "1", 40, (40,), (1,)),
    ("2.weight", "2", 1600, (40, 40), (40, 1)),
    ("2.bias", "3", 40, (40,), (1,)),
    ("4.weight", "4", 480, (12, 40), (40, 1)),
]


def _maybe(draw, real, wrong):
    """The real value three times in four, else a wrong one."""
    return real if draw(st.integers(0, 3)) else draw(wrong)


def _tensor(draw, key: str, numel: int, shape: tuple, stride: tuple) -> bytes:
    """torch's ``_rebuild_tensor_v2`` over a storage of the archive, arguments perhaps fuzzed."""
    shapes = st.lists(st.sampled_from(INTS[:8] + [2**62]), max_size=3).map(tuple)
    key = _maybe(draw, key, st.sampled_from(["0", "4", "9", "-1", "../0", ""]))
    numel = _maybe(draw, numel, st.sampled_from([0, 1, 959, 961, 2**40, -1]))
    storage_type = _maybe(
        draw, ("torch", "FloatStorage"),
        st.sampled_from([("torch", "BFloat16Storage"), ("torch", "LongStorage"),
                         ("torch", "Tensor"), ("builtins", "exec")]),
    )  # fmt: skip
    offset = _maybe(draw, 0, st.sampled_from([1, 959, 960, 2**40, -1]))
    shape = _maybe(draw, shape, shapes)
    stride = _maybe(draw, stride, shapes)
    storage = (
        b"(" + _str("storage") + _global(*storage_type) + _str(key) + _str("cpu") + _int(numel)
        + b"tQ"
    )  # fmt: skip
    return (
        _global("torch._utils", "_rebuild_tensor_v2")
        + b"(" + storage + _int(offset) + _int_tuple(shape) + _int_tuple(stride)
        + b"\x89" + _global("collections", "OrderedDict") + b")R" + b"tR"
    )  # fmt: skip


def _state_dict_pickle(draw) -> bytes:
    """torch.save's state dict of the test model with its tensors' arguments fuzzed, entries
    dropped, shared (a memo reference to an earlier tensor) or added; or any one object."""
    if draw(st.integers(0, 3)) == 0:
        return b"\x80\x02" + draw(pickled_object()) + b"."
    body = b""
    for i, (name, key, numel, shape, stride) in enumerate(REAL_TENSORS):
        choice = draw(st.sampled_from(["tensor"] * 6 + ["drop", "shared", "object"]))
        if choice == "drop":
            continue
        if choice == "shared" and i:
            value = _get(10 + draw(st.integers(0, i - 1)))
        elif choice == "object":
            value = draw(pickled_object())
        else:
            value = _tensor(draw, key, numel, shape, stride)
        body += _str(name) + value + _put(10 + i)
    if draw(st.booleans()):
        body += draw(st.sampled_from(WORDS).map(_str)) + draw(pickled_object())
    return b"\x80\x02}(" + body + b"u."


def _with_data_pkl(archive: bytes, pickled: bytes) -> bytes:
    """A torch archive with its ``data.pkl`` replaced (its storages kept)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = pickled if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info, data)
    return out.getvalue()


def _describe(raw: bytes) -> str:
    return raw[:300].hex() + ("..." if len(raw) > 300 else "") + f" ({len(raw)} bytes)"


@FUZZ
@given(data=st.data())
def test_fuzz_verl_pickles_through_every_entry_point(forkserver, corpus, data):
    pickled = _state_dict_pickle(data.draw)
    actor = _clone(corpus["verl"], corpus["scratch"])
    model = actor / VERL_MODEL
    model.write_bytes(_with_data_pkl(model.read_bytes(), pickled))
    described = f"verl .pt pickle: data.pkl {_describe(pickled)}"
    run_entry_points(forkserver, "verl", actor, corpus, described)


@st.composite
def dcp_metadata(draw) -> bytes:
    """A ``Metadata`` as DCP pickles it (NEWOBJ, then BUILD with its fields), fields fuzzed; or
    one of its fields' real shape (a dict of TensorStorageMetadata) with fuzzed members."""
    meta = _global("torch.distributed.checkpoint.metadata", "Metadata")
    fields = ["state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"]
    chosen = draw(st.lists(st.sampled_from(fields), unique=True, max_size=5))
    tsm = (
        _global("torch.distributed.checkpoint.metadata", "TensorStorageMetadata") + b")\x81"
        + b"}(" + _str("properties") + draw(pickled_object(2)) + _str("size")
        + _global("torch", "Size") + b"(" + draw(st.sampled_from(
            [_int_tuple([40, 24]), _int_tuple([2**63]), _int_tuple([-1]), b"N"])) + b"tR"
        + _str("chunks") + b"(" + draw(pickled_object(2)) + b"lub"
    )  # fmt: skip
    state = b"}("
    for name in chosen:
        value = draw(pickled_object(1))
        if name == "state_dict_metadata" and draw(st.booleans()):
            value = b"}(" + _str(draw(st.sampled_from(WORDS[:5]))) + tsm + b"u"
        state += _str(name) + value
    state += b"u"
    build = draw(st.sampled_from([b")\x81", b")R", b"N"]))
    head = meta + build if build != b"N" else draw(pickled_object(1))
    return b"\x80\x02" + head + state + b"b."


def _slots(obj, path: tuple = (), depth: int = 0) -> list[tuple]:
    """Every attribute of a dataclass, item of a dict or list below ``obj``: (holder, key,
    path)."""
    import dataclasses

    out = []
    if depth > 8:
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        children = list(obj.items())
    elif isinstance(obj, list):
        children = list(enumerate(obj))
    else:
        return out
    for key, value in children:
        where = path + (str(key)[:60],)
        out.append((obj, key, where))
        out += _slots(value, where, depth + 1)
    return out


def _set(holder, key, value) -> None:
    if isinstance(holder, (dict, list)):
        holder[key] = value
    else:
        object.__setattr__(holder, key, value)  # DCP's dataclasses may be frozen


def _wrong_metadata_value(draw, current):
    """A value of the wrong kind, or of the right kind and absurd (a size of 2**62, an offset
    past the file, a path out of the checkpoint, another dtype)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if isinstance(current, tuple) and current and all(type(v) is int for v in current):
        i = draw(st.integers(0, len(current) - 1))
        changed = list(current)
        changed[i] = draw(st.sampled_from([-1, 0, 2**31, 2**62, 2**63 - 1, current[i] + 1]))
        if draw(st.booleans()):
            return type(current)(changed) if isinstance(current, torch.Size) else tuple(changed)
    return draw(
        st.sampled_from(
            [None, -1, 0, 2**62, 2**64, 1.5, math.nan, "", "../../etc/passwd", "__0_0.distcp",
             [], {}, (), torch.Size([2**40, 2**40]), torch.Size([]), torch.float64, torch.int8,
             torch.bool, BytesStorageMetadata(), current, [current, current]]
        )
    )  # fmt: skip


def mutate_metadata(meta, data) -> str:
    """One to three fields of a real ``Metadata`` replaced, deleted or duplicated."""
    described = []
    for _ in range(data.draw(st.integers(1, 3), "edits")):
        slots = _slots(meta)
        holder, key, where = data.draw(st.sampled_from(slots), "field")
        current = holder[key] if isinstance(holder, (dict, list)) else getattr(holder, key)
        op = data.draw(st.sampled_from(["replace"] * 4 + ["delete"]), "op")
        if op == "delete" and isinstance(holder, (dict, list)):
            del holder[key]
            described.append(f"{'/'.join(where)} deleted")
            continue
        value = _wrong_metadata_value(data.draw, current)
        _set(holder, key, value)
        described.append(f"{'/'.join(where)} = {repr(value)[:60]}")
    return "; ".join(described)


@FUZZ
@given(data=st.data())
def test_fuzz_dcp_metadata_pickles_through_every_entry_point(forkserver, corpus, data):
    """Half the examples: a real ``.metadata`` (the test's own DCP save, read back) with
    fields made wrong, pickled as DCP pickles it; half: opcode-built ``Metadata``."""
    import pickle

    ckpt = _clone(corpus["dcp"], corpus["scratch"])
    if data.draw(st.booleans(), "from the real metadata"):
        meta = pickle.loads((corpus["dcp"] / ".metadata").read_bytes())  # our own file
        described = mutate_metadata(meta, data)
        try:
            pickled = pickle.dumps(meta)
        except Exception:  # noqa: BLE001  (DCP's classes cannot pickle it: no file to try)
            reject()
    else:
        pickled = data.draw(dcp_metadata())
        described = _describe(pickled)
    (ckpt / ".metadata").write_bytes(pickled)
    run_entry_points(forkserver, "dcp", ckpt, corpus, f"DCP .metadata: {described}")


# --- JSON with a wrong value in some field ----------------------------------------------------

_RAW = "\x00raw{}\x00"  # stands for JSON text json.dumps cannot write (placed after dumping)
WRONG_VALUES = st.one_of(
    st.sampled_from(
        [None, True, False, 0, -1, 1.5, 2**63, -(2**63) - 1, 10**400, math.nan, math.inf,
         -math.inf, "", "x", "../../etc/passwd", "F32", "\x00", [], {}, [1, 2], {"a": 1},
         [[0, 1], [2]], "0" * 1000]
    ),
    st.sampled_from(["[" * 100_000 + "]" * 100_000, "9" * 5000, "-" + "9" * 5000, "1e999999",
                     '"\\ud800"']).map(lambda raw: ("RAW", raw)),
    st.integers(),
    st.text(max_size=8),
)  # fmt: skip


def _paths(doc, prefix=()) -> list[tuple]:
    """Every place in ``doc`` (the document itself first), as key/index paths."""
    out = [prefix]
    if isinstance(doc, dict):
        for key in sorted(doc):
            out += _paths(doc[key], prefix + (key,))
    elif isinstance(doc, list):
        for i, item in enumerate(doc):
            out += _paths(item, prefix + (i,))
    return out


def mutate_field(doc, data) -> tuple[object, list[str], str]:
    """Replace one field of ``doc`` (or the whole document, or a key's presence) with a wrong
    value; returns the document, raw JSON texts to splice in, and a description."""
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths), "field")
    op = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]), "op")
    value = data.draw(WRONG_VALUES, "value")
    raws: list[str] = []
    if isinstance(value, tuple) and value and value[0] == "RAW":
        raws.append(value[1])
        value = _RAW.format(0)
    shown = (raws[0][:40] + "...") if raws else repr(value)[:80]
    if not path:  # the document itself
        return value, raws, f"the whole document -> {shown}"
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if op == "delete" and isinstance(parent, dict):
        del parent[key]
        return doc, [], f"{'/'.join(map(str, path))} deleted"
    if op == "add" and isinstance(parent, dict):
        parent[f"{key}-extra"] = value
        return doc, raws, f"{'/'.join(map(str, path))}-extra added = {shown}"
    parent[key] = value
    return doc, raws, f"{'/'.join(map(str, path))} = {shown}"


def _dumps(doc, raws: list[str], **kwargs) -> bytes:
    text = json.dumps(doc, **kwargs)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(_RAW.format(i)), raw)
    return text.encode()


@pytest.fixture(autouse=True)
def unlimited_int_text():
    """10**400 and longer are written here; the readers (other processes) keep the limit."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(before)


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_fields_through_every_entry_point(forkserver, corpus, data):
    """A wrong value in any field of manifest.json, re-sealed with a valid checksum."""
    step = _clone(corpus["native"], corpus["scratch"])
    doc = json.loads((step / native.MANIFEST).read_bytes())
    doc.pop("checksum")
    mutated, raws, described = mutate_field(doc, data)
    if isinstance(mutated, dict) and not raws:
        body = native.canonical({**mutated, "checksum": digest(native.canonical(mutated))})
    else:  # not an object, or text the reader cannot parse back: no checksum to compute
        body = _dumps(mutated, raws, sort_keys=True, separators=(",", ":"))
    (step / native.MANIFEST).write_bytes(body)
    run_entry_points(forkserver, "native", step, corpus, f"manifest.json: {described}")


@pytest.mark.parametrize(
    "where, value",
    [(("objects", "optimizer"), 0), (("objects", "optimizer", "scalars"), [1]), (("objects",), [])],
    ids=["optimizer-int", "scalars-list", "objects-list"],
)
def test_manifest_optimizer_objects_of_another_type(forkserver, corpus, where, value):
    """Found by make soak: restore read the optimizer's scalar names before the optimizer
    entry was checked (AttributeError on an int). Every entry point says what is wrong."""
    step = _clone(corpus["native"], corpus["scratch"])
    doc = json.loads((step / native.MANIFEST).read_bytes())
    doc.pop("checksum")
    parent = doc
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    body = native.canonical({**doc, "checksum": digest(native.canonical(doc))})
    (step / native.MANIFEST).write_bytes(body)
    run_entry_points(forkserver, "native", step, corpus, f"manifest.json: {'/'.join(where)}")


def _reframe(path: Path, data) -> str:
    """A safetensors header with one field wrong, framed with its correct length."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8 : 8 + length])
    mutated, raws, described = mutate_field(doc, data)
    header = _dumps(mutated, raws)
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])
    return described


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_headers_through_every_entry_point(forkserver, corpus, data):
    """A field of a rank file's header (a saved step) or of a merged model's header."""
    if data.draw(st.booleans(), "in a merged model"):
        model = _clone(corpus["hf"], corpus["scratch"])
        described = _reframe(model / "model.safetensors", data)
        run_entry_points(forkserver, "hf", model, corpus, f"HF safetensors header: {described}")
    else:
        step = _clone(corpus["native"], corpus["scratch"])
        name = data.draw(st.sampled_from(["rank-00000.safetensors", "rank-00001.safetensors"]))
        described = _reframe(step / name, data)
        run_entry_points(forkserver, "native", step, corpus, f"{name} header: {described}")


JSON_FILES = [
    ("hf", "config.json"),
    ("hf_sharded", "model.safetensors.index.json"),
    ("verl", "fsdp_config.json"),
    ("verl", "huggingface/config.json"),
]


@FUZZ
@given(data=st.data())
def test_fuzz_json_files_through_every_entry_point(forkserver, corpus, data):
    """config.json, model.safetensors.index.json and verl's fsdp_config.json and config.json."""
    kind, name = data.draw(st.sampled_from(JSON_FILES), "file")
    directory = _clone(corpus[kind], corpus["scratch"])
    doc = json.loads((directory / name).read_text())
    mutated, raws, described = mutate_field(doc, data)
    (directory / name).write_bytes(_dumps(mutated, raws))
    run_entry_points(forkserver, kind.split("_")[0], directory, corpus, f"{name}: {described}")


def _first_weight(doc):
    return sorted(doc["weight_map"])[0]


REGRESSIONS = {
    # found by these fuzzers; each once ended in a traceback
    "index weight_map value a number (verify sorted the names)": (
        "hf_sharded", "model.safetensors.index.json",
        lambda doc: doc["weight_map"].__setitem__(_first_weight(doc), 2**63),
    ),
    "index weight_map value an object": (
        "hf_sharded", "model.safetensors.index.json",
        lambda doc: doc["weight_map"].__setitem__(_first_weight(doc), {"a": 1}),
    ),
    "manifest contents holding an object (load made a set of it)": (
        "native", native.MANIFEST, lambda doc: doc["contents"].append({"a": 1}),
    ),
    "manifest step a string": ("native", native.MANIFEST, lambda doc: doc.update(step="3")),
    "config.json architectures a number (inspect iterated it)": (
        "hf", "config.json", lambda doc: doc.update(architectures=-1),
    ),
    "index weight_map file name a lone surrogate (open() raised UnicodeEncodeError)": (
        "hf_sharded", "model.safetensors.index.json",
        lambda doc: doc["weight_map"].__setitem__(_first_weight(doc), "\ud800.safetensors"),
    ),
    "config.json architectures a lone surrogate (inspect's print raised UnicodeEncodeError)": (
        "hf", "config.json", lambda doc: doc.update(architectures=["\ud800"]),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_fuzz_regressions(forkserver, corpus, case):
    kind, name, edit = REGRESSIONS[case]
    directory = _clone(corpus[kind], corpus["scratch"])
    doc = json.loads((directory / name).read_text())
    doc.pop("checksum", None)
    edit(doc)
    if name == native.MANIFEST:
        body = native.canonical({**doc, "checksum": digest(native.canonical(doc))})
    else:
        body = json.dumps(doc).encode()
    (directory / name).write_bytes(body)
    run_entry_points(forkserver, kind.split("_")[0], directory, corpus, f"{name}: {case}")


DCP_REGRESSIONS = {
    # found by the DCP metadata fuzzer; each once ended in a traceback
    "a storage entry's transform_descriptors an int (list() of it in the error message)": (
        lambda meta: object.__setattr__(next(iter(meta.storage_data.values())),
                                        "transform_descriptors", 5)
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DCP_REGRESSIONS))
def test_fuzz_dcp_regressions(forkserver, corpus, case):
    import pickle

    ckpt = _clone(corpus["dcp"], corpus["scratch"])
    meta = pickle.loads((corpus["dcp"] / ".metadata").read_bytes())  # our own file
    DCP_REGRESSIONS[case](meta)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    run_entry_points(forkserver, "dcp", ckpt, corpus, f"DCP .metadata: {case}")
