"""What a directory is, and the reader that opens it, whatever its format.

``detect`` names the kind of a directory, asking in this order and taking the first answer:

1. ``NATIVE``      shardstream's step: ``manifest.json`` (``native.is_native_checkpoint``)
2. ``VERL``        verl's checkpoint: ``model_world_size_W_rank_R.pt`` files
3. ``DCP``         PyTorch DCP (torchtitan, accelerate's ``pytorch_model_fsdp_N``): ``.metadata``
                   or ``__R_i.distcp`` files
   ``ACCELERATE``  accelerate's ``save_state`` (or a Trainer checkpoint) of an FSDP model:
                   ``pytorch_model_fsdp_N/`` (DCP) beside ``optimizer_N/``, the scheduler's and
                   RNG files; with ``FULL_STATE_DICT``, ``pytorch_model_fsdp.bin`` (one
                   ``torch.save`` state dict) beside ``optimizer.bin`` instead
   ``TORCH_SAVE``  PyTorch's FSDP2 example: ``model_state_dict.pt`` (a whole state dict
                   saved with ``torch.save``) beside ``optim_state_dict.pt``
   ``DCP_HF``      DCP's ``HuggingFaceStorageWriter``: per-rank ``shard-N-model-I-of-K
                   .safetensors`` files, or a model consolidated beside them in ``sharded/``
4. ``HF_MODEL``    a Hugging Face model: ``model.safetensors`` or its index (a merge's output;
                   merge reads it as whole tensors and writes it as save_pretrained would)
   ``HF_TORCH``    the same saved with ``torch.save``: ``pytorch_model.bin`` or its index
5. ``VERL_ROLES``  a verl step: subdirectories (``actor/``, ``critic/``) that are verl or
                   shardstream checkpoints (the verl plug-in writes the latter there)
6. ``RUN``         a run: ``global_step_N`` entries or the latest pointer
7. ``NONE``        none of these

A path that is a regular file named ``*.pt``, ``*.pth``, ``*.bin``, ``*.tar`` or ``*.ckpt`` is
``TORCH_FILE``: one ``torch.save`` file, a model's state dict or a general checkpoint dict
(``torch_state_dict.open_torch_file``).

What a directory holds itself comes before what its subdirectories hold: a model directory
that sits beside step directories is a model. Two of native, verl, DCP and ``TORCH_SAVE``
in one directory, or a Hugging Face model's weights beside one of them, make the directory
ambiguous: readers and verify refuse it (``second_model``).

Every kind but the last three has a reader (``open_checkpoint``); every reader offers
``CheckpointSource``. A new format is a module with a reader and one row of ``_KINDS``. verl's
and DCP's readers import torch (1-2 s), so their file names and tests are here, torch-free:
``shardstream inspect``/``verify`` of shardstream's own and HF directories never import it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import CheckpointFormatError, CheckpointNotFoundError, UsageError
from ..storage.commit import TMP_MARK
from ..storage.run_layout import LATEST_FILE, STEP_DIR, read_latest
from . import hf, native
from .regular_file import kind_of

if TYPE_CHECKING:
    from ..engine.endpoints import FileEndpoint
    from ..engine.plan import Block, GlobalTensor

# verl's rank files, {kind}_world_size_{W}_rank_{r}.pt; kind: model, optim, extra_state.
# As verl names them (no leading zeros): a stray rank_01.pt is not rank 1's file, which verl
# opens by its exact name.
VERL_FILE_PATTERN = r"^{kind}_world_size_(0|[1-9][0-9]*)_rank_(0|[1-9][0-9]*)\.pt\Z"
VERL_MODEL_FILE = re.compile(VERL_FILE_PATTERN.format(kind="model"))
VERL_ANY_FILE = re.compile(VERL_FILE_PATTERN.format(kind="(?:model|optim|extra_state)"))
# DCP's global metadata (written last) and its data files, __{rank}_{i}.distcp.
DCP_METADATA_FILE = ".metadata"
DCP_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp\Z", re.ASCII)
# dcp.save(use_collectives=False): one metadata file per rank
DCP_RANK_METADATA_FILE = re.compile(r"^__(\d+)\.metadata\Z", re.ASCII)
# A Hugging Face model saved with torch.save (transformers' safe_serialization=False,
# accelerate's save_state or save_model likewise): one file, or an index and its shards.
HF_TORCH_FILE = "pytorch_model.bin"
HF_TORCH_INDEX = "pytorch_model.bin.index.json"
# DCP's HuggingFaceStorageWriter(save_distributed=True): one safetensors file per rank (and
# with enable_consolidation=True those in sharded/ beside the consolidated model).
DCP_HF_SHARD_FILE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors\Z", re.ASCII)
DCP_HF_SHARDED_SUBDIR = "sharded"
# accelerate's save_state with a sharded FSDP state dict (and the Trainer's checkpoint-N): the
# model and optimizer as DCP directories, the scheduler and each rank's RNG as torch.save files.
ACCELERATE_SHARDED_FORMAT = "accelerate (SHARDED_STATE_DICT)"  # its model dir is DCP's
ACCELERATE_MODEL_DIR = re.compile(r"^pytorch_model_fsdp_(\d+)\Z", re.ASCII)
TRAINER_CHECKPOINT = re.compile(r"checkpoint-\d+", re.ASCII)  # the Trainer's checkpoint folders
TRAINER_STATE = "trainer_state.json"  # the Trainer writes it last into each checkpoint-N


def folders_around(directory: Path) -> list[Path]:
    """A model folder, then those a Trainer run keeps its side files in (config.json,
    adapter_config.json): the ``checkpoint-N`` around accelerate's ``pytorch_model_fsdp_N``,
    and that ``checkpoint-N``'s output_dir."""
    folders = [directory]
    if ACCELERATE_MODEL_DIR.match(directory.name):
        folders.append(directory.parent)
    if TRAINER_CHECKPOINT.fullmatch(folders[-1].name):
        folders.append(folders[-1].parent)
    return folders


