"""safetensors headers: built from shapes before any data is written, and validated before trust.

Layout: 8-byte little-endian header length N, N bytes of JSON (space-padded to a multiple of 8),
then the tensors' bytes, packed with no holes in header order.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..engine.dtypes import ITEMSIZE
from ..errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    UsageError,
)
from .regular_file import open_regular

MAX_HEADER_BYTES = 100_000_000
# Tensors one file may list. Planning holds ~2.4 KiB per tensor, so a legal 100 MB header of
# 1.33 million empty tensors took 3.5 GB. A released model's HF file holds a few thousand (a
# DeepSeek-V3 shard ~2,000); a rank file of this format holds its rank's parameters and their
# optimizer state, ~3 per parameter (a per-expert Kimi-K2, 70,000 parameters: ~210,000).
MAX_TENSORS = 1 << 20
METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    data_start: int
    file_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)

    def absolute(self, name: str) -> int:
        """File offset of a tensor's first byte."""
        return self.data_start + self.tensors[name].begin


MAX_DIMENSION = 2**63 - 1  # torch's sizes are int64; safetensors' readers refuse more too


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def build_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
    align: int = 8,
) -> tuple[bytes, list[TensorEntry]]:
    """Serialize a header for tensors laid out in the given order.

    Returns the full prefix (length + JSON + padding) and the entries with their data offsets.
    The JSON is padded with spaces so the data starts at a multiple of ``align`` (a multiple
    of 8; 4096 lets the data be written with direct I/O).
    """
    entries = layout_entries(tensors)
    return encode_header(entries, metadata, align), entries


