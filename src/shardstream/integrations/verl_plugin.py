"""verl plug-in: with ``SHARDSTREAM_VERL=1``, verl's FSDP engines build shardstream's checkpoint
manager (``shardstream.integrations.verl.FSDPCheckpointManager``) instead of verl's, and verl's
actor worker gains the ``async_calls_finalize_fn_exec`` method its PPO trainer calls after the
last step (``blocking=True``): it returns once this process's background saves have committed,
so Ray's teardown of the workers that follows loses no step. And verl's functions that write
LoRA deltas into the base weights in place for the rollout (``lora.merge``) first wait until
no background save reads them (``wait_for_reads``): their ``.data`` writes change no version
counter, so a save still reading would commit merged weights.

verl 0.9.1 imports every entry point of group ``verl.plugins`` on ``import verl``, in every
process (unless ``VERL_USE_EXTERNAL_PLUGINS`` is ``none`` or a list without ``shardstream``);
this module is shardstream's. Without the variable it does nothing. With it, it replaces
``FSDPCheckpointManager`` in verl's defining module and in each module that imported the name,
as each is imported: importing them here would pull verl's whole engine stack into
``import verl``. verl hides a plug-in's exceptions (logged at debug level), so a verl whose
files no longer hold these names stops the process (SystemExit) with what was expected where.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable
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
# verl 0.9.1's worker module and the worker class whose group its PPO trainer asks, by this
# method's name, to finish async saves (as Megatron's did) once the run's last step is saved.
WORKERS = "verl.workers.engine_workers"
WORKER = "ActorRolloutRefWorker"
FINALIZE = "async_calls_finalize_fn_exec"
# verl 0.9.1's functions that write the base weights in place around the rollout's weight sync
# (merge LoRA in, restore the backup; the last one for FSDP1), looked up in their module at
# call time by merged_lora_context and collect_merged_lora_params.
FSDP_UTILS = "verl.utils.fsdp_utils"
FENCED = ("fsdp_merge_unmerge", "restore_base_model_weights", "_merge_or_unmerge_lora_")
TARGETS = (DEFINING, *USERS, WORKERS, FSDP_UTILS)
# What each target's source holds in verl 0.9.1, and what of it the plug-in needs
EXPECTED = {
    DEFINING: ((f"class {CLASS}",), f"defines {CLASS}"),
    **{name: ((CLASS,), f"imports {CLASS}") for name in USERS},
    WORKERS: ((f"class {WORKER}",), f"defines {WORKER}"),
    FSDP_UTILS: (tuple(f"def {f}(" for f in FENCED), f"defines {', '.join(FENCED)}"),
}

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
        expected, holds = EXPECTED[name]
        try:
            text = source.read_text(encoding="utf-8")
        except OSError:
            raise VerlPluginError(
                f"verl {version} has no module {name} ({source}), where verl 0.9.1 {holds}; "
                "this shardstream does not know where to put its checkpoint manager"
            ) from None
        for needed in expected:
            if needed not in text:
                raise VerlPluginError(
                    f"{source}: expected {needed!r} there (as in verl 0.9.1); verl has moved "
                    "it, and this shardstream does not know where to put its checkpoint manager"
                )


def _patch(module: Any) -> None:
    from .verl import FSDPCheckpointManager

    name = module.__name__
    if name == WORKERS:
        _add_finalize(module)
        return
    if name == FSDP_UTILS:
        _fence_in_place_writes(module)
        return
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


def _add_finalize(module: Any) -> None:
    """Give verl's actor worker ``FINALIZE``, registered as verl registers a worker method that
    every rank runs; a verl that defines its own keeps it."""
    worker = getattr(module, WORKER, None)
    if not isinstance(worker, type):
        raise VerlPluginError(
            f"{module.__name__} has no class {WORKER} (verl 0.9.1 defines it there); this "
            "shardstream does not know which worker finishes async saves"
        )
    if FINALIZE in vars(worker):
        log.warning("shardstream: verl's %s defines %s; async saves not awaited", WORKER, FINALIZE)
        return
    from verl.single_controller.base.decorator import Dispatch, register

    setattr(worker, FINALIZE, register(dispatch_mode=Dispatch.ONE_TO_ALL)(finish_async_saves))


def _fence_in_place_writes(module: Any) -> None:
    """Each function of ``FENCED`` in ``module`` first waits until no background save reads a
    live tensor."""
    for name in FENCED:
        function = getattr(module, name, None)
        if not callable(function):
            raise VerlPluginError(
                f"{module.__name__} has no function {name} (verl 0.9.1 defines it there); this "
                "shardstream does not know where verl writes LoRA into the base weights"
            )
        if not getattr(function, "shardstream_fenced", False):
            setattr(module, name, _after_reads(function))


def _after_reads(function: Callable) -> Callable:
    @functools.wraps(function)
    def fenced(*args: Any, **kwargs: Any) -> Any:
        from .verl import wait_for_reads

        wait_for_reads()
        return function(*args, **kwargs)

    fenced.shardstream_fenced = True  # type: ignore[attr-defined]
    return fenced


def finish_async_saves(worker: Any, blocking: bool = False) -> None:
    """``FINALIZE`` of verl's actor worker: the trainer calls it before each step
    (``blocking=False``: nothing to do, a save finishes on its own) and after its last step
    (``blocking=True``): every background save of this process commits first, its error
    raised, before the trainer returns and Ray ends the workers."""
    if blocking:
        from .verl import finish_saves

        finish_saves()


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
