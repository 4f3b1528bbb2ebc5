"""The error tree. Every error shardstream raises on purpose derives from ShardstreamError.

Each subclass also inherits the fitting builtin, so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations


class ShardstreamError(Exception):
    """Root of all deliberate shardstream errors. ``str(err)`` is a complete one-line message."""


class CheckpointNotFoundError(ShardstreamError, FileNotFoundError):
    """A directory or file the operation needs does not exist."""


class CheckpointFormatError(ShardstreamError, ValueError):
    """Input that is truncated, corrupt, or inconsistent with itself."""


class UnsafeCheckpointError(CheckpointFormatError):
    """Input that tries to run code, escape its directory, or allocate absurd amounts."""


class ChecksumMismatchError(CheckpointFormatError):
    """Bytes on disk differ from the checksum recorded when they were written."""


class TargetExistsError(ShardstreamError, FileExistsError):
    """The output location is taken and overwriting was not asked for."""


class OutOfSpaceError(ShardstreamError, OSError):
    """The disk filled up while writing; partial output has been removed."""


class UsageError(ShardstreamError, ValueError):
    """An argument or configuration value is invalid."""


class CheckpointLockedError(ShardstreamError, RuntimeError):
    """Another live process holds the checkpoint directory's lock."""