def layout_entries(tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[TensorEntry]:
    """The entries of tensors packed in the given order; duplicate or non-Unicode names are
    refused."""
    entries, seen, offset = [], set(), 0
    for name, dtype, shape in tensors:
        if name in seen:
            raise CheckpointFormatError(f"duplicate tensor name {name!r} in safetensors layout")
        if name == METADATA_KEY:
            raise CheckpointFormatError(f"tensor name {name!r} is the safetensors metadata key")
        seen.add(name)
        if any(not 0 <= d <= MAX_DIMENSION for d in shape):  # no reader could load it
            raise CheckpointFormatError(
                f"tensor {name!r}: shape {str(list(shape))[:200]} has a dimension beyond "
                f"{MAX_DIMENSION}, torch's largest"
            )
        nbytes = tensor_nbytes(dtype, shape)
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    if not _is_unicode("".join(seen)):  # one check for all: the name is found only on failure
        bad = next(e.name for e in entries if not _is_unicode(e.name))
        raise CheckpointFormatError(
            f"tensor {bad!r}: the name is not valid Unicode (a lone surrogate), which no "
            "safetensors reader accepts"
        )
    if "" in seen:
        raise CheckpointFormatError("a tensor's name is empty: no module holds such a tensor")
    if UNPRINTABLE.search("".join(seen)):
        bad = next(e.name for e in entries if UNPRINTABLE.search(e.name))
        char = UNPRINTABLE.search(bad).group()
        raise CheckpointFormatError(
            f"tensor {bad[:200]!r}: the name holds U+{ord(char):04X}, a control or text-direction "
            "character no module's name holds (it would print as other text)"
        )
    return entries


# C0 and C1 controls (NUL, newline, escape), DEL, and the bidirectional overrides and isolates
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def encode_header(
    entries: Iterable[TensorEntry],
    metadata: Mapping[str, str] | None = None,
    align: int = 8,
    length: int | None = None,
) -> bytes:
    """The header prefix (length + JSON + padding) of ``layout_entries``' entries; padded
    with spaces to ``length`` bytes in all where given (a header written over one of that
    length), else to the next multiple of ``align``."""
    if align <= 0 or align % 8:
        raise ValueError(f"header alignment {align} is not a positive multiple of 8")
    doc: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    body = json.dumps(doc, separators=(",", ":")).encode()
    if length is not None:
        if 8 + len(body) > length:
            raise ValueError(f"header of {8 + len(body)} bytes does not fit in {length}")
        body += b" " * (length - 8 - len(body))
    else:
        body += b" " * (-(len(body) + 8) % align)
    return struct.pack("<Q", len(body)) + body


def _is_unicode(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate a header against the safetensors rules and the file's real size."""
    raw, file_size = read_header_bytes(path)
    return parse_header(os.fspath(path), raw[8:], file_size)


def read_header_bytes(path: str | os.PathLike) -> tuple[bytes, int]:
    """A safetensors file's first ``8 + header length`` bytes, unparsed (for a digest checked
    before the header is believed), and the file's size."""
    path = os.fspath(path)
    try:
        with open_regular(path) as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointFormatError(f"{path}: not a safetensors file ({file_size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise UnsafeCheckpointError(
                    f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"
                )
            if 8 + header_len > file_size:
                raise CheckpointFormatError(
                    f"{path}: header length {header_len} runs past the end of the file "
                    f"({file_size} bytes); the file is truncated or corrupt"
                )
            raw = f.read(header_len)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointFormatError(
            f"{path}: is a directory, expected a safetensors file"
        ) from None
    except PermissionError:
        raise UsageError(f"{path}: cannot read: permission denied") from None
    except OSError as exc:  # a symlink loop, an I/O error
        raise CheckpointFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return prefix + raw, file_size


def parse_header(path: str, raw: bytes, file_size: int) -> SafetensorsHeader:
    data_start = 8 + len(raw)
    listed = raw.count(b'"data_offsets"')  # each entry names it once: counted before parsing
    if listed > MAX_TENSORS:
        raise UnsafeCheckpointError(
            f"{path}: header lists about {listed} tensors, more than the {MAX_TENSORS} one file "
            "may hold here (a released model's file holds a few thousand; planning costs ~2.4 "
            "KiB of memory per tensor)"
        )
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # Recursion: deep nesting
        raise CheckpointFormatError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: header is not a JSON object")
    metadata = doc.pop(METADATA_KEY, None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointFormatError(f"{path}: __metadata__ must map strings to strings")
    if len(doc) > MAX_TENSORS:
        raise UnsafeCheckpointError(
            f"{path}: header lists {len(doc)} tensors, more than the {MAX_TENSORS} one file may "
            "hold here"
        )
    entries = [_parse_entry(path, name, info) for name, info in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for entry in entries:
        if entry.begin != expected:
            what = "overlaps the previous tensor" if entry.begin < expected else "leaves a hole"
            raise CheckpointFormatError(
                f"{path}: tensor {entry.name!r} at bytes [{entry.begin}, {entry.end}) {what} "
                f"(expected it to start at {expected})"
            )
        expected = entry.end
    data_size = file_size - data_start
    if expected != data_size:
        raise CheckpointFormatError(
            f"{path}: tensors cover {expected} data bytes but the file holds {data_size}; "
            "the file is truncated or has trailing bytes"
        )
    return SafetensorsHeader(path, data_start, file_size, {e.name: e for e in entries}, metadata)


def _parse_entry(path: str, name: str, info: object) -> TensorEntry:
    if not _is_unicode(name):  # a lone surrogate: safetensors itself refuses the file
        raise CheckpointFormatError(f"{path}: tensor name {name!r} is not valid Unicode")
    if not isinstance(info, dict):
        raise CheckpointFormatError(f"{path}: entry for tensor {name!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIMENSION for d in shape
    ):
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} has invalid shape {repr(shape)[:200]} (each dimension "
            f"an integer from 0 to {MAX_DIMENSION}, torch's largest)"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointFormatError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    nbytes = tensor_nbytes(dtype, shape)
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} needs {nbytes} bytes, "
            f"but its data_offsets span {offsets[1] - offsets[0]}"
        )
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


# --- writing, with checksums carried in the header ------------------------------------------

CHECKSUM_PREFIX = "shardstream."


# The files merge writes beside the weights (config, tokenizer, index, adapter), as
# ``name=xxh3`` pairs joined by ";" (``hf_writer.files_value``), in the first weight file's
# header: verify checks them as it checks the weights' chunks.
FILES_KEY = CHECKSUM_PREFIX + "files"


def files_value_length(names: Iterable[str]) -> int:
    """The most characters ``hf_writer.files_value`` takes, JSON-escaped, for ``names``."""
    from ..engine.checksum import new_hasher  # xxhash only

    width = len(new_hasher().hexdigest())
    names = sorted(set(names))
    return len(json.dumps(";".join(f"{n}={'0' * width}" for n in names))) - 2 if names else 0


def read_files_value(value: str) -> dict[str, str] | None:
    """``hf_writer.files_value``'s pairs as name -> digest; None for a value not of that form."""
    out = {}
    for pair in value.split(";") if value else []:
        name, sep, found = pair.rpartition("=")
        if not sep or not name or name in out:
            return None
        out[name] = found
    return out


def entries_digest(entries: Iterable[TensorEntry]) -> str:
    """A digest of names, dtypes, shapes and offsets, so a header edit is detected too."""
    from ..engine.checksum import digest

    canon = [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in entries]
    return digest(json.dumps(canon, separators=(",", ":")).encode())


def checksum_metadata(
    entries: list[TensorEntry], chunk_bytes: int, chunks: list[str] | None, data_size: int
) -> dict[str, str]:
    from ..engine.checksum import ALGORITHM, DIGEST_WIDTH

    if not _power_of_two(chunk_bytes):
        raise UsageError(f"chunk size {chunk_bytes} is not a power of two")
    count = -(-data_size // chunk_bytes) if data_size else 0
    text = "".join(chunks) if chunks is not None else "0" * (DIGEST_WIDTH * count)
    return {
        f"{CHECKSUM_PREFIX}algorithm": ALGORITHM,
        f"{CHECKSUM_PREFIX}chunk_bytes": str(chunk_bytes),
        f"{CHECKSUM_PREFIX}entries": entries_digest(entries),
        f"{CHECKSUM_PREFIX}chunks": text,
    }


def _power_of_two(n: int) -> bool:
    return type(n) is int and n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class StoredChecksums:
    chunk_bytes: int
    chunks: list[str]
    entries: str


def stored_checksums(header: SafetensorsHeader) -> StoredChecksums | None:
    """The checksums shardstream wrote into this header, or None for a foreign file."""
    from ..engine.checksum import ALGORITHM, DIGEST_WIDTH

    meta = header.metadata
    if not any(key.startswith(CHECKSUM_PREFIX) for key in meta):
        return None  # a foreign file; one with only some of our keys had a key name altered
    try:
        if meta[f"{CHECKSUM_PREFIX}algorithm"] != ALGORITHM:
            raise ValueError("unknown algorithm")
        chunk_text = meta[f"{CHECKSUM_PREFIX}chunk_bytes"]
        chunk_bytes = int(chunk_text)
        text = meta[f"{CHECKSUM_PREFIX}chunks"]
        entries = meta[f"{CHECKSUM_PREFIX}entries"]
        if chunk_bytes <= 0 or len(text) % DIGEST_WIDTH:
            raise ValueError("bad chunk table")
        # No digest covers this value, and in a file whose data fits in one chunk any larger
        # value verifies alike; so it must be a power of two written in plain decimal. One changed
        # character of such a number never gives another one (beyond 1, 2, 4, 8).
        if chunk_text != str(chunk_bytes) or not _power_of_two(chunk_bytes):
            raise ValueError(f"chunk_bytes {chunk_text!r} is not a power of two in plain decimal")
    except (KeyError, ValueError) as exc:
        raise CheckpointFormatError(f"{header.path}: damaged checksum metadata ({exc})") from None
    chunks = [text[i : i + DIGEST_WIDTH] for i in range(0, len(text), DIGEST_WIDTH)]
    data_size = header.file_size - header.data_start
    if len(chunks) != (-(-data_size // chunk_bytes) if data_size else 0):
        raise CheckpointFormatError(
            f"{header.path}: checksum table has {len(chunks)} chunks for {data_size} data bytes"
        )
    return StoredChecksums(chunk_bytes, chunks, entries)


def tensors_in_range(header: SafetensorsHeader, lo: int, hi: int) -> list[str]:
    """Names of tensors overlapping file bytes [lo, hi)."""
    return [
        e.name
        for e in header.tensors.values()
        if header.data_start + e.begin < hi and header.data_start + e.end > lo
    ]


def range_description(header: SafetensorsHeader, lo: int, hi: int) -> str:
    """What a damaged range [lo, hi) of the file holds, for an error message: its first
    tensors' names, or the header."""
    names = tensors_in_range(header, lo, hi)
    if not names:
        return " (header)"
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f" (tensor {', '.join(repr(n) for n in names[:3])}{more})"
