"""Source: whole model state dicts saved with ``torch.save`` by one process.

accelerate's ``save_state`` with an FSDP ``FULL_STATE_DICT`` writes one on rank 0
(``pytorch_model_fsdp.bin`` for model 0, ``pytorch_model_fsdp_N.bin`` for model N): plain
tensors under their module names, in the same kind of zip archive as one of verl's rank files.
So it is read as a verl checkpoint of world size 1 (``verl.read_rank_layouts``): the restricted
unpickler on the meta device for the layout, then byte ranges streamed with every zip record
checked against its CRC-32. A Hugging Face model saved with ``torch.save``
(``pytorch_model.bin``, or an index and its shards: ``open_torch_weights``) is read the same
way, file by file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..engine.plan import GlobalTensor
from ..errors import CheckpointFormatError
from .regular_file import check_inside, open_regular
from .verl import VerlCheckpoint, _model_state, read_rank_layouts

ACCELERATE_FULL_FORMAT = "accelerate (FULL_STATE_DICT)"
WHOLE = "whole (full state dict)"
ONE_FILE_MESH = "none: one whole state dict, written by rank 0"


@dataclass
class TorchStateDict(VerlCheckpoint):
    """A whole state dict in one ``torch.save`` file; ``world_size`` is the saving run's."""

    label: str = ACCELERATE_FULL_FORMAT
    prefix: str = ""  # what the model's names started with in the file (--prefix)

    @property
    def format(self) -> str:
        return self.label

    def config_dir(self) -> Path | None:
        """config.json's directory: the one holding the file (a Trainer's checkpoint-N has
        one; accelerate's save_state none: pass --hf_model_path)."""
        from .dcp_hf import link_root
        from .hf import check_no_links_out

        if os.path.lexists(self.directory / "config.json"):  # read_config refuses a non-file
            return check_no_links_out(self.directory, link_root(self.directory))
        return None


def open_torch_state_dict(
    file: str | os.PathLike,
    *,
    world_size: int = 1,
    label: str = ACCELERATE_FULL_FORMAT,
    shared: bool = False,
    prefix: str | None = None,
    part: str | None = None,
    skip: frozenset[str] = frozenset(),
) -> TorchStateDict:
    """The layout of the state dict in ``file`` (its tensors located, none loaded).

    ``world_size``: how many processes the saving run had (the file says nothing of it).
    ``shared``: every process of the current group opens it together (one unpickles it).
    ``part``: the key of the top-level dict that holds the state dict (a general checkpoint's
    ``model_state_dict``); None: the file holds it at the top level, without the keys in
    ``skip`` (the training state saved beside it). ``prefix``: what the model's names start
    with in that state dict (``model.`` where a Lightning module holds the model as its
    ``model``): the tensors under it, without it.
    """
    from .dcp import normalize_prefix

    file = Path(file)
    directory = file.parent
    prefix = normalize_prefix(prefix)
    check_inside(file, directory)

    def model_state(state: dict, path: str) -> dict:
        kept = {k: v for k, v in state.items() if k not in skip}
        if prefix:
            kept = {
                k[len(prefix) :]: v
                for k, v in kept.items()
                if isinstance(k, str) and k.startswith(prefix) and len(k) > len(prefix)
            }
            if not kept:
                raise CheckpointFormatError(
                    f"{path}: no name in its state dict starts with {prefix!r} (--prefix)"
                )
        return _model_state(kept, path)

    layout = read_rank_layouts([str(file)], _part_of(part, model_state), shared)
    return TorchStateDict(
        directory,
        world_size,
        None,
        layout.tensors,
        {t.name: WHOLE for t in layout.tensors},
        ONE_FILE_MESH,
        [str(file)],
        layout.replicas,
        label=label,
        prefix=prefix or "",
    )


