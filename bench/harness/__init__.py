"""What every bench script shares: where things live, and one log line format.

The modules below answer one question each:

- ``process``: how long did a command take and how much memory did it hold (GNU time, tree RSS)?
- ``memory``: how much memory and CPU did a stretch of *this* process use (VmHWM, samples)?
- ``cache``: is the page cache warm, cold or dirty (warm, drop, sync, tree sizes)?
- ``machine``: what ran the benchmark (CPU, memory, disk, kernel, git revision)?
- ``training``: what FSDP2 model and optimizer do the training benchmarks save and restore?
- ``render``: how do results become Markdown tables, numbers and plots in docs/?
"""

from __future__ import annotations

import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
MiB = 2**20


def log(msg: str) -> None:
    """Print ``msg`` with a wall-clock stamp, flushed (bench runs are followed live)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
