"""The one checksum shardstream writes: xxh3-64, as 16 lower-case hex digits; and CRC-32,
which zip archives (torch's ``.pt`` files) record and shardstream checks when it reads them."""

from __future__ import annotations

import xxhash

try:  # zlib-ng's CRC-32 uses carry-less multiplication: ~10x the stdlib's on x86-64
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - the same function, slower
    from zlib import crc32
try:  # CRC-32 of A + B from CRC-32(A), CRC-32(B) and len(B): pieces checked in any order
    from zlib_ng.zlib_ng import crc32_combine
except ImportError:  # pragma: no cover - pieces are then hashed in file order only
    crc32_combine = None

ALGORITHM = "xxh3_64"
EMPTY_DIGEST = xxhash.xxh3_64_hexdigest(b"")
DIGEST_WIDTH = 16


def new_hasher() -> xxhash.xxh3_64:
    return xxhash.xxh3_64()


def digest(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class ChunkHasher:
    """Digests of a byte range cut into ``chunk_bytes`` chunks, fed in pieces of any size.

    The range is ``length`` bytes long; its last chunk ends there, shorter if need be, and
    bytes fed past it are ignored. ``digests`` grows as chunks complete.
    """

    def __init__(self, chunk_bytes: int, length: int):
        self.chunk_bytes, self.length = chunk_bytes, length
        self.digests: list[str] = []
        self.fed = 0
        self._hasher = new_hasher()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view) and self.fed < self.length:
            chunk_end = min((len(self.digests) + 1) * self.chunk_bytes, self.length)
            take = min(len(view) - pos, chunk_end - self.fed)
            self._hasher.update(view[pos : pos + take])
            pos += take
            self.fed += take
            if self.fed == chunk_end:
                self.digests.append(self._hasher.hexdigest())
                self._hasher = new_hasher()


class Crc32:
    """CRC-32 (zip's) behind the hasher interface of ``new_hasher()``: 8 lower-case hex digits.

    ``combinable``: pieces of a span can be hashed apart, in any order, and their CRCs joined
    (``crc32_combine``), so a reader may visit a record's bytes out of order."""

    combinable = crc32_combine is not None

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"

    def reset(self) -> None:
        self.value = 0