ACCELERATE_OPTIMIZER_DIR = re.compile(r"^optimizer_(\d+)\Z", re.ASCII)
ACCELERATE_SCHEDULER_FILE = re.compile(r"^scheduler(?:_(\d+))?\.(?:bin|pt)\Z", re.ASCII)
# (the Trainer's single process writes rng_state.pth: rank 0's)
ACCELERATE_RNG_FILE = re.compile(
    r"^(?:random_states|rng_state)(?:_(\d+))?\.(?:pkl|pth)\Z", re.ASCII
)
# accelerate's save_state with an FSDP FULL_STATE_DICT: the whole model state dict, and the
# optimizer's, each one torch.save file by rank 0 (model 0: no _N; model N: _N).
ACCELERATE_FULL_MODEL_FILE = re.compile(r"^pytorch_model_fsdp(?:_([1-9]\d*))?\.bin\Z", re.ASCII)
ACCELERATE_FULL_OPTIMIZER_FILE = re.compile(r"^optimizer(?:_([1-9]\d*))?\.(?:bin|pt)\Z", re.ASCII)
# Without FSDP (DDP, one process) accelerate's save_state and the Trainer's checkpoint-N hold
# the model as save_pretrained / save_model writes it (model.safetensors or pytorch_model.bin,
# or an index) and the optimizer's own state_dict() (integer parameter ids) in optimizer.bin
# (the Trainer's: optimizer.pt), beside the scheduler and RNG files above.
ACCELERATE_PLAIN_FORMAT = "accelerate (no FSDP)"
# accelerate's FSDP1 LOCAL_STATE_DICT: each rank's flat-parameter shard, torch.save'd (not read).
ACCELERATE_LOCAL_MODEL_FILE = re.compile(r"^pytorch_model_fsdp(?:_\d+)?_rank\d+\.bin\Z", re.ASCII)
# Its second and later models (prepared together): model_N.safetensors / pytorch_model_N.bin.
ACCELERATE_PLAIN_MODEL_FILE = re.compile(
    r"^(?:model|pytorch_model)_([1-9]\d*)\.(?:safetensors|bin)$", re.ASCII
)
# PyTorch's FSDP2 example (pytorch/examples, distributed/FSDP2/checkpoint.py): rank 0 writes the
# whole model state dict and the optimizer's (by name, or the optimizer's own state_dict()
# with integer ids) with torch.save into checkpoints/<api>/<time>/.
TORCH_SAVE_MODEL_FILE = "model_state_dict.pt"
TORCH_SAVE_OPTIMIZER_FILE = "optim_state_dict.pt"
TORCH_SAVE_FORMAT = "torch.save (PyTorch FSDP2 example)"
# A checkpoint that is one torch.save file (PyTorch's save/load recipes): named so.
TORCH_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".tar", ".ckpt")
# Its other torch.save files, each a state_dict() restored by name (load(states={stem: obj})):
# the GradScaler's, register_for_checkpointing objects', stateful dataloaders'.
ACCELERATE_STATE_FILE = re.compile(
    r"^(?:scaler\.pt|custom_checkpoint_\d+\.pkl|dl_state_dict(?:_\d+)?\.bin)$"
)
# A pickled SeedableRandomSampler object (with its dataset): never unpickled, CRC-checked only.
ACCELERATE_SAMPLER_FILE = re.compile(r"^sampler(?:_\d+)?\.bin\Z", re.ASCII)
TRAINER_ARGS_FILE = re.compile(r"^training_args\.bin\Z")  # the Trainer's TrainingArguments


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

    @property
    def model_objects(self) -> tuple[str, ...]: ...  # non-tensor model entries merge leaves out

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


class Kind(enum.Enum):
    """What a directory is; see the module docstring for the order they are asked in."""

    NATIVE = "shardstream"
    VERL = "verl"
    DCP = "dcp"
    ACCELERATE = "accelerate"
    TORCH_SAVE = "torch_save"
    TORCH_FILE = "torch_file"  # a file, not a directory
    DCP_HF = "dcp_hf"
    HF_MODEL = "huggingface"
    HF_TORCH = "huggingface_torch"
    VERL_ROLES = "verl_roles"
    RUN = "run"
    NONE = "none"


