"""verl's FSDP checkpoint manager, answered with shardstream checkpoints.

verl's FSDP engines build ``FSDPCheckpointManager(model=, optimizer=, lr_scheduler=,
processing_class=, checkpoint_config=, trust_remote_code=)`` and call ``save_checkpoint`` and
``load_checkpoint``; this class takes the same arguments and calls (the plug-in,
``verl_plugin.py``, puts it in verl's modules). What changes is what lands on disk: a
shardstream checkpoint in the same ``global_step_N/actor`` directory, written by every rank
streaming its own shards (no gather), committed atomically, and ``hf_model`` written in place by
all ranks. verl never imports from here, and nothing here imports verl.

verl's trainer writes ``latest_checkpointed_iteration.txt`` after a save returns, except with
``async_save`` (verl#7952), where it writes none; an async save here then moves it itself once
the step has committed, so verl's ``find_latest_ckpt_path`` never names an incomplete step.
"""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ChecksumMismatchError, UsageError
from ..formats import native
from ..formats.hf import set_config_dtype
from ..manager import CheckpointConfig, CheckpointManager
from ..storage import collectives as coll
from ..storage import commit
from ..storage.commit import TMP_MARK, is_temporary
from ..storage.run_layout import MANIFEST, step_dirs, step_name, step_of, write_latest
from ..training import load as loading
from ..training import save as saving
from ..training import state as st
from ..training.async_save import StagingMemory
from ..units import DEFAULT_BUFFER_BYTES, WHOLE_STATE, staging_limit

if TYPE_CHECKING:
    from ..formats.source import Kind

log = logging.getLogger(__name__)

VERL_HF_MODEL_DTYPE = "bfloat16"  # what verl's FSDP manager's hf_model config.json names

VERL_CONTENTS = ("model", "optimizer", "extra", "hf_model")
DEFAULT_CONTENTS = ("model", "optimizer", "extra")  # verl's default for both lists
# verl's config has no key for it: host memory one rank may use to save beyond what it holds.
BUDGET_ENV = "SHARDSTREAM_STAGING_BUDGET"
DEFAULT_BUDGET = "256MiB"


def _staging_budget() -> tuple[str, int | None]:
    """``SHARDSTREAM_STAGING_BUDGET`` as given, and in bytes (None: ``state``, an async save
    may stage the rank's whole state)."""
    value = os.environ.get(BUDGET_ENV, DEFAULT_BUDGET).strip()
    try:
        return value, staging_limit(value)
    except UsageError as exc:
        raise UsageError(f"{BUDGET_ENV}: {exc} (or '{WHOLE_STATE}')") from None


HF_DIR = "huggingface"
LORA_META = "lora_train_meta.json"  # verl's name for r, lora_alpha and task_type


