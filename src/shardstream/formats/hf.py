"""A Hugging Face model directory (sharded safetensors, index, config, tokenizer): what merge
and the training export write into one (names, dtypes, files, config), and reading one back.

Free of torch, so that inspect and verify of a model directory start fast; ``hf_writer`` writes
the files this module plans."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.dtypes import TORCH_NAME, is_floating, itemsize, parse_dtype
from ..engine.plan import GlobalTensor, dense_block, split_into_files
from ..errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ShardstreamError,
    UnsafeCheckpointError,
    UsageError,
)
from ..storage.commit import is_temporary
from ..units import SHARD_BYTES_TRANSFORMERS_4, SHARD_BYTES_TRANSFORMERS_5
from .hf_names import config_object, has_weight_conversions, strip_wrappers
from .jsondoc import MAX_CONFIG_BYTES, read_object
from .native import is_safe_name
from .regular_file import present
from .safetensors import SafetensorsHeader, read_header

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..engine.plan import GlobalTensor
    from .writer import OutputTensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A model's weights as save_pretrained names them: one file, shards, or an index over them.
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-[0-9]{5}-of-[0-9]{5})?\.(safetensors|bin)")
_WEIGHT_INDEX = re.compile(r"(model\.safetensors|pytorch_model\.bin)\.index\.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".ckpt", ".h5", ".msgpack")
_NOT_CONFIG = {INDEX_FILE, "pytorch_model.bin.index.json", "fsdp_config.json", ".metadata"}
# A training run's own files beside config.json (the Trainer's checkpoint-N, accelerate's
# save_state, verl's and shardstream's runs): state of the run, not of the model.
_NOT_CONFIG |= {
    "trainer_state.json",
    "latest",
    "latest_checkpointed_iteration.txt",
    "manifest.json",
}
# An adapter's config beside a full model's weights (torchtune saves both into epoch_N/):
# copied beside the merged model, it made transformers (with peft installed) load the output
# as an adapter and fail. merge writes its own where it writes an adapter.
_NOT_CONFIG.add("adapter_config.json")
_STATE_SUFFIXES = (".pkl", ".pickle")  # accelerate's random_states_N.pkl, custom objects


def is_weight_file(name: str) -> bool:
    """``model.safetensors``, ``model-00001-of-00002.safetensors`` and their ``pytorch_model``
    ``.bin`` twins: a file of one set of a model's weights."""
    return _WEIGHT_FILE.fullmatch(name) is not None


def is_weight_index(name: str) -> bool:
    return _WEIGHT_INDEX.fullmatch(name) is not None


def default_shard_bytes() -> int:
    """``save_pretrained``'s default ``max_shard_size`` in the installed transformers (read
    from its version, not imported): 50 GB from 5.0, 5 GB before; the newest's without it."""
    from .hf_names_cache import transformers_version

    version = transformers_version()
    major = re.match(r"\d+", version or "")
    if major is not None and int(major[0]) < 5:
        return SHARD_BYTES_TRANSFORMERS_4
    return SHARD_BYTES_TRANSFORMERS_5


def plan_hf_files(
    tensors: Sequence[OutputTensor],
    max_file_bytes: int | None = None,
    storage: Mapping[str, tuple[int, int]] | None = None,
) -> list[tuple[str, list[OutputTensor]]]:
    """File names and contents, as ``save_pretrained`` would split them (at
    ``max_file_bytes``, by default its default).

    ``storage`` (``hf_names.NamePlan.storage``): the tensors that share a storage in
    ``save_pretrained`` (experts split from one fused tensor); huggingface_hub counts a
    storage's bytes once, at its first tensor, and puts its other tensors in that file.

    Inside a file, tensors are laid out by descending element size (stable otherwise), as the
    safetensors library does: every tensor then starts at a multiple of its element size, so
    any aligned byte range of the file (a direct write, a merging rank's share) starts and
    ends on element boundaries.
    """
    if max_file_bytes is None:
        max_file_bytes = default_shard_bytes()
    groups = _split_shared(tensors, max_file_bytes, storage or {})
    if len(groups) <= 1:
        return [(SINGLE_FILE, _by_element_size(tensors))]
    n = len(groups)
    return [
        (f"model-{i + 1:05d}-of-{n:05d}.safetensors", _by_element_size([tensors[j] for j in group]))
        for i, group in enumerate(groups)
    ]


