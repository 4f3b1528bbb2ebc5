"""shardstream: streaming, crash-safe checkpoints for PyTorch FSDP in memory bounded by a buffer."""

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
from .merge import MergeSummary, merge

__version__ = "0.1.0"

__all__ = [
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
