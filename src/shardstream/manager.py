"""CheckpointManager: interval, retention, atomic commit and restore for a training run.

Directory layout (see docs/format.md and storage/run_layout.py)::

    directory/
      latest_checkpointed_iteration.txt   newest committed step (replaced atomically)
      global_step_{N}/                    one committed checkpoint (manifest.json inside)
      global_step_{N}.tmp-*               a save in progress, or debris (storage/commit.py)
      .shardstream.lock                   held by the saving process (flock)

The lock is taken by the first save (or ``acquire_lock()``) and held until ``close()``; a manager
that only restores never takes it, so an evaluation job can restore while training saves.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    ShardstreamError,
    UsageError,
    os_error,
)
from .formats import native
from .storage import collectives as coll
from .storage import commit, locks
from .storage.run_layout import (
    LATEST_FILE,  # noqa: F401  (importable from here, as before)
    MANIFEST,
    committed_steps,
    is_run_entry,
    read_latest,
    step_dirs,
    step_name,
    write_latest,
)
from .training import load as loading
from .training import save as saving
from .training.arguments import check_live_objects, checked_step, one_optimizer
from .units import DEFAULT_BUFFER_BYTES, WHOLE_STATE, staging_limit

log = logging.getLogger(__name__)

LOCK_FILE = ".shardstream.lock"
# A manager start that finds the lock free takes it for a moment (a directory listing and a few
# renames) to clear a dead run's debris; a saver that meets it waits this long before calling
# the directory taken.
LOCK_GRACE_S = 1.0
# restore() of the newest step retries when retention deleted it mid-read (a run saving here).
RESTORE_ATTEMPTS = 5

# verl's checkpoint keys that mean nothing here; accepted so a verl config loads unchanged.
_IGNORED_VERL_KEYS = frozenset(
    {
        "_target_",
        "incremental_save",
        "del_local_ckpt_after_load",
        "checkpoint_engine",
        "mbridge_config",
        "save_hf_model",
        "strict",  # verl: strict weight export (Megatron); shardstream's checks are always strict
    }
)
RESUME_MODES = ("auto", "disable", "resume_path")  # verl's trainer.resume_mode values
_SYNONYMS = {
    "save_freq": "save_interval",
    "default_local_dir": "directory",
    "max_ckpt_to_keep": "keep_last",  # verl's checkpoint manager argument
}


@dataclass(frozen=True)
class CheckpointConfig:
    """What to save, where, how often, and how much host memory a save may use.

    Attributes:
        directory: root of the run's checkpoints.
        save_contents: any of "model", "optimizer", "extra", "hf_model".
        load_contents: what ``restore()`` loads; the rest starts fresh.
        save_interval: ``maybe_save(step)`` saves when ``step % save_interval == 0``; None or
            a value <= 0 saves only on ``final=True``.
        save_final: whether ``maybe_save(step, final=True)`` saves off the interval. False
            where verl's ``save_freq`` is <= 0 (``from_dict``): its PPO trainer then saves no
            checkpoint at all, the last step's neither.
        keep_last: committed checkpoints to keep (None keeps all); never the newest.
        staging_budget: host memory one rank may use for a save beyond what it holds ("256MiB").
            With ``async_save``, what is left after the writer's buffers (at most 64 MiB) is
            where a step copies tensors the save has not read yet; it is faulted in once and
            held while the manager lives. ``"state"``: an async save may stage the rank's whole
            state (its model and optimizer shards, the model twice with ``hf_model``), as
            ``dcp.async_save`` does, so a step never waits for the disk; the writer's buffers
            are then 64 MiB, as a synchronous save's.
        verify_on_load: check every byte read against its checksum.
        async_save: return from ``save()`` at once and write in the background.
        shared_filesystem: whether all ranks see one filesystem (None: detect at save time).
        stagger_host_transfers: ranks on one host take turns copying device tensors to host
            memory (GPU runs), so they don't saturate the host link together.
        save_lora_only: on a model with LoRA adapters, "model" saves only the adapter weights
            (verl's key); restoring such a checkpoint fills those and leaves the base weights.
        resume_mode: what ``restore()`` without arguments loads, as verl's key: "auto" the
            newest committed step (None if there is none), "disable" nothing (None),
            "resume_path" the checkpoint at ``resume_from_path``.
        resume_from_path: a checkpoint directory, or a verl ``global_step_N`` directory whose
            only role (``actor/``) is then the checkpoint.
        share_hf_weights: with "model" and "hf_model" saved together, a weight exported in the
            model's own dtype (an fp32 export of fp32 weights) is written once, into
            ``huggingface/``, and the manifest points there: a quarter less to write for an
            fp32 model with AdamW. The checkpoint then needs its ``huggingface/`` directory.
            An export that converts every weight (bf16 of fp32) shares none, and warns so.
    """

    directory: str
    save_contents: tuple[str, ...] = native.DEFAULT_CONTENTS
    load_contents: tuple[str, ...] = native.DEFAULT_CONTENTS
    save_interval: int | None = None
    save_final: bool = True
    keep_last: int | None = None
    staging_budget: int | str = "256MiB"
    verify_on_load: bool = True
    async_save: bool = False
    shared_filesystem: bool | None = None
    stagger_host_transfers: bool = False
    save_lora_only: bool = False
    share_hf_weights: bool = False
    resume_mode: str = "auto"
    resume_from_path: str | None = None

    def __post_init__(self) -> None:
        if not self.directory:
            raise UsageError("CheckpointConfig.directory must be set")
        for name in ("save_contents", "load_contents"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise UsageError(f"{name} must be a list of items, got the string {value!r}")
            object.__setattr__(self, name, native.check_contents(value, name))
        if self.save_interval is not None and not isinstance(self.save_interval, int):
            raise UsageError(f"save_interval must be an integer, got {self.save_interval!r}")
        if self.keep_last is not None and (
            not isinstance(self.keep_last, int) or self.keep_last < 1
        ):
            raise UsageError(
                f"keep_last must be a positive integer or None, got {self.keep_last!r}"
            )
        if self.resume_mode not in RESUME_MODES:
            raise UsageError(
                f"resume_mode must be one of {', '.join(RESUME_MODES)}, got {self.resume_mode!r}"
            )
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise UsageError("resume_mode 'resume_path' needs resume_from_path")
        try:
            budget = self.staging_budget_bytes
        except UsageError as exc:
            raise UsageError(f"staging_budget: {exc} (or '{WHOLE_STATE}')") from None
        if budget < 1 << 20:
            raise UsageError(f"staging_budget must be at least 1MiB, got {self.staging_budget!r}")
        if self.share_hf_weights and not {"model", "hf_model"} <= set(self.save_contents):
            warnings.warn(
                "share_hf_weights does nothing unless save_contents has both 'model' and "
                "'hf_model'",
                stacklevel=3,
            )

    @property
    def stages_whole_state(self) -> bool:
        """``staging_budget="state"``: an async save may stage the rank's whole state."""
        return staging_limit(self.staging_budget) is None

    @property
    def staging_budget_bytes(self) -> int:
        """The budget; with ``"state"``, the writer's buffers (an async save stages the rank's
        state on top)."""
        limit = staging_limit(self.staging_budget)
        return DEFAULT_BUFFER_BYTES if limit is None else limit

    @classmethod
    def from_dict(
        cls,
        values: Mapping[str, Any],
        directory: str | os.PathLike | None = None,
        role: str = "actor",
    ) -> CheckpointConfig:
        """Build from a dict such as verl's ``checkpoint:`` section; verl's keys work verbatim.
        verl keeps the directory in ``trainer.default_local_dir``: pass it in the dict or as
        ``directory``. ``role``: whose retention verl's trainer keys set, ``"actor"``
        (``max_actor_ckpt_to_keep``) or ``"critic"`` (``max_critic_ckpt_to_keep``).

        >>> CheckpointConfig.from_dict({"contents": ["model"], "save_freq": 100,
        ...                             "default_local_dir": "ckpts"}).save_interval
        100
        """
        if role not in ("actor", "critic"):
            raise UsageError(f"role must be 'actor' or 'critic', got {role!r}")
        other_role = "critic" if role == "actor" else "actor"
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {} if directory is None else {"directory": str(directory)}
        legacy_contents = None
        for key, value in values.items():
            if key in _IGNORED_VERL_KEYS or key == f"max_{other_role}_ckpt_to_keep":
                continue
            if key == f"max_{role}_ckpt_to_keep":
                key = "max_ckpt_to_keep"
            if key == "contents":  # verl's legacy key: the default for both lists
                legacy_contents = _listed(value)
                continue
            name = _SYNONYMS.get(key, key)
            if name not in known:
                raise UsageError(
                    f"unknown checkpoint config key {key!r}; known keys: {sorted(known)}"
                )
            if name in kwargs:
                raise UsageError(f"config sets {name!r} twice (through {key!r})")
            kwargs[name] = _listed(value) if name.endswith("_contents") else value
        if legacy_contents is not None:
            kwargs.setdefault("save_contents", legacy_contents)
            kwargs.setdefault("load_contents", legacy_contents)
        if isinstance(kwargs.get("save_interval"), int) and kwargs["save_interval"] <= 0:
            kwargs["save_interval"] = None
            if "save_freq" in values:  # verl's PPO trainer: save_freq -1, no checkpoint at all
                kwargs.setdefault("save_final", False)
        if kwargs.get("keep_last") in (-1, 0):
            kwargs["keep_last"] = None  # verl: max_ckpt_to_keep None/-1 keeps all
        if "directory" not in kwargs:
            raise UsageError(
                "checkpoint config has no directory: set 'default_local_dir' (verl keeps it in "
                "trainer.default_local_dir) or pass from_dict(..., directory=...)"
            )
        return cls(**kwargs)


def _listed(value: Any) -> Any:
    """A list of contents from a config (a list, tuple or OmegaConf ListConfig) as a tuple; a
    string or anything else as it is, for the config's own check to name."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return value
    return tuple(value)


def _holder() -> str:
    """What the lock file says of the process holding it."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname()})


@dataclass
class _Lock:
    path: Path
    fd: int = field(default=-1)

    def acquire(self, grace_s: float = LOCK_GRACE_S) -> None:
        fd = locks.open_lock(self.path)
        deadline = time.monotonic() + grace_s
        try:
            # Held by a saver, or for a moment by a manager start cleaning up (see
            # try_cleanup); only a holder still there after the grace period is a saver.
            while not locks.take(fd):
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                owner = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
                if owner == _holder():
                    raise CheckpointLockedError(
                        f"{self.path.parent}: this process saves here already ({owner}): an "
                        "earlier CheckpointManager of this directory (and role) is still open; "
                        "close() it, or keep using it"
                    )
                raise CheckpointLockedError(
                    f"{self.path.parent}: another live process is saving here ({owner}); use a "
                    "different directory or stop the other run (restoring needs no lock)"
                )
        except BaseException:
            os.close(fd)
            raise
        # A lock left by a dead process is released by the kernel, so reaching here means free.
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder().encode(), 0)
        self.fd = fd

    def try_cleanup(self, cleanup) -> bool:
        """Run ``cleanup()`` under the lock if it is free right now, then release it; False if
        a live process holds it, or the directory cannot take a lock (read-only, forbidden)."""
        try:
            fd = locks.open_lock(self.path, create=False)
        except OSError:
            return False  # no lock file (nothing ever saved here) or not writable
        try:
            taken = locks.take(fd)
        except OSError:
            taken = False
        if not taken:
            os.close(fd)
            return False
        try:
            cleanup()
        finally:
            locks.release(fd)
        return True

    def release(self) -> None:
        if self.fd >= 0:
            locks.release(self.fd)
        self.fd = -1


