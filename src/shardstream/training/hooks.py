"""Models whose ``state_dict`` hooks present parameters under other names.

torchtitan's fused attention keeps one ``wqkv`` parameter and registers a state-dict hook that
presents it as ``wq``/``wk``/``wv``, so checkpoints hold the presented keys while the model holds
the fused tensor. torch's ``get_model_state_dict`` cannot map such keys back to parameters
(it looks for an attribute ``wq``), and filling the tensors a hook returns would never reach the
parameter anyway.

Here the hooks are run once on meta tensors of each parameter's global shape (no data, no
memory): a presented tensor that is the parameter itself or a slice of it (``split``,
``chunk``, ``narrow``, basic indexing) names a rectangular region of that parameter. The saved
tensors are then described in the live parameters' terms: the blocks of ``wq``, ``wk`` and
``wv`` become the blocks of ``wqkv`` at their offsets, so DCP's load planner fills the real
(sharded) parameter at any world size, and optimizer state keyed by the presented names follows
the same mapping. A hook that builds a new tensor (``cat``, a transpose copy, arithmetic) is
refused, naming the module.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable

import torch

from ..engine.dtypes import itemsize
from ..engine.plan import Block, GlobalTensor, check_blocks_tile
from ..errors import CheckpointFormatError
from ..formats.native import MODEL_PREFIX, OPTIMIZER_PREFIX
from .state import STATE


@dataclasses.dataclass(frozen=True)
class Region:
    """Where a presented tensor lies: in live tensor ``live``, from ``start``, ``shape``."""

    live: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    # A hook that gathers rows (torchtitan's fused QKV: wq is every hpk rows of each kv group
    # of wqkv): (first presented row, rows, start in ``live``) per run of consecutive rows.
    rows: tuple[tuple[int, int, tuple[int, ...]], ...] | None = None


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.<fqn>`` -> the live parameter or persistent buffer (sharded DTensors as they are),
    by module attributes rather than through ``state_dict``."""
    out = {}
    for prefix, module in model.named_modules():
        head = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                out.setdefault(MODEL_PREFIX + head + name, param.detach())
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out.setdefault(MODEL_PREFIX + head + name, buffer)
    return out


def presented_regions(model: torch.nn.Module) -> dict[str, Region]:
    """Presented state-dict key -> the region of a live tensor it is (its FQN for most)."""
    return _walk(model, "")


