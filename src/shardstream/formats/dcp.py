"""Source: PyTorch Distributed Checkpoint (DCP) directories (``.metadata`` + ``__R_i.distcp``).

Written by ``torch.distributed.checkpoint.save`` (FileSystemWriter), torchtitan and accelerate's
FSDP ``SHARDED_STATE_DICT``. ``.metadata`` is a pickle of DCP's ``Metadata``: for every key of the
(flattened) state dict, the global shape and dtype and the chunks (``offsets``, ``sizes``) it was
saved in, and for every chunk a ``_StorageInfo(relative_path, offset, length)``: the byte range
of a ``.distcp`` file that holds it.

Each tensor chunk's byte range is a complete ``torch.save`` zip archive of that one chunk tensor.
torch stores zip records uncompressed, so the chunk's elements sit verbatim inside the file. To
find them we read the archive's central directory (at the end of the range), then the local
header of the ``data/<key>`` record, whose data starts right after the header's name and extra
field; ``data.pkl`` (a few hundred bytes) gives the chunk's storage offset, shape and strides.
No tensor bytes are read here; the merge engine later reads exactly the ranges it needs.

Both pickles (``.metadata`` and each chunk's ``data.pkl``) are read by restricted unpicklers that
resolve only the handful of names DCP writes, each to an inert stand-in defined here: a hostile
checkpoint cannot run code.

Which keys are model weights: DCP flattens nested state dicts (``{"model": {...}}`` becomes
``model.<fqn>``) and records the original path of every key in ``planner_data``. When some key's
path starts with a ``model`` container (accelerate, older torchtitan, ``{"model": ..., "optim":
...}`` train states) the model is what lies under it, renamed to the inner key; everything else
(optimizer, lr scheduler, dataloader, train state) is skipped. Otherwise (a plain model state
dict, or torchtitan's train state whose model keys sit at the top level) the model is every
top-level key and anything nested under a container (``optimizer.*``, ``train_state.*``) is
skipped. Non-tensor entries (``BytesStorageMetadata``) are always skipped.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from ..dtypes import code_of, itemsize
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from ..plan import Block, GlobalTensor, check_blocks_tile

METADATA_FILE = ".metadata"
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
RANK_METADATA_FILE = re.compile(r"^__(\d+)\.metadata$")
MODEL_CONTAINER = "model"
# accelerate saves the model of a Trainer checkpoint in <checkpoint>/pytorch_model_fsdp_<i>/ and
# the config and tokenizer next to it.
ACCELERATE_MODEL_DIR = re.compile(r"^pytorch_model_fsdp_\d+$")
# Top-level keys that are training state, never model weights (used without planner_data).
NON_MODEL_PREFIXES = (
    "optim.",
    "optimizer.",
    "optimizers.",
    "lr_scheduler.",
    "lr_schedulers.",
    "scheduler.",
    "dataloader.",
    "train_state.",
    "rng_state.",
    "extra_state.",
)
SUPPORTED_DCP_MAJOR = "1"

# A chunk record's data.pkl and central directory are a few hundred bytes; refuse absurd sizes.
MAX_RECORD_PICKLE_BYTES = 1 << 20
MAX_RECORD_READ_BYTES = 16 << 20

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50


# --------------------------------------------------------------------------- the reader's result


@dataclass
class DcpCheckpoint:
    directory: Path
    world_size: int
    tensors: list[GlobalTensor]
    placements: dict[str, str]
    files: list[str]
    layout: str
    dcp_version: str | None
    skipped: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, list[Block]] = field(default_factory=dict)
    metadata: _Metadata | None = field(default=None, repr=False)  # the unpickled .metadata

    @property
    def format(self) -> str:
        return "dcp"

    @property
    def mesh(self) -> str:
        return f"not recorded by DCP ({self.world_size} rank(s) wrote files)"

    def config_dir(self) -> Path | None:
        """config.json's directory: the checkpoint itself, or the Trainer checkpoint around
        accelerate's ``pytorch_model_fsdp_N``; None when neither has one."""
        candidates = [self.directory]
        if ACCELERATE_MODEL_DIR.match(self.directory.name):
            candidates.append(self.directory.parent)
        for candidate in candidates:
            if (candidate / "config.json").is_file():
                return candidate
        return None


def is_dcp_checkpoint(directory: Path) -> bool:
    """A directory with DCP's ``.metadata`` or any ``__R_i.distcp`` data file."""
    if not directory.is_dir():
        return False
    if (directory / METADATA_FILE).is_file():
        return True
    return any(DATA_FILE.match(p.name) for p in directory.iterdir())


# --------------------------------------------------------------------------- restricted unpickling


class _Frozen(type):
    """Metaclass of the stand-ins: pickle's BUILD can fill instances, never change the classes."""

    def __setattr__(cls, name, value):
        raise UnsafeCheckpointError(f"refused to unpickle: it tries to modify {cls.__name__[1:]}")

    def __delattr__(cls, name):
        raise UnsafeCheckpointError(f"refused to unpickle: it tries to modify {cls.__name__[1:]}")