def _holds_entries(directory: Path) -> bool:
    """Whether ``directory`` is a directory with anything in it (False where unreadable)."""
    try:
        return directory.is_dir() and any(directory.iterdir())
    except OSError:
        return False


def _unwritable(root: Path, exc: OSError) -> ShardstreamError:
    """The error for a run directory the lock or its creation met ``exc`` in: the disk's
    (full, forbidden, read-only; exit 1), else a usage error (a bad path)."""
    return os_error(exc) or UsageError(f"{root}: {exc}")


def _warn_of_contents_it_cannot_save(
    config: CheckpointConfig, model, optimizer, hf_export_given: bool
) -> None:
    """Say now, not at the first save many steps later, what ``save()`` will refuse (a
    manager that only loads may go without those objects)."""
    needs = [
        ("model", "model", model is not None),
        ("optimizer", "optimizer", optimizer is not None and model is not None),
        ("hf_model", "hf_config= or hf_source_dir=", hf_export_given),
    ]
    missing = [
        f"{part!r} but no {what} was given"
        for part, what, given in needs
        if part in config.save_contents and not given
    ]
    if missing and coll.rank() == 0:
        log.warning(
            "CheckpointManager: save_contents includes %s, so save() will refuse; give it, or "
            "leave it out of save_contents (load() is not affected)",
            " and ".join(missing),
        )


