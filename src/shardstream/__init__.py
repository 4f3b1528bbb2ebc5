"""shardstream: streaming, crash-safe checkpoints for PyTorch FSDP in memory bounded by a buffer."""

from .checkpoint import load, save
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
from .manager import CheckpointConfig, CheckpointManager
from .merge import MergeSummary, merge
from .verify import verify

__version__ = "0.1.0"

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
