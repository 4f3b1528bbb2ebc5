"""shardstream: streaming, crash-safe checkpoints for PyTorch FSDP in memory bounded by a buffer.

The public names are imported on first use (PEP 562), so ``import shardstream`` and the CLI's
start-up do not pay for torch and torch.distributed until a command needs them.
"""

from __future__ import annotations

import importlib
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
    from .commands.merge import MergeSummary, merge
    from .commands.verify import verify
    from .manager import CheckpointConfig, CheckpointManager
    from .training.load import load
    from .training.save import save

__version__ = "0.1.0"

# public name -> the module that defines it, imported when the name is first looked up
_LAZY = {
    "load": ".training.load",
    "save": ".training.save",
    "CheckpointConfig": ".manager",
    "CheckpointManager": ".manager",
    "MergeSummary": ".commands.merge",
    "merge": ".commands.merge",
    "verify": ".commands.verify",
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