def _setting(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of verl's ``CheckpointConfig`` dataclass, an OmegaConf DictConfig or a dict."""
    if config is None:
        return default
    getter = getattr(config, "get", None)
    value = getter(key, default) if callable(getter) else getattr(config, key, default)
    return default if value is None else value


def _contents(config: Any, key: str) -> list[str]:
    value = _setting(config, key, DEFAULT_CONTENTS)
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise UsageError(
            f"checkpoint_config.{key} must be a list such as {list(DEFAULT_CONTENTS)}, "
            f"got {value!r}"
        )
    items = [str(item) for item in value]
    unknown = [item for item in items if item not in VERL_CONTENTS]
    if unknown:
        raise UsageError(
            f"checkpoint_config.{key}: unknown item {unknown[0]!r}; verl's FSDP checkpoints take "
            f"any of {', '.join(VERL_CONTENTS)}"
        )
    return items


def _locate(local_path: str | os.PathLike) -> tuple[Path, int, str | None]:
    """(run root, step, role) of verl's ``ROOT/global_step_N/ROLE`` (PPO's trainer) or
    ``ROOT/global_step_N`` (SFT's); the root is where the latest pointer lives."""
    path = Path(local_path).absolute()
    for step_dir, role in ((path, None), (path.parent, path.name)):
        step = step_of(step_dir.name)
        if step is not None:
            return step_dir.parent, step, role
    raise UsageError(
        f"{path}: expected verl's checkpoint layout, DIR/global_step_N/ROLE or DIR/global_step_N"
    )


def _unwrapped(model: Any) -> Any:
    return getattr(model, "_fsdp_wrapped_module", model)  # FSDP1 wraps; FSDP2 does not


# Every manager of this process, for the plug-in's hooks into verl's workers.
_MANAGERS: weakref.WeakSet[FSDPCheckpointManager] = weakref.WeakSet()


def finish_saves() -> None:
    """Block until every background save of this process's managers has committed; raise the
    first failure."""
    for manager in list(_MANAGERS):
        manager.wait()


def wait_for_reads() -> float:
    """Return once no background save of this process's managers reads a live tensor."""
    return sum(manager.wait_for_reads() for manager in list(_MANAGERS))


class FSDPCheckpointManager:
    """verl's ``FSDPCheckpointManager`` (verl 0.9.1's signature and attributes) writing and
    reading shardstream checkpoints; it also reads verl's own ``.pt`` checkpoints, at any
    world size.

    ``checkpoint_config``: verl's ``CheckpointConfig``, a DictConfig or a dict, with
    ``save_contents``, ``load_contents``, ``async_save``, ``save_lora_only``, ``strict``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        processing_class: Any = None,
        checkpoint_config: Any = None,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ):
        if processing_class is None and "tokenizer" in kwargs:
            warnings.warn(
                "`tokenizer` is deprecated. use `processing_class` instead.",
                DeprecationWarning,
                stacklevel=2,
            )
            processing_class = kwargs.pop("tokenizer")
        self.checkpoint_config = checkpoint_config
        _staging_budget()  # a bad SHARDSTREAM_STAGING_BUDGET is refused now, not at the first save
        self.checkpoint_save_contents = _contents(checkpoint_config, "save_contents")
        self.checkpoint_load_contents = _contents(checkpoint_config, "load_contents")
        self.async_save = bool(_setting(checkpoint_config, "async_save", False))
        # verl's FSDP manager ignores `strict` (Megatron's weight export reads it); shardstream's
        # loads are always strict: a checkpoint of another model is refused by tensor name.
        self.strict = bool(_setting(checkpoint_config, "strict", True))
        if "hf_model" in self.checkpoint_save_contents and model is not None:
            from ..training.hf_export import refuse_peft_export

            refuse_peft_export(model)  # now, not at the first save a save_freq later
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        self.trust_remote_code = trust_remote_code
        self.previous_global_step: int | None = None
        self.previous_saved_paths: list[str] = []
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        self._runs: dict[tuple[Path, str | None], _RoleRun] = {}
        self._generation_config: Any = ...  # read on the first save (verl reads it per save)
        # Async saves copy into host memory faulted in after the first optimizer step, long
        # before the first save; the first role run to save asynchronously takes it.
        self._staging: StagingMemory | None = None
        _MANAGERS.add(self)
        if self.async_save and optimizer is not None:
            self._staging = StagingMemory()
            self._staging.prefault_after_first_step(
                model,
                optimizer,
                _staging_budget()[1],
                twice_model="hf_model" in self.checkpoint_save_contents,
            )

    # --- verl's BaseCheckpointManager attributes --------------------------------------------------

    @property
    def should_save_model(self) -> bool:
        return "model" in self.checkpoint_save_contents

    @property
    def should_save_optimizer(self) -> bool:
        return "optimizer" in self.checkpoint_save_contents

    @property
    def should_save_extra(self) -> bool:
        return "extra" in self.checkpoint_save_contents

    @property
    def should_save_hf_model(self) -> bool:
        return "hf_model" in self.checkpoint_save_contents

    @property
    def should_save_lora_only(self) -> bool:
        return bool(_setting(self.checkpoint_config, "save_lora_only", False))

    @property
    def should_load_model(self) -> bool:
        return "model" in self.checkpoint_load_contents

    @property
    def should_load_optimizer(self) -> bool:
        return "optimizer" in self.checkpoint_load_contents

    @property
    def should_load_extra(self) -> bool:
        return "extra" in self.checkpoint_load_contents

    @property
    def should_load_hf_model(self) -> bool:
        return "hf_model" in self.checkpoint_load_contents

    @staticmethod
    def is_lora_only_state_dict(state_dict: dict) -> bool:
        return bool(state_dict) and all(st.is_lora_name(k) for k in state_dict)

    @staticmethod
    def checkpath(local_path: str | None, hdfs_path: str | None) -> tuple[bool, str]:
        if local_path is None and hdfs_path is None:
            raise UsageError("local_path and hdfs_path cannot be both None")
        return local_path is not None, local_path if local_path is not None else hdfs_path

    @staticmethod
    def get_rng_state() -> dict[str, Any]:
        """verl's RNG record: torch's CPU generator, numpy's, Python's (and CUDA's)."""
        state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state()}
        state["random"] = random.getstate()
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def load_rng_state(rng_state: dict[str, Any]) -> None:
        torch.set_rng_state(rng_state["cpu"])
        np.random.set_state(rng_state["numpy"])
        random.setstate(rng_state["random"])
        if "cuda" in rng_state and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng_state["cuda"])

    # --- saving -----------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        local_path: str | None,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
    ) -> None:
        """Save into ``local_path`` (``.../global_step_N/actor``) from every rank; it appears
        there only when complete. ``max_ckpt_to_keep``: committed shardstream checkpoints of
        this role to keep (None, 0 or -1: all); verl's or anyone else's are never deleted.
        ``hdfs_path`` is unused, as in verl's FSDP manager."""
        if local_path is None:
            return
        self.previous_global_step = global_step
        if self.should_save_model and self.model is None:
            raise UsageError("save_contents includes 'model' but no model was given")
        if self.should_save_optimizer and self.optimizer is None:
            raise UsageError("save_contents includes 'optimizer' but no optimizer was given")
        root, step, role = _locate(local_path)
        run = self._run(root, role)
        keep = max_ckpt_to_keep  # verl: None, 0 or -1 keep everything
        valid = isinstance(keep, int) and not isinstance(keep, bool) and keep > 0
        run.keep = keep if valid else None
        extra = None
        if self.should_save_extra:  # verl keeps the scheduler with the RNG, in "extra"
            scheduler = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
            extra = {"lr_scheduler": scheduler}
        run.save(step, extra)

    def wait_for_reads(self) -> float:
        """Return once no background save reads a live tensor (``CheckpointManager.
        wait_for_reads``): before writing weights in place outside ``optimizer.step()``."""
        return sum(run.wait_for_reads() for run in self._runs.values())

    def wait(self) -> None:
        """Block until every background save has committed; raise its error if one failed."""
        for run in self._runs.values():
            run.wait()

    def close(self) -> None:
        """Wait for background saves and release the directory locks."""
        for run in self._runs.values():
            run.close()

    def _run(self, root: Path, role: str | None) -> _RoleRun:
        key = (root, role)
        if key not in self._runs:
            async_save = self.async_save
            if async_save and role is None:
                # verl's SFT trainer writes its data files into the step directory and moves the
                # latest pointer as soon as save_checkpoint returns: only a finished save is safe.
                log.warning(
                    "shardstream: async_save saves synchronously into %s/global_step_N (verl's "
                    "SFT layout moves the latest pointer when save_checkpoint returns)",
                    root,
                )
                async_save = False
                if self._staging is not None:
                    self._staging.drop()
                    self._staging = None
            contents = self.checkpoint_save_contents
            config = CheckpointConfig(
                directory=str(root),
                save_contents=tuple(contents),
                load_contents=tuple(c for c in self.checkpoint_load_contents if c != "hf_model"),
                staging_budget=_staging_budget()[0],
                async_save=async_save,
                save_lora_only=self.should_save_lora_only,
            )
            self._runs[key] = _RoleRun(config, self, role)
        return self._runs[key]

    def _side_files(self) -> _VerlFiles:
        """What verl writes beside the weights, captured on the training thread."""
        unwrapped = _unwrapped(self.model)
        config = getattr(unwrapped, "config", None)
        if self._generation_config is ...:
            self._generation_config = _generation_config(unwrapped, config)
        custom = None
        if config is not None and getattr(config, "auto_map", None):
            get_base = getattr(unwrapped, "get_base_model", None)
            custom = get_base() if callable(get_base) else unwrapped
        return _VerlFiles(
            export=None,
            config=config,
            generation_config=self._generation_config,
            processing_class=self.processing_class,
            lora_meta=st.model_lora_meta(unwrapped) if unwrapped is not None else None,
            custom_code_model=custom,
        )

    def _saved(self, path: str) -> None:
        if path not in self.previous_saved_paths:
            self.previous_saved_paths.append(path)

    def _deleted(self, path: str) -> None:
        if path in self.previous_saved_paths:
            self.previous_saved_paths.remove(path)

    # --- loading ----------------------------------------------------------------------------------

    def load_checkpoint(
        self, local_path: str | None, hdfs_path: str | None = None, del_local_after_load=False
    ) -> None:
        """Load ``local_path`` into the live model, optimizer, scheduler and RNG, from a
        shardstream checkpoint or verl's own ``.pt`` one saved at any world size.

        Every file the load reads is checked first, split between the ranks, so a corrupt,
        partial or foreign checkpoint is refused, naming the file, before the model changes.
        ``hdfs_path`` and ``del_local_after_load`` are unused (verl's FSDP manager only
        deletes copies it downloaded)."""
        if local_path is None:
            return
        if self.should_load_model and self.model is None:
            raise UsageError("load_contents includes 'model' but no model was given")
        if self.should_load_optimizer and self.optimizer is None:
            raise UsageError("load_contents includes 'optimizer' but no optimizer was given")
        self.wait()  # a save of ours still in flight finishes first
        from ..formats.source import Kind

        path = Path(local_path).absolute()
        kind = check_before_load(path)
        contents = tuple(c for c in self.checkpoint_load_contents if c != "hf_model")
        result = loading.load(
            path,
            model=self.model if self.should_load_model else None,
            optimizer=self.optimizer if self.should_load_optimizer else None,
            lr_scheduler=self.lr_scheduler if kind is Kind.DCP else None,
            contents=contents,
            verify=kind is Kind.DCP,  # checked in full above; DCP stores no checksums
            buffer_size=_staging_budget()[1] or DEFAULT_BUFFER_BYTES,
        )
        if self.should_load_extra and self.lr_scheduler is not None and kind is not Kind.DCP:
            if kind is Kind.VERL:
                scheduler = _verl_scheduler_state(path)
            else:
                scheduler = result.extra.get("lr_scheduler")
            if scheduler is not None:
                self.lr_scheduler.load_state_dict(scheduler)
        coll.barrier()


