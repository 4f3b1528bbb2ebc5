"""Open any checkpoint shardstream can read, whatever its format."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import CheckpointFormatError, CheckpointNotFoundError

if TYPE_CHECKING:
    from ..engine.endpoints import FileEndpoint
    from ..engine.plan import Block, GlobalTensor

# formats.native.MANIFEST. Each format's module is imported only once the directory looks
# like it: verl's and DCP's import torch (1-2 s), which shardstream's own format never needs.
NATIVE_MANIFEST = "manifest.json"
VERL_MODEL_FILES = "model_world_size_*_rank_*.pt"  # formats.verl.MODEL_FILE, as a glob
DCP_METADATA = ".metadata"


@runtime_checkable
class CheckpointSource(Protocol):
    """What every checkpoint reader offers merge, inspect, test, verify and load. A format
    without some piece of information answers the documented empty value."""

    @property
    def format(self) -> str: ...  # "shardstream", "verl", "dcp"

    @property
    def directory(self) -> Path: ...

    @property
    def tensors(self) -> list[GlobalTensor]: ...  # model tensors under their module names

    @property
    def files(self) -> list[str]: ...  # the data files, as paths

    @property
    def world_size(self) -> int: ...  # processes that saved it

    @property
    def fsdp_version(self) -> int | None: ...  # None: not recorded

    @property
    def mesh(self) -> str: ...  # the saving device mesh, as inspect shows it

    @property
    def placements(self) -> dict[str, str]: ...  # tensor -> how it was laid out, for people

    @property
    def replicas(self) -> dict[str, list[Block]]: ...  # tensor -> copies merge must compare

    @property
    def manifest(self) -> dict: ...  # shardstream's manifest; {} for the other formats

    @property
    def lora_settings(self) -> dict | None: ...  # r, lora_alpha, ... as saved; None: unknown

    def config_dir(self) -> Path | None:
        """Where config.json (and the tokenizer) lie; None when the checkpoint has none."""
        ...

    def endpoint(self, location: str) -> FileEndpoint:
        """A reader of one data file, checking what the format lets it check as it reads."""
        ...

    def check_split_records(self, tensors: list[GlobalTensor]) -> None:
        """Before a merge whose processes split ``tensors``: check, once across them, what
        ``endpoint`` cannot check on read (called by every process together)."""
        ...


def open_checkpoint(
    path: str | os.PathLike, *, model_only: bool = False, shared: bool = False
) -> CheckpointSource:
    """Detect the format of ``path`` and return its reader (see ``CheckpointSource``).

    ``model_only``: the caller reads model tensors only (merge, test), so a format that also
    holds optimizer state need not describe it. ``shared``: every process of the current group
    opens it together, and each reads a share of the rank files' headers (verl's and
    shardstream's formats).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: is a file; expected a checkpoint directory")
    if (path / NATIVE_MANIFEST).is_file():
        from . import native

        if native.is_native_checkpoint(path):
            return native.open_native(path, model_only=model_only, shared=shared)
    from . import verl

    if verl.is_verl_checkpoint(path):
        return verl.open_verl(path, shared=shared)
    from . import dcp

    if dcp.is_dcp_checkpoint(path):
        return dcp.open_dcp(path)
    hint = checkpoints_below(path)
    if hint:
        raise CheckpointNotFoundError(
            f"{path}: no model files here, but {' and '.join(map(str, hint))} "
            f"{'holds a checkpoint' if len(hint) == 1 else 'hold checkpoints'}; pass that directory"
        )
    raise CheckpointNotFoundError(
        f"{path}: no model files found (expected a shardstream manifest.json, verl's "
        "model_world_size_W_rank_R.pt files, or a DCP .metadata)"
    )


def looks_like_checkpoint(path: Path) -> bool:
    return (
        (path / NATIVE_MANIFEST).is_file()
        or (path / DCP_METADATA).is_file()
        or any(path.glob(VERL_MODEL_FILES))
    )


def checkpoints_below(path: Path) -> list[Path]:
    """Checkpoints a user may have meant when passing a run or step directory: the latest step
    of a run (``global_step_N``), and inside a step its ``actor``/``critic``-style roles; none
    where ``path`` cannot be listed."""
    try:
        return _checkpoints_below(path)
    except OSError:
        return []


def _checkpoints_below(path: Path) -> list[Path]:
    from ..storage.commit import is_temporary
    from ..storage.run_layout import STEP_DIR, read_latest

    steps = {}
    for entry in path.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            steps[int(match[1])] = entry
    if steps:
        path = steps.get(read_latest(path)) or steps[max(steps)]
        if looks_like_checkpoint(path):
            return [path]
    return sorted(
        d
        for d in path.iterdir()
        if not is_temporary(d.name) and d.is_dir() and looks_like_checkpoint(d)
    )
