"""``.pt`` files (torch zip archives) read for their layout only: no tensor bytes are loaded.

Loading with ``map_location="meta"`` and ``weights_only=True`` runs torch's restricted
unpickler (no arbitrary code) and gives each storage its byte offset inside the archive, where
torch stores it uncompressed; the executor then reads exactly the ranges it needs.

DTensors come back as ``DistributedTensor`` records. To resolve their pickles, torch's own
classes would have to be imported (``torch.distributed.tensor``, ~0.75 s: it registers every
sharding rule); unless that module is already loaded, the unpickler's allowlist gets inert
stand-ins under the same names instead. It is still torch's restricted unpickler: the stand-ins
only record the state they are given, so no code runs. A file they cannot describe (another
torch version's layout, a global they lack) is loaded again with torch's classes.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import pickle
import struct
import sys
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


def load_layout(path: str):
    """Unpickle ``path`` safely onto the meta device; raise shardstream errors only.

    DTensors anywhere in the result (dicts, lists, tuples) are ``DistributedTensor`` records.
    """
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path}: no such file")
    damage = _zip_damage(path)
    if damage:
        raise CheckpointFormatError(
            f"{path}: corrupt or truncated torch checkpoint ({os.path.getsize(path)} bytes): "
            f"{damage}"
        )
    stand_ins = _stand_ins()
    if stand_ins:
        try:
            with torch.serialization.safe_globals(stand_ins):
                return _records(_load(path), path, _from_stand_in)
        except Exception:  # noqa: BLE001  (torch's own classes decide, below)
            pass
    importlib.import_module("torch.distributed.tensor")  # registers DTensor with the unpickler
    return _records(_load(path), path, _from_dtensor)


def _load(path: str):
    try:
        with warnings.catch_warnings(), _quiet_device_mesh():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "sharded_tensor.api.ShardedTensor" in str(exc):
            raise CheckpointFormatError(
                f"{path}: holds FSDP1 ShardedTensors (saved without a device mesh), which "
                "shardstream does not read; save FSDP1 with device_mesh=init_device_mesh(...) "
                "(DTensor state) or use FSDP2"
            ) from None
        first = str(exc).strip().splitlines()
        detail = next((line for line in first if "Unsupported" in line or "GLOBAL" in line), "")
        raise UnsafeCheckpointError(
            f"{path}: refused to unpickle: the file asks for code or types outside the safe "
            f"allowlist{': ' + detail.strip() if detail else ''}"
        ) from None
    except Exception as exc:  # noqa: BLE001  (a damaged pickle fails anywhere in the unpickler)
        lines = str(exc).strip().splitlines()
        message = lines[0] if lines else ""
        if not message or not isinstance(exc, _READ_ERRORS):  # name the unexpected ones
            message = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        raise CheckpointFormatError(
            f"{path}: not a readable torch checkpoint (truncated or corrupt?): {message}"
        ) from None


# What torch.load raises for a truncated or corrupt archive; anything else is named by type.
_READ_ERRORS = (RuntimeError, zipfile.BadZipFile, EOFError, ValueError, OSError)


def _records(obj, path: str, convert, depth: int = 0):
    """``obj`` with every DTensor (or stand-in) replaced by ``convert(value)``."""
    if depth > 64:
        raise CheckpointFormatError(f"{path}: state nested more than 64 levels deep")
    if isinstance(obj, _StandInTensor) or _is_dtensor(obj):
        try:
            return convert(obj)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise CheckpointFormatError(
                f"{path}: a DTensor whose layout shardstream cannot read ({exc})"
            ) from None
    if isinstance(obj, dict):
        items = [(k, _records(v, path, convert, depth + 1)) for k, v in obj.items()]
        if type(obj) is dict:
            return dict(items)
        obj.clear()  # OrderedDict and friends keep their type
        obj.update(items)
        return obj
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        converted = [_records(v, path, convert, depth + 1) for v in obj]
        return converted if isinstance(obj, list) else tuple(converted)
    return obj


def _is_dtensor(obj) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _optional_ints(values) -> tuple[int, ...] | None:
    return None if values is None else _ints(values)


def _from_dtensor(value) -> DistributedTensor:
    """A record of a real DTensor (torch.distributed.tensor was loaded)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = []
    for p in value.placements:
        if type(p) is Shard:
            placements.append(Placement("Shard", int(p.dim)))
        elif isinstance(p, Replicate):
            placements.append(Placement("Replicate"))
        else:
            placements.append(Placement(str(p)))
    mesh = value.device_mesh
    return DistributedTensor(
        tuple(value.shape),
        tuple(placements),
        MeshLayout(
            _ints(mesh.shape),
            tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            _optional_ints(getattr(mesh, "_coordinate_on_dim", None)),
            getattr(mesh, "_rank", None),
            _optional_ints(getattr(mesh, "_flatten_rank_map", None)),
        ),
        value._local_tensor,
    )


