"""``.pt`` files (torch zip archives) read for their layout only: no tensor bytes are loaded.

``load_restricted`` runs ``torch.load`` (with ``map_location="meta"`` for layouts, which gives
each storage its byte offset inside the archive, where torch stores it uncompressed) through
shardstream's own restricted unpickler; the executor then reads exactly the ranges it needs.

The unpickler resolves a fixed allowlist of names, never torch's global one: functions are
wrapped (``_Fn``) and classes handed out as tokens (``_Type``), so a pickle's BUILD cannot
modify them, and DTensor's classes are always inert stand-ins that only record the state they
are given. Constructing a real DeviceMesh would create process groups (a rendezvous over the
network from a file's bytes), so no file ever gets torch's classes, whether or not
``torch.distributed.tensor`` is loaded. The pickle's opcodes are checked first
(``dcp_pickles.check_pickle``: lengths, nesting, hashing work) and the result after
(``check_unpickled``: shared objects, cycles), so hostile bytes end in a prompt error.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import types
import warnings
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..engine.checksum import Crc32
from ..engine.dtypes import code_of
from ..engine.endpoints import FileEndpoint
from ..engine.plan import Block
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from .dcp_pickles import (
    ZIP_ERRORS,
    RangeReader,
    _Call,
    _Frozen,
    _torch_dtype,
    check_pickle,
    check_unpickled,
    named_twice,
    open_zip_record,
    read_zip_record,
)
from .regular_file import open_regular, present


@dataclass(frozen=True)
class LocalTensor:
    """Where a tensor's elements sit in a ``.pt`` file."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int  # file offset of element [0, ..., 0]

    def block(self, path: str, start: tuple[int, ...]) -> Block:
        return Block(path, self.offset, self.dtype, start, self.shape, self.strides)


@dataclass(frozen=True)
class Placement:
    """A DTensor placement: ``kind`` is "Shard" (with ``dim``), "Replicate", or the name of a
    placement shardstream does not read (``Partial``, ``_StridedShard``, ...)."""

    kind: str
    dim: int | None = None

    def __str__(self) -> str:  # as torch prints placements: S(0), R
        return {"Shard": f"S({self.dim})", "Replicate": "R"}.get(self.kind, self.kind)

    def __repr__(self) -> str:  # as torch shows them: Shard(dim=0), Replicate()
        return {"Shard": f"Shard(dim={self.dim})", "Replicate": "Replicate()"}.get(
            self.kind, self.kind
        )


