"""Default sizes shared by the copy engine, the formats and the commands (no torch here)."""

from __future__ import annotations

DEFAULT_BUFFER_BYTES = 64 * 2**20  # --buffer-size and staging_budget
DEFAULT_CHUNK_BYTES = 4 * 2**20  # the span of one checksum in a data file
DIRECT_ALIGN = 4096  # offset, length and address granularity of direct (O_DIRECT) writes
