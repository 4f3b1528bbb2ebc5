"""verl plug-in: with ``SHARDSTREAM_VERL=1``, verl's FSDP engines build shardstream's checkpoint
manager (``shardstream.integrations.verl.FSDPCheckpointManager``) instead of verl's.

verl 0.9.1 imports every entry point of group ``verl.plugins`` on ``import verl``, in every
process (unless ``VERL_USE_EXTERNAL_PLUGINS`` is ``none`` or a list without ``shardstream``);
this module is shardstream's. Without the variable it does nothing. With it, it replaces
``FSDPCheckpointManager`` in verl's defining module and in each module that imported the name,
as each is imported: importing them here would pull verl's whole engine stack into
``import verl``. verl hides a plug-in's exceptions (logged at debug level), so a verl whose
files no longer hold these names stops the process (SystemExit) with what was expected where.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import ShardstreamError

log = logging.getLogger(__name__)

ENV = "SHARDSTREAM_VERL"
CLASS = "FSDPCheckpointManager"
DEFINING = "verl.utils.checkpoint.fsdp_checkpoint_manager"
# verl 0.9.1's modules that import the name and build one (its FSDP and VeOmni engines).
USERS = (
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.veomni.transformer_impl",
)
TARGETS = (DEFINING, *USERS)

# verl's own class, once its module is imported with the plug-in on (tests save with it).
ORIGINALS: dict[str, type] = {}
_installed = False


class VerlPluginError(ShardstreamError):
    """verl's modules no longer hold what the plug-in replaces."""


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def original() -> type | None:
    """verl's own ``FSDPCheckpointManager`` (None until its module is imported)."""
    return ORIGINALS.get(DEFINING)


def install() -> None:
    """Check verl's files for the names, then replace them as their modules are imported."""
    global _installed
    if _installed:
        return
    check_verl_files()
    sys.meta_path.insert(0, _Finder())
    _installed = True
    for name in TARGETS:  # imported before the plug-in was installed
        module = sys.modules.get(name)
        if module is not None:
            _patch(module)


def check_verl_files(base: Path | None = None) -> None:
    """Every target module's source is where verl 0.9.1 has it and mentions the class; read,
    not imported. ``base``: verl's package directory (default: the imported verl's)."""
    version = "?"
    if base is None:
        package = sys.modules.get("verl")
        if package is None:
            import verl as package  # noqa: F401  (loads this plug-in; install() is idempotent)
        base, version = Path(package.__file__).parent, getattr(package, "__version__", "?")
    for name in TARGETS:
        source = base.joinpath(*name.split(".")[1:]).with_suffix(".py")
        expected = f"class {CLASS}" if name == DEFINING else CLASS
        try:
            text = source.read_text(encoding="utf-8")
        except OSError:
            raise VerlPluginError(
                f"verl {version} has no module {name} ({source}), "
                f"where verl 0.9.1 {'defines' if name == DEFINING else 'imports'} {CLASS}; "
                "this shardstream does not know where to put its checkpoint manager"
            ) from None
        if expected not in text:
            raise VerlPluginError(
                f"{source}: expected {expected!r} there (as in verl 0.9.1); verl has moved it, "
                "and this shardstream does not know where to put its checkpoint manager"
            )


def _patch(module: Any) -> None:
    from .verl import FSDPCheckpointManager

    name = module.__name__
    found = getattr(module, CLASS, None)
    if not isinstance(found, type):
        raise VerlPluginError(
            f"{name} has no {CLASS} (verl 0.9.1 {'defines' if name == DEFINING else 'imports'} "
            "it there); this shardstream does not know where to put its checkpoint manager"
        )
    if name == DEFINING and found is not FSDPCheckpointManager:
        ORIGINALS[name] = found
    setattr(module, CLASS, FSDPCheckpointManager)
    log.info("shardstream: %s.%s is shardstream's", name, CLASS)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the target modules as Python would, and patches each once it has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... as the real one
        return getattr(self.loader, name)


if enabled():
    try:
        install()
    except VerlPluginError as exc:
        log.error("shardstream verl plug-in: %s", exc)
        raise SystemExit(f"shardstream verl plug-in ({ENV}=1): {exc}") from exc