@dataclass(frozen=True)
class MeshLayout:
    """What a DeviceMesh pickle says about the rank that saved it."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    coordinate: tuple[int, ...] | None  # the saving rank's coordinate, when recorded
    rank: int | None
    rank_map: tuple[int, ...] | None  # flat rank of each mesh position, when recorded


@dataclass(frozen=True)
class DistributedTensor:
    """A DTensor as loaded by ``load_layout``: global shape, placements, mesh, local shard."""

    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh: MeshLayout
    local: torch.Tensor  # a meta tensor; ``local_layout`` locates it in the file


# The pickled magic number the legacy (pre-zip) torch.save format starts with.
LEGACY_MAGIC = b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"
LEGACY_FORMAT = (
    "not a torch zip archive (the legacy format of "
    "torch.save(_use_new_zipfile_serialization=False) is not read)"
)


def is_legacy(path: str) -> bool:
    """Whether ``path`` starts as the legacy (pre-zip) ``torch.save`` format does."""
    with open_regular(path) as f:
        return LEGACY_MAGIC in f.read(32)


def load_layout(path: str):
    """Unpickle ``path`` safely onto the meta device; raise shardstream errors only.

    DTensors anywhere in the result (dicts, lists, tuples) are ``DistributedTensor`` records.
    """
    if not present(path):  # a FIFO, a directory, a broken link: named as what it is
        raise CheckpointNotFoundError(f"{path}: no such file")
    damage = _zip_damage(path)
    if damage and is_legacy(path):  # not a zip at all: said as what it is, not as corrupt
        raise CheckpointFormatError(f"{path}: {LEGACY_FORMAT}")
    if damage:
        raise CheckpointFormatError(
            f"{path}: corrupt or truncated torch checkpoint ({os.path.getsize(path)} bytes): "
            f"{damage}"
        )
    return _records(load_restricted(path, path, "meta"), path)


LIGHTNING_KEY = b"pytorch-lightning_version"  # early in every Lightning checkpoint's pickle


def _lightning_hint(source: str | bytes) -> str:
    """A sentence for a refused PyTorch Lightning checkpoint (the objects its saved
    hyperparameters or callbacks hold), else ""."""
    try:
        with zipfile.ZipFile(source if isinstance(source, str) else io.BytesIO(source)) as z:
            pickle_name = next((n for n in z.namelist() if n.endswith("/data.pkl")), None)
            if pickle_name is None:
                return ""
            with z.open(pickle_name) as f:
                head = f.read(1 << 16)
    except (OSError, zipfile.BadZipFile, ValueError, RuntimeError):
        return ""
    if LIGHTNING_KEY not in head:
        return ""
    return (
        " (a PyTorch Lightning checkpoint: objects its save_hyperparameters() or callbacks "
        "kept; shardstream unpickles no code. Save without them, save_hyperparameters("
        "ignore=[...]), or the model's state dict alone with torch.save)"
    )


def load_restricted(
    source: str | bytes,
    name: str,
    map_location: str = "meta",
    extra_globals: Mapping[tuple[str, str], object] | None = None,
):
    """``torch.load`` of the archive ``source`` (a path, or its bytes) through the restricted
    unpickler; ``extra_globals`` adds to the allowlist (values from ``_Fn``/``_Type``, e.g.
    ``numpy_globals()``). Errors are shardstream errors starting with ``name``."""
    allowed = {**_allowed_globals(), **(extra_globals or {})}
    checked: list[int] = []
    try:
        with open_regular(source) if isinstance(source, str) else io.BytesIO(source) as f:
            _check_archive(f)
            module = _pickle_module(allowed, checked)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = torch.load(
                    f, map_location=map_location, pickle_module=module, weights_only=False,
                    mmap=False,
                )  # fmt: skip
            check_unpickled(loaded, checked[0])
            return loaded
    except _Refused as exc:
        module_name = exc.args[0]
        kind = _UNREAD_KINDS.get(module_name)
        if kind is not None:
            raise CheckpointFormatError(
                f"{name}: holds a {kind} tensor, which shardstream does not read (only dense, "
                "strided ones); save it converted to one"
            ) from None
        if "sharded_tensor.api.ShardedTensor" in module_name:
            raise CheckpointFormatError(
                f"{name}: holds FSDP1 ShardedTensors (saved without a device mesh), which "
                "shardstream does not read; save FSDP1 with device_mesh=init_device_mesh(...) "
                "(DTensor state) or use FSDP2"
            ) from None
        raise UnsafeCheckpointError(
            f"{name}: refused to unpickle: the file asks for code or types outside the safe "
            f"allowlist: GLOBAL {module_name}{_lightning_hint(source)}"
        ) from None
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{name}: {exc}") from None
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(
            f"{name}: not a readable torch checkpoint (truncated or corrupt?): {exc}"
        ) from None
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{name}: no such file") from None
    except Exception as exc:  # noqa: BLE001  (a damaged pickle fails anywhere in the unpickler)
        lines = str(exc).strip().splitlines()
        message = lines[0][:300] if lines else ""
        if "explicit pickle_module" in message:  # TORCH_FORCE_WEIGHTS_ONLY_LOAD is set
            raise CheckpointFormatError(
                f"{name}: cannot read .pt files while TORCH_FORCE_WEIGHTS_ONLY_LOAD is set "
                "(shardstream uses its own restricted unpickler); unset it"
            ) from None
        if "Quantized" in message:  # torch's dispatcher, on a quantized meta tensor
            raise CheckpointFormatError(
                f"{name}: holds a {_UNREAD_KINDS['torch._utils._rebuild_qtensor']} tensor, which "
                "shardstream does not read (only dense, strided ones); save it converted to one"
            ) from None
        if message.startswith("expected key '0', got "):  # torch's storage-offset arithmetic
            raise CheckpointFormatError(
                f"{name}: the pickle's first storage is record data/{message[22:].strip(chr(39))}"
                ", where torch writes data/0 first: not written by torch.save (a damaged or "
                "hand-made file?)"
            ) from None
        if not message or not isinstance(exc, _READ_ERRORS):  # name the unexpected ones
            message = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        raise CheckpointFormatError(
            f"{name}: not a readable torch checkpoint (truncated or corrupt?): {message}"
        ) from None


# torch's rebuild functions for tensors that are not dense and strided: named, not called code.
_UNREAD_KINDS = {
    "torch._utils._rebuild_qtensor": "quantized (qint8, quint8...)",
    "torch._utils._rebuild_sparse_tensor": "sparse",
    "torch._utils._rebuild_nested_tensor": "nested",
}
# What torch.load raises for a truncated or corrupt archive; anything else is named by type.
_READ_ERRORS = (RuntimeError, zipfile.BadZipFile, EOFError, ValueError, OSError)


def _check_archive(f) -> None:
    """Only a torch zip archive goes to ``torch.load``: it would hand the legacy format and
    TorchScript archives to other loaders."""
    if f.read(4) != b"PK\x03\x04":
        raise CheckpointFormatError("not a torch zip archive (the legacy format is not read)")
    f.seek(0)
    try:
        records = _torch_records(f)
        if "constants.pkl" in records:  # torch.load hands such an archive to torch.jit.load
            raise UnsafeCheckpointError(
                "refused to unpickle: a TorchScript archive, not a checkpoint"
            )
        f.seek(0)
        archive = zipfile.ZipFile(f)
        names = archive.namelist()
        if _python_records(f, archive) != records:
            raise UnsafeCheckpointError(
                "refused to read: torch's zip reader and Python's list different records "
                "(names or offsets) in this archive, so what is checked would not be what "
                "torch loads; a crafted or damaged file"
            )
        if sum(n.rsplit("/", 1)[-1] == "data.pkl" for n in names) != 1:
            raise CheckpointFormatError("expected one data.pkl record in the archive")
        # torch.save stores every record as it is; a compressed one would be inflated whole
        # into memory before any check (a zip bomb: a megabyte file, gigabytes of pickle)
        packed = next(
            (i for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED), None
        )
        if packed is not None:
            raise CheckpointFormatError(
                f"record {packed.filename!r} is compressed; torch.save stores every record "
                "uncompressed (a crafted or foreign archive)"
            )
        # torch byte-swaps a big-endian archive's storages as it loads them, which on the meta
        # device crashes the process (SIGSEGV); the merge would copy the bytes unswapped anyway
        order = [n for n in names if n.rsplit("/", 1)[-1] == "byteorder"]
        if order and read_zip_record(archive, order[0]).strip() != b"little":
            raise CheckpointFormatError("saved on a big-endian machine; only little-endian is read")
    except ZIP_ERRORS as exc:
        if isinstance(exc, CheckpointFormatError):
            raise
        raise CheckpointFormatError(str(exc) or type(exc).__name__) from None
    f.seek(0)


def _torch_records(f) -> dict[str, int]:
    """Record name -> data offset, as the reader ``torch.load`` itself uses lists them."""
    reader = torch._C.PyTorchFileReader(f)
    return {name: reader.get_record_offset(name) for name in reader.get_all_records()}


def _python_records(f, archive: zipfile.ZipFile) -> dict[str, int]:
    """Record name (below the archive's top folder) -> data offset, as Python's zipfile
    finds them (each local header's name and extra field lengths give the data's start)."""
    found: dict[str, int] = {}
    infos = archive.infolist()
    if (twice := named_twice(infos)) is not None:
        raise CheckpointFormatError(f"the zip archive holds record {twice!r} twice")
    for info in infos:
        f.seek(info.header_offset)
        local = f.read(30 + len(_central_name(info)))
        start = _data_start(local, info.header_offset)
        if start is None:
            raise CheckpointFormatError(f"record {info.filename!r} has no local header")
        if (named := _named_otherwise(local, info)) is not None:
            raise UnsafeCheckpointError(
                f"refused to read: zip record {info.filename!r} is named {named!r} in its local "
                "header, so readers differ on which record holds which storage; a crafted or "
                "damaged file"
            )
        name = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
        found[name] = start
    return found


def _central_name(info: zipfile.ZipInfo) -> bytes:
    """The record's name as the central directory spells it, in bytes."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def _named_otherwise(local: bytes, info: zipfile.ZipInfo) -> str | None:
    """The name the local header read at ``info.header_offset`` (its first 30 bytes and the
    name's) gives the record, where the central directory names it otherwise (torch's
    reader goes by the central name, a meta load by the records' order); else None."""
    length = struct.unpack("<H", local[26:28])[0]
    named = local[30 : 30 + length]
    if named == _central_name(info):
        return None
    return named.decode("utf-8", "replace")[:200]


def _data_start(local: bytes, header_offset: int) -> int | None:
    """Where a record's data starts, from the 30 bytes read at its ``header_offset`` (the
    local header: its name's and extra field's lengths); None when they are no local header."""
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    return header_offset + 30 + name_length + extra_length


class _Refused(Exception):
    """A global outside the allowlist (args: its dotted name)."""


def _pickle_module(allowed: Mapping[tuple[str, str], object], checked: list[int]):
    """A stand-in for the ``pickle`` module, for ``torch.load(pickle_module=...)``."""

    class Unpickler(pickle.Unpickler):
        def __init__(self, file, **kwargs):
            data = file.getvalue() if isinstance(file, io.BytesIO) else None
            if data is None:  # torch hands over data.pkl in memory; anything else is unexpected
                raise CheckpointFormatError("unexpected pickle source")
            check_pickle(data, whole=True)
            checked.append(len(data))
            super().__init__(file, **kwargs)

        def find_class(self, module: str, name: str):
            found = allowed.get((module, name))
            if found is not None:
                return found
            dtype = _torch_dtype(module, name)
            if dtype is not None:
                return dtype
            raise _Refused(f"{module}.{name}")

    def refuse(*args, **kwargs):
        raise CheckpointFormatError("not a torch zip archive (the legacy format is not read)")

    return types.SimpleNamespace(
        __name__="shardstream_restricted_pickle",
        Unpickler=Unpickler,
        load=refuse,
        loads=refuse,
        UnpicklingError=pickle.UnpicklingError,
    )


class _Type:
    """A class a pickle names, as a token: calls through ``_Fn`` get the class, while the
    pickle's BUILD cannot reach it (it would change the class for the whole process)."""

    __slots__ = ("cls",)

    def __init__(self, cls: type):
        object.__setattr__(self, "cls", cls)

    def __setattr__(self, name, value):
        raise UnsafeCheckpointError("refused to unpickle: it tries to modify a class")

    def __reduce__(self):
        raise TypeError("not picklable")


class _UntypedStorage:
    """The storage type torch pickles for dtypes without a typed storage class (float8,
    uint16/32/64): torch's loader reads it as bytes (``dtype`` uint8, its numel counting bytes),
    and ``_rebuild_tensor_v3`` then gives the tensor its own dtype. A token, not the class, so
    the pickle cannot modify ``torch.UntypedStorage``."""

    __slots__ = ()
    dtype = torch.uint8

    def __setattr__(self, name, value):
        raise UnsafeCheckpointError("refused to unpickle: it tries to modify a storage type")

    def __reduce__(self):
        raise TypeError("not picklable")


class _Fn(_Call):
    """An allowed function (or class, called); ``_Type`` arguments are passed as their class."""

    __slots__ = ()

    def __call__(self, *args):
        return self._fn(*(a.cls if type(a) is _Type else a for a in args))


def _latin1(text, encoding="latin1"):
    """``_codecs.encode`` as protocol 2 pickles bytes: latin-1 only (other codecs decompress)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise CheckpointFormatError("_codecs.encode is allowed for latin-1 text only")
    return text.encode("latin-1")


def _allowed_globals() -> dict[tuple[str, str], object]:
    """What a torch checkpoint of tensors, containers and DTensors needs (storage types come
    from torch's own wrapper); DTensor's classes map to the stand-ins."""
    rebuild = torch._utils
    allowed: dict[tuple[str, str], object] = {
        ("collections", "OrderedDict"): _Fn(collections.OrderedDict),
        ("torch", "Size"): _Fn(torch.Size),
        ("torch", "device"): _Fn(torch.device),
        ("torch", "Tensor"): _Type(torch.Tensor),
        ("torch.nn.parameter", "Parameter"): _Type(torch.nn.Parameter),
        ("torch.serialization", "_get_layout"): _Fn(torch.serialization._get_layout),
        ("torch._tensor", "_rebuild_from_type_v2"): _Fn(torch._tensor._rebuild_from_type_v2),
        ("_codecs", "encode"): _Fn(_latin1),
        ("builtins", "set"): _Fn(set),
        ("builtins", "complex"): _Fn(complex),
        ("torch.storage", "UntypedStorage"): _UntypedStorage(),
        ("torch", "UntypedStorage"): _UntypedStorage(),
    }
    for fn in ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
               "_rebuild_parameter_with_state", "_rebuild_wrapper_subclass"):  # fmt: skip
        if hasattr(rebuild, fn):
            allowed[("torch._utils", fn)] = _Fn(getattr(rebuild, fn))
    for name, cls in _STAND_INS.items():
        module, _, qualname = name.rpartition(".")
        allowed[(module, qualname)] = _Type(cls) if cls is _StandInTensor else cls
    return allowed


def numpy_globals() -> dict[tuple[str, str], object]:
    """numpy's array and dtype reconstruction (verl keeps numpy's RNG state), for
    ``load_restricted(extra_globals=...)``."""
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    reconstruct = _Fn(multiarray.multiarray._reconstruct)

    def dtype(spec, align=False, copy=False):
        if type(spec) is not str:
            raise CheckpointFormatError("numpy dtype from a non-string")
        return np.dtype(spec, bool(align), bool(copy))

    return {
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,
        ("numpy", "ndarray"): _Type(np.ndarray),
        ("numpy", "dtype"): _Fn(dtype),
    }


def _records(obj, path: str):
    """``obj`` with every DTensor stand-in replaced by a ``DistributedTensor``; an object met
    again (pickles share them) is converted once."""
    done: dict[int, object] = {}

    def convert(value, depth: int):
        if depth > 64:
            raise CheckpointFormatError(f"{path}: state nested more than 64 levels deep")
        if id(value) in done:
            return done[id(value)]
        if isinstance(value, _StandInTensor):
            try:
                result = _from_stand_in(value)
            except (AttributeError, TypeError, ValueError, KeyError, IndexError) as exc:
                raise CheckpointFormatError(
                    f"{path}: a DTensor whose layout shardstream cannot read "
                    f"({type(exc).__name__}: {str(exc)[:200]})"
                ) from None
        elif isinstance(value, dict):
            items = [(k, convert(v, depth + 1)) for k, v in value.items()]
            if type(value) is dict:
                result = dict(items)
            else:  # OrderedDict and friends keep their type
                result = value
                value.clear()
                value.update(items)
        elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            converted = [convert(v, depth + 1) for v in value]
            result = converted if isinstance(value, list) else tuple(converted)
        else:
            return value
        done[id(value)] = result
        return result

    return convert(obj, 0)


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _optional_ints(values) -> tuple[int, ...] | None:
    return None if values is None else _ints(values)


def _from_stand_in(value: _StandInTensor) -> DistributedTensor:
    """A record of a stand-in DTensor; anything unexpected raises."""
    state = value._stand_in_state
    local, spec = state["_local_tensor"], state["_spec"]
    if type(local) is not torch.Tensor or not isinstance(spec, _Spec):
        raise TypeError("unexpected DTensor state")
    placements = []
    for p in spec.state["placements"]:
        if type(p) is _Shard:
            placements.append(Placement("Shard", int(p.state["dim"])))
        elif type(p) is _Replicate:
            placements.append(Placement("Replicate"))
        elif isinstance(p, _Record):
            placements.append(Placement(type(p).__name__.lstrip("_")))
        else:
            raise TypeError(f"placement {type(p).__name__}")
    mesh = spec.state["mesh"]
    if not isinstance(mesh, _Mesh):
        raise TypeError("unexpected mesh")
    ms = mesh.state
    if "_layout" in ms:  # torch >= 2.9: a CuTe-style layout, one axis per mesh dimension
        shape = tuple(math.prod(_axis_shape(axis)) for axis in _axes(ms["_layout"]))
    else:  # older torch: the mesh's rank tensor, whose shape is the mesh shape
        shape = tuple(ms["mesh"].shape)
    names = ms.get("_mesh_dim_names")
    return DistributedTensor(
        _ints(value.shape),
        tuple(placements),
        MeshLayout(
            _ints(shape),
            tuple(str(n) for n in names) if names else None,
            _optional_ints(ms.get("_coordinate_on_dim")),
            None if ms.get("_rank") is None else int(ms["_rank"]),
            _optional_ints(ms.get("_flatten_rank_map")),
        ),
        local,
    )


def _axes(layout) -> tuple:
    if not isinstance(layout, _Record):
        raise TypeError("unexpected mesh layout")
    return tuple(layout.state["axes"])


def _axis_shape(axis) -> tuple[int, ...]:
    if not isinstance(axis, _Record):
        raise TypeError("unexpected mesh layout axis")
    shape = axis.state["shape"]
    return (int(shape),) if isinstance(shape, int) else _ints(shape)


class _Record(metaclass=_Frozen):
    """A stand-in instance: keeps the pickled state in ``.state`` and nothing else."""

    state: Mapping = MappingProxyType({})  # until the pickle's BUILD gives one

    def __init__(self, *args):
        self.state = {"args": args}

    def __setstate__(self, state) -> None:
        self.state = {**self.state, **_state_dict(state)}


def _state_dict(state) -> dict:
    """A BUILD state as one dict of attributes: ``dict`` or ``(dict, slots)``, str keys."""
    if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
        parts = [part or {} for part in state]
        if not all(type(part) is dict for part in parts):
            raise TypeError("stand-in state must be dicts")
        state = {**parts[0], **parts[1]}
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise TypeError("stand-in state must be a dict of attributes")
    return state


class _Mesh(_Record):
    pass


class _Layout(_Record):
    pass


class _Spec(_Record):
    pass


class _Shard(_Record):
    pass


class _Replicate(_Record):
    pass


class _StridedShard(_Record):
    pass


class _Partial(_Record):
    pass


class _TensorMeta(_Record):
    pass


class _ShardOrderEntry(_Record):
    pass


class _StandInTensor(torch.Tensor):
    """Stands in for DTensor: a meta wrapper of the global shape that keeps its pickled state."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError("a DTensor stand-in holds a layout only")

    def __setstate__(self, state) -> None:
        self._stand_in_state = _state_dict(state)


_STAND_INS = {
    "torch.distributed.tensor.DTensor": _StandInTensor,
    "torch.distributed.tensor._api.DTensor": _StandInTensor,
    "torch.distributed.device_mesh.DeviceMesh": _Mesh,
    "torch.distributed._mesh_layout._MeshLayout": _Layout,
    "torch.distributed._mesh_layout._FlatLayout": _Layout,
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": _Spec,
    "torch.distributed.tensor._dtensor_spec.TensorMeta": _TensorMeta,
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry": _ShardOrderEntry,
    "torch.distributed.tensor.placement_types.Shard": _Shard,
    "torch.distributed.tensor.placement_types._StridedShard": _StridedShard,
    "torch.distributed.tensor.placement_types.Replicate": _Replicate,
    "torch.distributed.tensor.placement_types.Partial": _Partial,
}


def _zip_damage(path: str) -> str | None:
    """Why the zip container is unreadable or its pickle fails its CRC-32; None if it is fine.

    torch does not check CRCs, so a flipped byte in ``data.pkl`` would otherwise surface as an
    odd unpickling error, or not at all. Only the central directory and the pickle are read.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"]
            if not pickles:
                return "the zip archive has no data.pkl record"
            with open_zip_record(archive, pickles[0]) as record:
                while record.read(1 << 20):
                    pass
    except ZIP_ERRORS as exc:  # BadZipFile among them
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


@dataclass(frozen=True)
class ZipRecord:
    """A stored (uncompressed) zip record: its data bytes [start, end) and their CRC-32."""

    name: str
    start: int
    end: int
    crc: str


def zip_records(path: str, *, unchecked: bool = False) -> list[ZipRecord]:
    """The stored records of the zip archive ``path`` that carry a CRC-32, in file order.

    torch writes a CRC-32 for every record but checks none when it loads; records saved with
    ``compute_crc32=False`` hold 0 there and are left out (nothing to check them against),
    unless ``unchecked``. Compressed records are always left out: no tensor may lie in one.
    An archive naming a record twice is refused (readers disagree on which one counts).
    """
    records = []
    try:
        with open_regular(path) as f, zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
            if (twice := named_twice(infos)) is not None:
                raise CheckpointFormatError(
                    f"{path}: corrupt torch checkpoint: the zip archive holds record "
                    f"{twice!r} twice"
                )
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    continue
                if info.CRC == 0 and info.file_size and not unchecked:
                    continue
                local = os.pread(f.fileno(), 30 + len(_central_name(info)), info.header_offset)
                start = _data_start(local, info.header_offset)
                if start is None:
                    raise CheckpointFormatError(
                        f"{path}: corrupt torch checkpoint: zip record {info.filename!r} has no "
                        f"local header at byte {info.header_offset}"
                    )
                if (named := _named_otherwise(local, info)) is not None:
                    raise CheckpointFormatError(
                        f"{path}: corrupt torch checkpoint: zip record {info.filename!r} is "
                        f"named {named!r} in its local header (torch reads by the first name)"
                    )
                crc = f"{info.CRC:08x}"
                records.append(ZipRecord(info.filename, start, start + info.file_size, crc))
    except CheckpointFormatError:
        raise
    except ZIP_ERRORS as exc:
        if isinstance(exc, zipfile.BadZipFile) and is_legacy(path):
            raise CheckpointFormatError(f"{path}: {LEGACY_FORMAT}") from None
        raise CheckpointFormatError(f"{path}: corrupt torch checkpoint: {exc}") from None
    records.sort(key=lambda r: r.start)
    for before, after in zip(records, records[1:]):
        if after.start < before.end:
            raise CheckpointFormatError(
                f"{path}: corrupt torch checkpoint: zip records {before.name!r} and "
                f"{after.name!r} overlap"
            )
    return records


def zip_records_in(
    path: str, start: int, length: int, fd: int | None = None, unchecked: bool = False
) -> list[ZipRecord]:
    """``zip_records`` of the archive that fills bytes [start, start + length) of ``path`` (a
    DCP item, which ``torch.save`` wrote with a CRC-32 in every record); offsets are the
    file's. ``fd``: the file, already open. ``unchecked``: as ``zip_records``'s."""
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    records = []
    try:
        with zipfile.ZipFile(RangeReader(fd, start, length)) as archive:
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    continue
                if info.CRC == 0 and info.file_size and not unchecked:
                    continue
                at = start + info.header_offset
                local = os.pread(fd, 30 + len(_central_name(info)), at)
                lo = _data_start(local, at)
                if lo is None:
                    raise CheckpointFormatError(
                        f"{path}: corrupt item at bytes [{start}, {start + length}): zip record "
                        f"{info.filename!r} has no local header"
                    )
                if (named := _named_otherwise(local, info)) is not None:
                    raise CheckpointFormatError(
                        f"{path}: corrupt item at bytes [{start}, {start + length}): zip record "
                        f"{info.filename!r} is named {named!r} in its local header"
                    )
                if lo + info.file_size > start + length:
                    raise CheckpointFormatError(
                        f"{path}: corrupt item at bytes [{start}, {start + length}): zip record "
                        f"{info.filename!r} runs past its end"
                    )
                records.append(ZipRecord(info.filename, lo, lo + info.file_size, f"{info.CRC:08x}"))
    except ZIP_ERRORS as exc:
        if isinstance(exc, CheckpointFormatError):
            raise
        raise CheckpointFormatError(
            f"{path}: corrupt item at bytes [{start}, {start + length}): {exc}"
        ) from None
    finally:
        if own:
            os.close(fd)
    return sorted(records, key=lambda r: r.start)


def crc_checked_endpoint(
    path: str,
    tensors_in: Callable[[int, int], list[str]] | None = None,
    records: list[ZipRecord] | None = None,
) -> FileEndpoint:
    """A reader of a ``.pt`` file that checks each zip record's CRC-32 as its bytes stream
    past; ``tensors_in(lo, hi)`` names the tensors of a damaged range. ``records``: the ones
    to check (of ``zip_records(path)``; default all, the others were checked already)."""
    records = zip_records(path) if records is None else records

    def describe(lo: int, hi: int) -> str:
        names = [r.name for r in records if r.start == lo]
        tensors = tensors_in(lo, hi) if tensors_in else []
        shown = ", ".join(repr(t) for t in tensors[:3]) + (", ..." if len(tensors) > 3 else "")
        return f" (zip record {names[0] if names else '?'}{': ' + shown if shown else ''})"

    return FileEndpoint(
        path,
        [r.crc for r in records],
        spans=[(r.start, r.end) for r in records],
        hasher=Crc32,
        describe=describe,
    )


def check_records(
    path: str,
    tensors_in: Callable[[int, int], list[str]] | None = None,
    records: list[ZipRecord] | None = None,
) -> None:
    """Read every record of ``path`` (or just ``records``) and check its CRC-32; raises
    ``ChecksumMismatchError`` naming the file, record and tensors of the first damaged one."""
    reader = crc_checked_endpoint(path, tensors_in, records)
    try:
        reader.check_all()
    finally:
        reader.close()


def storage_records(path: str) -> dict[int, int]:
    """Where the storages of the archive ``path`` may lie: data start -> size of each of its
    stored (uncompressed) records, those without a CRC-32 too."""
    return {r.start: r.end - r.start for r in zip_records(path, unchecked=True)}


def local_layout(
    path: str, name: str, tensor: torch.Tensor, file_size: int, records: Mapping[int, int]
) -> LocalTensor:
    """The layout of a plain (non-distributed) meta tensor loaded by ``load_layout``.

    ``records``: ``storage_records(path)``. torch places a meta storage by arithmetic over the
    sizes the pickle claims, and grows it to fit any view of it, so neither is trusted: the
    storage must be a stored zip record, and the tensor must lie inside that record.
    """
    # A pickle may set a tensor's attributes (``_rebuild_from_type_v2``'s state): one that
    # shadows a method of torch.Tensor (``is_neg``, ``stride``) would lie to every check here.
    shadowed = sorted(k for k in getattr(tensor, "__dict__", {}) if hasattr(torch.Tensor, k))
    if shadowed:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r}: its pickle sets the attribute {shadowed[0]!r}, which "
            "hides torch.Tensor's own (no torch checkpoint does this; a hostile file?)"
        )
    if tensor.is_conj() or tensor.is_neg():  # the stored bytes are not the tensor's values
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} is a lazily {'conjugated' if tensor.is_conj() else 'negated'}"
            " view (its stored bytes are not its values); save it resolved (.resolve_conj(), "
            ".resolve_neg())"
        )
    storage = tensor.untyped_storage()
    base = getattr(storage, "_checkpoint_offset", None)
    if base is None:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has no storage offset")
    try:
        dtype = code_of(tensor.dtype)
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{path}: tensor {name!r}: {exc}") from None
    isz = tensor.element_size()
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    record_size = records.get(base)
    if record_size is None:
        raise CheckpointFormatError(
            f"{path}: the storage of tensor {name!r} (at byte {base}) is not an uncompressed "
            "record of the zip archive; the file is compressed, damaged or not written by torch"
        )
    if storage.nbytes() != record_size:
        raise CheckpointFormatError(
            f"{path}: the storage of tensor {name!r} claims {storage.nbytes()} bytes but its "
            f"zip record holds {record_size}"
        )
    if any(s < 0 for s in strides):
        raise CheckpointFormatError(f"{path}: tensor {name!r} has negative strides {strides}")
    if tensor.numel():
        last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(shape, strides))
        if tensor.storage_offset() < 0 or (last + 1) * isz > record_size:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} reaches past the end of its storage"
            )
    if base + record_size > file_size:
        raise CheckpointFormatError(
            f"{path}: storage of tensor {name!r} ends at byte {base + record_size}, "
            f"past the end of the file ({file_size} bytes); the file is truncated"
        )
    return LocalTensor(dtype, shape, strides, base + tensor.storage_offset() * isz)