def _walk(module: torch.nn.Module, prefix: str) -> dict[str, Region]:
    entries: dict[str, Region] = {}
    for name, param in module._parameters.items():
        if param is not None:
            entries[prefix + name] = _whole(prefix + name, param)
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            entries[prefix + name] = _whole(prefix + name, buffer)
    for name, child in module._modules.items():
        if child is not None:
            entries.update(_walk(child, f"{prefix}{name}."))
    if not module._state_dict_hooks:
        return entries
    where = f"{type(module).__name__} at {prefix[:-1] or '<root>'}"
    probes = {key: torch.empty(region.shape, device="meta") for key, region in entries.items()}
    state = _run_hooks(
        module, probes, prefix, f"the state_dict hook of {where} cannot run on shapes alone",
        "rename, split or slice",
    )  # fmt: skip
    by_id = {id(probe): key for key, probe in probes.items()}
    out: dict[str, Region] = {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        source = by_id.get(id(tensor)) or by_id.get(id(tensor._base))
        if source is None:  # a copy: which elements? (torchtitan's fused QKV gathers rows)
            return _gathered(module, entries, prefix, where)
        start = _offset_in(probes[source], tensor, key, where)
        base = entries[source]
        if base.rows is not None and (any(start) or tuple(tensor.shape) != base.shape):
            raise CheckpointFormatError(
                f"the state_dict hook of {where} presents {key!r} as a slice of a tensor that "
                "an inner hook gathered; shardstream restores one level of such hooks"
            )
        if base.rows is not None:
            out[key] = base
            continue
        out[key] = Region(
            base.live, tuple(a + b for a, b in zip(base.start, start)), tuple(tensor.shape)
        )
    return out


def _run_hooks(
    module: torch.nn.Module, probes: dict[str, torch.Tensor], prefix: str, failed: str, can: str
) -> OrderedDict:
    """``module``'s state-dict hooks run over ``probes``, as ``state_dict`` would run them."""
    state: OrderedDict = OrderedDict(probes)
    try:
        for hook in list(module._state_dict_hooks.values()):
            result = hook(module, state, prefix, {"version": getattr(module, "_version", 1)})
            if result is not None:
                state = result
    except Exception as exc:  # noqa: BLE001 - a hook that needs real data or cannot be traced
        raise CheckpointFormatError(
            f"{failed} ({type(exc).__name__}: {exc}); shardstream restores hooks that {can} "
            "parameters"
        ) from None
    return state


def _gathered(
    module: torch.nn.Module, entries: dict[str, Region], prefix: str, where: str
) -> dict[str, Region]:
    """Run ``module``'s hooks again on index tensors (each element holds its own position, one
    range per entry; one module's tensors, transiently): every presented tensor must be, row by
    row, a rectangular slice of one entry, and becomes runs of consecutive such rows."""
    bases, probes, base = [], {}, 0
    for key, region in entries.items():
        if region.rows is not None:
            raise CheckpointFormatError(
                f"the state_dict hook of {where} copies a tensor that an inner hook gathered; "
                "shardstream restores one level of such hooks"
            )
        n = math.prod(region.shape)
        probes[key] = torch.arange(base, base + n, dtype=torch.int64).reshape(region.shape)
        bases.append((base, base + n, key))
        base += n
    state = _run_hooks(
        module, probes, prefix, f"the state_dict hook of {where} cannot be traced",
        "rename, split, slice or gather",
    )  # fmt: skip
    out: dict[str, Region] = {}
    for key, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            out[key] = _rows_of(key, tensor, probes, bases, entries, where)
    return out


def _rows_of(key, tensor, probes, bases, entries, where) -> Region:
    new = CheckpointFormatError(
        f"the state_dict hook of {where} presents {key!r} as a new tensor, not a part of a "
        "parameter (cat, arithmetic, a reshape across rows); shardstream restores hooks that "
        "rename, split, slice or gather parameters"
    )
    if tensor.dtype != torch.int64 or tensor.dim() == 0 or tensor.numel() == 0:
        raise new
    lo, hi = int(tensor.min()), int(tensor.max())
    found = [(a, key_) for a, b, key_ in bases if a <= lo and hi < b]
    if not found:
        raise new
    first_index, source = found[0]
    src = probes[source]
    if tensor.dim() != src.dim():
        raise new
    rows = tensor.reshape(tensor.shape[0], -1) - first_index
    firsts = rows[:, 0]
    # the offsets of a rectangular slice of tensor.shape[1:] inside the source's rows
    pattern = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(tensor.shape[1:], src.stride()[1:]):
        pattern = pattern.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    if not torch.equal(rows - firsts[:, None], pattern.reshape(1, -1).expand_as(rows)):
        raise new
    coords = []
    rest = firsts.clone()
    for stride in src.stride():
        coords.append(rest // stride)
        rest = rest % stride
    coords = torch.stack(coords, 1)  # (presented row, source dims)
    for d in range(1, src.dim()):
        if bool((coords[:, d] + tensor.shape[d] > src.shape[d]).any()):
            raise new
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    base = entries[source]
    for i, at in enumerate(coords.tolist()):
        at = tuple(a + b for a, b in zip(base.start, at))
        if runs:
            p, n, start = runs[-1]
            if at == (start[0] + n, *start[1:]):
                runs[-1] = (p, n + 1, start)
                continue
        runs.append((i, 1, at))
    if len(runs) == 1:
        return Region(base.live, runs[0][2], tuple(tensor.shape))
    return Region(base.live, (0,) * tensor.dim(), tuple(tensor.shape), tuple(runs))


def _whole(name: str, tensor: torch.Tensor) -> Region:
    return Region(name, (0,) * tensor.dim(), tuple(tensor.shape))


def _offset_in(probe: torch.Tensor, view: torch.Tensor, key: str, where: str) -> tuple[int, ...]:
    """The start of ``view`` inside ``probe`` when it is a rectangular, same-layout slice."""
    same = view.dim() == probe.dim() and all(
        n <= 1 or s == t for n, s, t in zip(view.shape, view.stride(), probe.stride())
    )
    offset = view.storage_offset() - probe.storage_offset()
    start = []
    for n, g, stride in zip(view.shape, probe.shape, probe.stride()):
        start.append(offset // stride if stride else 0)
        offset -= start[-1] * stride
        if start[-1] + n > g:
            same = False
    if not same or offset:
        raise CheckpointFormatError(
            f"the state_dict hook of {where} presents {key!r} as a reshaped or transposed view "
            "of a parameter; shardstream restores hooks that rename, split or slice parameters"
        )
    return tuple(start)


def renamer(regions: dict[str, Region]) -> Callable[[str], str]:
    """A parameter name as saved (presented) -> its live FQN."""
    moved = {k: r.live for k, r in regions.items() if r.live != k}
    return lambda name: moved.get(name, name)


def translate(
    tensors: dict[str, GlobalTensor], regions: dict[str, Region], live: dict[str, torch.Tensor]
) -> dict[str, GlobalTensor]:
    """Saved tensors named as presented -> the same bytes described as the live tensors they
    are parts of (model and optimizer state); others pass unchanged."""
    moved = {
        k: r
        for k, r in regions.items()
        if r.live != k or any(r.start) or r.shape != tuple(live[MODEL_PREFIX + r.live].shape)
    }
    if not moved:
        return tensors
    out: dict[str, GlobalTensor] = {}
    pieces: dict[str, list[Block]] = {}
    kinds: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, tensor in tensors.items():
        found = _split_name(name, moved)
        if found is None:
            out[name] = tensor
            continue
        head, key, tail = found
        region = moved[key]
        target = f"{head}{region.live}{tail}"
        full = tuple(live[MODEL_PREFIX + region.live].shape)
        if tensor.shape == region.shape and len(full) == len(region.shape):
            if region.rows is not None:
                shifted = [p for b in tensor.blocks for p in _row_pieces(b, region.rows)]
            else:
                shifted = [
                    dataclasses.replace(
                        b, start=tuple(s + o for s, o in zip(b.start, region.start))
                    )
                    for b in tensor.blocks
                ]
            pieces.setdefault(target, []).extend(shifted)
            kinds[target] = (tensor.dtype, full)
        elif tensor.shape == () and target not in kinds:  # e.g. Adam's step, once per part
            out[target] = dataclasses.replace(tensor, name=target)
        elif tensor.shape != ():
            raise CheckpointFormatError(
                f"saved {name!r} has shape {list(tensor.shape)}, but the model presents "
                f"{key!r} with shape {list(region.shape)}"
            )
    for target, blocks in pieces.items():
        dtype, shape = kinds[target]
        blocks.sort(key=lambda b: b.start)
        check_blocks_tile(target, shape, blocks)  # every part of the live tensor saved once
        out[target] = GlobalTensor(target, dtype, shape, tuple(blocks))
    return out


def _row_pieces(block: Block, rows) -> list[Block]:
    """A saved block of a gathered tensor, cut where its rows' runs end, in the live tensor."""
    out = []
    first, count = block.start[0], block.shape[0]
    for presented, n, start in rows:
        lo, hi = max(first, presented), min(first + count, presented + n)
        if lo >= hi:
            continue
        out.append(
            dataclasses.replace(
                block,
                offset=block.offset + (lo - first) * block.strides[0] * itemsize(block.dtype),
                start=(start[0] + lo - presented, *(a + b for a, b in zip(start[1:],
                                                                          block.start[1:]))),
                shape=(hi - lo, *block.shape[1:]),
            )
        )  # fmt: skip
    return out


def translate_names(
    values: dict, regions: dict[str, Region], heads: tuple[str, ...] = (OPTIMIZER_PREFIX + STATE,)
) -> dict:
    """Flat names ``<head><presented>.<key>`` (optimizer scalars; DCP's flattened
    ``param_groups.<fqn>.<key>``) renamed to the live FQN, the first of several parts' equal
    values kept."""
    moved = {k: r for k, r in regions.items() if r.live != k}
    out: dict = {}
    for name, value in values.items():
        found = _split_name(name, moved, heads) if isinstance(name, str) else None
        target = name if found is None else f"{found[0]}{moved[found[1]].live}{found[2]}"
        out.setdefault(target, value)
    return out


_NAME_HEADS = (MODEL_PREFIX, OPTIMIZER_PREFIX + STATE)


def _split_name(
    name: str, moved: dict[str, Region], heads: tuple[str, ...] = _NAME_HEADS
) -> tuple[str, str, str] | None:
    """(head, presented key, tail) of a model or optimizer-state name, or None."""
    for head in heads:
        if not name.startswith(head):
            continue
        rest = name[len(head) :]
        if rest in moved:
            return head, rest, ""
        parts = rest.split(".")
        for i in range(len(parts) - 1, 0, -1):
            key = ".".join(parts[:i])
            if key in moved:
                return head, key, "." + ".".join(parts[i:])
    return None
