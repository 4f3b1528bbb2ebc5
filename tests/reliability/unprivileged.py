"""Entry points for the scenarios that run as uid 65534 (``scenarios.unprivileged_*``).

The forkserver's ``call`` job imports this module while the forked child is still root, then
drops privileges. After that nothing new can be imported: the interpreter's standard library
lives under /root, and a checkout in a private directory (mode 0700, as ``mktemp -d`` makes
one) hides the editable package, and any virtual environment inside it, from that user. So every
shardstream module, and what they import lazily, is imported here first.
"""

from __future__ import annotations

import importlib
import pkgutil

import scenarios

import shardstream

# Imported inside shardstream's functions (or by torch on a save's path).
LAZY = (
    "numpy",
    "safetensors.torch",
    "tqdm",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint.default_planner",
    "torch.distributed.checkpoint._dedup_save_plans",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor._utils",
    "torch.profiler._cupti_monitor",
    "zlib_ng.zlib_ng",
)
# Not reached by the scenarios: the CLI's entry script (it runs on import), the demo, test
# helpers, and the plug-ins for other frameworks (the verl one installs an import hook).
SKIP = (
    "shardstream.__main__",
    "shardstream.demo",
    "shardstream.testing",
    "shardstream.integrations",
)


def _import_everything() -> None:
    for info in pkgutil.walk_packages(shardstream.__path__, "shardstream."):
        if not info.name.startswith(SKIP):
            importlib.import_module(info.name)
    for name in LAZY:
        try:
            importlib.import_module(name)
        except ImportError:  # optional, or absent from this torch
            pass


_import_everything()


def denied(spec: dict, rank: int) -> int:
    return scenarios.unprivileged_denied(spec, rank)


def mid_run(spec: dict, rank: int) -> int:
    return scenarios.unprivileged_mid_run(spec, rank)