# The kinds whose model's names a prefix selects (--prefix, prefix=): DCP's keys, a torch.save
# file's state dict (a Lightning module's model.), accelerate's save_state of either
PREFIXED_KINDS: frozenset[Kind] = frozenset(
    (Kind.DCP, Kind.ACCELERATE, Kind.TORCH_FILE, Kind.TORCH_SAVE)
)


def is_verl_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and any(VERL_MODEL_FILE.match(p.name) for p in directory.iterdir())


def is_dcp_checkpoint(directory: Path) -> bool:
    """A directory with DCP's ``.metadata`` or any ``__R_i.distcp`` data file."""
    if not directory.is_dir():
        return False
    if (directory / DCP_METADATA_FILE).is_file():
        return True
    return any(DCP_DATA_FILE.match(p.name) for p in directory.iterdir())


@dataclasses.dataclass
class AccelerateState:
    """The parts of accelerate's ``save_state`` directory; ``model``, ``optimizer`` and
    ``scheduler`` are those of model ``index`` (0 unless chosen). ``model`` and ``optimizer``
    are DCP directories (``SHARDED_STATE_DICT``), or with ``full_state`` one ``torch.save``
    file each (``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin``, ``optimizer.bin``), or with
    ``plain`` (saved without FSDP) the directory's HF model and ``optimizer.state_dict()``."""

    directory: Path
    model: Path
    optimizer: Path | None
    scheduler: Path | None
    rng: dict[int, Path]  # saving process -> its RNG file
    models: int  # pytorch_model_fsdp_N directories (or .bin files)
    index: int = 0
    indices: tuple[int, ...] = (0,)  # the N of every pytorch_model_fsdp_N
    # file stem -> file, for load(states={stem: obj}): scaler, custom_checkpoint_N,
    # dl_state_dict[_N], scheduler[_N]; samplers (pickled objects) apart
    states: dict[str, Path] = dataclasses.field(default_factory=dict)
    samplers: dict[str, Path] = dataclasses.field(default_factory=dict)
    plain: bool = False  # saved without FSDP: ``model`` is the directory, a HF model
    plain_models: dict[int, Path] = dataclasses.field(default_factory=dict)  # N >= 1: its file
    # optimizer_N directories without a DCP .metadata: a save interrupted before it finished
    unfinished_optimizers: dict[int, Path] = dataclasses.field(default_factory=dict)

    @property
    def full_state(self) -> bool:
        """Whether model ``index`` is one whole state dict (``FULL_STATE_DICT``)."""
        return self.model.is_file()

    @property
    def world_size(self) -> int:
        """The processes of the saving run, from its per-rank RNG files (1 without any)."""
        return max(self.rng) + 1 if self.rng else 1


def accelerate_state(directory: Path, index: int = 0) -> AccelerateState | None:
    """The parts of an accelerate ``save_state`` directory, with model ``index``'s model,
    optimizer and scheduler; None when ``directory`` is none (or has no model ``index``).
    Raises ``CheckpointFormatError`` when model ``index`` (or its optimizer) is there both
    as a DCP directory and as a ``.bin`` file: two saves, and which one is meant is unknown."""
    if not directory.is_dir():
        return None
    models, optims, schedulers, rng, states, samplers, plain_models = {}, {}, {}, {}, {}, {}, {}
    full_models, full_optims, unfinished = {}, {}, {}
    for entry in directory.iterdir():
        name = entry.name
        if (m := ACCELERATE_MODEL_DIR.match(name)) and is_dcp_checkpoint(entry):
            models[int(m[1])] = entry
        elif m := ACCELERATE_OPTIMIZER_DIR.match(name):
            if is_dcp_checkpoint(entry):
                optims[int(m[1])] = entry
            elif entry.is_dir():
                unfinished[int(m[1])] = entry
        elif (m := ACCELERATE_FULL_MODEL_FILE.match(name)) and entry.is_file():
            full_models[int(m[1] or 0)] = entry
        elif (m := ACCELERATE_FULL_OPTIMIZER_FILE.match(name)) and entry.is_file():
            full_optims[int(m[1] or 0)] = entry
        elif (m := ACCELERATE_SCHEDULER_FILE.match(name)) and entry.is_file():
            schedulers[int(m[1] or 0)] = entry
            states[entry.stem] = entry
        elif (m := ACCELERATE_RNG_FILE.match(name)) and entry.is_file():
            rng[int(m[1] or 0)] = entry
        elif ACCELERATE_STATE_FILE.match(name) and entry.is_file():
            states[entry.stem] = entry
        elif ACCELERATE_SAMPLER_FILE.match(name) and entry.is_file():
            samplers[entry.stem] = entry
        elif (m := ACCELERATE_PLAIN_MODEL_FILE.match(name)) and entry.is_file():
            plain_models[int(m[1])] = entry
    for sharded, full in ((models, full_models), (optims, full_optims)):
        if index in sharded and index in full:
            raise CheckpointFormatError(
                f"{directory}: holds both {sharded[index].name}/ (SHARDED_STATE_DICT) and "
                f"{full[index].name} (FULL_STATE_DICT), from two saves; remove the one not "
                "meant"
            )
    indices = {*models, *full_models}
    if (
        not indices
        and index == 0
        and (full_optims or schedulers or rng)
        and (is_hf_model(directory) or is_hf_torch_model(directory))
    ):  # saved without FSDP: the model is the directory's HF model
        return AccelerateState(
            directory,
            directory,
            full_optims.get(0),
            schedulers.get(0),
            rng,
            1 + len(plain_models),
            indices=(0, *sorted(plain_models)),
            plain=True,
            states=states,
            samplers=samplers,
            plain_models=plain_models,
        )
    if 0 not in indices or index not in indices:
        return None
    return AccelerateState(
        directory,
        models.get(index) or full_models[index],
        optims.get(index) or full_optims.get(index),
        schedulers.get(index),
        rng,
        len(indices),
        index,
        tuple(sorted(indices)),
        states,
        samplers,
        unfinished_optimizers=unfinished,
    )


