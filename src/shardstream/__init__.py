"""shardstream: streaming, crash-safe checkpoints for PyTorch FSDP in memory bounded by a buffer.

The public names are imported on first use (PEP 562), so ``import shardstream`` and the CLI's
start-up do not pay for torch and torch.distributed until a command needs them.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

from .errors import (
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    OutOfSpaceError,
    ShardstreamError,
    TargetExistsError,
    UnsafeCheckpointError,
    UsageError,
)

if TYPE_CHECKING:
    from .loading import load
    from .manager import CheckpointConfig, CheckpointManager
    from .merge import MergeSummary, merge
    from .saving import save
    from .verify import verify

__version__ = "0.1.0"

# public name -> the module that defines it, imported when the name is first looked up
_LAZY = {
    "load": ".loading",
    "save": ".saving",
    "CheckpointConfig": ".manager",
    "CheckpointManager": ".manager",
    "MergeSummary": ".merge",
    "merge": ".merge",
    "verify": ".verify",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """``shardstream.merge`` and ``shardstream.verify`` are functions that share their name with
    the submodule defining them. Importing the submodule makes the import system bind it on the
    package; ignore that, so the name keeps meaning the function (as the eager import did)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "load",
    "save",
    "verify",
    "CheckpointFormatError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "MergeSummary",
    "OutOfSpaceError",
    "ShardstreamError",
    "TargetExistsError",
    "UnsafeCheckpointError",
    "UsageError",
    "merge",
]
