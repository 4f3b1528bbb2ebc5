"""LoRA checkpoints (PEFT key naming): split the adapter from the base model, or fuse it.

A verl LoRA run saves keys like ``base_model.model.<path>.base_layer.weight`` and
``base_model.model.<path>.lora_A.default.weight``. merge writes the base model under HF names
and the adapter as a PEFT ``adapter_model.safetensors`` beside it, or with ``--fuse-lora`` folds
``W + (alpha / r) * B @ A`` into the base weights, row block by row block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.copy import RowTransform, Streamer, read_tensor
from ..engine.plan import GlobalTensor
from ..errors import CheckpointFormatError, UsageError
from . import jsondoc

PEFT_PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
META_FILE = "lora_train_meta.json"
ADAPTER_DIR = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"


@dataclass
class LoraSplit:
    base: list[GlobalTensor]
    factors: dict[str, dict[str, GlobalTensor]] = field(default_factory=dict)  # module -> A/B

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.rsplit(".", 1)[-1] for m in self.factors})


def _hf_name(name: str) -> str:
    name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def split_lora(tensors: list[GlobalTensor]) -> LoraSplit | None:
    """Separate LoRA factors from base weights; None when there are no LoRA keys."""
    if not any(".lora_A." in t.name or ".lora_B." in t.name for t in tensors):
        return None
    split = LoraSplit(base=[])
    for tensor in tensors:
        match = _FACTOR.match(tensor.name)
        if match:
            module = _hf_name(match["module"])
            split.factors.setdefault(module, {})[match["which"]] = tensor
        else:
            split.base.append(
                GlobalTensor(_hf_name(tensor.name), tensor.dtype, tensor.shape, tensor.blocks)
            )
    for module, pair in split.factors.items():
        if set(pair) != {"A", "B"}:
            raise CheckpointFormatError(f"LoRA module {module!r} has lora_{set(pair).pop()} only")
    return split


def lora_settings(directory: Path, recorded: dict | None = None) -> tuple[int, float]:
    """(r, lora_alpha) as the checkpoint ``recorded`` them (shardstream's manifest), else from
    verl's lora_train_meta.json or lora_adapter/adapter_config.json."""
    if recorded is not None:
        try:
            return int(recorded["r"]), float(recorded["lora_alpha"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointFormatError(f"{directory}: no usable r/lora_alpha ({exc})") from None
    for path in (directory / META_FILE, directory / ADAPTER_DIR / ADAPTER_CONFIG):
        if path.is_file():
            meta = jsondoc.read_object(path)
            try:
                return int(meta["r"]), float(meta["lora_alpha"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointFormatError(f"{path}: no usable r/lora_alpha ({exc})") from None
    raise CheckpointFormatError(
        f"{directory}: LoRA weights found but neither {META_FILE} nor "
        f"{ADAPTER_DIR}/{ADAPTER_CONFIG} says r and lora_alpha"
    )


def fuse_transforms(
    split: LoraSplit, r: int, alpha: float, streamer: Streamer, shapes: dict[str, tuple[int, ...]]
) -> dict[str, RowTransform]:
    """Per base weight, a row hook adding ``(alpha / r) * B @ A`` to the rows it is given."""
    scale = alpha / r
    transforms: dict[str, RowTransform] = {}
    for module, pair in split.factors.items():
        weight = f"{module}.weight"
        if weight not in shapes:
            raise CheckpointFormatError(f"LoRA module {module!r} has no base weight {weight!r}")
        a = read_tensor(pair["A"], streamer, "F32")
        b = read_tensor(pair["B"], streamer, "F32")
        rows, cols = shapes[weight]
        if a.shape != (a.shape[0], cols) or b.shape != (rows, a.shape[0]):
            raise CheckpointFormatError(
                f"LoRA module {module!r}: A {list(a.shape)} and B {list(b.shape)} do not fit "
                f"weight {list(shapes[weight])}"
            )
        transforms[weight] = _adder(a, b * scale, cols)
    return transforms


def _adder(a: torch.Tensor, scaled_b: torch.Tensor, cols: int) -> RowTransform:
    def add(values: torch.Tensor, first: int, step: int, n: int) -> torch.Tensor:
        for j in range(values.shape[0]):
            start = first + j * step
            r0, r1 = start // cols, (start + n - 1) // cols
            delta = (scaled_b[r0 : r1 + 1] @ a).reshape(-1)
            offset = start - r0 * cols
            values[j] += delta[offset : offset + n]
        return values

    return add


def adapter_tensors(split: LoraSplit) -> list[tuple[str, GlobalTensor]]:
    """PEFT's saved names: ``base_model.model.<module>.lora_A.weight``."""
    out = []
    for module in sorted(split.factors):
        for which in ("A", "B"):
            out.append((f"{PEFT_PREFIX}{module}.lora_{which}.weight", split.factors[module][which]))
    return out


def adapter_config(split: LoraSplit, r: int, alpha: float, base_model: str | None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": split.target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def require_lora(split: LoraSplit | None, fuse: bool) -> None:
    if fuse and split is None:
        raise UsageError("--fuse-lora given, but the checkpoint has no LoRA weights")