def refuse_local_state_dict(directory: Path) -> None:
    """``CheckpointFormatError`` when ``directory`` holds accelerate's FSDP1 LOCAL_STATE_DICT
    model files, which no reader here reads (each rank's flat-parameter shard, whose layout
    only the saving run's FSDP1 wrapping knows)."""
    try:
        found = sorted(
            e.name for e in os.scandir(directory) if ACCELERATE_LOCAL_MODEL_FILE.match(e.name)
        )
    except OSError:
        return
    if found:
        raise CheckpointFormatError(
            f"{directory}: holds accelerate's FSDP1 LOCAL_STATE_DICT model files "
            f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): each rank's "
            "flat-parameter shard, which shardstream does not read; save with "
            "fsdp_state_dict_type SHARDED_STATE_DICT (or FULL_STATE_DICT) instead"
        )


def several_models(parts: AccelerateState) -> str:
    """What an accelerate directory holding several models holds, for messages."""
    if parts.plain:
        first = next(
            (n for n in (hf.SINGLE_FILE, hf.INDEX_FILE, HF_TORCH_FILE, HF_TORCH_INDEX)
             if (parts.directory / n).is_file()),
            "the HF model",
        )  # fmt: skip
        files = [first, *(parts.plain_models[i].name for i in sorted(parts.plain_models))]
        return f"holds {parts.models} models saved without FSDP ({', '.join(files)})"
    if parts.full_state:
        names = [f"pytorch_model_fsdp{'' if i == 0 else f'_{i}'}.bin" for i in parts.indices]
        return f"holds {parts.models} models saved whole (FULL_STATE_DICT: {', '.join(names)})"
    names = [f"pytorch_model_fsdp_{i}" for i in parts.indices]
    return f"holds {parts.models} models ({', '.join(names)})"


def one_model_hint(parts: AccelerateState) -> str:
    """How to merge or inspect one of several models of an accelerate directory."""
    where = parts.directory
    if parts.plain:
        first = min(parts.plain_models)
        if parts.plain_models[first].suffix == ".bin":  # a whole state dict: a checkpoint
            return f"pass one model's file, such as {parts.plain_models[first]}"
        return (
            "put one model's file in a directory of its own as model.safetensors, with its "
            "config.json, and pass that"
        )
    if parts.full_state:
        return f"pass one model's file, {where}/pytorch_model_fsdp_<i>.bin"
    return f"pass one model's directory, {where}/pytorch_model_fsdp_<i>"


def training_state_files(directory: Path) -> list[str]:
    """The names of accelerate's or the Trainer's training-state files in ``directory``
    (optimizer, scheduler, RNG): what a save holds beside its model."""
    patterns = (ACCELERATE_FULL_OPTIMIZER_FILE, ACCELERATE_SCHEDULER_FILE, ACCELERATE_RNG_FILE)
    try:
        names = sorted(entry.name for entry in directory.iterdir())
    except OSError:
        return []
    return [n for n in names if any(p.match(n) for p in patterns) or n == TORCH_SAVE_OPTIMIZER_FILE]


def is_accelerate_state(directory: Path) -> bool:
    try:
        return accelerate_state(directory) is not None
    except CheckpointFormatError:  # both layouts of model 0: accelerate's, and the reader says
        return True


def is_dcp_hf(directory: Path) -> bool:
    """Files of DCP's HuggingFaceStorageWriter: per-rank shard files here, or a model here
    consolidated from the shard files in ``sharded/``."""

    def shards(d: Path) -> bool:
        return d.is_dir() and any(DCP_HF_SHARD_FILE.match(p.name) for p in d.iterdir())

    return shards(directory) or (
        is_hf_model(directory) and shards(directory / DCP_HF_SHARDED_SUBDIR)
    )


def is_hf_torch_model(directory: Path) -> bool:
    """A Hugging Face model saved with ``torch.save``: ``pytorch_model.bin`` or its index."""
    return _any_named(directory, HF_TORCH_FILE, HF_TORCH_INDEX)


