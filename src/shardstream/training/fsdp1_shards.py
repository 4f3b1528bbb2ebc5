"""What an FSDP1 rank holds, read straight from its flat parameters: no unflatten, no gather.

FSDP1 keeps each wrapped unit's parameters as one flat parameter, concatenated, padded and
cut into equal contiguous shards. A rank's part of an original parameter is therefore a range
of its row-major elements, which ``flat_boxes`` cuts into at most a few rectangular boxes, each
a contiguous run of the local shard. torch's sharded state dict of FSDP1 instead all-gathers
every unit and clones every parameter's ``torch.chunk`` rows (and does the same to the
optimizer state): a second copy of the rank's whole state, on the device or, on CPU, in host
memory. The boxes here are views of the live shard and its optimizer state, which the save
streams like any other tensor.

Every sharding strategy is read this way: full or gradient-op sharding over the whole process
group, hybrid sharding (shards within a group, groups replicating each other: the first replica
writes), and no sharding (every rank holds everything: rank 0 writes). ``layout(model)`` is None
when the model is not plain FSDP1 (ignored modules, other state-dict hooks, parameters not in
their sharded views): the caller then takes torch's path. A save or restore takes the layout
once and asks it for what it reads or fills.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.plan import flat_runs
from ..errors import UsageError
from ..formats.native import MODEL_PREFIX, OPTIMIZER_PREFIX
from .state import STATE, has_state_dict_hooks

PLACEMENT = "fsdp1:flat"  # the manifest's placement for these tensors
Segment = tuple[str, tuple[int, ...], int]  # (fqn, shape, offset in the unpadded flat param)


@dataclass(frozen=True)
class FlatShard:
    """A rank's part of one global tensor as boxes: (start, view of the live storage).

    Stands where a DTensor would in the save's tensors: ``shape`` and ``dtype`` are the global
    tensor's."""

    shape: torch.Size
    dtype: torch.dtype
    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...]


@dataclass(frozen=True)
class _Param:
    fqn: str  # as torch's state dict names it
    shape: torch.Size
    begin: int  # the range of the parameter's elements this rank holds
    end: int
    offset: int  # where that range starts in the rank's shard of the flat parameter


def _pieces(param: _Param, local: torch.Tensor) -> FlatShard:
    """``local``'s elements ``param.offset ...`` as the boxes of the parameter's range."""
    pieces = tuple(
        (start, local[param.offset + at : param.offset + at + math.prod(size)].view(size))
        for start, size, at in flat_runs(param.shape, param.begin, param.end)
    )
    return FlatShard(param.shape, local.dtype, pieces)