def _split_shared(
    tensors: Sequence[OutputTensor], max_file_bytes: int, storage: Mapping[str, tuple[int, int]]
) -> list[list[int]]:
    """``split_into_files`` over the first tensor of each storage (sized as the storage);
    every other tensor of a storage joins its first tensor's file."""
    firsts: list[int] = []
    sizes: list[int] = []
    leader: dict[int, int] = {}
    followers: dict[int, list[int]] = {}
    for i, tensor in enumerate(tensors):
        shared = storage.get(tensor.name)
        if shared is None:
            size = tensor.nbytes
        elif shared[0] in leader:
            followers.setdefault(leader[shared[0]], []).append(i)
            continue
        else:
            leader[shared[0]] = i
            size = shared[1] * itemsize(tensor.dtype)
        firsts.append(i)
        sizes.append(size)
    return [
        [firsts[j] for j in group] + [f for j in group for f in followers.get(firsts[j], [])]
        for group in split_into_files(sizes, max_file_bytes)
    ]


def _by_element_size(tensors: Sequence[OutputTensor]) -> list[OutputTensor]:
    return sorted(tensors, key=lambda t: -itemsize(t.dtype))


def index_document(
    files: Sequence[tuple[str, Sequence[OutputTensor]]], buffers: Iterable[str] = ()
) -> dict:
    """The index ``save_pretrained`` writes: total parameter count (the elements written but
    ``buffers``, outputs of the model's buffers, as its ``num_parameters()`` counts), total
    bytes, and the weight map, keys sorted."""
    weight_map = {t.name: name for name, tensors in files for t in tensors}
    total = sum(t.nbytes for _, tensors in files for t in tensors)
    left_out = set(buffers)
    count = sum(math.prod(t.shape) for _, ts in files for t in ts if t.name not in left_out)
    return {
        "metadata": {"total_parameters": count, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }


def check_no_links_out(config_dir: Path, root: Path) -> Path:
    """merge copies config files into its output: none may lead out of checkpoint ``root``."""
    base = Path(os.path.realpath(root))
    for path in (config_dir, *config_dir.iterdir()):
        real = Path(os.path.realpath(path))
        if path.is_symlink() and real != base and base not in real.parents:
            raise UnsafeCheckpointError(f"{path}: symlink points outside the checkpoint")
    return config_dir


def config_files(config_dir: Path) -> list[Path]:
    """config.json, generation_config.json, tokenizer and processor files: no weights.
    Subdirectories are not copied; a FIFO or broken link under such a name is refused,
    naming it, rather than left out of the output unsaid."""
    return sorted(
        p
        for p in config_dir.iterdir()
        if not p.name.endswith(_WEIGHT_SUFFIXES + _STATE_SUFFIXES)
        and p.name not in _NOT_CONFIG
        and not is_temporary(p.name)
        and not p.name.startswith(("model_world_size_", "optim_world_size_", "extra_state_"))
        and not p.is_dir()
        and present(p)
    )


def write_configs(
    target: Path,
    out_dtype: str | None,
    source: Path | None = None,
    hf_config: Any = None,
    tokenizer: Any = None,
    architecture: str | None = None,
) -> None:
    """The model's config and tokenizer files in ``target``: copied from ``source``, then
    saved from a transformers config and tokenizer where given; config.json names
    ``out_dtype`` (None: as it was), and ``architecture`` (the model's class) where it names
    none, as ``save_pretrained`` writes it."""
    dtype_name = TORCH_NAME[out_dtype] if out_dtype else None
    copied = copy_config(source, target, dtype_name) if source is not None else []
    if hf_config is not None:
        hf_config.save_pretrained(target)
        _write_generation_config(target, hf_config)
        if dtype_name:
            set_config_dtype(target / "config.json", target / "config.json", dtype_name)
    elif "config.json" in copied and "generation_config.json" not in copied:
        _generation_config_from_file(target, source)
    if architecture and (target / "config.json").is_file():
        config = read_config_file(target / "config.json")
        if not config.get("architectures"):
            config["architectures"] = [architecture]
            _write_config(target / "config.json", config)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)