def open_torch_optimizer(
    file: str | os.PathLike,
    prefix: str,
    names_of: Callable[[list[dict]], dict[int, str]] | None = None,
    part: str | None = None,
) -> tuple[list[GlobalTensor], dict[str, object], list[dict]]:
    """A whole optimizer state dict keyed by parameter name, as ``get_optimizer_state_dict``
    (full) and FSDP1's ``FSDP.optim_state_dict`` give it (accelerate's ``optimizer.bin``):
    its tensors named ``<prefix><fqn>.<key>``, its other per-parameter values under the same
    names, and its param groups (``params`` as names). Every process reads the pickle.
    ``names_of``: for an optimizer's own ``state_dict()`` (integer parameter ids, saved without
    FSDP), the parameter names of the ids its param groups list. ``part``: as for
    ``open_torch_state_dict``."""
    file = Path(file)
    check_inside(file, file.parent)
    groups: list[dict] = []

    def flatten(state, path: str) -> dict:
        state = nested_optimizer(state)
        entries = state.get("state") if isinstance(state, dict) else None
        saved_groups = state.get("param_groups") if isinstance(state, dict) else None
        if not isinstance(entries, dict) or not isinstance(saved_groups, list):
            raise CheckpointFormatError(
                f"{path}: not an optimizer state dict (no state and param_groups)"
            )
        if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved_groups):
            raise CheckpointFormatError(f"{path}: a param group without a params list")
        ids = [p for g in saved_groups for p in g["params"]]
        if names_of is not None and ids and all(type(p) is int for p in ids):
            if len(set(ids)) != len(ids):
                raise CheckpointFormatError(f"{path}: a parameter id listed in two param groups")
            names = names_of(saved_groups)
            unlisted = [k for k in entries if k not in names]
            if unlisted:
                raise CheckpointFormatError(
                    f"{path}: optimizer state under parameter id {unlisted[0]!r}, which no "
                    "param group lists"
                )
            entries = {names[k]: v for k, v in entries.items()}
            saved_groups = [{**g, "params": [names[p] for p in g["params"]]} for g in saved_groups]
        out = {}
        for fqn, values in entries.items():
            if not isinstance(fqn, str) or not isinstance(values, dict):
                raise CheckpointFormatError(
                    f"{path}: optimizer state under {fqn!r}, not a parameter name with its "
                    "values (saved with optimizer.state_dict() rather than a full state dict?)"
                )
            out.update({f"{prefix}{fqn}.{key}": value for key, value in values.items()})
        groups[:] = saved_groups
        return out

    layout = read_rank_layouts([str(file)], _part_of(part, flatten), keep_scalars=True)
    return layout.tensors, layout.scalars, _group_values_read(file, groups)


def nested_optimizer(state: object) -> object:
    """An optimizer state dict saved flattened (``flatten_optimizer_state_dict``:
    ``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``; alone or beside the model's tensors)
    as the nested one (``state``, ``param_groups``): the parameters of equal settings one
    group, in the order saved. Anything else as it is."""
    from .dcp import flat_optimizer_keys

    if not isinstance(state, dict) or "param_groups" in state:
        return state
    flat = flat_optimizer_keys([k for k in state if isinstance(k, str)], None)
    if not flat:
        return state
    entries: dict[str, dict] = {}
    settings: dict[str, dict] = {}
    for key in (k for k in state if k in flat):
        head, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        (entries if head == "state" else settings).setdefault(fqn, {})[name] = state[key]
    groups: list[dict] = []
    for fqn, values in settings.items():
        same = next((g for g in groups if _same_group(g, values)), None)
        if same is None:
            groups.append({**values, "params": [fqn]})
        else:
            same["params"].append(fqn)
    return {"state": entries, "param_groups": groups}


def _same_group(group: dict, values: dict) -> bool:
    """Whether ``values`` are ``group``'s settings (a tensor setting, unread here, never is)."""
    import torch

    if group.keys() - {"params"} != values.keys():
        return False
    return all(
        not isinstance(v, torch.Tensor) and not isinstance(group[k], torch.Tensor) and group[k] == v
        for k, v in values.items()
    )