def is_torch_save_state(directory: Path) -> bool:
    """PyTorch's FSDP2 example: ``model_state_dict.pt`` (and ``optim_state_dict.pt``)."""
    return _any_named(directory, TORCH_SAVE_MODEL_FILE)


def is_hf_model(directory: Path) -> bool:
    """``model.safetensors`` or its index."""
    return _any_named(directory, hf.SINGLE_FILE, hf.INDEX_FILE)


def _any_named(directory: Path, *names: str) -> bool:
    """Whether anything is under one of ``names`` (a FIFO or broken link too: the reader then
    names it as what it is, rather than the directory being taken for another kind)."""
    return any(os.path.lexists(directory / name) for name in names)


def verl_merges(checkpoint: CheckpointSource) -> bool:
    """Whether verl's merger would merge ``checkpoint`` too: verl's own files, or the verl
    plug-in's (shardstream's format in a ``global_step_N/<role>`` directory of a verl run).
    Its defaults then follow verl's (bfloat16 output and comparison)."""
    if checkpoint.format == "verl":
        return True
    role = Path(os.path.realpath(checkpoint.directory))  # however the path was spelled
    return checkpoint.format == "shardstream" and bool(STEP_DIR.match(role.parent.name))


def models_beside(checkpoint: CheckpointSource) -> dict[str, int]:
    """A DCP checkpoint's tensors beside its model that are no training state (an EMA copy):
    container -> tensor count (``dcp.unread_groups``); {} for other formats, without
    importing the DCP reader (and torch)."""
    skipped = getattr(checkpoint, "skipped", None)
    if not isinstance(skipped, dict):
        return {}
    from .dcp import unread_groups

    return unread_groups(skipped, getattr(checkpoint, "prefix", None) or "")


def verl_roles(directory: Path) -> list[Path]:
    """The subdirectories of a verl step directory that are checkpoints (``actor/``, and maybe
    ``critic/``): verl's ``.pt`` files, or shardstream's as the verl plug-in writes them there.
    Step directories and temporaries are not roles (a run holds those)."""
    return sorted(
        d
        for d in directory.iterdir()
        if d.is_dir()
        and not STEP_DIR.match(d.name)
        and TMP_MARK not in d.name
        and (is_verl_checkpoint(d) or native.is_native_checkpoint(d))
    )


def _roles_of_a_step(directory: Path) -> list[Path]:
    """``verl_roles``, of a directory holding no step directory: a run root may hold a step
    copied aside (``best/``, ``global_step_2.bak``), which is no role of the run."""
    if any(STEP_DIR.match(entry.name) for entry in directory.iterdir()):
        return []
    return verl_roles(directory)


def is_run(directory: Path) -> bool:
    """A run directory: ``global_step_N`` entries, committed or not, or the latest pointer."""
    return (directory / LATEST_FILE).exists() or any(
        STEP_DIR.match(entry.name) for entry in directory.iterdir()
    )


# (path, model_only, shared, prefix): prefix is what a DCP checkpoint's model keys start with
Opener = Callable[[Path, bool, bool, "str | None"], CheckpointSource]


def _open_native(
    path: Path, model_only: bool, shared: bool, prefix: str | None
) -> CheckpointSource:
    return native.open_native(path, model_only=model_only, shared=shared)


def _open_verl(path: Path, model_only: bool, shared: bool, prefix: str | None) -> CheckpointSource:
    from .verl import open_verl

    return open_verl(path, shared=shared)


def _open_dcp(path: Path, model_only: bool, shared: bool, prefix: str | None) -> CheckpointSource:
    from .dcp import open_dcp

    return open_dcp(path, prefix)


def _open_accelerate(
    path: Path, model_only: bool, shared: bool, prefix: str | None
) -> CheckpointSource:
    parts = accelerate_state(path)
    if parts.models > 1:
        raise UsageError(f"{path}: {several_models(parts)}; {one_model_hint(parts)}")
    if parts.plain:  # without FSDP: the HF model beside the training state
        if prefix is not None:
            raise UsageError(
                f"{path}: --prefix applies to DCP checkpoints (keys such as 'app.model.*'); "
                "this one holds its model as a Hugging Face model, under its own names"
            )
        opener = _open_hf_model if is_hf_model(path) else _open_hf_torch
        checkpoint = opener(path, model_only, shared, prefix)
        checkpoint.label = ACCELERATE_PLAIN_FORMAT
        checkpoint.world_size = parts.world_size  # the saving run's (its RNG files)
        return checkpoint
    if parts.full_state:  # FULL_STATE_DICT: pytorch_model_fsdp.bin
        from .torch_state_dict import open_torch_state_dict

        return open_torch_state_dict(
            parts.model, world_size=parts.world_size, shared=shared, prefix=prefix
        )
    from .dcp import open_dcp

    checkpoint = open_dcp(parts.model, prefix)
    checkpoint.label = ACCELERATE_SHARDED_FORMAT
    return checkpoint