def one_floating_dtype(dtypes: Iterable[str]) -> str | None:
    """The dtype code every floating one of ``dtypes`` is, if they share one: what
    ``save_pretrained`` names in config.json for a model of one dtype."""
    found = {code for code in dtypes if is_floating(code)}
    return found.pop() if len(found) == 1 else None


def copy_config(config_dir: Path, target: Path, dtype_name: str | None) -> list[str]:
    """Copy config and tokenizer files; record the output dtype in config.json."""
    copied = []
    for path in config_files(config_dir):
        if path.name == "config.json" and dtype_name:
            set_config_dtype(path, target / path.name, dtype_name)
        else:
            shutil.copyfile(path, target / path.name)
        copied.append(path.name)
    return copied


def set_config_dtype(source: Path, target: Path, dtype_name: str) -> None:
    """config.json names the dtype under the key(s) it already uses, else under ``dtype``."""
    config = read_config_file(source)  # written back as it was spelled
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = dtype_name
    _write_config(target, config)


def _write_config(path: Path, config: dict) -> None:
    """config.json as shardstream writes one it edited: sorted keys, two-space indent."""
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_generation_config(target: Path, hf_config: Any) -> None:
    """generation_config.json from the model's config, as ``save_pretrained`` writes it: only
    for a model class that can generate (a critic's ``*ForTokenClassification`` cannot)."""
    if (target / "generation_config.json").exists():
        return
    try:
        from transformers import GenerationConfig
    except ImportError:  # pragma: no cover
        return
    if not _can_generate(hf_config):
        return
    GenerationConfig.from_model_config(hf_config).save_pretrained(target)


def _generation_config_from_file(target: Path, config_dir: Path) -> None:
    """The generation_config.json that ``save_pretrained`` of a model built from
    ``config_dir``'s config.json writes (verl's merger, whose model has no other), when
    transformers is installed and knows the model type; otherwise none, and the log says so."""
    config = read_config(config_dir)
    try:
        hf_config = config_object(config)
    except ImportError:
        reason = "transformers is not installed (pip install transformers)"
    except Exception as exc:  # noqa: BLE001  (any refusal of transformers: its words, one line)
        reason = f"transformers cannot build its config ({type(exc).__name__}: {exc})"[:300]
    else:
        try:
            _write_generation_config(target, hf_config)
            return
        except Exception as exc:  # noqa: BLE001
            reason = f"transformers refused it ({type(exc).__name__}: {exc})"[:300]
    log.warning("%s has no generation_config.json and none was written: %s", config_dir, reason)


def _can_generate(hf_config: Any) -> bool:
    """Whether the class the config names generates; True for one transformers cannot name."""
    from .hf_names import _model_class

    try:
        cls = _model_class(hf_config.to_dict())
    except (ShardstreamError, AttributeError):
        return True
    can = getattr(cls, "can_generate", None)
    return bool(can()) if callable(can) else True


def read_config(config_dir: Path | None) -> dict:
    if config_dir is None or not present(config_dir / "config.json"):
        return {}
    return read_config_file(config_dir / "config.json")


def read_config_file(path: Path) -> dict:
    """A config.json: a JSON object of at most ``MAX_CONFIG_BYTES``, non-finite floats read
    as transformers 4.x wrote them."""
    return read_object(path, "config (JSON object)", nonfinite=True, limit=MAX_CONFIG_BYTES)