class _Record(metaclass=_Frozen):
    """Inert stand-in for one of DCP's metadata dataclasses: pickle's BUILD fills ``__dict__``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class _Metadata(_Record):
    state_dict_metadata = None
    planner_data = None
    storage_data = None
    storage_meta = None
    version = None


class _TensorStorageMetadata(_Record):
    properties = None
    size = None
    chunks = None


class _BytesStorageMetadata(_Record):
    pass


class _ChunkStorageMetadata(_Record):
    offsets = None
    sizes = None


class _TensorProperties(_Record):
    dtype = None

    def __setstate__(self, state) -> None:
        # DCP pickles (dtype, layout, requires_grad, memory_format, pin_memory).
        if isinstance(state, tuple) and state:
            self.__dict__["dtype"] = state[0]
        elif isinstance(state, dict):
            self.__dict__["dtype"] = state.get("dtype")
        else:
            raise CheckpointFormatError("TensorProperties with an unknown state layout")


class _MetadataIndex(_Record):
    fqn = None
    offset = None
    index = None


class _StorageMeta(_Record):
    pass


class _StorageInfo(_Record):
    relative_path = None
    offset = None
    length = None
    transform_descriptors = None


class _Call:
    """A callable the unpickler may hand out; it has no state that BUILD could change."""

    __slots__ = ("_fn",)

    def __init__(self, fn):
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args):
        return self._fn(*args)

    def __setattr__(self, name, value):
        raise UnsafeCheckpointError("refused to unpickle: it tries to modify a callable")

    def __reduce__(self):
        raise TypeError("not picklable")


def _size(dims=()) -> tuple[int, ...]:
    """``torch.Size(dims)`` as a plain tuple of ints."""
    dims = tuple(dims)
    if not all(type(d) is int for d in dims):
        raise CheckpointFormatError(f"torch.Size with non-integer entries {dims!r}")
    return dims


def _enum_value(value=0):
    return value


_LAYOUTS = {"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn"}


def _layout(name: str) -> str:
    if name not in _LAYOUTS:
        raise CheckpointFormatError(f"unknown tensor layout {name!r}")
    return name


def _path(*parts) -> str:
    return str(PurePosixPath(*(str(p) for p in parts)))


def _windows_path(*parts) -> str:
    return str(PureWindowsPath(*(str(p) for p in parts)))


_DCP_META = "torch.distributed.checkpoint.metadata"
_OLD_SHARD_META = "torch.distributed._shard.sharded_tensor.metadata"
_METADATA_GLOBALS: dict[tuple[str, str], object] = {
    (_DCP_META, "Metadata"): _Metadata,
    (_DCP_META, "TensorStorageMetadata"): _TensorStorageMetadata,
    (_DCP_META, "BytesStorageMetadata"): _BytesStorageMetadata,
    (_DCP_META, "ChunkStorageMetadata"): _ChunkStorageMetadata,
    (_DCP_META, "TensorProperties"): _TensorProperties,
    (_DCP_META, "MetadataIndex"): _MetadataIndex,
    (_DCP_META, "StorageMeta"): _StorageMeta,
    (_DCP_META, "_MEM_FORMAT_ENCODING"): _Call(_enum_value),
    # torch <= 2.1 kept TensorProperties with the sharded-tensor metadata.
    (_OLD_SHARD_META, "TensorProperties"): _TensorProperties,
    (_OLD_SHARD_META, "MEM_FORMAT_ENCODING"): _Call(_enum_value),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): _Call(_size),
    ("torch.serialization", "_get_layout"): _Call(_layout),
    ("collections", "OrderedDict"): OrderedDict,
    # StorageMeta.checkpoint_id is the save path.
    ("pathlib", "PosixPath"): _Call(_path),
    ("pathlib", "PurePosixPath"): _Call(_path),
    ("pathlib", "Path"): _Call(_path),
    ("pathlib", "WindowsPath"): _Call(_windows_path),
    ("pathlib", "PureWindowsPath"): _Call(_windows_path),
}


def _torch_dtype(module: str, name: str):
    """``torch.float32`` and friends: values, never callables."""
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    return None


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``allowed`` (to stand-ins) and torch dtypes."""

    allowed: dict[tuple[str, str], object] = {}

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        dtype = _torch_dtype(module, name)
        if dtype is not None:
            return dtype
        raise UnsafeCheckpointError(
            f"{self.path}: refused to unpickle: it asks for {module}.{name}, which a DCP "
            "checkpoint never needs (the file may be hostile)"
        )

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.path}: refused to unpickle: unexpected persistent id")


class _MetadataUnpickler(_SafeUnpickler):
    allowed = _METADATA_GLOBALS