class CheckpointManager:
    """Saves and restores a training run's checkpoints.

    >>> mgr = CheckpointManager(CheckpointConfig("ckpts", save_interval=100), model=model,
    ...                         optimizer=opt)  # doctest: +SKIP
    >>> mgr.maybe_save(step)  # doctest: +SKIP
    >>> step, extra = mgr.restore() or (0, {})  # doctest: +SKIP
    """

    # The directory's lock file; a subclass whose writers share a directory with another's
    # (verl's actor and critic roles) names its own.
    lock_name: str = LOCK_FILE
    # A step saved without "hf_model" carries huggingface/ config files when given any.
    saves_config_files: bool = True

    def __init__(
        self,
        config: CheckpointConfig,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        hf_config: Any = None,
        tokenizer: Any = None,
        hf_source_dir: str | os.PathLike | None = None,
        hf_dtype: str | None = None,
    ):
        check_live_objects(model, optimizer, lr_scheduler)
        optimizer = one_optimizer(optimizer)
        hf_export_given = hf_config is not None or hf_source_dir is not None
        _warn_of_contents_it_cannot_save(config, model, optimizer, hf_export_given)
        if "hf_model" in config.save_contents and model is not None:
            from .training.hf_export import refuse_peft_export

            refuse_peft_export(model)  # now, not at the first save many steps later
        self.config = config
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.hf_config, self.tokenizer = hf_config, tokenizer
        self.hf_source_dir = hf_source_dir
        self.hf_dtype = hf_dtype
        self.root = Path(config.directory).absolute()
        self._closed = True  # until constructed: __del__ and close() have nothing to release
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"checkpoint directory {self.root} exists and is not a directory")
        self._lock = _Lock(self.root / self.lock_name)
        self._deleter = commit.Deleter()  # retention's deletions, off the training thread
        self._closed = False
        self._writer = False
        self._async = None
        if coll.rank() == 0 and self.root.is_dir():
            # Debris of a dead run goes now if no one saves here; a live saver's stays. Nothing
            # is held afterwards: the lock is taken by the first save (acquire_lock).
            doomed: list[Path] = []
            try:
                self._lock.try_cleanup(lambda: doomed.extend(self._take_debris()))
            except OSError as exc:
                log.info("shardstream: left incomplete checkpoints in %s: %s", self.root, exc)
            for path in doomed:  # outside the lock: they are ours alone after the rename
                commit.remove(path)
        if config.stagger_host_transfers:
            from .engine.transfer import configure_host_transfers

            configure_host_transfers(stagger=True)
        if config.async_save:
            from .training.async_save import AsyncSaver

            self._async = AsyncSaver(self, self._shared_staging())

    def _shared_staging(self) -> Any:
        """Staging memory for async saves that its owner faulted in already (a
        ``training.async_save.StagingMemory``); None: the saver's own."""
        return None

    # --- queries ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        return committed_steps(self.root)

    def latest_step(self) -> int | None:
        """The newest committed step: the ``latest`` pointer if it names one, else a scan."""
        steps = self.all_steps()
        pointer = read_latest(self.root)
        if pointer in steps:
            return pointer
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def should_save(self, step: int, final: bool = False) -> bool:
        interval = self.config.save_interval
        on_interval = interval is not None and interval > 0 and step % interval == 0
        return on_interval or (final and self.config.save_final)

    # --- saving -------------------------------------------------------------------------------

    def acquire_lock(self) -> None:
        """Take the directory's lock now (a collective call), as the first save would: raises
        ``CheckpointLockedError`` if another live process saves here. Held until ``close()``.

        Only writers need it; call it at start-up to fail before training rather than at the
        first save. Removes what crashed saves left behind.
        """
        self._guard()
        if self._writer:
            return
        error = None
        if coll.rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._lock.acquire()
                self._remove_debris()
            except (OSError, ShardstreamError) as exc:
                self._lock.release()
                error = exc if isinstance(exc, ShardstreamError) else _unwritable(self.root, exc)
        coll.agree_or_raise(error)
        self._writer = True  # on every rank: rank 0 holds the lock for all of them

    def maybe_save(
        self, step: int, extra: Mapping[str, Any] | None = None, final: bool = False
    ) -> bool:
        """Save if ``step`` is on the interval (or ``final``); return whether a save started."""
        if not self.should_save(step, final):
            if self._async is not None:
                self._async.raise_pending_error()
            return False
        self.save(step, extra)
        return True

    def save(self, step: int, extra: Mapping[str, Any] | None = None):
        """Save ``step``. Its directory appears, and ``latest`` moves, only when complete.

        With ``async_save`` this returns once the save is registered; a save still in flight is
        waited for first (saves never overlap), and its error, if any, is raised here.
        """
        self._guard()
        step = checked_step(step)
        self.acquire_lock()
        self._refuse_foreign_step(step)
        if self._async is not None:
            return self._async.submit(step, extra)
        return self._save(step, extra)

    def _refuse_foreign_step(self, step: int) -> None:
        """Never replace a step directory shardstream did not write (a verl checkpoint saved
        into the same directory): saving over it would delete it."""
        error = None
        if coll.rank() == 0:
            path = self.step_dir(step)
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                error = UsageError(
                    f"{path} exists and is not a shardstream checkpoint directory; saving step "
                    f"{step} would replace it: move it away or save into another directory"
                )
            elif path.is_dir() and not (path / native.MANIFEST).is_file():
                try:
                    held = sorted(p.name for p in path.iterdir())
                except OSError:  # not ours to judge: the save meets it and reports it
                    held = []
                if held:  # an empty one: nothing to lose
                    error = UsageError(
                        f"{path} exists and is not a shardstream checkpoint (it holds "
                        f"{', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); saving "
                        f"step {step} would delete it: move it away or save into another "
                        "directory"
                    )
            newer = [s for s in self.all_steps() if s > step]
            if error is None and newer:
                log.warning(
                    "%s: saving step %d while newer steps are committed (%s): a run resumed "
                    "from an older step? They are kept, not counted by keep_last, and the "
                    "latest pointer names step %d once it is saved",
                    self.root,
                    step,
                    ", ".join(map(str, newer)),
                    step,
                )
        error = coll.broadcast(error)  # every rank raises rank 0's finding
        if error is not None:
            raise error

    def _save(self, step: int, extra: Mapping[str, Any] | None):
        return self._commit(self._prepare(step, extra, self.config.staging_budget_bytes))

    def _prepare(
        self,
        step: int,
        extra: Mapping[str, Any] | None,
        buffer_bytes: int,
        background: bool = False,
    ):
        """Capture what to save (references, not copies; ``background``: the buffers copied,
        for an async save); local to this rank."""
        from .training.hf_export import config_files, hf_exporter

        # The last retention's deletions end first: disk use stays at keep_last steps, and a
        # step directory retention empties is not removed under a save of that same step.
        self._deleter.join()

        contents = self.config.save_contents
        exporter = None
        if "hf_model" in contents:
            exporter = hf_exporter(
                self.model,
                self.hf_config,
                self.tokenizer,
                self.hf_source_dir,
                self.hf_dtype,
                self.config.shared_filesystem,
            )
        elif self.saves_config_files:  # the config without the weights, as verl's steps hold it
            exporter = config_files(self.hf_config, self.tokenizer, self.hf_source_dir)
        return saving.prepare_save(
            self.step_dir(step),
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            extra=extra,
            contents=contents,
            step=step,
            buffer_size=buffer_bytes,
            overwrite=True,
            hf_export=exporter,
            lora_only=self.config.save_lora_only,
            share_hf_weights=self.config.share_hf_weights,
            background=background,
        )

    def _commit(self, prepared):
        """Write, commit, move ``latest``, apply retention (every rank, collectively)."""
        result = saving.execute_save(prepared)
        if coll.rank() == 0:
            write_latest(self.root, prepared.step)
            self._retain(prepared.step)
        coll.barrier()
        return result

    def _retain(self, newest: int) -> None:
        """Drop committed steps beyond ``keep_last``; never ``newest``, never a step a save is
        using, never an uncommitted dir."""
        keep = self._keep_last()
        if keep is None:
            return
        older = [s for s in self.all_steps() if s < newest]
        protected = self._async.in_flight_steps() if self._async is not None else set()
        doomed = [s for s in older[: max(0, len(older) - (keep - 1))] if s not in protected]
        graves = []
        for step in doomed:
            path = self.step_dir(step)
            free, claim = locks.claim_unread(path / MANIFEST)
            if not free:
                log.info("shardstream: %s is being read; a later save drops it", path)
                continue
            try:
                graves.append(commit.bury(path))  # gone at once; a crash leaves debris to sweep
            except OSError as exc:
                log.warning("shardstream: could not delete old checkpoint %s: %s", path, exc)
                continue
            finally:
                if claim is not None:
                    locks.release(claim)
            self._dropped(path)
        # The slow part, in the background; joined by wait(), close() and the next save.
        self._deleter.submit(graves, self._after_deleting())

    def _keep_last(self) -> int | None:
        return self.config.keep_last

    def _dropped(self, path: Path) -> None:
        """``path``, a step retention drops, has just left every listing."""

    def _after_deleting(self) -> Callable[[Path], None] | None:
        """What to do with each dropped step once its files are deleted."""
        return None

    def _remove_debris(self) -> None:
        """Remove temporary directories left by crashed saves (this process holds the lock)."""
        for path in self._take_debris():
            commit.remove(path)

    def _take_debris(self) -> list[Path]:
        """Apply the commit recovery rule to the steps' and the pointer's temporaries: a step
        a crash left between the two renames of its swap is put back, the rest is renamed to
        unique names and returned. The caller holds the lock (so no save is in progress) and
        deletes them, with or without it."""
        taken = commit.take_debris(self.root, is_run_entry)
        for path in taken:
            log.info("shardstream: removed incomplete checkpoint %s", path)
        return taken

    # --- restoring ----------------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        path: str | os.PathLike | None = None,
        prefix: str | None = None,
        states: Mapping[str, Any] | None = None,
        ignore_frozen_params: bool = False,
    ):
        """Load the newest committed checkpoint (or ``step``, or a verl/shardstream/DCP
        ``path``, or accelerate's save_state directory). Without arguments,
        ``config.resume_mode`` decides, as in verl: "auto" the newest, "disable" nothing,
        "resume_path" ``config.resume_from_path``. ``prefix``: what a DCP checkpoint's model
        keys start with ("app.model."), where detection finds several candidates. ``states``:
        other Stateful objects of a DCP train state by name (torchtitan's ``{"dataloader":
        dl, "train_state": ts}``), or accelerate's extra files by stem (``{"scaler":
        grad_scaler, "custom_checkpoint_0": obj}``), restored with the rest or not at all.
        ``ignore_frozen_params``: parameters that require no gradient may be missing from the
        checkpoint (torch's ``StateDictOptions(ignore_frozen_params=True)`` saves none); they
        keep their live values.

        Returns ``(step, extra)``, or None when there is nothing to restore.
        """
        self._guard()
        if self._async is not None:
            self._async.wait()
        if path is None and step is None:
            if self.config.resume_mode == "disable":
                return None
            if self.config.resume_mode == "resume_path":
                path = self._resume_path()
        if path is not None:
            result = self._load(path, prefix, states, ignore_frozen_params)
            return result.step if step is None else step, result.extra
        explicit = step is not None
        for attempt in range(RESTORE_ATTEMPTS):
            if not explicit:
                # Every rank must read the same step, and a run saving here (this manager needs
                # no lock to restore) may commit another one meanwhile: rank 0 picks.
                step = coll.broadcast(self._newest_or_refuse() if coll.rank() == 0 else None)
                if isinstance(step, ShardstreamError):
                    raise step
                if step is None:
                    return None
            else:  # every rank learns of a rank asking for a step that is not there
                committed = self.all_steps()
                error = None
                if step not in committed:
                    error = CheckpointNotFoundError(
                        f"{self.root}: no committed checkpoint for step {step} "
                        f"(committed: {committed or 'none'})"
                    )
                coll.agree_or_raise(error, "restore")
            # A run saving here deletes old steps (retention) but not one a reader leases, so
            # a step every rank leases is read whole; one deleted before that is retried.
            lease = locks.lease(self.step_dir(step) / MANIFEST)
            try:
                if all(coll.gather(lease is not None)):
                    try:
                        loaded = self._load(self.step_dir(step), None, None, ignore_frozen_params)
                        return step, loaded.extra
                    except ShardstreamError:
                        # Deleted mid-read all the same: a filesystem without locks.
                        gone = coll.broadcast(
                            not self.step_dir(step).exists() if coll.rank() == 0 else None
                        )
                        if explicit or not gone or attempt + 1 == RESTORE_ATTEMPTS:
                            raise
                        log.info("shardstream: step %s was deleted while restoring it", step)
                        continue
            finally:
                if lease is not None:
                    locks.release(lease)
            if explicit or attempt + 1 == RESTORE_ATTEMPTS:
                raise CheckpointNotFoundError(
                    f"{self.step_dir(step)}: deleted while it was being restored (the "
                    f"retention of a run saving in {self.root}?)"
                )
            log.info("shardstream: step %s was deleted before restoring it; retrying", step)
        raise AssertionError("unreachable")

    def _resume_path(self) -> Path:
        """``resume_from_path``, or the one checkpoint inside it (verl's ``resume_from_path``
        names a ``global_step_N`` directory, its ``actor/`` being the checkpoint)."""
        from .formats.source import checkpoints_below, looks_like_checkpoint, unfinished_note

        path = Path(self.config.resume_from_path)
        if path.is_dir() and not looks_like_checkpoint(path):
            below = checkpoints_below(path)
            if len(below) == 1:
                if unfinished := unfinished_note(path):
                    log.warning("shardstream: resuming from %s%s", below[0], unfinished)
                return below[0]
        return path

    def _newest_or_refuse(self) -> int | ShardstreamError | None:
        """The newest committed step; None for a directory holding no checkpoint at all; an
        error naming them for one that holds only another tool's (verl's
        ``global_step_N/actor``), which restore() does not silently start over beside."""
        step = self.latest_step()
        if step is not None:
            self._say_skipped_above(step)
        if step is not None or not self.root.is_dir():
            return step
        from .formats.source import checkpoints_below

        found = checkpoints_below(self.root)
        pointer = read_latest(self.root)
        pointed = self.step_dir(pointer) if pointer is not None else None
        if not found and pointed is not None and _holds_entries(pointed):
            return CheckpointNotFoundError(
                f"{pointed}: the latest pointer names it, but it holds no {MANIFEST}, so it is "
                "no committed checkpoint (damaged, or written by another tool); "
                "restore(path=...) another checkpoint, or move it away to start afresh"
            )
        if not found:
            return None
        names = " and ".join(map(str, found))
        return CheckpointNotFoundError(
            f"{self.root} holds no shardstream checkpoint, but {names} "
            f"{'is a checkpoint' if len(found) == 1 else 'are checkpoints'} of another format: "
            f"restore(path=...) resumes from {'it' if len(found) == 1 else 'one'} (at any world "
            "size); to start afresh, use another directory"
        )

    def _say_skipped_above(self, step: int) -> None:
        """Warn of step directories newer than ``step`` that hold no manifest (not committed:
        written by hand or by another tool), and of a pointer naming a step not committed:
        restore falls back past them, and a user should hear of it."""

        def uncommitted(s: int) -> bool:
            # Checked now, not as listed: a run saving here meanwhile commits newer steps and
            # renames old ones away (retention), neither of which is worth a warning.
            return not (self.step_dir(s) / MANIFEST).is_file() and self.step_dir(s).is_dir()

        skipped = {s for s in step_dirs(self.root) if s > step and uncommitted(s)}
        pointer = read_latest(self.root)
        if pointer is not None and pointer > step and uncommitted(pointer):
            skipped.add(pointer)
        if skipped:
            log.warning(
                "%s: %s not committed (no %s): restoring step %d, the newest committed one",
                self.root,
                ", ".join(step_name(s) for s in sorted(skipped)),
                MANIFEST,
                step,
            )

    def _load(
        self,
        path: str | os.PathLike,
        prefix: str | None = None,
        states=None,
        ignore_frozen_params: bool = False,
    ):
        return loading.load(
            path,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            contents=self.config.load_contents,
            verify=self.config.verify_on_load,
            buffer_size=self.config.staging_budget_bytes,
            prefix=prefix,
            states=states,
            ignore_frozen_params=ignore_frozen_params,
        )

    # --- lifecycle ----------------------------------------------------------------------------

    def wait_for_reads(self) -> float:
        """Return once an async save in flight reads no live tensor (it copies what the
        staging budget holds and waits for the rest, as before an optimizer step); the seconds
        that took. Call it before writing parameters or optimizer state in place outside
        ``optimizer.step()`` (an EMA swap, ``load_state_dict``): a save that finds a tensor
        written meanwhile is not committed."""
        return self._async.release_live() if self._async is not None else 0.0

    def wait(self) -> None:
        """Block until every background save has committed and the steps retention dropped
        are deleted from disk; raise a failed save's error."""
        try:
            if self._async is not None:
                self._async.wait()
        finally:
            self._deleter.join()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            if self._async is not None:
                self._async.shutdown()
            self._lock.release()
            self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # May run at interpreter exit, when modules are half torn down: nothing may raise.
        try:
            if not self._closed:
                self._lock.release()
        except Exception:  # noqa: BLE001
            pass

    def _guard(self) -> None:
        if self._closed:
            raise UsageError("this CheckpointManager is closed")