TIED_HEAD = "lm_head.weight"
TIED_EMBEDDING_SUFFIX = "embed_tokens.weight"
# verl's merger always writes bfloat16: merging a verl checkpoint whose config.json names no
# dtype does the same, so swapping the tools gives the same files.
VERL_DEFAULT_DTYPE = "bfloat16"


def output_dtype(
    requested: str | None,
    config: dict,
    verl_merges: bool = False,
    config_dir: Path | None = None,
) -> str | None:
    """``--dtype`` if given; else bfloat16 for a checkpoint verl's merger merges
    (``verl_merges``: it casts every floating tensor to bf16, whatever config.json names);
    else the dtype config.json (in ``config_dir``) names, else the stored dtype (None).
    Either must be a floating dtype: it is what the floating weights are cast to. A quantized
    model (config.json's ``quantization_config``: float8 weights beside float32 scales, say)
    keeps every stored dtype unless ``--dtype`` asks: transformers loads its scales as stored."""
    if requested:
        code = parse_dtype(requested)
        if not is_floating(code):
            raise UsageError(
                f"--dtype {requested}: expected a floating dtype "
                "(bfloat16, float16, float32, float64)"
            )
        return code
    named = named_dtype(config, config_dir)
    if verl_merges:
        return parse_dtype(VERL_DEFAULT_DTYPE)
    return None if isinstance(config.get("quantization_config"), dict) else named


def named_dtype(config: dict, config_dir: Path | None = None) -> str | None:
    """The floating dtype config.json names (``dtype``, or ``torch_dtype`` before it), None
    for none or ``auto``; another value is refused, naming the file."""
    named = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(named, str) or named == "auto":
        return None
    try:
        code = parse_dtype(named)
    except UsageError:
        code = None
    if code is None or not is_floating(code):
        where = config_dir / "config.json" if config_dir is not None else "config.json"
        raise CheckpointFormatError(
            f"{where}: dtype {named!r} is not a floating dtype to write the weights in "
            "(bfloat16, float16, float32, float64); pass --dtype"
        )
    return code


def cast_dtype(stored: str, out_dtype: str | None) -> str:
    """The dtype a tensor stored as ``stored`` is written in: floating tensors take the output
    dtype; integer and bool tensors keep theirs."""
    return out_dtype if out_dtype and is_floating(stored) else stored


def tied_duplicates(
    tensors: Sequence[GlobalTensor],
    config: dict,
    force_tie: bool,
    live_config: Any = None,
    reference_ties: bool = False,
) -> set[str]:
    """``lm_head.weight`` (its stored name, wrapper prefixes aside) when the model ties it to
    the input embedding: not written. ``live_config``: the live model's config, where the
    caller has it (the ``hf_model`` export), else ``config`` (config.json) decides.
    ``force_tie`` (``--tie-word-embedding``) answers only where the config cannot: verl's FSDP
    merger ignores the flag, and a head the config unties, dropped, is lost.
    ``reference_ties``: ``shardstream test``'s reference model ties it, so it holds none."""
    names = strip_wrappers([t.name for t in tensors])
    has_embedding = any(n.endswith(TIED_EMBEDDING_SUFFIX) for n in names.values())
    heads = {stored for stored, name in names.items() if name == TIED_HEAD}
    if heads and has_embedding:
        return heads if _tied(config, live_config, force_tie, reference_ties) else set()
    # Other embeddings (GPT-2's transformer.wte, Mamba's backbone.embeddings): the pairs the
    # model class ties, where transformers is installed to say
    from .hf_names_cache import transformers_version

    if transformers_version() is None or not isinstance(config.get("model_type"), str):
        if force_tie and not reference_ties:
            log.warning(
                "--tie-word-embedding ignored: the checkpoint holds no %s beside an "
                "*%s, and no other pair is known to be tied (that takes a config.json naming "
                "the model type, and transformers); every tensor is written",
                TIED_HEAD,
                TIED_EMBEDDING_SUFFIX,
            )
        return set()
    if not _tied(config, live_config, force_tie, reference_ties):
        return set()
    plain = {name: stored for stored, name in names.items()}
    pairs = _class_tied_pairs(config)
    # 4.x's list names a tie's source too (ProphetNet's word_embeddings, the one kept): of
    # it only the head goes here; the names plan leaves out the other aliases, one kept.
    return {
        plain[t]
        for t, s in pairs.items()
        if t in plain and (s in plain if s is not None else t == TIED_HEAD)
    }