# Pickle opcodes whose argument is a length followed by that many bytes: (size of the length
# field, signed). The C unpickler allocates the declared length before reading, so a flipped byte
# here is a memory bomb unless the length is checked against the bytes that are really there.
_COUNTED = {
    b"\x8a"[0]: (1, False),  # LONG1
    b"\x8b"[0]: (4, True),  # LONG4
    b"T"[0]: (4, True),  # BINSTRING
    b"U"[0]: (1, False),  # SHORT_BINSTRING
    b"B"[0]: (4, False),  # BINBYTES
    b"C"[0]: (1, False),  # SHORT_BINBYTES
    b"\x8e"[0]: (8, False),  # BINBYTES8
    b"\x96"[0]: (8, False),  # BYTEARRAY8
    b"\x8c"[0]: (1, False),  # SHORT_BINUNICODE
    b"X"[0]: (4, False),  # BINUNICODE
    b"\x8d"[0]: (8, False),  # BINUNICODE8
}
_FRAME = b"\x95"[0]
_STOP = b"."[0]
_LONG_BINPUT = b"r"[0]
_PUT = b"p"[0]
# Opcodes with a fixed-size argument (bytes), and those whose argument runs to a newline (lines).
_FIXED = {b"J"[0]: 4, b"K"[0]: 1, b"M"[0]: 2, b"G"[0]: 8, b"h"[0]: 1, b"j"[0]: 4, b"q"[0]: 1,
          b"r"[0]: 4, b"\x82"[0]: 1, b"\x83"[0]: 2, b"\x84"[0]: 4, b"\x80"[0]: 1}  # fmt: skip
_LINES = {b"I"[0]: 1, b"L"[0]: 1, b"S"[0]: 1, b"V"[0]: 1, b"F"[0]: 1, b"g"[0]: 1, b"p"[0]: 1,
          b"P"[0]: 1, b"c"[0]: 2, b"i"[0]: 2}  # fmt: skip
_NO_ARGUMENT = frozenset(
    b"\x97\x98N\x88\x89]ael)t\x85\x86\x87}dsu\x8f\x90\x9102(1\x94\x93RboQ\x81\x92"
)


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle's opcodes without running any, refusing what would make the unpickler
    allocate more than the input justifies: a declared length (bytes, string, long, frame) past
    the end of the data, or a memo index (which sizes the memo table) beyond the data's length.
    Raises UnsafeCheckpointError or CheckpointFormatError without the path (the caller adds it).
    """
    end = len(data)
    at = 0
    while at < end:
        op = data[at]
        start = at
        at += 1
        counted = _COUNTED.get(op)
        if counted is not None:
            width, signed = counted
            if at + width > end:
                raise CheckpointFormatError(f"pickle truncated at byte {start}")
            n = int.from_bytes(data[at : at + width], "little", signed=signed)
            at += width
            if n < 0 or n > end - at:
                raise UnsafeCheckpointError(
                    f"pickle opcode at byte {start} declares {n} bytes, but only {end - at} "
                    "follow (a corrupt or hostile length)"
                )
            at += n
        elif op == _FRAME:
            if at + 8 > end:
                raise CheckpointFormatError(f"pickle truncated at byte {start}")
            n = int.from_bytes(data[at : at + 8], "little")
            at += 8
            if n > end - at:
                raise UnsafeCheckpointError(
                    f"pickle frame at byte {start} declares {n} bytes, but only {end - at} follow "
                    "(a corrupt or hostile length)"
                )
        elif op in _FIXED:
            width = _FIXED[op]
            if at + width > end:
                raise CheckpointFormatError(f"pickle truncated at byte {start}")
            if op == _LONG_BINPUT and int.from_bytes(data[at : at + 4], "little") > end:
                raise UnsafeCheckpointError(
                    f"pickle opcode at byte {start} stores memo entry "
                    f"{int.from_bytes(data[at : at + 4], 'little')}, more than the data has bytes"
                )
            at += width
        elif op in _LINES:
            for _ in range(_LINES[op]):
                newline = data.find(b"\n", at)
                if newline < 0:
                    raise CheckpointFormatError(f"pickle truncated at byte {start}")
                line = data[at:newline]
                at = newline + 1
            if op == _PUT and not (line.isdigit() and len(line) <= 19 and int(line) <= end):
                raise UnsafeCheckpointError(
                    f"pickle opcode at byte {start} stores memo entry {line[:30]!r}, not an index "
                    "within the data"
                )
        elif op == _STOP:
            return
        elif op not in _NO_ARGUMENT:
            raise CheckpointFormatError(f"unknown pickle opcode {op:#04x} at byte {start}")
    raise CheckpointFormatError("pickle ends without a STOP opcode (truncated?)")


def _safe_loads(unpickler_cls, data: bytes, path: str, what: str):
    """Unpickle ``data`` with ``unpickler_cls`` after ``_check_opcodes``; any failure is a
    CheckpointFormatError (or UnsafeCheckpointError) naming ``path``."""
    try:
        _check_opcodes(data)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{path}: {what}: {exc}") from None
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(
            f"{path}: {what} is not readable (truncated or corrupt?): {exc}"
        ) from None
    try:
        return unpickler_cls(io.BytesIO(data), path).load()
    except UnsafeCheckpointError as exc:
        if str(exc).startswith(path):
            raise
        raise UnsafeCheckpointError(f"{path}: {exc}") from None
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{path}: {what} is malformed: {exc}") from None
    except Exception as exc:  # noqa: BLE001  (anything the unpickler raises means bad bytes)
        # OverflowError, MemoryError, RecursionError, UnpicklingError, EOFError, ValueError, ...
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointFormatError(
            f"{path}: {what} is not readable (truncated or corrupt?): "
            f"{type(exc).__name__}{': ' + detail[:200] if detail else ''}"
        ) from None


def load_metadata(path: str | os.PathLike) -> _Metadata:
    """Unpickle DCP's ``.metadata`` with the restricted unpickler."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    meta = _safe_loads(_MetadataUnpickler, data, path, "the DCP metadata")
    if not isinstance(meta, _Metadata):
        raise CheckpointFormatError(
            f"{path}: expected DCP Metadata, found {type(meta).__name__}; not a DCP .metadata file"
        )
    return meta


