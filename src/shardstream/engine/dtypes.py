"""Dtype names: safetensors codes ("F32", "BF16") are the canonical spelling in plans and files."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CheckpointFormatError, UsageError

if TYPE_CHECKING:
    import torch

# Bytes per element of each safetensors dtype code. Kept free of torch, so that commands which
# only read headers and hash bytes (verify, inspect of shardstream's format) never import it.
ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,  # MX formats' scales
    "C64": 8,
}
# torch's names of the codes (``str(torch.bfloat16)`` less its ``torch.`` prefix).
TORCH_NAME: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
_FLOATING = frozenset({"F64", "F32", "F16", "BF16"})

# What users type (--dtype, config.json's torch_dtype) to a code.
_ALIASES = {
    "bfloat16": "BF16",
    "bf16": "BF16",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "float32": "F32",
    "fp32": "F32",
    "float": "F32",
    "float64": "F64",
    "double": "F64",
}


def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    by_code = {code: getattr(torch, name) for code, name in TORCH_NAME.items()}
    return by_code, {v: k for k, v in by_code.items()}


def __getattr__(name: str):
    """``TORCH_BY_CODE`` and ``CODE_BY_TORCH``, built (and torch imported) on first use."""
    if name in ("TORCH_BY_CODE", "CODE_BY_TORCH"):
        by_code, by_torch = _torch_tables()
        globals().update(TORCH_BY_CODE=by_code, CODE_BY_TORCH=by_torch)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def code_of(dtype: torch.dtype) -> str:
    try:
        return (globals().get("CODE_BY_TORCH") or __getattr__("CODE_BY_TORCH"))[dtype]
    except KeyError:
        raise CheckpointFormatError(
            f"unsupported tensor dtype {dtype} (safetensors holds no such type)"
        ) from None


def itemsize(code: str) -> int:
    try:
        return ITEMSIZE[code]
    except KeyError:
        raise CheckpointFormatError(f"unknown dtype code {code!r}") from None


def is_floating(code: str) -> bool:
    """Whether values of this dtype are real floating-point numbers: the ones a requested
    output dtype casts, and compared with a tolerance."""
    return code in _FLOATING


def parse_dtype(name: str) -> str:
    """``parse_dtype("bfloat16") == "BF16"``; accepts codes, torch names and ``torch.`` prefixes."""
    key = str(name).strip().removeprefix("torch.")
    if key.upper() in ITEMSIZE:
        return key.upper()
    try:
        return _ALIASES[key.lower()]
    except KeyError:
        choices = "bfloat16, float16, float32, float64"
        raise UsageError(f"unknown dtype {name!r}: expected one of {choices}") from None
