"""Training state as shardstream stores it: tensors by flat name, everything else as JSON.

Model and optimizer state come from torch.distributed.checkpoint.state_dict, so FSDP2 DTensors
and plain modules look alike. Non-tensor values (param groups, scheduler, extra) become JSON;
tuples and tensors inside them are tagged so they come back as they were. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..engine.endpoints import refuse_lazy_view
from ..errors import CheckpointFormatError, UsageError
from ..formats import jsondoc
from ..formats.layout_names import describe_placements, mesh_dim_names
from ..formats.lora import UNSUPPORTED, setting_is_on
from ..formats.native import MODEL_PREFIX, OPTIMIZER_PREFIX
from .schedulers import same_kind

_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)
# Loading: a parameter without saved state (never had a gradient) is left without, as
# Optimizer.load_state_dict does; restore has checked every other entry by then.
_LOAD_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False, strict=False)
STATE = "state."
TENSOR_TAG, TUPLE_TAG, FLOAT_TAG = "__tensor__", "__tuple__", "__float__"
# A small tensor written into the JSON itself (a tensor learning rate in a param group, a
# scheduler's tensors): dtype code, shape and its bytes in hex, bit for bit.
INLINE_TAG = "__inline_tensor__"
INT_KEYS_TAG = "__int_keys__"
# A mapping with a key of the tags' own is kept as its (key, value, key-is-int) entries
DICT_TAG = "__dict__"
TAGS = frozenset((TENSOR_TAG, TUPLE_TAG, FLOAT_TAG, INLINE_TAG, INT_KEYS_TAG, DICT_TAG))
MAX_INLINE_BYTES = 1 << 16


def model_tensors(
    model: torch.nn.Module, ignore_frozen_params: bool = False
) -> dict[str, torch.Tensor]:
    """``model.<fqn>`` -> live (sharded) tensor, sharing storage with the parameters; without
    the parameters that require no gradient with ``ignore_frozen_params``."""
    options = _OPTIONS
    if ignore_frozen_params:
        options = dataclasses.replace(_OPTIONS, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    tensors = {MODEL_PREFIX + k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for name, tensor in tensors.items():  # before a save or restore begins, not midway
        refuse_lazy_view(name[len(MODEL_PREFIX) :], local_shard(tensor))
    return tensors


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_of(tensor: torch.Tensor) -> int:
    """Where a tensor's (a DTensor's local shard's) storage lives: equal for views of one."""
    return local_shard(tensor).untyped_storage().data_ptr()