def check_before_load(path: Path) -> Kind:
    """Check every byte of the checkpoint at ``path`` against its checksum, each rank a share
    of the files (every rank calls this); returns its ``Kind``. A damaged or missing file
    fails every rank with that file named. DCP checkpoints store no checksums."""
    from ..formats import verl
    from ..formats.source import Kind, detect

    error, kind, files = None, None, []
    try:
        kind = detect(path) if path.is_dir() else Kind.NONE
        if kind is Kind.NATIVE:
            checkpoint = native.open_native(path, regions={})  # sizes now, headers when read
            files = sorted(checkpoint.manifest.get("files", {}))
        elif kind is Kind.VERL:
            files = sorted(str(p) for p in path.glob("*.pt"))
    except Exception as exc:  # noqa: BLE001  (every rank must learn of it)
        error = exc
    coll.agree_or_raise(error, "restore")
    if kind is Kind.VERL:
        verl.check_dealt_out([(file, None) for file in files], [], "restore")
    elif kind is Kind.NATIVE:
        try:
            for name in files[coll.rank() :: coll.world()]:
                _check_native_file(checkpoint, name)
        except Exception as exc:  # noqa: BLE001
            error = exc
        coll.agree_or_raise(error, "restore")
    return kind


def _check_native_file(checkpoint: native.NativeCheckpoint, name: str) -> None:
    info = checkpoint.manifest["files"][name]
    path = native.check_name(checkpoint.directory, name, "files")
    if isinstance(info, dict) and "header_xxh3" in info:
        endpoint = checkpoint.endpoint(str(path))
        try:
            endpoint.check_all()
        finally:
            endpoint.close()
    elif native.file_digest(path) != (info.get("xxh3") if isinstance(info, dict) else None):
        raise ChecksumMismatchError(f"{path}: checksum mismatch")


