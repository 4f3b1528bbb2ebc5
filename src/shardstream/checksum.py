"""The one checksum shardstream uses: xxh3-64, as 16 lower-case hex digits."""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"
EMPTY_DIGEST = xxhash.xxh3_64_hexdigest(b"")
DIGEST_WIDTH = 16


def new_hasher() -> xxhash.xxh3_64:
    return xxhash.xxh3_64()


def digest(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)