class Layout:
    """The FSDP1 units of a model: each flat parameter, its local shard and its parameters;
    ``writes``: this rank is the one of its replicas that saves what it holds."""

    def __init__(
        self,
        units: list[tuple[Any, torch.Tensor, list[_Param], list[tuple[str, str]]]],
        writes: bool = True,
    ):
        self.units = units  # (flat param, local shard, params, [(shared fqn, primary fqn)])
        self.writes = writes

    @classmethod
    def of(cls, model: torch.nn.Module) -> Layout | None:
        import torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._common_utils import clean_tensor_name
        from torch.distributed.fsdp._flat_param import HandleShardingStrategy

        hybrid = (HandleShardingStrategy.HYBRID_SHARD, HandleShardingStrategy._HYBRID_SHARD_ZERO2)
        fsdp = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, FullyShardedDataParallel)
        ]
        if not fsdp or has_state_dict_hooks(model) or not dist.is_initialized():
            return None
        units, covered, writers = [], set(), set()
        for name, module in fsdp:
            handle = module._handle
            if handle is None:
                continue
            group = handle.process_group  # the ranks the flat parameter is sharded over
            if handle._sharding_strategy in hybrid:
                replicas = module._inter_node_pg  # the ranks holding the same shard
                writes = dist.get_rank(replicas) == 0
            elif handle._sharding_strategy == HandleShardingStrategy.NO_SHARD:
                replicas, group = group, None  # every rank holds everything
                writes = dist.get_rank(replicas) == 0
            else:
                replicas, writes = None, True
            sizes = [dist.get_world_size(g) for g in (group, replicas) if g is not None]
            if math.prod(sizes) != dist.get_world_size():
                return None
            writers.add(writes)
            flat = handle.flat_param
            local = getattr(flat, "_local_shard", None)  # set at FSDP's lazy init
            if local is None and flat.size() == getattr(flat, "_sharded_size", None):
                local = flat.data  # before the first forward: the flat parameter is the shard
            if local is None or local.dim() != 1:
                return None
            prefix = f"{name}." if name else ""
            params = []
            infos = zip(flat._fqns, flat._shapes, flat._shard_param_infos)
            for fqn, shape, info in infos:
                if not math.prod(shape):
                    return None  # torch's path handles empty parameters
                full = clean_tensor_name(prefix + fqn)
                if info.in_shard:
                    begin, end = info.intra_param_start_idx, info.intra_param_end_idx + 1
                    params.append(_Param(full, shape, begin, end, info.offset_in_shard))
                else:
                    params.append(_Param(full, shape, 0, 0, 0))
            shared = [
                (
                    clean_tensor_name(prefix + _joined(s.module_name, s.param_name)),
                    clean_tensor_name(prefix + _joined(s.prim_module_name, s.prim_param_name)),
                )
                for s in flat._shared_param_infos
            ]
            views = flat._params or ()
            if any(v.numel() != p.end - p.begin for v, p in zip(views, params)):
                return None  # not in their sharded views (inside summon_full_params)
            units.append((flat, local, params, shared))
            covered.add(id(flat))
            covered.update(id(p) for p in (flat._params or ()))
        if not units or any(id(p) not in covered for p in model.parameters()):
            return None  # a parameter outside every flat parameter (ignored modules)
        if len(writers) != 1:
            return None  # units replicated differently: torch's path
        return cls(units, writers.pop())

    def model_tensors(
        self, model: torch.nn.Module, every_rank: bool = False
    ) -> dict[str, FlatShard | torch.Tensor]:
        """``model.<fqn>`` -> this rank's part (views of the flat parameters), buffers whole.
        A replica that does not write presents no boxes, unless ``every_rank`` (restore
        targets)."""
        out: dict[str, FlatShard | torch.Tensor] = {}
        held = every_rank or self.writes
        for _, local, params, shared in self.units:
            mine = {p.fqn: _pieces(p if held else _nothing(p), local) for p in params}
            for shared_fqn, primary in shared:
                mine[shared_fqn] = mine[primary]
            out.update(mine)
        for name, buffer in _persistent_buffers(model):
            out[name] = buffer.detach()
        return {MODEL_PREFIX + k: v for k, v in out.items()}

    def optimizer_tensors(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, FlatShard], dict[str, Any]] | None:
        """``state.optimizer_state`` from the live optimizer state (what this rank holds of
        it); None before the first step, where torch's path creates the state."""
        return self.optimizer(optimizer) if optimizer.state else None

    def optimizer(
        self, optimizer: torch.optim.Optimizer, every_rank: bool = False
    ) -> tuple[dict[str, FlatShard], dict[str, Any]]:
        """Tensors by ``optimizer.state.<fqn>.<key>`` and the JSON-able rest, as
        ``state.optimizer_state`` gives them. A rank presents only the state it holds (with
        ``use_orig_params`` a parameter outside its shard has none): every rank's boxes reach
        the manifest, so each entry is written by the rank that holds it. ``every_rank``:
        scalar state on every rank that has it (restore targets), not on one."""
        by_param: dict[int, list[str]] = {}
        tensors: dict[str, FlatShard] = {}
        scalars: dict[str, Any] = {}
        held = every_rank or self.writes
        for flat, local, all_params, _ in self.units:
            params = all_params if held else [_nothing(p) for p in all_params]
            if flat._params is None:  # use_orig_params=False: the optimizer steps ``flat``
                by_param[id(flat)] = [p.fqn for p in params]
                for key, value in (optimizer.state.get(flat) or {}).items():
                    for p in params:
                        _add(tensors, scalars, p, key, value, local.numel(), p.offset, every_rank)
                continue
            for p, live in zip(params, flat._params):  # use_orig_params=True: each of them
                by_param[id(live)] = [p.fqn]
                for key, value in (optimizer.state.get(live) or {}).items():
                    _add(tensors, scalars, p, key, value, live.numel(), 0, every_rank)
        groups = []
        for group in optimizer.param_groups:
            names = [n for param in group["params"] for n in by_param.get(id(param), ())]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        return tensors, {"param_groups": groups, "scalars": scalars}

    def restore_targets(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> RestoreTargets:
        """The live boxes a restore fills."""
        objects: dict[str, Any] = {"param_groups": [], "scalars": {}}
        tensors: dict[str, FlatShard | torch.Tensor] = {}
        if optimizer is not None:
            if not optimizer.state:
                from torch.distributed.checkpoint.state_dict import _init_optim_state

                _init_optim_state(optimizer)  # torch's own: one step of zero gradients at lr 0
            tensors, objects = self.optimizer(optimizer, every_rank=True)
        params = {}
        for flat, _, units_params, _ in self.units:
            owners = flat._params or [flat] * len(units_params)
            params.update({p.fqn: owner for p, owner in zip(units_params, owners)})
        return RestoreTargets(self.model_tensors(model, every_rank=True), tensors, objects, params)

    def optimizer_segments(
        self, optimizer: torch.optim.Optimizer
    ) -> list[list[list[Segment]]] | None:
        """For FSDP1 with ``use_orig_params=False``: per optimizer group, per flat parameter in
        it, where each parameter lies in the whole (unsharded) flat parameter; what reads a
        flat optimizer state saved at another world size (verl's FSDP1 ``.pt``). None
        otherwise."""
        by_flat: dict[int, list[Segment]] = {}
        for flat, _, params, _ in self.units:
            if flat._params is not None:
                return None
            segments, at, queue = [], 0, iter(params)
            for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
                if not padding:
                    p = next(queue)
                    segments.append((p.fqn, tuple(p.shape), at))
                at += numel
            by_flat[id(flat)] = segments
        groups = []
        for group in optimizer.param_groups:
            if any(id(param) not in by_flat for param in group["params"]):
                return None
            groups.append([by_flat[id(param)] for param in group["params"]])
        return groups


def wrapped(model: torch.nn.Module) -> bool:
    """Whether FSDP1 wraps any part of ``model``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def wrap_policy_segments(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[list[Segment]]] | None:
    """For a model that is not FSDP1 itself (FSDP2, or plain): where a verl FSDP1 run with
    ``use_orig_params=False`` kept its parameters, as ``Layout.optimizer_segments`` gives them.
    verl's wrap policy makes a unit of each outermost module whose class the model's
    ``_no_split_modules`` names; the root unit holds the rest and comes first; a unit's flat
    parameter holds its parameters in module order, each once, with no padding between. None
    when the model names no such class or a unit's parameters are not in one optimizer group.
    A guess from the model's own classes: the saved flat sizes must confirm it
    (``formats.verl.open_verl_flat_optimizer`` checks them)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        return None
    units: list[str] = []
    for name, module in model.named_modules():
        # FSDP2's fully_shard makes each module an instance of a subclass of its own class
        named = any(c.__name__ in classes for c in type(module).__mro__)
        if named and not any(name.startswith(u + ".") for u in units):
            units.append(name)
    members: dict[str, list[tuple[str, torch.nn.Parameter]]] = {"": [], **{u: [] for u in units}}
    for fqn, param in model.named_parameters():
        owner = next((u for u in units if fqn.startswith(u + ".")), "")
        members[owner].append((fqn, param))
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    per_group: list[list[list[Segment]]] = [[] for _ in optimizer.param_groups]
    for params in members.values():
        if not params:
            continue
        groups = {group_of.get(id(param)) for _, param in params}
        if len(groups) != 1 or None in groups:
            return None
        segments, at = [], 0
        for fqn, param in params:
            segments.append((fqn, tuple(param.shape), at))
            at += param.numel()
        per_group[groups.pop()].append(segments)
    return per_group


def _nothing(param: _Param) -> _Param:
    """``param`` as a rank that holds none of it presents it."""
    return _Param(param.fqn, param.shape, 0, 0, 0)


def _add(
    tensors,
    scalars,
    param: _Param,
    key: str,
    value: Any,
    local_numel: int,
    offset: int,
    every_rank: bool,
):
    """One optimizer state entry of ``param``: the param's range of a per-element state
    tensor; a scalar tensor from the rank holding the parameter's first element (one copy of
    it reaches the checkpoint); anything else JSON."""
    name = f"{OPTIMIZER_PREFIX}{STATE}{param.fqn}.{key}"
    if not isinstance(value, torch.Tensor):
        scalars[name] = value
    elif value.dim() == 0:
        held = every_rank or (param.begin == 0 and param.end > 0)
        pieces = (((), value.detach()),) if held else ()
        tensors[name] = FlatShard(value.shape, value.dtype, pieces)
    elif value.numel() == local_numel and value.is_contiguous():  # 1-D, or unsharded (NO_SHARD)
        tensors[name] = _pieces(
            _Param(param.fqn, param.shape, param.begin, param.end, offset),
            value.detach().view(-1),
        )
    else:
        raise UsageError(
            f"{name}: optimizer state of shape {tuple(value.shape)} does not follow the FSDP1 "
            f"flat shard ({local_numel} elements); shardstream cannot place it"
        )


def _joined(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name


def _persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield clean_tensor_name(_joined(module_name, name)), buffer


@dataclass
class RestoreTargets:
    """What a restore fills in an FSDP1 model, in place: views of the flat shards and of the
    optimizer state (created first, as torch does, where the optimizer has none yet)."""

    model: dict[str, FlatShard | torch.Tensor]  # model.<fqn>
    optimizer: dict[str, FlatShard | torch.Tensor]  # optimizer.state.<fqn>.<key>
    objects: dict[str, Any]  # the live optimizer's param groups (FQNs) and scalar state
    params: dict[str, Any]  # fqn -> the object the optimizer keys its state by

    @property
    def names(self) -> set[str]:
        """Parameter and buffer names, as ``state.nest_optimizer_state`` needs them."""
        return {k[len(MODEL_PREFIX) :] for k in self.model}

    def apply_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        nested: dict[str, dict[str, Any]],
        groups: list,
        stateful: set[str],
    ) -> None:
        """After the tensors are filled: the saved hyperparameters of each group (matched by
        its parameter names) and the non-tensor state values. A parameter outside
        ``stateful`` (FQNs the checkpoint keeps state for) is left without state, where no
        parameter sharing its optimizer entry has any."""
        kept = {id(self.params[fqn]) for fqn in stateful if fqn in self.params}
        for owner in {id(o): o for o in self.params.values()}.values():
            if id(owner) not in kept:
                optimizer.state.pop(owner, None)
        # A flat parameter (use_orig_params=False) has one state for all of its parameters:
        # those the checkpoint keeps none for get zeros in their ranges, as torch's FSDP1
        # loading gives them (no AdamW moments), not what the live optimizer held there.
        prefix = OPTIMIZER_PREFIX + STATE
        for name, target in self.optimizer.items():
            fqn = name[len(prefix) :].rpartition(".")[0]
            if fqn in stateful or id(self.params.get(fqn)) not in kept:
                continue
            if isinstance(target, FlatShard) and len(target.shape) > 0:  # not a shared step
                for _, view in target.pieces:
                    view.zero_()
        live = [frozenset(g["params"]) for g in self.objects["param_groups"]]
        for group, names in zip(optimizer.param_groups, live):
            saved = next(g for g in groups if frozenset(g["params"]) == names)
            group.update({k: v for k, v in saved.items() if k != "params"})
        for fqn, entries in nested.items():
            for key, value in entries.items():
                filled = isinstance(value, (torch.Tensor, FlatShard))  # in place already
                if not filled and fqn in self.params:
                    optimizer.state[self.params[fqn]][key] = value


def layout(model: torch.nn.Module | None) -> Layout | None:
    """The model's FSDP1 layout, or None where this path does not apply."""
    return None if model is None else Layout.of(model)


def boxes(
    targets: dict[str, FlatShard | torch.Tensor],
) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
    """(name, global start, live tensor) of every box to fill: a flat shard's boxes, a plain
    tensor (a buffer) whole."""
    out = []
    for name, target in targets.items():
        if isinstance(target, FlatShard):
            out += [(name, start, view) for start, view in target.pieces]
        else:
            out.append((name, (0,) * target.dim(), target))
    return out


def region(target: FlatShard | torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, shape) of the smallest box holding every box of ``target`` this rank fills."""
    if not isinstance(target, FlatShard):
        return (0,) * target.dim(), tuple(target.shape)
    if not target.pieces:
        return (0,) * len(target.shape), (0,) * len(target.shape)
    lo = [min(s[d] for s, _ in target.pieces) for d in range(len(target.shape))]
    hi = [max(s[d] + v.shape[d] for s, v in target.pieces) for d in range(len(target.shape))]
    return tuple(lo), tuple(h - low for h, low in zip(hi, lo))
