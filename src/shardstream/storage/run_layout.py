"""A run directory's names: ``global_step_N`` per step, the latest pointer, and debris.

The names are verl's and Megatron's, so either tool finds its way around a shardstream run::

    directory/
      latest_checkpointed_iteration.txt   newest committed step (replaced atomically)
      global_step_{N}/                    one step; committed once manifest.json is inside
      global_step_{N}.tmp-*               a write in progress, or debris (see commit.py)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointFormatError, permission_denied
from ..formats.regular_file import open_regular
from .commit import atomic_write_bytes, is_temporary

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_PREFIX = "global_step_"
STEP_DIR = re.compile(r"^global_step_(0|[1-9][0-9]*)\Z")  # verl's names: no leading 0
# Written last into a step directory (formats/native writes it): its presence commits the step.
MANIFEST = "manifest.json"


def step_name(step: int) -> str:
    """The directory name of ``step``."""
    return f"{STEP_PREFIX}{int(step)}"


def step_of(name: str) -> int | None:
    """The step a ``global_step_N`` name is for; None for any other name."""
    match = STEP_DIR.match(name)
    return int(match[1]) if match else None


def step_in_path(path: str | os.PathLike) -> int | None:
    """The step of the first ``global_step_N`` in ``path`` (a verl role such as
    ``global_step_5/actor`` sits inside one); None if there is none."""
    match = re.search(r"global_step_([0-9]+)", str(Path(path).absolute()))
    return int(match[1]) if match else None


def step_dirs(directory: str | os.PathLike) -> dict[int, Path]:
    """Every ``global_step_N`` entry of ``directory`` by step, committed or not."""
    found = {}
    for entry in Path(directory).iterdir():
        step = step_of(entry.name)
        if step is not None:
            found[step] = entry
    return found


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """Steps whose directory holds a manifest, oldest first. Anything else is not a step."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(step for step, path in step_dirs(root).items() if (path / MANIFEST).is_file())


# The most digits a pointer may hold: a step fits in 63 bits (and int() refuses 4301 digits).
MAX_LATEST_DIGITS = 19


def read_latest(directory: str | os.PathLike) -> int | None:
    """The step ``LATEST_FILE`` names, or None when it is missing or damaged (not a regular
    file, not ASCII digits, or more than ``MAX_LATEST_DIGITS`` of them): a reader then falls
    back to the highest committed step (format.md section 1)."""
    path = Path(directory) / LATEST_FILE
    try:
        with open_regular(path) as f:  # a FIFO blocked every reader of the run
            raw = f.read(MAX_LATEST_DIGITS + 64)  # a pointer is a number and a newline
    except (FileNotFoundError, CheckpointFormatError):
        return None
    except PermissionError as exc:
        raise permission_denied(exc, path) from None
    text = raw.strip(b" \t\r\n")
    if not text or len(text) > MAX_LATEST_DIGITS or not all(48 <= c <= 57 for c in text):
        return None
    return int(text)


def write_latest(directory: str | os.PathLike, step: int) -> None:
    """Point ``LATEST_FILE`` at ``step``; readers see the old or the new pointer, never part."""
    atomic_write_bytes(Path(directory) / LATEST_FILE, str(int(step)).encode())  # as verl writes it


def uncommitted(directory: str | os.PathLike) -> list[str]:
    """The names of ``directory``'s writes in progress or debris (``*.tmp-*``), sorted: never
    read as steps, removed by the run's next save."""
    return sorted(name for name in os.listdir(directory) if is_temporary(name))


def is_run_entry(name: str) -> bool:
    """Whether ``name`` is a step's or the latest pointer's: their temporaries (``NAME.tmp-*``)
    are the run's to sweep, anything else in the directory is left alone."""
    return name == LATEST_FILE or step_of(name) is not None
