"""``.pt`` files (torch zip archives) read for their layout only: no tensor bytes are loaded.

Loading with ``map_location="meta"`` and ``weights_only=True`` runs torch's restricted
unpickler (no arbitrary code) and gives each storage its byte offset inside the archive, where
torch stores it uncompressed; the executor then reads exactly the ranges it needs.
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings
import zipfile
from dataclasses import dataclass

import torch

from ..dtypes import code_of
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from ..plan import Block


@dataclass(frozen=True)
class LocalTensor:
    """Where a tensor's elements sit in a ``.pt`` file."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int  # file offset of element [0, ..., 0]

    def block(self, path: str, start: tuple[int, ...]) -> Block:
        return Block(path, self.offset, self.dtype, start, self.shape, self.strides)


def load_layout(path: str) -> dict:
    """Unpickle ``path`` safely onto the meta device; raise shardstream errors only."""
    import torch.distributed.tensor  # noqa: F401  (registers DTensor with the safe unpickler)

    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path}: no such file")
    damage = _zip_damage(path)
    if damage:
        raise CheckpointFormatError(
            f"{path}: corrupt or truncated torch checkpoint ({os.path.getsize(path)} bytes): "
            f"{damage}"
        )
    try:
        with warnings.catch_warnings(), _quiet_device_mesh():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="meta", weights_only=True)
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
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointFormatError(
            f"{path}: not a readable torch checkpoint (truncated or corrupt?): {message}"
        ) from None
    return obj


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
