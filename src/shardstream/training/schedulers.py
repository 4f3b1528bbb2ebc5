"""Saved LR scheduler state into a live scheduler, whatever wrote it.

A scheduler's ``state_dict()`` does not always survive a checkpoint as it was: DCP's
flattening drops empty containers (``LambdaLR`` over a ``functools.partial``, as transformers'
``get_cosine_schedule_with_warmup`` builds, keeps ``lr_lambdas: [{}]``, which comes back
missing), and int keys come back as strings. ``load_state_dict`` of most schedulers needs every
key (``LambdaLR`` pops ``lr_lambdas``, ``SequentialLR`` ``_schedulers``). So the saved values
are merged into the live scheduler's own ``state_dict()``: what was saved wins, what was lost
on the way keeps the live value, and the result has the shape the scheduler expects.

``check`` tries the merged state on the live scheduler and puts the old state back, so a
restore can refuse before it touches anything else.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointFormatError


def merged_state(live: Mapping[str, Any], saved: Any, where: str = "lr_scheduler") -> dict:
    """``saved`` laid over ``live`` (a scheduler's ``state_dict()``), recursively. ``where``
    names the object in errors: the scheduler, or a Stateful of ``states=`` by its name."""
    if not isinstance(saved, Mapping):
        raise CheckpointFormatError(f"{where}: saved state is a {type(saved).__name__}, not a dict")
    return _merge(live, saved, where)


def _merge(live: Any, saved: Any, where: str) -> Any:
    if isinstance(live, Mapping) and isinstance(saved, Mapping):
        by_text = {str(k): k for k in live}
        out = dict(live)
        for key, value in saved.items():
            target = key if key in live else by_text.get(str(key), key)
            out[target] = _merge(live[target], value, f"{where}.{key}") if target in live else value
        return out
    if isinstance(live, (list, tuple)) and isinstance(saved, Mapping):
        # a list flattened to {0: ..., 1: ...} (or {"0": ...}) that was not put back together
        items = list(live)
        for key, value in saved.items():
            index = int(key) if str(key).isdigit() else None
            if index is None or index >= len(items):
                raise CheckpointFormatError(
                    f"{where}: saved entry {key!r} has no place in the live scheduler's list of "
                    f"{len(items)}"
                )
            items[index] = _merge(items[index], value, f"{where}[{index}]")
        return type(live)(items) if isinstance(live, tuple) else items
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        if len(live) != len(saved):
            # one entry per param group (base_lrs), or per chained scheduler: their count is
            # the live optimizer's and scheduler's, and a step zips them with the groups
            if any(isinstance(v, Mapping) for v in live) or (
                live and all(same_kind(0.0, v) and v is not None for v in live)
            ):
                raise CheckpointFormatError(
                    f"{where}: {len(saved)} saved entries for the live scheduler's {len(live)}; "
                    "build the scheduler as the run did"
                )
            return saved
        merged = [_merge(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(live, saved))]
        return type(saved)(merged) if isinstance(saved, tuple) else merged
    if not same_kind(live, saved):
        raise CheckpointFormatError(
            f"{where}: saved as {type(saved).__name__} {_shown(saved)}, but the live value is "
            f"a {type(live).__name__}"
        )
    return saved


def same_kind(live: Any, saved: Any) -> bool:
    """Whether a saved scalar may stand where the live one does: numbers (and 0-dim tensors)
    for numbers, a bool for a bool, a string for a string; None and other objects either way
    (optional settings, objects a state keeps)."""
    import numbers

    import torch

    def number(x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return x.numel() == 1 and not x.dtype.is_complex
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    if live is None or saved is None:
        return True
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if number(live):
        return number(saved)
    if isinstance(live, str):
        return isinstance(saved, str)
    return True


def _plain_data(value: Any) -> bool:
    """Numbers, strings, containers, tensors, None: what a state may replace."""
    import numbers

    import torch

    return value is None or isinstance(
        value, (numbers.Number, str, bytes, list, tuple, dict, set, torch.Tensor)
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load(scheduler: Any, saved: Any, where: str = "lr_scheduler") -> None:
    """Load ``saved`` into ``scheduler`` (or any Stateful, named ``where``), merged over its
    current state."""
    live = scheduler.state_dict()
    state = merged_state(live, saved, where)
    for key in state.keys() - live.keys():  # a scheduler's load_state_dict sets attributes
        if not _plain_data(getattr(scheduler, str(key), None)):  # (its optimizer, a model)
            raise CheckpointFormatError(
                f"{where}: saved key {key!r} would replace the live {type(scheduler).__name__}'s "
                f"own {key} (not part of its state): saved by another kind of object?"
            )
    scheduler.load_state_dict(state)


def foreign_keys(scheduler: Any, saved: Any) -> list[str]:
    """The saved top-level keys the live scheduler's own state lacks: a state saved by another
    kind of scheduler (a ``CosineAnnealingLR``'s ``T_max`` restored into a ``LambdaLR``),
    whose schedule the live one will not follow."""
    if not isinstance(saved, Mapping):
        return []
    live = {str(k) for k in scheduler.state_dict()}
    return sorted(str(k) for k in saved if str(k) not in live)


def check(scheduler: Any, saved: Any, where: str = "lr_scheduler") -> None:
    """Raise what ``load`` would raise, leaving ``scheduler`` as it was."""
    before = copy.deepcopy(scheduler.state_dict())
    attributes = set(getattr(scheduler, "__dict__", ()))
    try:
        load(scheduler, copy.deepcopy(saved), where)
    except CheckpointFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure: the state does not fit
        raise CheckpointFormatError(
            f"the saved state does not fit the live {type(scheduler).__name__} "
            f"({type(exc).__name__}: {exc})"
        ) from None
    finally:
        scheduler.load_state_dict(copy.deepcopy(before))
        for name in set(getattr(scheduler, "__dict__", ())) - attributes:
            delattr(scheduler, name)  # set by the trial load from keys it did not have
