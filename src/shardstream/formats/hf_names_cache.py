"""An on-disk cache of the NamePlans transformers computes (``hf_names.plan_names``), so that
only the first merge, export or inspect of a layout pays for importing transformers and its
modeling module (seconds); later ones read a small JSON file and import nothing.

Key: sha256 of the cache format (``CACHE_FORMAT``, bumped with the planning code), the
installed transformers version (read from its package metadata, which imports nothing),
config.json's content as canonical JSON (``model_type`` and ``architectures`` among it), the
stored tensors (name, dtype code, shape) in order, and apart from them the heads config.json
ties (``tied``: the plan keeps those the model holds apart).
Directory: ``$SHARDSTREAM_CACHE_DIR`` if set (the empty string disables the cache), else
``$XDG_CACHE_HOME/shardstream/hf-layouts``, else ``~/.cache/shardstream/hf-layouts``. It holds
at most ``MAX_ENTRIES`` plans: a hit touches its file's mtime, and each store removes the
least recently used beyond that (other processes may prune at the same time: a file already
gone is no error), and the temporary files of writes a crash cut off, once they are an hour old
(a write takes milliseconds, so none is still being written).

A file is read with the strict JSON reader (``jsondoc``) and checked: its ``digest`` (sha256
of its key, rule and pieces as canonical JSON) must match, so a damaged or hand-edited plan
that is still well-formed JSON is not used; and against the request: every piece names a
stored tensor of the request, its box lies inside that tensor, its output shape is the box's,
output names are unique, every field has its type. Anything else is a miss: the plan is
computed again and the file rewritten. (The directory is trusted as the user's own files are:
whoever can write there can also write a matching digest.)
Writes are atomic (``storage.commit.atomic_write_bytes``); a write that fails
(a read-only home, a full disk) is skipped, logged at debug level.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import ShardstreamError
from ..storage.commit import TMP_MARK, atomic_write_bytes
from .jsondoc import is_counts

log = logging.getLogger(__name__)

# Bump whenever what plan_names computes or refuses, or this file's layout, changes. 2: the
# shape and size checks against config.json's model (a plan cached before them is not used);
# 3: the digest; 4: a model holding none of the stored tensors is not planned by;
# 5: the aliases save_pretrained leaves out (T5's encoder/decoder embed_tokens); 6: the
# model's parts the checkpoint holds nothing of (``missing``); 7: a box from the origin that is
# part of its stored tensor (the first chunk of a split) was planned as the whole tensor;
# 8: a checkpoint in the saved layout whose names partly are in-memory names too; 9: pieces in
# the model's order, and the saved layout's storage groups; 10: the outputs of buffers;
# 11: the heads config.json ties, asked of the model (``tied``), a class that ties none kept;
# 12: the aliases left out, each with the tensor written for it (``aliases``); 13: ``missing``
# names parts as ``part.*`` and, by name, tensors missing from the parts the output holds.
CACHE_FORMAT = 13
ENV = "SHARDSTREAM_CACHE_DIR"
MAX_ENTRIES = 64  # plans kept in the cache directory, most recently used first
ENTRY = re.compile(r"[0-9a-f]{64}\.json")  # a plan's file: its key; nothing else is pruned
# ``atomic_write_bytes``'s temporary for a plan's file, and the age at which one is surely dead
STALE_WRITE = re.compile(r"[0-9a-f]{64}\.json" + re.escape(TMP_MARK) + r"[0-9a-f]{8}")
STALE_WRITE_S = 3600
FIELDS = ("name", "stored", "start", "extent", "dims", "shape", "storage", "storage_numel")

Tensors = Sequence[tuple[str, str, tuple[int, ...]]]


def cache_dir() -> Path | None:
    """Where plans are kept; None when ``$SHARDSTREAM_CACHE_DIR`` is set to ``""``."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardstream" / "hf-layouts"


