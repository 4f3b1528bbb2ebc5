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