def tied_sources(
    head: GlobalTensor, tensors: Sequence[GlobalTensor], drop: Collection[str], config: dict
) -> list[GlobalTensor]:
    """The stored tensors a head left out as tied may be tied to, of those of its shape that
    are written: the embedding the model class pairs it with, else those named
    ``*embed_tokens.weight``, else (an embedding named otherwise, no class to ask) all of
    them. A tied head holds its source's values; one that holds none of these would be lost
    (a head equal to another tensor of its shape, an MLP weight, is not tied to it)."""
    names = strip_wrappers([t.name for t in tensors])
    source = None  # lm_head.weight's is found by name, without asking transformers (seconds)
    if names[head.name] != TIED_HEAD and isinstance(config.get("model_type"), str):
        source = _class_tied_pairs(config).get(names[head.name])
    shape = tuple(head.shape)
    same = [t for t in tensors if t.name not in drop and tuple(t.shape) == shape]
    paired = [t for t in same if names[t.name] == source]
    embeddings = [t for t in same if names[t.name].endswith(TIED_EMBEDDING_SUFFIX)]
    return paired or embeddings or same


def only_copy_of_tied(head: GlobalTensor, tensors: Sequence[GlobalTensor], config: dict) -> bool:
    """Whether ``head`` is the one stored copy of the pair its model class ties: the class
    (the installed transformers') names the embedding it ties the head to, and no stored
    tensor has that name. save_pretrained keeps such a pair under the head's name (BLT's
    class ties ``model.local_encoder.embed_tokens.weight`` to ``lm_head.weight``, which it
    writes alone)."""
    from .hf_names_cache import transformers_version

    if transformers_version() is None or not isinstance(config.get("model_type"), str):
        return False
    names = strip_wrappers([t.name for t in tensors])
    name, pairs = names[head.name], _class_tied_pairs(config)
    # either side of the pair: BLT's class ties its embedding to the head ({embedding: head})
    partner = pairs.get(name) or next((t for t, s in pairs.items() if s == name), None)
    return partner is not None and partner not in set(names.values())


def _tied(config: dict, live_config: Any, force_tie: bool, reference_ties: bool = False) -> bool:
    if reference_ties:
        return True
    if live_config is None and not config:  # no config.json: nothing else says, the flag does
        return force_tie
    try:
        tied = ties_word_embeddings(config, live_config)
    except UsageError:  # undecided without transformers: the flag decides
        if force_tie:
            return True
        raise
    if force_tie and not tied:
        log.warning(
            "--tie-word-embedding ignored: the model's config unties its output head "
            "(tie_word_embeddings false), so lm_head.weight is kept, as verl's FSDP merger "
            "(which takes the flag for Megatron checkpoints only) keeps it"
        )
    return tied


def _class_tied_pairs(config: dict) -> dict[str, str | None]:
    """The model class's tied names (its ``_tied_weights_keys``): transformers 5's
    ``{head: embedding}``, 4.x's list of tied names (embedding None); empty for a class it
    does not know."""
    from .hf_names import _model_class

    try:
        cls = _model_class(config)
    except ShardstreamError:  # architectures and model_type disagree: the names plan says so
        return {}
    keys = getattr(cls, "_tied_weights_keys", None) if cls is not None else None
    if isinstance(keys, dict):
        return {k: v for k, v in keys.items() if isinstance(k, str) and isinstance(v, str)}
    if isinstance(keys, (list, tuple)):
        return {k: None for k in keys if isinstance(k, str)}
    return {}