def _from_stand_in(value: _StandInTensor) -> DistributedTensor:
    """A record of a stand-in DTensor; anything unexpected raises (then torch's classes load)."""
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
    axes = layout.state["axes"] if isinstance(layout, _Record) else layout.axes
    return tuple(axes)


def _axis_shape(axis) -> tuple[int, ...]:
    shape = axis.state["shape"] if isinstance(axis, _Record) else axis.shape
    return (int(shape),) if isinstance(shape, int) else _ints(shape)


class _Record:
    """A stand-in instance: keeps the pickled state in ``.state`` and nothing else."""

    state: Mapping = MappingProxyType({})  # until the pickle's BUILD gives one

    def __init__(self, *args):
        self.state = {"args": args}

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise TypeError("stand-in state must be a dict")
        self.state = {**self.state, **state}


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
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise TypeError("DTensor state must be a dict")
        self._stand_in_state = state


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


def _stand_ins() -> list[tuple[type, str]]:
    """The stand-ins for names the allowlist does not hold yet; none once torch's DTensor
    classes are loaded (two classes under one name would make the pick arbitrary)."""
    if "torch.distributed.tensor" in sys.modules:
        return []
    taken = set()
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            taken.add(entry[1])
        else:
            taken.add(f"{entry.__module__}.{entry.__qualname__}")
    if "torch.distributed.tensor.DTensor" in taken:
        return []
    return [(cls, name) for name, cls in _STAND_INS.items() if name not in taken]


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
            with archive.open(pickles[0]) as record:
                while record.read(1 << 20):
                    pass
    except zipfile.BadZipFile as exc:
        return str(exc)
    except (OSError, EOFError, ValueError, NotImplementedError) as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


@dataclass(frozen=True)
class ZipRecord:
    """A stored (uncompressed) zip record: its data bytes [start, end) and their CRC-32."""

    name: str
    start: int
    end: int
    crc: str


def zip_records(path: str) -> list[ZipRecord]:
    """The stored records of the zip archive ``path`` that carry a CRC-32, in file order.

    torch writes a CRC-32 for every record but checks none when it loads; records saved with
    ``compute_crc32=False`` hold 0 there and are left out (nothing to check them against).
    """
    records = []
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED or (info.CRC == 0 and info.file_size):
                    continue
                local = os.pread(f.fileno(), 30, info.header_offset)
                if len(local) < 30 or local[:4] != b"PK\x03\x04":
                    raise CheckpointFormatError(
                        f"{path}: corrupt torch checkpoint: zip record {info.filename!r} has no "
                        f"local header at byte {info.header_offset}"
                    )
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = info.header_offset + 30 + name_len + extra_len
                crc = f"{info.CRC:08x}"
                records.append(ZipRecord(info.filename, start, start + info.file_size, crc))
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: corrupt torch checkpoint: {exc}") from None
    records.sort(key=lambda r: r.start)
    for before, after in zip(records, records[1:]):
        if after.start < before.end:
            raise CheckpointFormatError(
                f"{path}: corrupt torch checkpoint: zip records {before.name!r} and "
                f"{after.name!r} overlap"
            )
    return records


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


def local_layout(path: str, name: str, tensor: torch.Tensor, file_size: int) -> LocalTensor:
    """The layout of a plain (non-distributed) meta tensor loaded by ``load_layout``."""
    storage = tensor.untyped_storage()
    base = getattr(storage, "_checkpoint_offset", None)
    if base is None:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has no storage offset")
    dtype = code_of(tensor.dtype)
    isz = tensor.element_size()
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if tensor.numel():
        last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(shape, strides))
        if tensor.storage_offset() < 0 or (last + 1) * isz > storage.nbytes():
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} reaches past the end of its storage"
            )
    if base + storage.nbytes() > file_size:
        raise CheckpointFormatError(
            f"{path}: storage of tensor {name!r} ends at byte {base + storage.nbytes()}, "
            f"past the end of the file ({file_size} bytes); the file is truncated"
        )
    return LocalTensor(dtype, shape, strides, base + tensor.storage_offset() * isz)


class _quiet_device_mesh:
    """Silence DeviceMesh's harmless 'unpickled before the PGs were created' warning."""

    def __enter__(self):
        self.logger = logging.getLogger("torch.distributed.device_mesh")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
