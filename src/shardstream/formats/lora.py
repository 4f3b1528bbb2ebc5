"""LoRA checkpoints (PEFT key naming): split the adapter from the base model, or fuse it.

A verl LoRA run saves keys like ``base_model.model.<path>.base_layer.weight`` and
``base_model.model.<path>.lora_A.default.weight``. merge writes the base model under HF names
and the adapter as a PEFT ``adapter_model.safetensors`` beside it, or with ``--fuse-lora`` folds
``W + scale * B @ A`` into the base weights, row block by row block (``scale``: lora_alpha / r,
or lora_alpha / sqrt(r) with ``use_rslora``; ``LoraSettings``).

Splitting and checking import no torch (verify runs them); fusing does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.plan import GlobalTensor
from ..errors import CheckpointFormatError, UsageError
from . import jsondoc

if TYPE_CHECKING:
    import torch

    from ..engine.copy import RowTransform, Streamer

PEFT_PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight\Z")
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
        """PEFT's ``target_modules``: for each adapted module the shortest name suffix that
        matches no module of the model left without an adapter (PEFT matches a module whose
        path is a suffix or ends in ``.<suffix>``: a VLM's ``visual.merger.mlp.0`` is
        ``mlp.0``, as ``0`` would take every layer ``N.0``). An adapter saved alone shows
        no other modules: their last names."""
        modules = {t.name.rsplit(".", 1)[0] for t in self.base}
        for module in list(modules):
            while "." in module:
                module = module.rsplit(".", 1)[0]
                modules.add(module)
        others = modules - set(self.factors)
        chosen = set()
        for module in self.factors:
            parts = module.split(".")
            for n in range(1, len(parts) + 1):
                suffix = ".".join(parts[-n:])
                if not any(o == suffix or o.endswith("." + suffix) for o in others):
                    break
            chosen.add(suffix)
        return sorted(chosen)


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


# PEFT's own key parts for what merge does not apply, by what each is: the weights they
# hold are not W + scale * B @ A factors, so the adapter or fused weights would be wrong.
_PEFT_FEATURES = (
    (re.compile(r"\.lora_embedding_[AB]\."), "LoRA on an embedding (lora_embedding_A/B)"),
    (re.compile(r"\.lora_magnitude_vector\."), "DoRA (lora_magnitude_vector)"),
    (
        re.compile(r"\.(modules_to_save|original_module)\."),
        "modules_to_save (a whole trained copy of a module, as a LoRA critic's score head)",
    ),
    (re.compile(r"\.(token_adapter|trainable_tokens_delta)\b"), "trainable tokens"),
    (re.compile(r"\.base_layer\.lora_[AB]\."), "LoRA on parameters (target_parameters)"),
)


# Any other ``lora_*`` part of a PEFT model's name: a tensor of a LoRA variant
# (``lora_bias``'s ``lora_B.bias``, KaSA's ``lora_diag``, AdaLoRA's ``lora_E``) that the
# factors alone do not describe.
_LORA_PART = re.compile(r"\.lora_\w+")


def unsupported_peft(names: Iterable[str]) -> str | None:
    """What of PEFT that merge does not apply the tensor ``names`` show, naming one tensor;
    also several adapters in one model (PEFT's ``add_adapter``): None if nothing. In a PEFT
    model (one with LoRA factors) every ``lora_*`` tensor must be a factor."""
    adapters: dict[str, str] = {}
    other_parts: list[str] = []
    for name in names:
        for pattern, what in _PEFT_FEATURES:
            if pattern.search(name):
                return f"PEFT's {what} (tensor {name!r})"
        match = _FACTOR.match(name)
        if match:
            adapters.setdefault(match["adapter"] or "", name)
        elif _LORA_PART.search(name):
            other_parts.append(name)
    if adapters and other_parts:
        return (
            f"a LoRA variant whose tensors are not lora_A/lora_B weights (tensor "
            f"{other_parts[0]!r}: lora_bias, KaSA's lora_diag, AdaLoRA's lora_E and the like)"
        )
    if len(adapters) > 1:
        shown = ", ".join(repr(a) for a in sorted(adapters))
        return f"several PEFT adapters ({shown}), which merge would mix"
    return None


def refuse_unsupported_peft(directory: object, names: Iterable[str]) -> None:
    """Refuse a checkpoint whose PEFT model uses what merge does not apply
    (``unsupported_peft``), rather than write a model or adapter other than the trained one."""
    found = unsupported_peft(names)
    if found is not None:
        raise CheckpointFormatError(
            f"{directory}: the checkpoint's PEFT model uses {found}; merge does not apply it, "
            "so the model or adapter written would differ from the trained one (restore it "
            "with shardstream's CheckpointManager or verl plug-in, which load it as it is)"
        )


@dataclass(frozen=True)
class LoraSettings:
    """What the factors mean: ``W + scale * B @ A`` with ``scale`` from these."""

    r: int
    alpha: float
    rslora: bool = False  # PEFT's use_rslora: scale alpha / sqrt(r)
    rslora_stated: bool = True  # False: no file said (verl's meta file does not record it)

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    @property
    def scale_rule(self) -> str:
        return "lora_alpha / sqrt(r)" if self.rslora else "lora_alpha / r"


# PEFT settings that change what the factors mean; merge does not apply them, so it refuses
# them rather than write an adapter or fused weights that differ from the trained model.
UNSUPPORTED = {
    "use_dora": "DoRA's magnitude vectors",
    "fan_in_fan_out": "transposed factors",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "lora_bias": "a bias on lora_B",
    "kasa_config": "KaSA's singular values between the factors",
    "alora_invocation_tokens": "activated LoRA, which applies from its invocation tokens on "
    "(PEFT does not fuse it either)",
    "use_bdlora": "block-diagonal factors (BD-LoRA)",
    "use_qalora": "QA-LoRA's pooled inputs",
    "velora_config": "VeLoRA's compressed activations",
    "monteclora_config": "MonteCLoRA's sampled factors",
    "arrow_config": "Arrow's routing among adapters",
    "layer_replication": "replicated layers",
    "modules_to_save": "whole trained copies of modules",
    "trainable_token_indices": "trainable tokens",
    "target_parameters": "LoRA on parameters",
}
# adapter_config.json's keys that do not change what the factors and base weights merge reads
# mean (where and how the adapter was placed and initialised, bookkeeping). Any other key that
# is set is refused: a PEFT variant merge does not know would be written as plain LoRA.
NEUTRAL = frozenset(
    {
        "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
        "revision", "inference_mode", "r", "lora_alpha", "use_rslora", "lora_dropout",
        "target_modules", "exclude_modules", "bias", "init_lora_weights", "layers_to_transform",
        "layers_pattern", "megatron_config", "megatron_core", "loftq_config", "eva_config",
        "corda_config", "lora_ga_config", "runtime_config", "qalora_group_size",
        "ensure_weight_tying",
    }
)  # fmt: skip


def setting_is_on(key: str, value: object) -> bool:
    """Whether a PEFT setting is on: not null, false or an empty list (nor the empty patterns
    that are rank_pattern's and alpha_pattern's defaults; an empty ``kasa_config`` is on)."""
    if value is None or value is False or value == []:
        return False
    return not (value == {} and key in ("rank_pattern", "alpha_pattern"))


def lora_settings(directory: Path, recorded: dict | None = None) -> LoraSettings:
    """The LoRA settings as the checkpoint ``recorded`` them (shardstream's manifest), else
    from verl's lora_train_meta.json and lora_adapter/adapter_config.json or PEFT's
    adapter_config.json beside the weights (or, for a Trainer's checkpoint-N, in its
    output_dir), which must agree
    (``use_rslora`` where both state it: verl's meta file does not). ``r`` must be a positive
    integer, ``lora_alpha`` a positive finite number and ``use_rslora`` a boolean; a setting
    merge cannot apply (``UNSUPPORTED``) is refused, naming the file."""
    if recorded is not None:
        return _settings(recorded, f"{directory} (recorded LoRA settings)")[0]
    found = []
    from .source import folders_around

    places = [directory / META_FILE, directory / ADAPTER_DIR / ADAPTER_CONFIG]
    # PEFT's, beside the weights, and where a Trainer run keeps it (its output_dir)
    places += [folder / ADAPTER_CONFIG for folder in folders_around(directory)]
    for path in places:
        if path.is_file():
            found.append((path, *_settings(jsondoc.read_object(path), str(path))))
    if not found:
        looked = ", ".join(str(p) for p in places)
        raise CheckpointFormatError(
            f"{directory}: LoRA weights found but nothing says their r and lora_alpha (looked "
            f"for {looked}: verl's {META_FILE} and {ADAPTER_DIR}/, PEFT's {ADAPTER_CONFIG})"
        )
    (first, settings, stated), *rest = found
    for path, other, other_stated in rest:
        if (other.r, other.alpha) != (settings.r, settings.alpha):
            raise CheckpointFormatError(
                f"{first} says r={settings.r}, lora_alpha={settings.alpha} but {path} says "
                f"r={other.r}, lora_alpha={other.alpha}"
            )
        if stated and other_stated and other.rslora != settings.rslora:
            raise CheckpointFormatError(
                f"{first} says use_rslora={settings.rslora} but {path} says "
                f"use_rslora={other.rslora}"
            )
        if other_stated and not stated:  # same r and alpha: other only adds use_rslora
            settings, stated = other, True
    return settings if stated else replace(settings, rslora_stated=False)


def _settings(meta: object, where: str) -> tuple[LoraSettings, bool]:
    """The settings ``meta`` holds, and whether it states ``use_rslora``."""
    if not isinstance(meta, dict):
        raise CheckpointFormatError(f"{where}: a {type(meta).__name__}, not a JSON object")
    r, alpha, rslora = meta.get("r"), meta.get("lora_alpha"), meta.get("use_rslora")
    if type(r) is not int or r <= 0:
        raise CheckpointFormatError(f"{where}: r is {repr(r)[:40]}, not a positive integer")
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise CheckpointFormatError(
            f"{where}: lora_alpha is {repr(alpha)[:40]}, not a positive finite number"
        )
    if rslora is not None and type(rslora) is not bool:
        raise CheckpointFormatError(f"{where}: use_rslora is {str(rslora)[:40]}, not true or false")
    for key, value in meta.items():
        if key in NEUTRAL or not setting_is_on(key, value):
            continue
        what = UNSUPPORTED.get(key, "a PEFT setting merge does not know")
        raise CheckpointFormatError(
            f"{where}: {key} is set ({what}); merge does not apply it, so the adapter or "
            "fused weights would differ from the trained model"
        )
    peft_type = meta.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise CheckpointFormatError(
            f"{where}: peft_type is {str(peft_type)[:40]}; merge reads LoRA adapters only"
        )
    return LoraSettings(r, float(alpha), bool(rslora)), rslora is not None


def check_factors(split: LoraSplit, r: int) -> None:
    """Every module's lora_A is [r, in] and lora_B [out, r], as the settings say, and unless
    the adapter was saved alone (no base weights), the module's base weight
    ``<module>.weight`` exists and is [out, in]."""
    base = {t.name: t.shape for t in split.base}
    for module, pair in sorted(split.factors.items()):
        a, b = pair["A"].shape, pair["B"].shape
        if len(a) != 2 or len(b) != 2 or a[0] != r or b[1] != r:
            raise CheckpointFormatError(
                f"LoRA module {module!r}: lora_A {list(a)} and lora_B {list(b)} are not "
                f"[{r}, in] and [out, {r}] (r={r} in the LoRA settings)"
            )
        if not base:
            continue
        weight = f"{module}.weight"
        if weight not in base:
            raise CheckpointFormatError(f"LoRA module {module!r} has no base weight {weight!r}")
        if tuple(base[weight]) != (b[0], a[1]):
            raise CheckpointFormatError(
                f"LoRA module {module!r}: lora_A {list(a)} and lora_B {list(b)} do not fit "
                f"its base weight {list(base[weight])}"
            )


def fuse_transforms(
    split: LoraSplit, settings: LoraSettings, streamer: Streamer
) -> dict[str, RowTransform]:
    """Per base weight, a row hook adding ``settings.scale * B @ A`` to the rows it is given
    (``check_factors`` checks the factors fit the base weights first)."""
    import torch

    from ..engine.copy import read_tensor

    check_factors(split, settings.r)
    scale = settings.scale
    transforms: dict[str, RowTransform] = {}
    for module, pair in split.factors.items():
        weight = f"{module}.weight"
        a = read_tensor(pair["A"], streamer, "F32")
        b = read_tensor(pair["B"], streamer, "F32")
        cols = a.shape[1]  # the base weight's columns: check_factors made sure
        scaled = b * scale
        if not torch.isfinite(scaled).all():
            raise CheckpointFormatError(
                f"LoRA module {module!r}: lora_B times {settings.scale_rule} ({scale:g}) is "
                "not finite in float32; the fused weights would be inf or NaN"
            )
        transforms[weight] = _adder(a, scaled, cols)
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


def adapter_config(split: LoraSplit, settings: LoraSettings, base_model: str | None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "use_rslora": settings.rslora,
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