def _open_torch_save(
    path: Path, model_only: bool, shared: bool, prefix: str | None
) -> CheckpointSource:
    from .torch_state_dict import open_torch_state_dict

    return open_torch_state_dict(
        path / TORCH_SAVE_MODEL_FILE, label=TORCH_SAVE_FORMAT, shared=shared, prefix=prefix
    )


def _open_dcp_hf(
    path: Path, model_only: bool, shared: bool, prefix: str | None
) -> CheckpointSource:
    from .dcp_hf import open_dcp_hf

    return open_dcp_hf(path)


# detect's table, in the order it asks: (kind, test, reader or None).
_KINDS: tuple[tuple[Kind, Callable[[Path], object], Opener | None], ...] = (
    (Kind.NATIVE, native.is_native_checkpoint, _open_native),
    (Kind.VERL, is_verl_checkpoint, _open_verl),
    (Kind.DCP, is_dcp_checkpoint, _open_dcp),
    (Kind.ACCELERATE, is_accelerate_state, _open_accelerate),
    (Kind.TORCH_SAVE, is_torch_save_state, _open_torch_save),
    (Kind.DCP_HF, is_dcp_hf, _open_dcp_hf),
    (Kind.HF_MODEL, is_hf_model, None),
    (Kind.HF_TORCH, is_hf_torch_model, None),
    (Kind.VERL_ROLES, _roles_of_a_step, None),
    (Kind.RUN, is_run, None),
)
_READERS = {kind: opener for kind, _, opener in _KINDS if opener is not None}


def _open_hf_model(
    path: Path, model_only: bool, shared: bool, prefix: str | None
) -> CheckpointSource:
    from .dcp_hf import open_hf_model

    return open_hf_model(path)


def _open_hf_torch(
    path: Path, model_only: bool, shared: bool, prefix: str | None
) -> CheckpointSource:
    from .torch_state_dict import open_torch_weights

    return open_torch_weights(path, shared=shared)


# A Hugging Face model is read too (merge re-lays it out: names, dtype, file split), though it
# is no training checkpoint: looks_like_checkpoint and the hints leave it out.
_READERS[Kind.HF_MODEL] = _open_hf_model
_READERS[Kind.HF_TORCH] = _open_hf_torch


def detect(path: str | os.PathLike) -> Kind:
    """The kind of directory ``path`` is (a regular file named ``*.pt``, ``*.pth``, ``*.bin``,
    ``*.tar`` or ``*.ckpt``: ``Kind.TORCH_FILE``; ``Kind.NONE`` for anything else not a
    directory); from file names only, reading no file. Raises ``OSError`` if it cannot be
    listed."""
    path = Path(path)
    if not path.is_dir():
        if path.suffix in TORCH_FILE_SUFFIXES and path.is_file():
            return Kind.TORCH_FILE
        return Kind.NONE
    for kind, test, _ in _KINDS:
        if test(path):
            return kind
    return Kind.NONE


def looks_like_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory a reader opens (of any format)."""
    return path.is_dir() and any(opener and test(path) for _, test, opener in _KINDS)


def open_checkpoint(
    path: str | os.PathLike,
    *,
    model_only: bool = False,
    shared: bool = False,
    prefix: str | None = None,
) -> CheckpointSource:
    """The reader of the checkpoint at ``path``, whatever its format.

    ``model_only``: the caller reads model tensors only (merge, test), so a format that also
    holds optimizer state need not describe it. ``shared``: every process of the current group
    opens it together, and each reads a share of the rank files' headers (verl's and
    shardstream's formats). ``prefix``: what a DCP checkpoint's model keys start with
    ("app.model.", "" for the top level) where detection is ambiguous; DCP only.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such directory")
    if detect(path) is Kind.TORCH_FILE:  # one torch.save file (PyTorch's recipes)
        if VERL_ANY_FILE.match(path.name):
            raise UsageError(
                f"{path}: is one rank's file of a verl checkpoint, which holds that rank's "
                f"shards only; pass the directory of every rank's files ({path.parent})"
            )
        from .torch_state_dict import open_torch_file

        opened = open_torch_file(path, shared=shared, prefix=prefix)
        return _holding_tensors(path, opened, model_only)
    if not path.is_dir():
        raise CheckpointFormatError(
            f"{path}: is {kind_of(path) or 'gone'}; expected a checkpoint directory or a "
            f"torch.save file ({', '.join(TORCH_FILE_SUFFIXES)})"
        )
    kind = detect(path)
    opener = _READERS.get(kind)
    if prefix is not None and kind not in PREFIXED_KINDS:
        raise UsageError(
            f"{path}: --prefix applies to DCP checkpoints (keys such as 'app.model.*') and "
            f"torch.save files, not to this one ({kind.value})"
        )
    if opener is not None:
        if (beside := second_model(path, kind)) is not None:
            raise CheckpointFormatError(beside)
        return _holding_tensors(path, opener(path, model_only, shared, prefix), model_only)
    refuse_local_state_dict(path)
    exported = path / "huggingface"  # a verl step saved with save_contents=['hf_model'] alone
    if is_hf_model(exported):
        raise CheckpointNotFoundError(
            f"{path}: no model files here, but {exported} holds the model saved with hf_model: "
            "pass that directory, or use it as it is"
        )
    hint = checkpoints_below(path)
    if len(hint) == 1:
        raise CheckpointNotFoundError(
            f"{path}: no model files here, but {hint[0]} holds a checkpoint; pass that "
            f"directory{unfinished_note(path)}"
        )
    if hint:  # in step order: the last is the newest (torchtitan's step-N, checkpoint-N)
        steps = all(_step_order(h)[0] >= 0 for h in hint)
        newest = f", e.g. the newest, {hint[-1]}" if steps else f" ({hint[0]}, ...)"
        raise CheckpointNotFoundError(
            f"{path}: no model files here, but {len(hint)} folders hold checkpoints "
            f"({', '.join(h.name for h in hint)}); pass one of them{newest}"
            f"{unfinished_note(path)}"
        )
    raise CheckpointNotFoundError(
        f"{path}: no model files found ({EXPECTED}){unfinished_note(path) or unread_hint(path)}"
    )