# --------------------------------------------------------------------------- chunk records


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype | None  # None: an untyped storage (dtype comes with _rebuild_tensor_v3)
    key: str
    numel: int  # elements of ``dtype``, or bytes for an untyped storage


@dataclass(frozen=True)
class _TensorRecord:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        raise CheckpointFormatError(f"{what} is {value!r}, not a tuple of integers")
    return value


def _int_sequence(value, what: str) -> tuple[int, ...]:
    """A tuple, list or ``torch.Size`` of ints from unpickled metadata (None: empty)."""
    if value is None:
        return ()
    if not isinstance(value, (tuple, list)):
        raise CheckpointFormatError(f"{what} is a {type(value).__name__}, not a tuple of integers")
    return _ints(tuple(value), what)


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *rest):
    if not isinstance(storage, _StorageRef) or storage.dtype is None:
        raise CheckpointFormatError("tensor without a typed storage")
    return _TensorRecord(
        storage, storage_offset, _ints(size, "size"), _ints(stride, "stride"), storage.dtype
    )


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *rest):
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError("tensor without a storage or dtype")
    return _TensorRecord(
        storage, storage_offset, _ints(size, "size"), _ints(stride, "stride"), dtype
    )


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: torch.dtype | None


def _storage_types() -> dict[tuple[str, str], object]:
    from torch.storage import _dtype_to_storage_type_map

    types: dict[tuple[str, str], object] = {
        ("torch", name): _StorageType(dtype) for dtype, name in _dtype_to_storage_type_map().items()
    }
    types[("torch", "UntypedStorage")] = _StorageType(None)
    return types


class _RecordUnpickler(_SafeUnpickler):
    allowed: dict[tuple[str, str], object] = {}

    def persistent_load(self, pid):
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and type(pid[4]) is int
        ):
            raise CheckpointFormatError(f"unexpected persistent id {pid!r}")
        return _StorageRef(pid[1].dtype, pid[2], pid[4])


def _record_unpickler() -> type[_RecordUnpickler]:
    if not _RecordUnpickler.allowed:
        _RecordUnpickler.allowed = {
            ("torch._utils", "_rebuild_tensor_v2"): _Call(_rebuild_v2),
            ("torch._utils", "_rebuild_tensor_v3"): _Call(_rebuild_v3),
            ("collections", "OrderedDict"): OrderedDict,
            **_storage_types(),
        }
    return _RecordUnpickler


class _RangeReader(io.RawIOBase):
    """A read-only, seekable window [start, start + length) of an open file, via ``pread``."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the record")
        self.pos = base + offset
        return self.pos

    def read(self, size: int = -1) -> bytes:
        remaining = max(0, self.length - self.pos)
        size = remaining if size is None or size < 0 else min(size, remaining)
        if size > MAX_RECORD_READ_BYTES:
            # Only zip directories and data.pkl are read here, never tensor data.
            raise CheckpointFormatError(f"asked to read {size} bytes of zip metadata; too large")
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(buffer)])

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:n]], self.start + self.pos + done)
            if got == 0:
                break
            done += got
        self.pos += done
        return done

    def pread(self, offset: int, size: int) -> bytes:
        self.seek(offset)
        return self.read(size)


@dataclass(frozen=True)
class ChunkLayout:
    """Where a saved chunk's elements are: ``offset`` is the file offset of element [0, ...]."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


