"""Compare two Hugging Face safetensors model directories tensor by tensor, bit for bit.

Each tensor is loaded alone with ``safe_open`` (single or sharded ``*.safetensors``), so the
comparison itself needs memory for two tensors, not two models. Usable as a script:

    python bench/compare.py DIR_A DIR_B
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def _key_index(model_dir: Path) -> dict[str, Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    index: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                if k in index:
                    raise ValueError(f"{k!r} appears in both {index[k].name} and {f.name}")
                index[k] = f
    return index


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def compare_dirs(a: Path, b: Path, max_listed: int = 20) -> dict:
    """Return a report; ``report["identical"]`` is True only if keys, dtypes, shapes and every
    byte match. When only dtypes differ, ``equal_after_cast`` lists tensors whose wider copy,
    cast to the narrower dtype (round-to-nearest-even, as ``Tensor.to`` does), matches bit for
    bit, so a dtype policy difference can be told apart from wrong data."""
    ia, ib = _key_index(a), _key_index(b)
    only_a = sorted(set(ia) - set(ib))
    only_b = sorted(set(ib) - set(ia))
    common = sorted(set(ia) & set(ib))
    shape_mismatch, dtype_mismatch, value_mismatch, equal_after_cast = [], [], [], []
    nbytes = 0
    handles: dict[Path, object] = {}

    def get(index: dict[str, Path], key: str) -> torch.Tensor:
        f = index[key]
        if f not in handles:
            handles[f] = safe_open(f, framework="pt").__enter__()
        return handles[f].get_tensor(key)

    try:
        for k in common:
            ta, tb = get(ia, k), get(ib, k)
            if ta.shape != tb.shape:
                shape_mismatch.append(f"{k}: {tuple(ta.shape)} vs {tuple(tb.shape)}")
                continue
            if ta.dtype != tb.dtype:
                dtype_mismatch.append(f"{k}: {ta.dtype} vs {tb.dtype}")
                wide, narrow = (ta, tb) if ta.element_size() > tb.element_size() else (tb, ta)
                if torch.equal(_bits(wide.to(narrow.dtype)), _bits(narrow)):
                    equal_after_cast.append(k)
                else:
                    value_mismatch.append(f"{k}: differs even after casting to {narrow.dtype}")
                continue
            nbytes += ta.numel() * ta.element_size()
            if not torch.equal(_bits(ta), _bits(tb)):
                diff = None
                if ta.is_floating_point():
                    diff = (ta.double() - tb.double()).abs().max().item()
                value_mismatch.append(f"{k}: bytes differ (max abs diff {diff})")
            del ta, tb
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)

    identical = not (only_a or only_b or shape_mismatch or dtype_mismatch or value_mismatch)
    return {
        "a": str(a),
        "b": str(b),
        "identical": identical,
        "n_keys_a": len(ia),
        "n_keys_b": len(ib),
        "n_common": len(common),
        "bytes_compared_bitwise": nbytes,
        "only_in_a": only_a[:max_listed],
        "only_in_b": only_b[:max_listed],
        "n_only_in_a": len(only_a),
        "n_only_in_b": len(only_b),
        "shape_mismatch": shape_mismatch[:max_listed],
        "dtype_mismatch": dtype_mismatch[:max_listed],
        "n_dtype_mismatch": len(dtype_mismatch),
        "n_equal_after_cast": len(equal_after_cast),
        "value_mismatch": value_mismatch[:max_listed],
        "n_value_mismatch": len(value_mismatch),
    }


def summarize(report: dict) -> str:
    if report["identical"]:
        return (
            f"IDENTICAL: {report['n_common']} tensors, "
            f"{report['bytes_compared_bitwise'] / 2**20:.1f} MiB compared bit for bit"
        )
    parts = [f"MISMATCH between {report['a']} and {report['b']}:"]
    if report["n_only_in_a"] or report["n_only_in_b"]:
        parts.append(
            f"  keys only in A: {report['n_only_in_a']} {report['only_in_a']}; "
            f"only in B: {report['n_only_in_b']} {report['only_in_b']}"
        )
    if report["shape_mismatch"]:
        parts.append(f"  shape mismatches: {report['shape_mismatch']}")
    if report["n_dtype_mismatch"]:
        parts.append(
            f"  dtype mismatches: {report['n_dtype_mismatch']} "
            f"(e.g. {report['dtype_mismatch'][:3]}); "
            f"{report['n_equal_after_cast']} of them equal bit for bit after casting to the "
            "narrower dtype"
        )
    if report["n_value_mismatch"]:
        parts.append(
            f"  value mismatches: {report['n_value_mismatch']} "
            f"(e.g. {report['value_mismatch'][:5]})"
        )
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    report = compare_dirs(Path(argv[0]), Path(argv[1]))
    print(summarize(report))
    print(json.dumps(report, indent=2))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
