"""Dtype names: safetensors codes ("F32", "BF16") are the canonical spelling in plans and files."""

from __future__ import annotations

import torch

from .errors import CheckpointFormatError, UsageError

TORCH_BY_CODE: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
CODE_BY_TORCH: dict[torch.dtype, str] = {v: k for k, v in TORCH_BY_CODE.items()}
ITEMSIZE: dict[str, int] = {code: dt.itemsize for code, dt in TORCH_BY_CODE.items()}
FLOATING = frozenset({"F64", "F32", "F16", "BF16"})

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


def code_of(dtype: torch.dtype) -> str:
    try:
        return CODE_BY_TORCH[dtype]
    except KeyError:
        raise CheckpointFormatError(f"unsupported tensor dtype {dtype}") from None


def itemsize(code: str) -> int:
    try:
        return ITEMSIZE[code]
    except KeyError:
        raise CheckpointFormatError(f"unknown dtype code {code!r}") from None


def parse_dtype(name: str) -> str:
    """``parse_dtype("bfloat16") == "BF16"``; accepts codes, torch names and ``torch.`` prefixes."""
    key = str(name).strip().removeprefix("torch.")
    if key.upper() in ITEMSIZE:
        return key.upper()
    try:
        return _ALIASES[key.lower()]
    except KeyError:
        choices = "bfloat16, float16, float32"
        raise UsageError(f"unknown dtype {name!r}: expected one of {choices}") from None