def read_chunk_layout(fd: int, path: str, offset: int, length: int, what: str) -> ChunkLayout:
    """Locate the elements of the ``torch.save`` archive in bytes [offset, offset+length)."""
    view = _RangeReader(fd, offset, length)
    where = f"{path}: {what} (bytes [{offset}, {offset + length}))"
    if view.pread(0, 4) != b"PK\x03\x04":
        raise CheckpointFormatError(
            f"{where} is not a torch.save archive; shardstream reads DCP's default torch_save "
            "serialization (the safetensors serialization format and custom storage writers "
            "are not supported)"
        )
    try:
        archive = zipfile.ZipFile(view)
        infos = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in infos if name.endswith("data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointFormatError(f"{where}: expected one data.pkl, found {len(pickles)}")
        prefix = pickles[0][: -len("data.pkl")]
        pkl = infos[pickles[0]]
        if pkl.file_size > MAX_RECORD_PICKLE_BYTES:
            raise UnsafeCheckpointError(
                f"{where}: data.pkl claims {pkl.file_size} bytes; a tensor record needs a few "
                "hundred"
            )
        byteorder = infos.get(prefix + "byteorder")
        if byteorder is not None and archive.read(byteorder) != b"little":
            raise CheckpointFormatError(f"{where}: saved on a big-endian machine; unsupported")
        pickled = archive.read(pkl)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError,
            struct.error, NotImplementedError) as exc:  # fmt: skip
        if isinstance(exc, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{where}: not a readable torch.save archive: {exc}") from None
    record = _safe_loads(_record_unpickler(), pickled, path, f"{what} (its data.pkl)")
    if not isinstance(record, _TensorRecord):
        raise CheckpointFormatError(f"{where}: holds a {type(record).__name__}, not a plain tensor")
    info = infos.get(f"{prefix}data/{record.storage.key}")
    if info is None:
        raise CheckpointFormatError(f"{where}: storage {record.storage.key!r} is missing")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointFormatError(f"{where}: storage record is compressed; expected stored")
    if info.header_offset < 0:
        raise CheckpointFormatError(f"{where}: bad zip directory (negative record offset)")
    header = view.pread(info.header_offset, _LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_HEADER_MAGIC:
        raise CheckpointFormatError(f"{where}: bad zip local header for the storage record")
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[9:11]
    data_start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    nbytes = info.file_size
    if data_start + nbytes > length:
        raise CheckpointFormatError(
            f"{where}: storage data [{data_start}, {data_start + nbytes}) runs past the record"
        )
    try:
        dtype = code_of(record.dtype)
    except CheckpointFormatError:
        raise CheckpointFormatError(f"{where}: unsupported dtype {record.dtype}") from None
    isz = itemsize(dtype)
    expected = record.storage.numel * (isz if record.storage.dtype is not None else 1)
    if expected != nbytes:
        raise CheckpointFormatError(
            f"{where}: storage holds {nbytes} bytes but the pickle says {expected}"
        )
    size, stride = record.size, record.stride
    if (
        len(size) != len(stride)
        or any(n < 0 for n in size)
        or any(s < 0 for s in stride)
        or type(record.storage_offset) is not int
        or record.storage_offset < 0
    ):
        raise CheckpointFormatError(f"{where}: invalid size/stride/offset in the pickle")
    if math.prod(size):
        last = record.storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
        if (last + 1) * isz > nbytes:
            raise CheckpointFormatError(f"{where}: tensor reaches past the end of its storage")
    return ChunkLayout(dtype, size, stride, offset + data_start + record.storage_offset * isz)


# --------------------------------------------------------------------------- validation helpers


def _index_key(index) -> tuple[str, tuple[int, ...] | None]:
    if not isinstance(index, _MetadataIndex) or not isinstance(index.fqn, str):
        raise CheckpointFormatError(f"storage_data key {index!r} is not a MetadataIndex")
    offset = index.offset
    if offset is not None:
        offset = _ints(tuple(offset) if isinstance(offset, list) else offset, "chunk offset")
    return index.fqn, offset


def _data_file(directory: Path, relative: object, meta_path: Path) -> Path:
    if not isinstance(relative, str) or not relative:
        raise CheckpointFormatError(f"{meta_path}: storage entry with file name {relative!r}")
    candidate = Path(relative)
    if candidate.is_absolute() or ".." in candidate.parts or "\\" in relative:
        raise UnsafeCheckpointError(
            f"{meta_path}: storage file {relative!r} lies outside the checkpoint directory"
        )
    full = directory / candidate
    try:
        full.resolve().relative_to(directory.resolve())
    except ValueError:
        raise UnsafeCheckpointError(
            f"{meta_path}: storage file {relative!r} lies outside the checkpoint directory"
        ) from None
    return full


def _object_paths(planner_data) -> dict[str, tuple] | None:
    """DCP's ``planner_data``: flattened key -> path in the original nested state dict."""
    if not isinstance(planner_data, dict):
        return None
    paths = {}
    for key, path in planner_data.items():
        if isinstance(path, list):
            path = tuple(path)
        if (
            not isinstance(key, str)
            or not isinstance(path, tuple)
            or not path
            or not all(isinstance(p, (str, int)) for p in path)
        ):
            return None
        paths[key] = path
    return paths


def _model_names(keys: list[str], paths: dict[str, tuple] | None) -> tuple[dict[str, str], str]:
    """Which tensor keys are model weights, under which HF name; and a description of the layout.

    Keys missing from the result are training state (reported as skipped).
    """
    if paths is not None and all(k in paths for k in keys):
        nested = {k: paths[k] for k in keys if len(paths[k]) > 1}
        if any(p[0] == MODEL_CONTAINER for p in nested.values()):
            names = {
                k: ".".join(str(p) for p in paths[k][1:])
                for k in keys
                if len(paths[k]) > 1 and paths[k][0] == MODEL_CONTAINER
            }
            return names, "train state (model under 'model')" if len(names) < len(
                keys
            ) else "model under 'model'"
        names = {k: k for k in keys if len(paths[k]) == 1}
        return names, "model at top level" + (
            " with training state" if len(names) < len(keys) else ""
        )
    # No planner_data (custom planners): decide by key prefixes.
    model = [k for k in keys if not k.startswith(NON_MODEL_PREFIXES)]
    if len(model) < len(keys) and model and all(k.startswith("model.") for k in model):
        return {k: k[len("model.") :] for k in model}, "train state (model under 'model')"
    return {k: k for k in model}, "model at top level (no planner_data; named by prefix)"


def _reason(key: str, paths: dict[str, tuple] | None) -> str:
    container = paths[key][0] if paths and key in paths and len(paths[key]) > 1 else None
    if container is None:
        container = key.split(".", 1)[0] if key.startswith(NON_MODEL_PREFIXES) else None
    return f"training state ({container})" if container else "not under the model"


def _describe(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    if len(chunks) == 1 and all(o == 0 for o in chunks[0][0]):
        return "whole (1 chunk)"
    dims = sorted({d for offsets, _ in chunks for d, o in enumerate(offsets) if o})
    where = ", ".join(str(d) for d in dims)
    return f"{len(chunks)} chunks along dim{'s' if len(dims) > 1 else ''} {where}".rstrip()


# --------------------------------------------------------------------------- opening


def open_dcp(directory: str | os.PathLike) -> DcpCheckpoint:
    """Read ``.metadata`` and each model chunk's record header; describe tensors as blocks."""
    directory = Path(directory)
    meta_path = directory / METADATA_FILE
    on_disk = sorted(p.name for p in directory.iterdir() if DATA_FILE.match(p.name))
    if not meta_path.is_file():
        per_rank = sorted(p.name for p in directory.iterdir() if RANK_METADATA_FILE.match(p.name))
        if per_rank:
            raise CheckpointFormatError(
                f"{directory}: per-rank DCP metadata ({per_rank[0]}, ...) but no global "
                ".metadata: saved without collectives, which shardstream does not read"
            )
        raise CheckpointNotFoundError(
            f"{directory}: DCP data files but no .metadata; DCP writes it last, so the save "
            "did not finish (or the file was not copied)"
        )
    meta = load_metadata(meta_path)
    version = meta.version
    if version is not None and (
        not isinstance(version, str) or version.split(".")[0] != SUPPORTED_DCP_MAJOR
    ):
        raise CheckpointFormatError(
            f"{meta_path}: DCP metadata version {version!r} is not supported (expected 1.x)"
        )
    entries = meta.state_dict_metadata
    storage = meta.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointFormatError(
            f"{meta_path}: state_dict_metadata/storage_data missing; not a FileSystemWriter "
            "checkpoint"
        )
    for key, value in entries.items():
        if not isinstance(key, str) or not isinstance(
            value, (_TensorStorageMetadata, _BytesStorageMetadata)
        ):
            raise CheckpointFormatError(f"{meta_path}: entry {key!r} is not tensor or bytes")

    skipped: dict[str, str] = {}
    tensor_keys = []
    for key, value in entries.items():
        if isinstance(value, _BytesStorageMetadata):
            skipped[key] = "not a tensor (pickled bytes)"
        else:
            tensor_keys.append(key)
    paths = _object_paths(meta.planner_data)
    names, layout = _model_names(tensor_keys, paths)
    for key in tensor_keys:
        if key not in names:
            skipped[key] = _reason(key, paths)
    if not names:
        raise CheckpointNotFoundError(
            f"{directory}: the DCP checkpoint holds no model tensors ({len(entries)} entries, "
            "e.g. " + ", ".join(repr(k) for k in list(entries)[:3]) + "); for accelerate, point "
            "at pytorch_model_fsdp_N rather than optimizer_N"
        )
    seen: dict[str, str] = {}
    for key, name in names.items():
        if not name:
            raise CheckpointFormatError(f"{meta_path}: key {key!r} gives an empty tensor name")
        if name in seen:
            raise CheckpointFormatError(
                f"{meta_path}: keys {seen[name]!r} and {key!r} both map to tensor {name!r}"
            )
        seen[name] = key

    by_chunk = _storage_by_chunk(storage, meta_path)

    sizes: dict[Path, int] = {}
    fds: dict[Path, int] = {}
    tensors: list[GlobalTensor] = []
    placements: dict[str, str] = {}
    try:
        for key, name in names.items():
            md = entries[key]
            tensors.append(
                _global_tensor(directory, meta_path, key, name, md, by_chunk, sizes, fds)
            )
            placements[name] = _describe([(b.start, b.shape) for b in tensors[-1].blocks])
    finally:
        for fd in fds.values():
            os.close(fd)

    ranks = {int(DATA_FILE.match(n)[1]) for n in on_disk}
    ranks |= {int(m[1]) for p in sizes if (m := DATA_FILE.match(p.name))}
    world_size = max(ranks) + 1 if ranks else 1
    files = sorted({str(directory / n) for n in on_disk} | {str(p) for p in sizes})
    return DcpCheckpoint(
        directory=directory,
        world_size=world_size,
        tensors=tensors,
        placements=placements,
        files=files,
        layout=layout,
        dcp_version=version,
        skipped=skipped,
        metadata=meta,
    )


def _storage_by_chunk(storage: dict, meta_path: Path) -> dict:
    """``storage_data`` keyed by (key, chunk offsets), each entry checked to be a _StorageInfo."""
    by_chunk: dict[tuple[str, tuple[int, ...] | None], _StorageInfo] = {}
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointFormatError(f"{meta_path}: storage entry {index!r} is malformed")
        by_chunk[_index_key(index)] = info
    return by_chunk


def _stored_range(directory: Path, meta_path: Path, key: str, info, sizes, fds, kind="tensor"):
    """The data file and byte range of a storage entry, opened once and checked to fit."""
    path = _data_file(directory, info.relative_path, meta_path)
    if path not in sizes:
        if not path.is_file():
            raise CheckpointNotFoundError(
                f"{path}: missing DCP data file (referenced by {meta_path.name} for {key!r})"
            )
        fds[path] = os.open(path, os.O_RDONLY)
        sizes[path] = os.fstat(fds[path]).st_size
    start, length = info.offset, info.length
    if type(start) is not int or type(length) is not int or start < 0 or length < 0:
        raise CheckpointFormatError(
            f"{meta_path}: {kind} {key!r} has an invalid byte range {start!r}+{length!r}"
        )
    if start + length > sizes[path]:
        raise CheckpointFormatError(
            f"{path}: truncated: {kind} {key!r} needs bytes [{start}, {start + length}) but the "
            f"file has {sizes[path]}"
        )
    return path, start, length


def _global_tensor(directory, meta_path, key, name, md, by_chunk, sizes, fds) -> GlobalTensor:
    try:
        dtype = code_of(getattr(md.properties, "dtype", None))
    except (CheckpointFormatError, TypeError):
        raise CheckpointFormatError(
            f"{meta_path}: tensor {key!r} has unsupported dtype "
            f"{getattr(md.properties, 'dtype', None)}"
        ) from None
    shape = md.size
    if isinstance(shape, list):
        shape = tuple(shape)
    shape = _ints(shape, f"tensor {key!r} shape")
    if any(n < 0 for n in shape) or not isinstance(md.chunks, list):
        raise CheckpointFormatError(f"{meta_path}: tensor {key!r} has an invalid shape or chunks")
    blocks = []
    for chunk in md.chunks:
        if not isinstance(chunk, _ChunkStorageMetadata):
            raise CheckpointFormatError(f"{meta_path}: tensor {key!r} has a malformed chunk")
        offsets = _int_sequence(chunk.offsets, f"tensor {key!r} chunk offsets")
        lengths = _int_sequence(chunk.sizes, f"tensor {key!r} chunk sizes")
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            raise CheckpointFormatError(
                f"{meta_path}: tensor {key!r} of shape {list(shape)} has a chunk of rank "
                f"{len(lengths)}"
            )
        if any(n < 0 for n in lengths):
            raise CheckpointFormatError(f"{meta_path}: tensor {key!r} has a negative chunk size")
        info = by_chunk.get((key, offsets))
        if info is None:
            raise CheckpointFormatError(
                f"{meta_path}: chunk of tensor {key!r} at offsets {list(offsets)} has no storage "
                "entry"
            )
        if info.transform_descriptors:
            raise CheckpointFormatError(
                f"{meta_path}: tensor {key!r} is stored through transform(s) "
                f"{list(info.transform_descriptors)} (e.g. zstd compression); shardstream streams "
                "byte ranges and cannot read transformed chunks; save without _extensions"
            )
        path, start, length = _stored_range(directory, meta_path, key, info, sizes, fds)
        what = f"chunk of {key!r} at {list(offsets)}"
        layout = read_chunk_layout(fds[path], str(path), start, length, what)
        if layout.shape != lengths:
            raise CheckpointFormatError(
                f"{path}: {what} holds shape {list(layout.shape)}, but .metadata says "
                f"{list(lengths)}"
            )
        if layout.dtype != dtype:
            raise CheckpointFormatError(
                f"{path}: {what} holds {layout.dtype}, but .metadata says {dtype}"
            )
        blocks.append(Block(str(path), layout.offset, dtype, offsets, lengths, layout.strides))
    blocks.sort(key=lambda b: b.start)
    check_blocks_tile(name, shape, blocks)
    return GlobalTensor(name, dtype, shape, tuple(blocks))


# --------------------------------------------------------------------------- training state

# Non-tensor entries (param group values, scheduler fields) are small torch.save archives.
MAX_OBJECT_BYTES = 64 << 20
OPTIMIZER_STATE_PREFIX = "optimizer.state."


@dataclass
class DcpTrainState:
    """What a DCP train state holds besides the model, for ``restore()``.

    ``optimizer_tensors`` are named ``optimizer.state.<fqn>.<key>``, as shardstream names them.
    ``objects`` maps a container (``optimizer``, ``lr_scheduler``) to its non-tensor values,
    nested as they were saved: under ``flatten_optimizer_state_dict`` (torchtitan) the
    optimizer's values are keyed ``param_groups.<fqn>.<key>`` and ``state.<fqn>.<key>``.
    """

    optimizer_tensors: list[GlobalTensor]
    objects: dict[str, object]


def open_dcp_train_state(
    directory: str | os.PathLike,
    containers: tuple[str, ...] = ("optimizer", "lr_scheduler"),
    metadata: _Metadata | None = None,
) -> DcpTrainState:
    """Describe the optimizer tensors of a DCP checkpoint and read its small non-tensor state.

    ``metadata``: the ``.metadata`` ``open_dcp`` already unpickled, so it is not read twice.
    """
    directory = Path(directory)
    meta_path = directory / METADATA_FILE
    meta = metadata if metadata is not None else load_metadata(meta_path)
    entries, storage = meta.state_dict_metadata, meta.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointFormatError(f"{meta_path}: state_dict_metadata/storage_data missing")
    by_chunk = _storage_by_chunk(storage, meta_path)
    paths = _object_paths(meta.planner_data) or {}
    sizes: dict[Path, int] = {}
    fds: dict[Path, int] = {}
    tensors: list[GlobalTensor] = []
    objects: dict[str, object] = {}
    try:
        for key, md in entries.items():
            if not isinstance(key, str):
                raise CheckpointFormatError(f"{meta_path}: entry {key!r} is not named by a str")
            if isinstance(md, _TensorStorageMetadata):
                if key.startswith(OPTIMIZER_STATE_PREFIX):
                    tensors.append(
                        _global_tensor(directory, meta_path, key, key, md, by_chunk, sizes, fds)
                    )
                continue
            path = paths.get(key) or tuple(key.split(".", 1))
            if path[0] not in containers:
                continue
            value = _read_object(directory, meta_path, key, by_chunk, sizes, fds)
            _place(objects, path, value, meta_path, key)
    finally:
        for fd in fds.values():
            os.close(fd)
    return DcpTrainState(tensors, {k: _lists(v) for k, v in objects.items()})


def _read_object(directory: Path, meta_path: Path, key: str, by_chunk, sizes, fds) -> object:
    info = by_chunk.get((key, None))
    if info is None:
        raise CheckpointFormatError(f"{meta_path}: entry {key!r} has no storage entry")
    path, start, length = _stored_range(directory, meta_path, key, info, sizes, fds, "entry")
    if length > MAX_OBJECT_BYTES:
        raise UnsafeCheckpointError(
            f"{path}: entry {key!r} declares {length} bytes, over the {MAX_OBJECT_BYTES} limit"
        )
    data = os.pread(fds[path], length, start)
    try:
        # weights_only: plain containers, numbers and strings only; nothing can run code.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure here is a bad record
        raise CheckpointFormatError(
            f"{path}: entry {key!r} is not a readable weights-only record "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def _place(root: dict, path: tuple, value: object, meta_path: Path, key: str) -> None:
    """Set ``value`` at ``path`` in nested dicts (list indices stay int keys until _lists)."""
    node = root
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise CheckpointFormatError(f"{meta_path}: entry {key!r} overlaps another entry")
        node = child
    if path[-1] in node:
        raise CheckpointFormatError(f"{meta_path}: entry {key!r} is stored twice")
    node[path[-1]] = value


def _lists(node: object) -> object:
    """Dicts keyed 0..n-1 by int (DCP's flattened lists) back into lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out