def transformers_version() -> str | None:
    """The installed transformers' version, without importing it; None when absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except (PackageNotFoundError, ValueError):
        return None


def cache_key(
    tensors: Tensors, config: dict, version: str | None = None, tied: Tensors = ()
) -> str | None:
    """The hex key of a request, or None when it cannot be keyed (no transformers installed,
    a config that is not JSON)."""
    version = version if version is not None else transformers_version()
    if version is None or not isinstance(config, dict):
        return None
    try:
        described = json.dumps(
            {
                "format": CACHE_FORMAT,
                "transformers": version,
                "config": config,
                "tensors": [[n, d, [int(x) for x in s]] for n, d, s in tensors],
                "tied": [[n, d, [int(x) for x in s]] for n, d, s in tied],
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
            allow_nan=False,
        )
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(described.encode()).hexdigest()


def load(
    tensors: Tensors, config: dict, tied: Tensors = ()
) -> tuple[str, list[dict], list[str], list[str], list[list[str]]] | None:
    """The cached ``(rule, pieces, missing, buffers, aliases)`` for this request, pieces as
    dicts of ``FIELDS`` with tuples; None on a miss, a disabled cache or a file that fails any
    check."""
    directory = cache_dir()
    key = cache_key(tensors, config, tied=tied)
    if directory is None or key is None:
        return None
    path = directory / f"{key}.json"
    from .jsondoc import read_object

    try:
        if not path.is_file():
            return None
        doc = read_object(path, "cached layout")
        found = _checked(doc, key, [*tensors, *tied])
    except (OSError, ShardstreamError, ValueError, TypeError, KeyError, RecursionError) as exc:
        log.debug("ignoring the cached layout %s: %s", path, exc)
        return None
    if found is None:
        log.debug("ignoring the cached layout %s: it does not fit the request", path)
        return None
    try:
        os.utime(path)  # recently used: pruned last
    except OSError as exc:  # a read-only cache, or pruned by another process meanwhile
        log.debug("cannot touch the cached layout %s: %s", path, exc)
    return found


def store(
    tensors: Tensors,
    config: dict,
    rule: str,
    pieces: Sequence,
    missing: Sequence[str] = (),
    buffers: Sequence[str] = (),
    tied: Tensors = (),
    aliases: Sequence[tuple[str, str]] = (),
) -> None:
    """Keep ``rule``, ``pieces`` (``hf_names.Piece``), ``missing`` (``NamePlan.missing``),
    ``buffers`` (``NamePlan.buffers``) and ``aliases`` (``NamePlan.aliases``) for this
    request; never raises for a directory or disk that refuses the write."""
    directory = cache_dir()
    key = cache_key(tensors, config, tied=tied)
    if directory is None or key is None:
        return
    listed = [
        {
            "name": p.name,
            "stored": p.stored,
            "start": list(p.start),
            "extent": list(p.extent),
            "dims": list(p.dims),
            "shape": list(p.shape),
            "storage": p.storage,
            "storage_numel": p.storage_numel,
        }
        for p in pieces
    ]
    doc = {
        "format": CACHE_FORMAT,
        "key": key,
        "transformers": transformers_version(),
        "rule": rule,
        "pieces": listed,
        "missing": list(missing),
        "buffers": list(buffers),
        "aliases": [list(pair) for pair in aliases],
        "digest": _digest(
            key, rule, listed, list(missing), list(buffers), [list(pair) for pair in aliases]
        ),
    }
    try:
        raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / f"{key}.json", raw)
    except (OSError, ShardstreamError, ValueError, TypeError) as exc:
        log.debug("not caching the layout in %s: %s", directory, exc)
        return
    prune(directory)


def prune(directory: Path, keep: int | None = None) -> None:
    """Remove all but the ``keep`` (``MAX_ENTRIES``) most recently used plans, by mtime, from
    ``directory``, and plan-file temporaries older than ``STALE_WRITE_S``; files named as
    neither are left alone. Other processes may store, touch
    or prune at the same time: a file that is gone when looked at or removed is skipped; any
    other failure stops the pruning, logged at debug level."""
    keep = MAX_ENTRIES if keep is None else keep
    try:
        found, doomed = [], []
        stale_before = time.time_ns() - STALE_WRITE_S * 10**9
        with os.scandir(directory) as entries:
            for entry in entries:
                plan, stale = ENTRY.fullmatch(entry.name), STALE_WRITE.fullmatch(entry.name)
                if not plan and not stale:
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    mtime = entry.stat(follow_symlinks=False).st_mtime_ns
                except FileNotFoundError:
                    continue
                if plan:
                    found.append((mtime, entry.name))
                elif mtime < stale_before:
                    doomed.append(entry.name)
        found.sort(reverse=True)
        for name in [name for _, name in found[keep:]] + doomed:
            try:
                os.unlink(directory / name)
            except FileNotFoundError:
                continue
    except OSError as exc:
        log.debug("not pruning the cached layouts in %s: %s", directory, exc)


def _digest(
    key: str, rule: object, pieces: object, missing: object, buffers: object, aliases: object
) -> str:
    canonical = json.dumps(
        [key, rule, pieces, missing, buffers, aliases], sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _is_int(value: object, low: int = 0) -> bool:
    return type(value) is int and value >= low


_FIELD_SET = frozenset(FIELDS)


def _checked(
    doc: dict, key: str, tensors: Tensors
) -> tuple[str, list[dict], list[str], list[str], list[list[str]]] | None:
    """``doc``'s rule, pieces, missing parts, buffers' outputs and aliases when every check
    holds against the request, else None."""
    if doc.get("format") != CACHE_FORMAT or doc.get("key") != key:
        return None
    rule, pieces, missing = doc.get("rule"), doc.get("pieces"), doc.get("missing")
    if not isinstance(rule, str) or not isinstance(pieces, list):
        return None
    if not isinstance(missing, list) or not all(type(m) is str for m in missing):
        return None
    buffers = doc.get("buffers")
    if not isinstance(buffers, list) or not all(type(b) is str for b in buffers):
        return None
    aliases = doc.get("aliases")
    if doc.get("digest") != _digest(key, rule, pieces, missing, buffers, aliases):
        return None
    shapes = {n: tuple(int(x) for x in s) for n, _, s in tensors}
    if not isinstance(aliases, list) or not all(
        type(pair) is list and len(pair) == 2 and all(type(n) is str and n in shapes for n in pair)
        for pair in aliases
    ):
        return None
    own = {n: n for n in shapes}  # one string per stored name, not one per piece
    names: set[str] = set()
    out = []
    for piece in pieces:
        if type(piece) is not dict or piece.keys() != _FIELD_SET:
            return None
        name, stored = piece["name"], piece["stored"]
        if type(name) is not str or name in names or type(stored) is not str:
            return None
        names.add(name)
        stored_shape = shapes.get(stored)
        start, extent, dims, shape = piece["start"], piece["extent"], piece["dims"], piece["shape"]
        if stored_shape is None or not all(map(is_counts, (start, extent, shape))):
            return None
        ndim = len(stored_shape)
        if len(start) != ndim or len(extent) != ndim:
            return None
        if any(s + e > size for s, e, size in zip(start, extent, stored_shape)):
            return None
        if type(dims) is not list or len(dims) != len(shape):
            return None
        used = [d for d in dims if d is not None]
        if not all(_is_int(d) and d < ndim for d in used) or len(set(used)) != len(used):
            return None
        if any(size != (1 if d is None else extent[d]) for size, d in zip(shape, dims)):
            return None
        if math.prod(shape) != math.prod(extent):
            return None
        storage, numel = piece["storage"], piece["storage_numel"]
        if not _is_int(storage, -1) or storage >= len(pieces) or not _is_int(numel):
            return None
        piece["stored"] = own[stored]
        piece["start"], piece["extent"] = tuple(start), tuple(extent)
        piece["dims"], piece["shape"] = tuple(dims), tuple(shape)
        out.append({**piece, "stored_shape": stored_shape})
    return rule, out, missing, buffers, aliases
