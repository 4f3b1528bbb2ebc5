"""Sizes: the defaults every layer shares, and human-readable sizes ("5GB", "64MiB") parsed
to byte counts at the CLI and config boundary only (no torch here)."""

from __future__ import annotations

import os
import re
from fractions import Fraction

from .errors import UsageError

DEFAULT_BUFFER_BYTES = 64 * 2**20  # --buffer-size and staging_budget
DEFAULT_CHUNK_BYTES = 4 * 2**20  # the span of one checksum in a data file
# save_pretrained's default max_shard_size: "5GB" in transformers 4, "50GB" from 5.0
SHARD_BYTES_TRANSFORMERS_4 = 5 * 10**9
SHARD_BYTES_TRANSFORMERS_5 = 50 * 10**9
DIRECT_ALIGN = 4096  # offset, length and address granularity of direct (O_DIRECT) writes
WHOLE_STATE = "state"  # staging_budget: an async save may stage the rank's whole state

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?[Bb]?)\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Parse a byte size the way transformers' ``max_shard_size`` does.

    Decimal units (KB, MB, GB) are powers of 10, binary ones (KiB, MiB, GiB) powers of 2, and a
    lower-case ``b`` (``5Gb``) means bits. ``parse_size("5GB") == 5_000_000_000``.
    """
    if isinstance(value, bool):
        raise UsageError(f"invalid size {value!r}: expected an integer or a string like '5GB'")
    if isinstance(value, int):
        if value < 0:
            raise UsageError(f"invalid size {value}: must not be negative")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise UsageError(
            f"invalid size {value!r}: expected a number and a unit like '5GB' or '64MiB'"
        )
    number, unit = match.groups()
    bits = unit.endswith("b") and not unit.upper().endswith("IB")
    factor = _UNITS.get(unit.upper())
    if factor is None:
        raise UsageError(f"invalid size {value!r}: unknown unit {unit!r}")
    size = int(Fraction(number) * factor)  # exact: float loses digits past 2**53
    return size // 8 if bits else size


def available_memory() -> int | None:
    """Bytes of memory this machine can give a process now (``MemAvailable``), else its
    physical memory; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def check_buffer_size(value: int | str, flag: str = "--buffer-size") -> int:
    """``parse_size(value)``, refused up front when it exceeds the memory available (a 100TB
    buffer failed deep inside with ENOMEM, a 20-digit one with OverflowError)."""
    nbytes = parse_size(value)
    available = available_memory()
    if available is not None and nbytes > available:
        raise UsageError(
            f"{flag} {value}: {format_size(nbytes)} is more than the {format_size(available)} "
            "of memory available"
        )
    return nbytes


def format_size(nbytes: float) -> str:
    """``format_size(1536) == '1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def staging_limit(budget: int | str) -> int | None:
    """A ``staging_budget`` in bytes; None for ``"state"`` (an async save may stage the rank's
    whole state)."""
    if isinstance(budget, str) and budget.strip().lower() == WHOLE_STATE:
        return None
    return parse_size(budget)