def _verl_scheduler_state(path: Path) -> dict | None:
    """The LR scheduler verl saved (rank 0's extra state; every rank saved the same)."""
    from ..formats import verl

    worlds = verl.files_by_world_size(path, "extra_state")
    if not worlds:
        return None
    return verl.read_extra_state(path, max(worlds), 0).get("lr_scheduler")


def _generation_config(model: Any, config: Any) -> Any:
    """The generation config verl saves: the pretrained one named by the config, if any."""
    can_generate = getattr(model, "can_generate", None)
    name = getattr(config, "name_or_path", None)
    if not (callable(can_generate) and can_generate() and name):
        return None
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(name)
    except Exception:  # noqa: BLE001  (verl saves none then, too)
        return None


@dataclass
class _VerlFiles:
    """``huggingface/`` (config, generation config, tokenizer or processor, custom code) and
    ``lora_train_meta.json`` as verl writes them, added by rank 0 to the staged step; wraps the
    step's hf_model export when it has one (``saving.execute_save`` calls it in its place)."""

    export: Any
    config: Any
    generation_config: Any
    processing_class: Any
    lora_meta: dict | None
    custom_code_model: Any

    def rank_file_keys(self, items):
        return None if self.export is None else self.export.rank_file_keys(items)

    def live_reads(self):
        return [] if self.export is None else self.export.live_reads()

    def __call__(self, tmp: Path, buffer_bytes: int, guard=None, rank_file=None) -> dict:
        records = {} if self.export is None else self.export(tmp, buffer_bytes, guard, rank_file)
        error = None
        if coll.rank() == 0:
            try:
                self._write(tmp)
            except Exception as exc:  # noqa: BLE001  (every rank must learn of it)
                error = exc
        coll.agree_or_raise(error)
        return records

    def _write(self, tmp: Path) -> None:
        hf_dir = tmp / HF_DIR
        hf_dir.mkdir(exist_ok=True)
        if self.export is None and self.config is not None:  # the export wrote it otherwise
            self.config.save_pretrained(hf_dir)
        elif self.export is not None and (hf_dir / "config.json").is_file():
            # verl's hf_model names bfloat16 whatever its tensors' dtype (it builds the model
            # to save with torch_dtype=bfloat16): so do its files here, and a merge of them
            path = hf_dir / "config.json"
            set_config_dtype(path, path, VERL_HF_MODEL_DTYPE)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(hf_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(hf_dir)
        if self.custom_code_model is not None:
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(self.custom_code_model, hf_dir, config=self.config)
        if self.lora_meta is not None:
            (tmp / LORA_META).write_text(json.dumps(self.lora_meta, indent=4))


class _RoleRun(CheckpointManager):
    """One role's checkpoints in a verl run directory: ``ROOT/global_step_N/ROLE`` (or
    ``ROOT/global_step_N`` when ``role`` is None), with the manager's commit, lock, async
    save and debris rules. The lock is per role: verl's actor and critic save side by side."""

    def __init__(self, config: CheckpointConfig, owner: FSDPCheckpointManager, role: str | None):
        self.role = role
        self.owner = owner
        self.keep: int | None = None
        self.lock_name = f".shardstream-{role}.lock" if role else ".shardstream.lock"
        unwrapped = _unwrapped(owner.model)
        super().__init__(
            config,
            model=owner.model,
            optimizer=owner.optimizer,
            hf_config=getattr(unwrapped, "config", None),
        )

    def _shared_staging(self) -> StagingMemory | None:
        staging, self.owner._staging = self.owner._staging, None
        return staging

    def step_dir(self, step: int) -> Path:
        path = self.root / step_name(step)
        return path if self.role is None else path / self.role

    def all_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(s for s in step_dirs(self.root) if (self.step_dir(s) / MANIFEST).is_file())

    saves_config_files = False  # _VerlFiles writes them, as verl does

    def _prepare(self, step, extra, buffer_bytes, background=False):
        prepared = super()._prepare(step, extra, buffer_bytes, background)
        files = self.owner._side_files()
        files.export = prepared.hf_export
        prepared.hf_export = files
        return prepared

    def _commit(self, prepared):
        result = saving.execute_save(prepared)
        step = prepared.step
        if coll.rank() == 0:
            # verl's trainer writes the pointer after a synchronous save returns, and none
            # after an async one: then it moves here, once the whole step has committed.
            if self.config.async_save and self._step_complete(step):
                write_latest(self.root, step)
            self.owner._saved(str(self.step_dir(step)))  # rank 0's list, as verl keeps it
            self._retain(step)
        coll.barrier()
        return result

    def _step_complete(self, step: int) -> bool:
        """No other role of ``step`` is being written (a critic saving beside the actor)."""
        if self.role is None:
            return True
        try:
            entries = list((self.root / step_name(step)).iterdir())
        except OSError:
            return False
        for entry in entries:
            if entry.name == self.role or not entry.is_dir():
                continue
            if is_temporary(entry.name):
                if not entry.name.startswith(self.role + TMP_MARK):
                    return False
            elif not (entry / MANIFEST).is_file() and not any(entry.glob("model_world_size_*")):
                return False
        return True

    # Retention is verl's ``max_ckpt_to_keep`` (``keep``) over this role's committed
    # shardstream steps, as ``all_steps`` lists them: never a directory of another format.
    def _keep_last(self) -> int | None:
        return self.keep

    def _dropped(self, path: Path) -> None:
        self.owner._deleted(str(path))  # verl's previous_saved_paths: bookkeeping, at once

    def _after_deleting(self) -> Callable[[Path], None] | None:
        """With a role, the step directory once its files are gone, if that role was all it
        held."""
        return _drop_emptied_step if self.role is not None else None

    def _take_debris(self) -> list[Path]:
        if self.role is None:
            return super()._take_debris()
        # Only this role's: the latest pointer's temporaries may be another role's, mid-write.
        taken = []
        for step_path in step_dirs(self.root).values():
            if step_path.is_dir():
                taken += commit.take_debris(step_path, lambda name: name == self.role)
        return taken


def _drop_emptied_step(grave: Path) -> None:
    """Remove the step directory holding ``grave`` if nothing else is left in it."""
    try:
        grave.parent.rmdir()
    except OSError:
        pass
