"""Small JSON documents a checkpoint holds (config.json, an index, fsdp_config.json), read
strictly: JSON allows what no checkpoint holds (``Infinity``, ``NaN``, integers of thousands of
digits, a top-level list where an object belongs), and each of those once ended in a traceback
far from the file. Here each is one ``CheckpointFormatError`` naming the file."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from ..errors import CheckpointFormatError, UnsafeCheckpointError, os_error
from .regular_file import open_regular

MAX_NESTING = 200  # containers within containers in saved state (Python recurses per level)
MAX_DOCUMENT_BYTES = 64 * 2**20  # config, index, generation config: kilobytes to megabytes
# config.json: the largest real ones (21k class labels, both ways) hold about 2 MB, and
# transformers copies and serializes a config several times as merge writes it
MAX_CONFIG_BYTES = 4 * 2**20
MAX_INT_DIGITS = 20  # 2**64 has 20 digits; nothing in these files counts higher


class Refused(ValueError):
    """A value JSON allows but a checkpoint's document cannot hold."""


def _no_constant(name: str):
    raise Refused(f"holds {name}, which is not a JSON number a checkpoint can hold")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Refused(f"holds an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise Refused(f"holds {text}, a number beyond a float's range")
    return value


_LONG_DIGITS = rf"[0-9]{{{MAX_INT_DIGITS + 1}}}"
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"0" * 9)


def strict(raw: bytes | str | None = None, **kwargs) -> dict:
    """``json.loads`` keyword arguments that raise ``Refused`` for those values. Given the
    ``raw`` text, integers are checked one by one only where it holds a digit run longer
    than ``MAX_INT_DIGITS`` (a scan in C; a hook per integer costs more than the parse)."""
    if raw is None or _long_digit_run(raw):
        kwargs["parse_int"] = _bounded_int
    kwargs.setdefault("parse_constant", _no_constant)
    return dict(parse_float=_finite_float, **kwargs)


def _long_digit_run(raw: bytes | str) -> bool:
    """Whether ``raw`` may hold an integer of over ``MAX_INT_DIGITS`` digits (UTF-16 and -32,
    which hold NULs, are not scanned: they may)."""
    if isinstance(raw, str):
        return re.search(_LONG_DIGITS, raw) is not None
    raw = bytes(raw)
    return b"\0" in raw or b"0" * (MAX_INT_DIGITS + 1) in raw.translate(_DIGITS_AS_ZERO)


def nested_deeper(value: object, limit: int) -> bool:
    """Whether a JSON value holds a value more than ``limit`` containers deep (the root is at
    depth 0); iterative, so a deep value cannot exhaust Python's recursion."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


def is_counts(value: object) -> bool:
    """Whether ``value`` is a JSON list of non-negative integers (a shape, offsets, sizes): a
    bool is none, and a string or a float is never read as digits or rounded."""
    return type(value) is list and all(type(v) is int and v >= 0 for v in value)


def loads(raw: bytes | str, where: str | os.PathLike, nonfinite: bool = False) -> object:
    """``json.loads`` without ``Infinity``/``NaN`` (unless ``nonfinite``) or integers over
    ``MAX_INT_DIGITS`` digits."""
    try:
        return json.loads(raw, **strict(raw, **({"parse_constant": float} if nonfinite else {})))
    except Refused as exc:
        raise CheckpointFormatError(f"{where}: {exc}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointFormatError(f"{where}: not valid JSON ({exc})") from None


def read_object(
    path: str | os.PathLike,
    what: str = "JSON object",
    nonfinite: bool = False,
    limit: int = MAX_DOCUMENT_BYTES,
) -> dict:
    """The JSON object in ``path``; anything else (a list, a number, bad JSON, a file over
    ``limit`` bytes, an unreadable file) is one shardstream error naming it.
    ``nonfinite``: ``Infinity`` and ``NaN`` are read as floats (a config.json transformers 4.x
    wrote: Mamba2's ``time_step_limit``)."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        mapped = os_error(exc, path)
        if mapped is None:
            raise
        raise mapped from None
    if len(raw) > limit:
        raise UnsafeCheckpointError(f"{path}: over the {limit:,}-byte limit of a {what}")
    doc = loads(raw, path, nonfinite)
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: not a {what} (holds a {type(doc).__name__})")
    return doc