def ties_word_embeddings(config: dict, live_config: Any = None) -> bool:
    """Whether the model ties its output head to its input embedding, as the installed
    transformers decides when it builds the model (so ``save_pretrained`` writes one tensor).

    transformers 5 reads the top-level ``tie_word_embeddings`` (default False); 4.x reads it
    from the decoder's text config (``get_text_config(decoder=True)``, default True). Their
    ``save_pretrained`` leaves a value out of config.json when it is the class default, so a
    missing key means the class's default: a text model's explicit key is taken as written,
    anything else is resolved through the config class. Without transformers a missing key
    is refused (``UsageError``): only the class knows its default. For a model type the
    installed transformers does not know (remote code), a missing key keeps the head:
    written when tied, it holds the embedding's values; left out of an untied model, it
    would be lost."""
    explicit = config.get("tie_word_embeddings")
    if explicit is not None and not isinstance(explicit, bool):
        raise CheckpointFormatError(
            f"config.json: tie_word_embeddings is {json.dumps(explicit)[:40]}, not true or "
            "false (transformers would not load a model from it)"
        )
    composite = any(isinstance(v, dict) and "model_type" in v for v in config.values())
    if live_config is None and isinstance(explicit, bool) and not composite:
        return explicit
    built = live_config if live_config is not None else _built_config(config)
    if built is None:
        if isinstance(explicit, bool):
            return explicit
        _refuse_undecided_tie(config)
        return False
    if has_weight_conversions():  # transformers 5
        return bool(getattr(built, "tie_word_embeddings", False))
    text = getattr(built, "get_text_config", None)
    decoder = text(decoder=True) if callable(text) else built
    return bool(getattr(decoder, "tie_word_embeddings", True))


def _refuse_undecided_tie(config: dict) -> None:
    """Without transformers, a config.json of a model type that leaves
    ``tie_word_embeddings`` out leaves the head's fate to the class default, which only
    transformers knows (4.x leaves the key out of a tied Gemma's config.json)."""
    from .hf_names_cache import transformers_version

    model_type = config.get("model_type")
    if transformers_version() is not None or not isinstance(model_type, str):
        return
    raise UsageError(
        f"config.json: no 'tie_word_embeddings', so whether save_pretrained writes "
        f"lm_head.weight is the {model_type!r} config class's default, which only transformers "
        'knows: pip install transformers, or add "tie_word_embeddings": true or false to '
        "config.json (--tie-word-embedding also leaves the head out)"
    )


def _built_config(config: dict) -> Any:
    """config.json as the installed transformers' config class builds it; None without
    transformers, for a model type it does not know, or for a config it refuses."""
    from .hf_names_cache import transformers_version

    if transformers_version() is None or not isinstance(config.get("model_type"), str):
        return None
    try:
        return config_object(config)
    except Exception:  # noqa: BLE001 - an unknown or malformed config: config.json decides
        return None


@dataclass(frozen=True)
class HfTensor:
    """A tensor of a HF safetensors model, located by its file offset."""

    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # file offset of the first byte


def whole_tensors(tensors: Sequence[HfTensor]) -> list[GlobalTensor]:
    """Each tensor of a safetensors file as a global tensor of one dense block."""
    return [
        GlobalTensor(t.name, t.dtype, t.shape, (dense_block(t.path, t.offset, t.dtype, t.shape),))
        for t in tensors
    ]


def both_weights_files(directory: Path) -> str | None:
    """The problem of a model directory holding both ``model.safetensors`` and an index, or
    None. Readers disagree on which is the model (transformers loads the single file, vLLM
    the files the index names), so neither is taken. Anything but a regular file under either
    name (a FIFO, a directory, a broken link) is a ``CheckpointFormatError`` naming it."""
    single, index = present(directory / SINGLE_FILE), present(directory / INDEX_FILE)
    if single and index:
        return (
            f"holds both {SINGLE_FILE} and {INDEX_FILE}; transformers would load "
            "the first and vLLM the files the second names, so which is the model is "
            "ambiguous: remove one"
        )
    return None