def apply_model_copies(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Hand filled model tensors back where ``model_tensors`` returned copies rather than the
    live storage (FSDP1 unflattens its flat parameters into new tensors); nothing to do where
    they are the parameters themselves (FSDP2, plain modules)."""
    live = {storage_of(t) for t in (*model.parameters(), *model.buffers())}
    if all(storage_of(t) in live for t in tensors.values() if t.numel()):
        return
    state = {k[len(MODEL_PREFIX) :]: v for k, v in tensors.items()}
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def placement_of(tensor: torch.Tensor) -> str:
    """How a live tensor is laid out over ranks, as the manifest records it: ``"fsdp:S(0)"``,
    ``"ddp:R, fsdp:S(0)"`` (HSDP), or ``"plain"`` (a regular tensor, alike on every rank)."""
    from torch.distributed.tensor import DTensor

    from ..formats.torch_pt import Placement

    if not isinstance(tensor, DTensor):
        return "plain"
    kinds = [str(Placement(type(p).__name__, getattr(p, "dim", None))) for p in tensor.placements]
    return describe_placements(tensor.device_mesh.mesh_dim_names, kinds)


def mesh_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """Shape and dim names of the largest device mesh a DTensor lies on (most devices, then
    most dims; the first of equals), or None. Not the first DTensor's: with tensor
    parallelism an embedding left to FSDP lies on the data-parallel submesh alone."""
    from torch.distributed.tensor import DTensor

    best = None
    for tensor in tensors.values():
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if best is None or (mesh.size(), mesh.ndim) > (best.size(), best.ndim):
                best = mesh
    if best is None:
        return None
    names = mesh_dim_names(best.mesh_dim_names, best.ndim)
    return {"shape": list(best.shape), "dim_names": list(names)}


def is_lora_name(name: str) -> bool:
    """A LoRA/adapter weight, by the test verl uses for LoRA-only checkpoints."""
    return "lora_" in name or ".adapter_" in name


def lora_only(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA weights of a model's tensors; all of them when the model has none."""
    lora = {k: v for k, v in tensors.items() if is_lora_name(k)}
    return lora or tensors


def model_lora_meta(model: torch.nn.Module) -> dict[str, Any] | None:
    """r, lora_alpha and task_type of a PEFT model's first adapter (what verl records in
    lora_train_meta.json), or None for a model without LoRA."""
    config = getattr(model, "peft_config", None)
    if isinstance(config, dict):
        config = config.get("default") or next(iter(config.values()), None)
    if config is None:
        return None

    def field(name: str, default: Any = None) -> Any:
        return (
            config.get(name, default)
            if isinstance(config, dict)
            else getattr(config, name, default)
        )

    r = int(field("r", 0) or 0)
    if r <= 0:
        return None
    task = field("task_type", None) or "CAUSAL_LM"
    meta = {
        "r": r,
        "lora_alpha": float(field("lora_alpha", r)),
        "task_type": str(getattr(task, "value", task)),
        "use_rslora": bool(field("use_rslora", False)),
    }
    for key in UNSUPPORTED:  # settings merge refuses, recorded only when they are set
        if setting_is_on(key, field(key)):
            meta[key] = True
    return meta


def optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer tensors by flat name, and the JSON-able rest (param groups, scalar state)."""
    state = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for fqn, entries in state["state"].items():
        for key, value in entries.items():
            flat = f"{OPTIMIZER_PREFIX}{STATE}{fqn}.{key}"
            if isinstance(value, torch.Tensor):
                tensors[flat] = value
            else:
                scalars[flat] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_param_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's param groups with FQNs for ``params`` (initialising empty state)."""
    return get_optimizer_state_dict(model, optimizer, options=_OPTIONS)["param_groups"]


def parameters_by_fqn(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Each parameter under the names torch's state-dict API gives it (wrapper prefixes
    such as DDP's ``module.`` and ``_orig_mod.`` left out; a tied parameter under each)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    found: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        for fqn in _get_fqns(model, name):
            found[fqn] = param
    return found


def create_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Give ``params`` (the optimizer's, without state) the state its first step creates, as
    torch's ``_init_optim_state`` does for a never-stepped optimizer: one step of zero
    gradients at lr 0, taken by them alone (the other parameters' gradients are set aside
    meanwhile). A frozen parameter gets state too, as ``Optimizer.load_state_dict`` gives it."""
    chosen = {id(p) for p in params}
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for p, _ in grads:
            p.grad = torch.zeros_like(p) if id(p) in chosen else None
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if "lr" in group:
                group["lr"] = lr
        for p, grad in grads:
            p.grad = grad


def check_param_groups(
    live_groups: list, saved: Any, settings: Collection[str] = frozenset()
) -> None:
    """Saved param groups must fit the live optimizer's (``optimizer_state``'s, FQNs as
    ``params``): as many groups, each naming exactly the parameters of one live group (else
    torch's ``set_optimizer_state_dict`` fails after the model was already written), and each
    holding the numeric ones of ``settings`` (the optimizer's own hyperparameters, not what a
    scheduler adds: ``initial_lr``) that the live group has."""
    live = [frozenset(g["params"]) for g in live_groups]
    if not isinstance(saved, list) or len(saved) != len(live):
        count = f"{len(saved)} groups" if isinstance(saved, list) else type(saved).__name__
        raise CheckpointFormatError(
            f"param_groups: {count} saved, the optimizer has {len(live)} groups"
        )
    for i, group in enumerate(saved):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise CheckpointFormatError(
                f"param_groups[{i}]: not a group with a list of parameter names"
            )
        mine = next((g for g in live_groups if frozenset(g["params"]) == frozenset(params)), {})
        for key, value in group.items():  # a hyperparameter of another type fails later on
            if key != "params" and key in mine and not _fits(mine[key], value):
                raise CheckpointFormatError(
                    f"param_groups[{i}]: {key} is saved as {type(value).__name__} "
                    f"{str(value)[:60]!r}, but the optimizer's is a {type(mine[key]).__name__} "
                    f"{str(mine[key])[:60]!r}"
                )
        # a numeric setting (lr, betas, eps) left out fails at the next step; flags
        # (foreach, maximize...) left out are set to their defaults by the optimizer
        lacking = [k for k, v in mine.items() if k in settings and k not in group and _numeric(v)]
        if lacking:
            raise CheckpointFormatError(
                f"param_groups[{i}]: no {', '.join(repr(k) for k in lacking)} saved, which the "
                "optimizer needs to step"
            )
        if frozenset(params) not in live:
            # the live group sharing most parameters with it: say what differs
            near = max(live, key=lambda g: len(g & frozenset(params)), default=frozenset())
            extra, lacking = sorted(set(params) - near), sorted(near - set(params))
            differs = "; ".join(
                f"{what} {', '.join(repr(n) for n in names[:3])}"
                + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                for what, names in (("saved only", extra), ("live only", lacking))
                if names
            )
            heads = [n for n in extra + lacking if n.rsplit(".", 1)[0].endswith("lm_head")]
            if heads and len(heads) == len(extra) + len(lacking):  # the head alone differs
                hint = (
                    "saved with an untied output head, restored into a model that ties it "
                    "(tie_word_embeddings)?"
                    if extra
                    else "saved with a tied output head, restored into a model that unties it "
                    "(tie_word_embeddings)?"
                )
            elif lacking and not extra:
                hint = (
                    "the optimizer now holds parameters it did not hold when saved (frozen "
                    "then, or left out of it, and trainable now?); restore without the "
                    "optimizer (load_contents without 'optimizer'), or build it as it was"
                )
            elif extra and not lacking:
                hint = (
                    "the optimizer now lacks parameters it held when saved (frozen since, or "
                    "left out of it?); build it as it was, or restore without the optimizer"
                )
            else:
                hint = "was it saved from a different model?"
            raise CheckpointFormatError(
                f"param_groups[{i}]: its parameters are not those of any of the optimizer's "
                f"groups ({differs}): {hint}"
            )


def _numeric(value: Any) -> bool:
    """A number (not a bool), a 0-dim tensor, or a tuple of them (betas)."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_numeric(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fits(live: Any, saved: Any) -> bool:
    """``same_kind``, and a tuple of numbers (betas) saved as one of as many numbers."""
    if _numeric(live) and isinstance(live, (tuple, list)):
        return (
            isinstance(saved, (tuple, list))
            and len(saved) == len(live)
            and all(same_kind(a, b) for a, b in zip(live, saved))
        )
    return same_kind(live, saved)


def apply_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    nested: Mapping[str, Mapping[str, Any]],
    param_groups: list,
) -> None:
    """Hand the optimizer state back: ``nested`` as ``nest_optimizer_state`` returns it (its
    tensors filled by now) and the saved param groups."""
    state = {"state": dict(nested), "param_groups": param_groups}
    set_optimizer_state_dict(model, optimizer, state, options=_LOAD_OPTIONS)
    # torch's state-dict API leaves out the state of parameters that do not require
    # gradients (a frozen layer); Optimizer.load_state_dict keeps it, and so does this.
    grouped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for fqn, param in parameters_by_fqn(model).items():
        if not param.requires_grad and id(param) in grouped and fqn in nested:
            optimizer.state[param] = dict(nested[fqn])


def nest_optimizer_state(
    model: torch.nn.Module, values: Mapping[str, Any], names: set[str] | None = None
) -> dict[str, dict[str, Any]]:
    """``optimizer.state.<fqn>.<key>`` -> value as ``{fqn: {key: value}}``; raises for a name
    that is no parameter of ``model`` (``names``: its parameter names, where known)."""
    prefix = OPTIMIZER_PREFIX + STATE
    nested: dict[str, dict[str, Any]] = {}
    names = _parameter_names(model) if names is None else names
    for flat, value in values.items():
        rest = flat[len(prefix) :]
        fqn = next((n for n in _prefixes(rest) if n in names), None)
        if fqn is None:
            raise CheckpointFormatError(f"optimizer state {flat!r} names no parameter of the model")
        nested.setdefault(fqn, {})[rest[len(fqn) + 1 :]] = value
    return nested


def has_state_dict_hooks(model: torch.nn.Module) -> bool:
    """Whether any module registers a hook that may change what ``state_dict`` presents.
    FSDP1's own hooks (which unflatten its flat parameters) do not count: torch's state-dict
    API reads through them."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(
        module._state_dict_hooks and not isinstance(module, FullyShardedDataParallel)
        for module in model.modules()
    )


def _parameter_names(model: torch.nn.Module) -> set[str]:
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    if has_state_dict_hooks(model):
        return names  # hooks present other keys than the parameters (training/hooks.py)
    return names | set(get_model_state_dict(model, options=_OPTIONS))


def _prefixes(name: str):
    """Candidate parameter names of ``a.b.c.exp_avg``: longest first."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        yield ".".join(parts[:i])


# --- JSON with tagged tensors and tuples --------------------------------------------------------


MAX_NESTING = jsondoc.MAX_NESTING


def encode(
    value: Any, tensors: dict[str, torch.Tensor] | None, path: str = "", depth: int = 0
) -> Any:
    """JSON-able form of ``value``; tensors are moved into ``tensors`` under their path, or
    with ``tensors`` None written inline (up to ``MAX_INLINE_BYTES`` each)."""
    if depth > MAX_NESTING:
        raise UsageError(
            f"extra state at {path[:200] or '<root>'}: containers nested over {MAX_NESTING} "
            "deep; flatten it"
        )
    depth += 1
    if isinstance(value, torch.Tensor) and tensors is None:
        return _inline(value, path)
    if isinstance(value, torch.Tensor):
        key = path or "value"
        tensors[key] = value.detach().cpu().contiguous()
        return {TENSOR_TAG: key}
    if _is_ndarray(value):
        return encode(torch.from_numpy(value.copy()), tensors, path) | {"numpy": True}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {FLOAT_TAG: repr(value)}
    if isinstance(value, tuple):
        return {TUPLE_TAG: [encode(v, tensors, f"{path}.{i}", depth) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, f"{path}.{i}", depth) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        entries = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise UsageError(
                    f"extra state key {k!r} at {path or '<root>'} must be a str or int"
                )
            entries.append((k, encode(v, tensors, f"{path}.{k}", depth)))
        names = [str(k) for k, _ in entries]
        if len(set(names)) < len(names) or any(k in TAGS for k in names if isinstance(k, str)):
            # a key the tags spell, or 1 and "1" both: kept as (key, value, key-is-int) entries
            return {DICT_TAG: [[str(k), v, isinstance(k, int)] for k, v in entries]}
        out = {str(k): v for k, v in entries}
        if ints := [str(k) for k, _ in entries if isinstance(k, int)]:
            out[INT_KEYS_TAG] = ints
        return out
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalars
        return encode(value.item(), tensors, path, depth)
    raise UsageError(
        f"extra state at {path or '<root>'} is a {type(value).__name__}; only JSON values, "
        "tuples and tensors can be checkpointed"
    )


def _inline(tensor: torch.Tensor, path: str) -> dict:
    from ..engine.dtypes import code_of

    local = tensor.detach()
    if type(local) is not torch.Tensor:  # a DTensor: its whole value (a replicated scalar)
        local = local.full_tensor()
    local = local.cpu().contiguous()
    if local.numel() * local.element_size() > MAX_INLINE_BYTES:
        raise UsageError(
            f"{path or '<root>'}: a tensor of {local.numel()} elements among the optimizer's or "
            f"scheduler's settings; at most {MAX_INLINE_BYTES} bytes are kept there"
        )
    data = local.reshape(-1).view(torch.uint8).numpy().tobytes() if local.numel() else b""
    return {INLINE_TAG: {"dtype": code_of(local.dtype), "shape": list(local.shape),
                         "hex": data.hex()}}  # fmt: skip


def _from_inline(spec: Any) -> torch.Tensor:
    from ..engine.dtypes import TORCH_BY_CODE, itemsize

    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "hex"}:
        raise ValueError(f"{INLINE_TAG} is {str(spec)[:100]}, not dtype, shape and hex")
    dtype, shape, hexed = spec["dtype"], spec["shape"], spec["hex"]
    if dtype not in TORCH_BY_CODE or not isinstance(shape, list) or not isinstance(hexed, str):
        raise ValueError(f"{INLINE_TAG}: bad dtype, shape or data")
    if not all(type(n) is int and 0 <= n for n in shape) or len(hexed) > 2 * MAX_INLINE_BYTES:
        raise ValueError(f"{INLINE_TAG}: bad shape or too much data")
    data = bytes.fromhex(hexed)
    if len(data) != math.prod(shape) * itemsize(dtype):
        raise ValueError(f"{INLINE_TAG}: {len(data)} bytes for shape {shape} of {dtype}")
    out = torch.empty(shape, dtype=TORCH_BY_CODE[dtype])
    if data:
        out.view(-1).view(torch.uint8)[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode(value: Any, tensors: Mapping[str, torch.Tensor], depth: int = 0) -> Any:
    """``encode``'s value back. Raises ``KeyError``, ``ValueError`` or ``TypeError`` for one it
    could not have written (callers name the file)."""
    if depth > MAX_NESTING:
        raise ValueError(f"values nested over {MAX_NESTING} deep, which no save writes")
    depth += 1
    if isinstance(value, list):
        return [decode(v, tensors, depth) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and DICT_TAG in value:
        return {
            (int(k) if as_int else k): decode(v, tensors, depth)
            for k, v, as_int in _entries(value[DICT_TAG])
        }
    if INLINE_TAG in value:
        return _from_inline(value[INLINE_TAG])
    if TENSOR_TAG in value:
        tensor = tensors[value[TENSOR_TAG]]
        return tensor.numpy() if value.get("numpy") else tensor
    if TUPLE_TAG in value:
        return tuple(decode(v, tensors, depth) for v in value[TUPLE_TAG])
    if FLOAT_TAG in value:
        return float(value[FLOAT_TAG])
    int_keys = set(value.get(INT_KEYS_TAG, []))
    return {
        (int(k) if k in int_keys else k): decode(v, tensors, depth)
        for k, v in value.items()
        if k != INT_KEYS_TAG
    }


def _entries(listed: Any) -> list[tuple[str, Any, bool]]:
    """``DICT_TAG``'s entries: (key, value, whether the key was an int)."""
    if not isinstance(listed, list) or not all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and type(e[2]) is bool
        for e in listed
    ):
        raise ValueError(f"{DICT_TAG} is {str(listed)[:100]}, not [key, value, is_int] entries")
    return [(k, v, as_int) for k, v, as_int in listed]


def _is_ndarray(value: Any) -> bool:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, np.ndarray)


# --- RNG ---------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["random"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def check_rng_state(state: Any) -> None:
    """Raise what ``set_rng_state`` would raise, leaving the generators as they were."""
    if not isinstance(state, Mapping) or "torch" not in state or "random" not in state:
        raise CheckpointFormatError("RNG state lacks the torch or random generator's state")
    before = rng_state()
    try:
        set_rng_state(state)
    except Exception as exc:  # noqa: BLE001 - any failure: the state does not fit
        raise CheckpointFormatError(
            f"RNG state cannot be set ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        set_rng_state(before)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