def _group_values_read(file: Path, groups: list[dict]) -> list[dict]:
    """Param groups whose tensor values (a tensor learning rate), loaded for their layout on
    the meta device, are read from ``file``: small, each at most ``MAX_INLINE_BYTES``."""
    import torch

    from ..training.state import MAX_INLINE_BYTES
    from .torch_pt import local_layout, storage_records

    if not any(isinstance(v, torch.Tensor) for g in groups for v in g.values()):
        return groups
    path, records, out = str(file), storage_records(str(file)), []
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        for i, group in enumerate(groups):
            group = dict(group)
            for key, value in group.items():
                if not isinstance(value, torch.Tensor):
                    continue
                name = f"param_groups[{i}][{key!r}]"
                local = local_layout(path, name, value, size, records)
                span = (
                    sum((n - 1) * s for n, s in zip(local.shape, local.strides)) + 1
                    if value.numel()
                    else 0
                ) * value.element_size()
                if span > MAX_INLINE_BYTES:
                    raise CheckpointFormatError(
                        f"{path}: {name} is a tensor of {value.numel()} elements; a param "
                        f"group's values are settings (at most {MAX_INLINE_BYTES} bytes)"
                    )
                f.seek(local.offset)
                data = bytearray(f.read(span))
                flat = torch.frombuffer(data, dtype=value.dtype) if span else None
                group[key] = (
                    torch.as_strided(flat, local.shape, local.strides).clone()
                    if flat is not None
                    else torch.empty(local.shape, dtype=value.dtype)
                )
            out.append(group)
    return out


def _part_of(part: str | None, read: Callable[[object, str], dict]) -> Callable:
    """``read`` applied to ``state[part]`` (``part`` None: to ``state`` itself)."""
    if part is None:
        return read

    def read_part(state, path: str) -> dict:
        if not isinstance(state, dict) or not isinstance(state.get(part), dict):
            raise CheckpointFormatError(f"{path}: no {part!r} dict at the top level")
        return read(state[part], f"{path} [{part!r}]")

    return read_part


# One torch.save file as PyTorch's recipes write it: ``torch.save(model.state_dict(), PATH)``,
# or a general checkpoint ``{"model_state_dict": ..., "optimizer_state_dict": ..., "epoch": ..}``
# (also under the keys other scripts use). Two models (under two keys, or one beside loose
# tensors) are refused as unclear.
TORCH_FILE_FORMAT = "torch.save file"
MODEL_PARTS = ("model_state_dict", "model", "state_dict")
OPTIMIZER_PARTS = ("optimizer_state_dict", "optimizer", "optim")


class NoModelInFileError(CheckpointFormatError):
    """A ``torch.save`` file of training state alone (an optimizer's, a recipe's progress):
    intact, but no model to read."""


@dataclass(frozen=True)
class TorchFileLayout:
    """What one ``torch.save`` file holds, from its unpickled layout."""

    model: str | None  # the key holding the model's state dict; None: it is at the top level
    optimizer: str | None  # the key holding the optimizer's, or None for none
    values: dict[str, object]  # a general checkpoint's other plain values (the recipe's epoch)
    # The model at the top level: the keys beside it that are not its (torchtitan's
    # "optimizer", "lr_scheduler", ...; a flattened optimizer's state.* and param_groups.*)
    skip: frozenset[str] = frozenset()
    flat_optimizer: bool = False  # a flattened optimizer beside the model at the top level

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None or self.flat_optimizer


def torch_file_layout(state: object, file: str | os.PathLike) -> TorchFileLayout:
    """``TorchFileLayout`` of ``file`` from ``state``, its layout as ``torch_pt.load_layout``
    unpickles it (restricted, meta device, no tensor read). Values are plain numbers,
    strings and booleans; a tensor (the recipe's ``loss``) is left out."""
    if not isinstance(state, dict):
        raise CheckpointFormatError(
            f"{file}: holds a {type(state).__name__}, not a state dict or a checkpoint dict"
        )
    models = [k for k in MODEL_PARTS if isinstance(state.get(k), dict)]
    model = models[0] if models else None
    optimizer = next((k for k in OPTIMIZER_PARTS if isinstance(state.get(k), dict)), None)
    if any(state[k] is not state[model] for k in models[1:]):
        raise CheckpointFormatError(
            f"{file}: holds a state dict under each of {', '.join(repr(k) for k in models)}; "
            "which one is the model is unclear, so none is read (save one, or load the file "
            "and save the one you mean)"
        )
    from .dcp import is_rng_state

    # a 0-d loss may be beside the model, and an RNG state (a generator's bytes)
    loose = [k for k, v in state.items() if getattr(v, "ndim", 0) >= 1 and not is_rng_state(k)]
    if model is not None and loose:
        raise CheckpointFormatError(
            f"{file}: holds a state dict under {model!r} and {len(loose)} tensor"
            f"{'s' if len(loose) != 1 else ''} beside it at the top level (e.g. "
            f"{str(loose[0])[:200]!r}); which of them is the model is unclear, so neither is "
            "read"
        )
    skip: frozenset[str] = frozenset()
    flat = False
    if model is None:
        from .dcp import flat_optimizer_keys

        flat_keys = flat_optimizer_keys([k for k in state if isinstance(k, str)], None)
        flat = bool(flat_keys) and optimizer is None
        skip = frozenset(k for k in state if is_rng_state(k))
        if optimizer is not None or flat:  # the model's tensors at the top level beside them
            import torch

            skip |= frozenset(
                k for k, v in state.items() if k in flat_keys or not isinstance(v, torch.Tensor)
            )
            if len(skip) == len(state):
                raise NoModelInFileError(
                    f"{file}: holds an optimizer's state but no model state dict (under any "
                    f"of {', '.join(repr(k) for k in MODEL_PARTS)}, or as tensors at the top "
                    "level)"
                )
    values = {}
    if model is not None:  # a state dict alone holds nothing else
        values = {
            k: v
            for k, v in state.items()
            if isinstance(k, str)
            and k not in (model, optimizer)
            and isinstance(v, (bool, int, float, str))
        }
    return TorchFileLayout(model, optimizer, values, skip, flat)