def read_hf_model(directory: str | os.PathLike) -> tuple[list[HfTensor], dict]:
    """The tensors of a HF safetensors model (single file or sharded) and its config.json.

    ``directory`` may also be a single ``.safetensors`` file. Only headers are read.
    """
    path = Path(directory)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such model directory")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointFormatError(
                f"{path}: expected a HF model directory or a .safetensors file"
            )
        return tensors_of(read_header(path)), read_config(path.parent)
    if not path.is_dir():  # a FIFO, a device
        raise CheckpointFormatError(f"{path}: expected a HF model directory or a .safetensors file")
    config = read_config(path)
    index = path / INDEX_FILE
    single = path / SINGLE_FILE
    both = both_weights_files(path)
    if both:
        raise CheckpointFormatError(f"{path}: {both}")
    if index.is_file():
        return _read_index(path, index), config
    if single.is_file():
        return tensors_of(read_header(single)), config
    others = sorted(p.name for p in path.iterdir() if p.name.endswith((".bin", ".pt", ".pth")))
    if others:
        raise CheckpointFormatError(
            f"{path}: has {others[0]} but no {SINGLE_FILE}, {INDEX_FILE} or "
            "pytorch_model.bin (or its index): no Hugging Face model's weights"
        )
    raise CheckpointNotFoundError(
        f"{path}: no {SINGLE_FILE} or {INDEX_FILE} in the model directory"
    )


def tensors_of(header: SafetensorsHeader) -> list[HfTensor]:
    return [
        HfTensor(e.name, header.path, e.dtype, e.shape, header.data_start + e.begin)
        for e in sorted(header.tensors.values(), key=lambda e: e.begin)
    ]


def is_plain_file_name(name: object) -> bool:
    """Whether an index's ``weight_map`` may name ``name``: a file of the model directory
    itself (no folder), named as a manifest may name one (``native.is_safe_name``: encodes as
    UTF-8, no control character, not "." or "..")."""
    return is_safe_name(name) and "/" not in name


def read_weight_map(index: Path, what: str = "safetensors index") -> dict[str, list[str]]:
    """An index's ``weight_map`` (safetensors' or ``pytorch_model.bin``'s) as file -> the
    tensors it holds; every file a plain name in the model directory, at least one tensor."""
    try:
        weight_map = read_object(index, f"{what} (JSON object)")["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map must map tensor names to file names")
        if not weight_map:
            raise ValueError("weight_map lists no tensor")
    except CheckpointFormatError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"{index}: not a valid {what} ({exc})") from None
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        # no folder, "." or "..", nor a name that names no file (a lone surrogate, a NUL)
        if not is_plain_file_name(file):
            raise UnsafeCheckpointError(
                f"{index}: tensor {name[:300]!r} points at {file[:300]!r}, which is not a plain "
                "file name in the model directory"
            )
        files.setdefault(file, []).append(name)
    return files


def check_index_matches(index: Path, file: Path, listed: list[str], held) -> None:
    """``file`` holds exactly the tensors ``index`` lists for it (``held``: its names).
    Loaders take a file's tensors whatever the index says: a tensor it leaves out (or lists
    in another file, a second copy) would make a merge differ from the model they load."""
    for name in listed:
        if name not in held:
            raise CheckpointFormatError(
                f"{index}: lists tensor {name!r} in {file.name}, but {file.name} has no such tensor"
            )
    unlisted = sorted(set(held) - set(listed))
    if unlisted:
        raise CheckpointFormatError(
            f"{file}: holds tensor {unlisted[0]!r}, which {index.name} does not list for it"
        )


def _read_index(directory: Path, index: Path) -> list[HfTensor]:
    files = read_weight_map(index)
    headers = {file: read_header(directory / file) for file in sorted(files)}  # each readable
    tensors = []
    for file, names in sorted(files.items()):
        header = headers[file]
        check_index_matches(index, directory / file, names, header.tensors)
        tensors.extend(tensors_of(header))
    return tensors