def _holding_tensors(path: Path, source: CheckpointSource, model_only: bool) -> CheckpointSource:
    """``source``, unless a caller that reads model tensors only (merge, test) would find
    none in it: then an error naming ``path``."""
    if model_only and not source.tensors:
        raise CheckpointFormatError(
            f"{path}: the {source.format} checkpoint holds no model tensors; nothing to merge or "
            "compare"
        )
    return source


def second_model(path: Path, kind: Kind) -> str | None:
    """Why ``path``, read as ``kind``, is ambiguous: beside a native, verl, DCP or
    ``TORCH_SAVE`` checkpoint lies another of these, or a Hugging Face model's weights, which
    none of them writes there; which one is meant is not said. None when nothing does."""
    if kind not in {k for k, _, _ in _ONE_PER_DIRECTORY}:
        return None
    beside = [what for k, test, what in _ONE_PER_DIRECTORY if k is not kind and test(path)]
    names = (hf.SINGLE_FILE, hf.INDEX_FILE, HF_TORCH_FILE, HF_TORCH_INDEX)
    held = [n for n in names if _any_named(path, n)]
    if held:
        beside.append(f"a Hugging Face model's {' and '.join(held)}")
    if not beside:
        return None
    return (
        f"{path}: holds a {kind.value} checkpoint and, beside it, {' and '.join(beside)}; "
        "which one to read is not clear: move one of them into a directory of its own"
    )


# One of these in a directory, and nothing else's weights: (kind, test, what to call it).
_ONE_PER_DIRECTORY: tuple[tuple[Kind, Callable[[Path], object], str], ...] = (
    (Kind.NATIVE, native.is_native_checkpoint, "a shardstream manifest.json"),
    (Kind.VERL, is_verl_checkpoint, "verl's model_world_size_W_rank_R.pt files"),
    (Kind.DCP, is_dcp_checkpoint, "a DCP checkpoint's .metadata or .distcp files"),
    (Kind.TORCH_SAVE, is_torch_save_state, "a torch.save model_state_dict.pt"),
)


# What a reader opens, for messages that find none of it.
EXPECTED = (
    "expected a shardstream manifest.json, verl's model_world_size_W_rank_R.pt files, a DCP "
    ".metadata, accelerate's pytorch_model_fsdp_0/ or pytorch_model_fsdp.bin, a Hugging Face "
    "model.safetensors or pytorch_model.bin (or its index), or a torch.save file"
)
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
PEFT_ADAPTER_FILES = frozenset({"adapter_model.safetensors", "adapter_model.bin"})
_VARIANT = re.compile(
    r"model\.safetensors\.index\.(.+)\.json|model\.([^.-]+)(-\d+-of-\d+)?\.safetensors"
)


def unread_hint(path: Path, subject: str = "it") -> str:
    """What a directory no reader opens holds that a user may have meant: save_pretrained's
    variant files (``variant="fp16"``), a PEFT adapter alone; "" when neither. ``subject``:
    how the sentence names the directory."""
    from ..storage.commit import interrupted_update

    if cut := interrupted_update(Path(path)):
        return f"; {cut}"
    try:
        names = sorted(p.name for p in Path(path).iterdir())
    except OSError:
        return ""
    variants = sorted({m[1] or m[2] for n in names if (m := _VARIANT.fullmatch(n))})
    if variants:
        return (
            f"; {subject} holds save_pretrained's variant {', '.join(map(repr, variants))} "
            f"({next(n for n in names if _VARIANT.fullmatch(n))}...): shardstream reads the "
            "files without a variant, model.safetensors or model.safetensors.index.json; "
            "save without variant=, or load it with transformers (variant=...) and save again"
        )
    shards = [n for n in names if _SHARD.fullmatch(n)]
    if shards and "model.safetensors.index.json" not in names:
        return (
            f"; {subject} holds save_pretrained's shards ({shards[0]}, ...) but not "
            "model.safetensors.index.json, which names the tensors each holds: copy the index "
            "back from where the shards came from"
        )
    if PEFT_ADAPTER_FILES.intersection(names):
        return (
            f"; {subject} holds a PEFT adapter alone (adapter_model.*), not a model: merge the "
            "adapter into its base model with PEFT (merge_and_unload) and save that, or merge "
            "the training checkpoint it came from with --fuse-lora"
        )
    return _torch_files_hint(Path(path), names, subject)