def open_torch_file(
    file: str | os.PathLike,
    shared: bool = False,
    layout: TorchFileLayout | None = None,
    prefix: str | None = None,
) -> TorchStateDict:
    """The model in one ``torch.save`` file, read as a whole state dict (``layout``: the
    file's, when the caller has it already; ``prefix``: as ``open_torch_state_dict``'s)."""
    from .torch_pt import load_layout

    layout = layout or torch_file_layout(load_layout(str(file)), file)
    return open_torch_state_dict(
        file,
        label=TORCH_FILE_FORMAT,
        shared=shared,
        part=layout.model,
        skip=layout.skip,
        prefix=prefix,
    )


HF_TORCH_FORMAT = "huggingface (pytorch_model.bin)"


def torch_weights_files(directory: Path) -> tuple[list[Path], Path | None, dict[str, list[str]]]:
    """The weights files of a ``pytorch_model.bin`` model directory, its index (None for a
    single file) and what the index lists in each file. Both a single file and an index, or
    anything but a regular file under either name, is refused, naming it."""
    from . import hf
    from .regular_file import present
    from .source import HF_TORCH_FILE, HF_TORCH_INDEX

    single, index = directory / HF_TORCH_FILE, directory / HF_TORCH_INDEX
    has_single, has_index = present(single), present(index)
    if has_single and has_index:
        raise CheckpointFormatError(
            f"{directory}: holds both {HF_TORCH_FILE} and {HF_TORCH_INDEX}; which is the model "
            "is ambiguous: remove one"
        )
    if not has_index:
        return [single], None, {}
    listed = hf.read_weight_map(index, "pytorch_model.bin index")
    return [directory / name for name in sorted(listed)], index, listed


def open_torch_weights(directory: str | os.PathLike, shared: bool = False) -> TorchStateDict:
    """A Hugging Face model saved with ``torch.save`` (``pytorch_model.bin``, or an index and
    its shard files): every file a whole state dict, read as accelerate's ``FULL_STATE_DICT``
    (restricted unpickler for the layout, every record checked against its CRC-32 as it is
    read). Each shard must hold exactly the tensors the index lists for it, and no file may
    link out of the model (``dcp_hf.link_root``: a huggingface_hub snapshot may)."""
    from .dcp_hf import link_root
    from .hf import check_index_matches, check_no_links_out

    directory = Path(directory)
    check_no_links_out(directory, link_root(directory))
    files, index, listed = torch_weights_files(directory)
    tensors: list[GlobalTensor] = []
    replicas: dict = {}
    for file in files:
        layout = read_rank_layouts([str(file)], _model_state, shared)
        if index is not None:
            check_index_matches(index, file, listed[file.name], [t.name for t in layout.tensors])
        tensors += layout.tensors
        replicas.update(layout.replicas)
    return TorchStateDict(
        directory,
        1,
        None,
        tensors,
        {t.name: WHOLE for t in tensors},
        "none: whole tensors (a Hugging Face model)",
        [str(f) for f in files],
        replicas,
        label=HF_TORCH_FORMAT,
    )