# A training run's files that hold no model: the Trainer's and accelerate's optimizer,
# scheduler, scaler and RNG states, verl's rank files (a folder of its own)
CHECKPOINT_FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".tar")
TRAINING_STATE_FILE = re.compile(
    r"(optimizer|scheduler|scaler|rng_state|random_states|training_args|model_world_size|"
    r"optim_world_size|extra_state)\w*\.\w+\Z"
)


def _torch_files_hint(path: Path, names: list[str], subject: str) -> str:
    """A directory of ``torch.save`` files (Lightning's ``checkpoints/`` of ``.ckpt`` files):
    they are read one at a time, so name them and the newest; "" for none."""
    found = []
    for name in names:
        if name.endswith(CHECKPOINT_FILE_SUFFIXES) and not TRAINING_STATE_FILE.match(name):
            try:
                if (path / name).is_file():
                    found.append((os.stat(path / name).st_mtime, name))
            except OSError:
                continue
    if not found:
        return ""
    newest = max(found)[1]
    listed = ", ".join(name for _, name in sorted(found, key=lambda f: f[1])[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    return (
        f"; {subject} holds torch.save files ({listed}{more}), each a checkpoint read as one "
        f"file: pass one of them, e.g. the newest, {path / newest}"
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

    steps = {}
    for entry in path.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            steps[int(match[1])] = entry
    if steps:
        path = steps.get(read_latest(path)) or steps[max(steps)]
        if looks_like_checkpoint(path):
            return [path]
    found = [
        d
        for d in path.iterdir()
        if not is_temporary(d.name)
        and d.is_dir()
        # a model save_pretrained wrote counts too (torchtune's epoch_N beside dist_epoch_N)
        and (looks_like_checkpoint(d) or is_hf_model(d) or is_hf_torch_model(d))
    ]
    return sorted((d for d in found if not unfinished_save(d)), key=_step_order)


def unfinished_below(path: Path) -> list[Path]:
    """The checkpoints directly in ``path`` whose save did not finish (``unfinished_save``),
    for messages naming what ``checkpoints_below`` leaves out."""
    try:
        found = [d for d in path.iterdir() if d.is_dir() and unfinished_save(d)]
    except OSError:
        return []
    return sorted(found, key=_step_order)


def unfinished_note(path: Path) -> str:
    """ "; X is a checkpoint whose save did not finish" for each in ``path``, or ""."""
    found = unfinished_below(path)
    if not found:
        return ""
    what = "is a checkpoint whose save" if len(found) == 1 else "are checkpoints whose saves"
    return (
        f"; {' and '.join(map(str, found))} {what} did not finish (no DCP .metadata, or no "
        f"{TRAINER_STATE}), left out"
    )


def unfinished_save(directory: Path) -> bool:
    """Whether ``directory`` is a checkpoint whose save did not finish: a DCP directory, or
    accelerate's ``pytorch_model_fsdp_N``/``optimizer_N`` in it, without the ``.metadata``
    DCP writes last; or a Trainer ``checkpoint-N`` holding ``training_args.bin`` (written with
    the model) but not the ``trainer_state.json`` written after everything else."""

    def dcp_unfinished(d: Path) -> bool:
        return not (d / DCP_METADATA_FILE).is_file() and not any(
            DCP_RANK_METADATA_FILE.match(p.name) for p in d.iterdir()
        )

    try:
        if is_dcp_checkpoint(directory) and dcp_unfinished(directory):
            return True
        for entry in directory.iterdir():
            accelerate = ACCELERATE_MODEL_DIR.match(entry.name) or ACCELERATE_OPTIMIZER_DIR.match(
                entry.name
            )
            if accelerate and entry.is_dir() and dcp_unfinished(entry):
                return True
        return unfinished_trainer_save(directory)
    except OSError:
        return False


def unfinished_trainer_save(directory: Path, siblings_finished: bool = False) -> bool:
    """A Trainer's ``checkpoint-N`` without the ``trainer_state.json`` it writes last: one whose
    ``training_args.bin`` (written with the model) is there, or whose siblings have theirs."""
    if not TRAINER_CHECKPOINT.fullmatch(directory.name) or (directory / TRAINER_STATE).is_file():
        return False
    return siblings_finished or (directory / "training_args.bin").is_file()


def _step_order(path: Path) -> tuple[int, str]:
    """Step directories in step order (checkpoint-9 before checkpoint-10), the rest by name."""
    match = re.search(r"([0-9]+)\Z", path.name)
    return (int(match[1]) if match else -1, path.name)
