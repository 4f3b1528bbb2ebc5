"""The names, shapes and slices a HF model directory gives a checkpoint's tensors: what
``save_pretrained`` of the installed transformers writes for the same in-memory state.

Wrapper prefixes (``torch.compile``'s ``_orig_mod.``, FSDP1's ``_fsdp_wrapped_module.``,
activation checkpointing's ``_checkpoint_wrapped_module.``, DDP's leading ``module.``) are
stripped first. Then transformers' own save-time conversion for the model is applied:

* transformers 5 (``core_model_loading.revert_weight_conversion``): the function itself runs
  on meta tensors that are views into one meta storage, with ``contiguous()`` kept a view.
  Every output that comes back as a view of one stored tensor is a rename (the whole tensor)
  or a box of it (an expert of a fused MoE weight, half of a gate_up projection); anything
  it computes otherwise (a concatenation, a transpose) is refused, naming the tensor.
* transformers 4 (the model class's ``_checkpoint_conversion_mapping``): the renames
  ``save_pretrained`` applies when it reverses that mapping.

The model is built from config.json only once config.json is plausible for the checkpoint:
its layer counts and the parameters the model registers are bounded by the stored tensors,
and every stored tensor the model holds must have the model's shape; anything else is
refused, naming config.json or the tensor.

A model type known to need no mapping (``NO_MAPPING_MODEL_TYPES``, checked against
transformers 4.57 and 5.25) is written under its stripped names without asking transformers,
unless a newer transformers is installed. Without transformers any other model type is
refused, naming it and ``pip install transformers``. torch and transformers are imported only
when a config names a model type the table does not decide, and the plan is not in the
on-disk cache of plans transformers computed before (``hf_names_cache``); that import and the
trace run with the cyclic garbage collector paused (``engine.memory.imports_collector_held``);
under the ``shardstream`` command, in a forked child (``PLAN_APART``), so that the command's own
process never holds transformers' modules.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import signal
import threading
import traceback
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..engine.plan import Block, GlobalTensor, check_blocks_tile
from ..errors import CheckpointFormatError, ShardstreamError, UsageError

WRAPPER_PARTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
DDP_PREFIX = "module."

# Model types whose causal-LM, token/sequence-classification classes have no save-time
# conversion in transformers 4.57 nor 5.25: written under their stripped names even without
# transformers installed. Every other model type needs transformers to be decided.
NO_MAPPING_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "starcoder2", "olmo2"}
)
TABLE_CHECKED_UP_TO = (5, 25)  # the newest transformers (major, minor) the table was checked on
# How the names of those classes (and their base models) start, checked against every class
# of them in both versions; a checkpoint with any other name (a training wrapper's
# "model.model.layers.0...", torchtitan's "tok_embeddings", "layers.0.attention.wq") is asked
# of transformers, which refuses names the model does not hold.
TABLE_NAMES = re.compile(
    r"(?:model\.)?(?:embed_tokens|norm|layers\.\d+\.(?:self_attn|mlp|input_layernorm"
    r"|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm))\."
    r"|(?:lm_head|score|classifier)\."
)

# Building the meta model stops once it has registered more parameters than this many per
# stored tensor, plus the slack: a model matches its checkpoint about one to one.
PARAMETERS_PER_STORED_TENSOR = 8
PARAMETERS_SLACK = 4096
LAYER_COUNT = re.compile(r"num_\w*layers")  # num_hidden_layers, num_mtp_layers, ...

# Set by the ``shardstream`` command (one process, none of a training run's threads): a layout
# transformers must plan is planned in a forked child (``_planned_apart``).
PLAN_APART = False


@dataclass(frozen=True, slots=True)
class Piece:
    """One output tensor: the box ``start``/``extent`` of stored tensor ``stored``, whose
    output dim k is stored dim ``dims[k]`` (None: an added size-1 dim)."""

    name: str
    stored: str
    start: tuple[int, ...]
    extent: tuple[int, ...]
    dims: tuple[int | None, ...]
    shape: tuple[int, ...]
    # The tensor save_pretrained's conversion leaves this one a view of (an index, counted
    # from 0, and its element count); -1: its own. huggingface_hub's shard split counts a
    # storage once, at its first tensor, and puts the storage's other tensors in that file.
    storage: int = -1
    storage_numel: int = 0
    stored_shape: tuple[int, ...] = ()  # the stored tensor's: a box from 0 may be a part

    @property
    def whole(self) -> bool:
        """The whole stored tensor as it is: a rename at most."""
        return (
            self.extent == self.stored_shape
            and not any(self.start)
            and self.dims == tuple(range(len(self.extent)))
            and self.shape == self.extent
        )


@dataclass(frozen=True)
class NamePlan:
    """Every output tensor in the order ``save_pretrained`` holds them, and the rule used."""

    pieces: tuple[Piece, ...]
    rule: str
    kept_names: bool = False
    stripped: dict[str, str] | None = None  # stored -> without wrapper prefixes
    # Parts of the model (``visual``, ``lm_head``: ``parameter_group``) save_pretrained writes
    # of which the checkpoint holds nothing; known where transformers built the model
    missing: tuple[str, ...] = ()
    # Outputs save_pretrained writes from the model's persistent buffers (DeepSeek-V3's
    # e_score_correction_bias): its index's total_parameters (num_parameters()) leaves them out
    buffers: tuple[str, ...] = ()
    # Of the heads config.json ties (``plan_names``'s ``tied``), the stored names of those the
    # model holds apart all the same, which save_pretrained writes: planned like the others
    untied: tuple[str, ...] = ()
    # Stored tensors left out as aliases of a written one, (left out, written) by stored name:
    # the model answers to both with one parameter (BLIP-2's language_model.lm_head.weight
    # and its embedding), so a loaded model takes the written one's values for both
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def renamed(self) -> int:
        """Whole tensors whose name the mapping changes (wrapper prefixes aside)."""
        plain = self.stripped or {}
        return sum(p.whole and p.name != plain.get(p.stored, p.stored) for p in self.pieces)

    def storage(self) -> dict[str, tuple[int, int]]:
        """Output name -> (storage index, its element count), for ``hf.plan_hf_files``."""
        return {p.name: (p.storage, p.storage_numel) for p in self.pieces if p.storage >= 0}

    @property
    def sliced(self) -> int:
        return sum(not p.whole for p in self.pieces)

    def describe(self) -> str:
        """One line for merge's summary and inspect."""
        if self.kept_names:
            return f"{self.rule}: in-memory names written on purpose"
        changes = []
        if self.renamed:
            changes.append(f"{self.renamed} renamed")
        if self.sliced:
            stored = len({p.stored for p in self.pieces if not p.whole})
            changes.append(f"{stored} fused tensors split into {self.sliced}")
        return f"{self.rule} ({', '.join(changes) or 'nothing renamed or split'})"


@dataclass(frozen=True)
class Traced:
    """What transformers planned for the stored tensors (``_with_transformers``): the pieces
    and rule, and ``NamePlan``'s ``missing``, ``buffers`` and ``aliases`` (by stripped names)."""

    pieces: tuple[Piece, ...]
    rule: str
    missing: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    version: str = ""  # the transformers that planned it

    @classmethod
    def from_json(cls, doc: dict) -> Traced:
        """The inverse of ``dataclasses.asdict`` after a JSON round trip (lists for tuples)."""
        pieces = tuple(
            Piece(**{k: tuple(v) if type(v) is list else v for k, v in p.items()})
            for p in doc["pieces"]
        )
        aliases = tuple((left, kept) for left, kept in doc["aliases"])
        return cls(
            pieces,
            doc["rule"],
            tuple(doc["missing"]),
            tuple(doc["buffers"]),
            aliases,
            doc["version"],
        )


def stored_view(
    plan: NamePlan,
    saved: Mapping[str, GlobalTensor],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, GlobalTensor]:
    """The stored (in-memory) tensors of ``shapes`` as blocks of the ``saved`` tensors that
    ``plan`` names (a model saved in the layout save_pretrained writes, read back into the
    model's own names): each output's blocks placed in its box of the stored tensor. A stored
    tensor whose pieces are not all saved, or saved in different dtypes, is left out (the
    restore then names it missing); a piece saved in another shape is refused."""
    pieces: dict[str, list[Piece]] = {}
    for piece in plan.pieces:
        pieces.setdefault(piece.stored, []).append(piece)
    out = {}
    for stored, parts in pieces.items():
        if stored not in shapes or any(p.name not in saved for p in parts):
            continue
        for p in parts:
            if tuple(saved[p.name].shape) != tuple(p.shape):
                raise CheckpointFormatError(
                    f"tensor {p.name!r}: shape {list(saved[p.name].shape)} in the saved "
                    f"model, but {list(p.shape)} in the layout of the model's {stored!r}: "
                    "saved from another model"
                )
        dtypes = {saved[p.name].dtype for p in parts}
        if len(dtypes) != 1:
            continue
        blocks = [_placed(b, p) for p in parts for b in saved[p.name].blocks]
        shape = tuple(shapes[stored])
        check_blocks_tile(stored, shape, blocks)
        out[stored] = GlobalTensor(stored, dtypes.pop(), shape, tuple(blocks))
    return out


def _placed(block: Block, piece: Piece) -> Block:
    """``block`` of output ``piece.name`` as a block of the stored tensor: output dim k is
    stored dim ``piece.dims[k]``; a stored dim the output lacks has extent 1 there."""
    rank = len(piece.extent)
    start, shape, strides = list(piece.start), [1] * rank, [0] * rank
    for k, dim in enumerate(piece.dims):
        if dim is None:
            continue
        start[dim] += block.start[k]
        shape[dim] = block.shape[k]
        strides[dim] = block.strides[k]
    where = (block.location, block.offset, block.dtype)
    return Block(*where, tuple(start), tuple(shape), tuple(strides))


def without_wrapper_parts(name: str) -> str:
    """``name`` without the wrapper modules' parts (``WRAPPER_PARTS``), wherever they are."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def strip_wrappers(names: Sequence[str]) -> dict[str, str]:
    """Stored name -> name without wrapper prefixes; two names that become one are refused.
    DDP's ``module.`` goes when every name starts with it once the other parts are gone:
    ``torch.compile(DDP(model))`` saves ``_orig_mod.module.*``."""
    bare = [without_wrapper_parts(n) for n in names]
    drop_module = bool(bare) and all(b.startswith(DDP_PREFIX) for b in bare)
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name, stripped in zip(names, bare):
        if drop_module:
            stripped = stripped[len(DDP_PREFIX) :]
        if stripped in seen:
            raise CheckpointFormatError(
                f"tensors {seen[stripped]!r} and {name!r} both become {stripped!r} once wrapper "
                f"prefixes ({', '.join(WRAPPER_PARTS)} and a leading {DDP_PREFIX}) are stripped"
            )
        seen[stripped] = name
        out[name] = stripped
    return out


def plan_names(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]],
    config: dict,
    keep_names: bool = False,
    config_path: str = "config.json",
    model_order: bool = False,
    tied: Sequence[tuple[str, str, tuple[int, ...]]] = (),
) -> NamePlan:
    """The output tensors for stored tensors ``(name, dtype code, shape)`` of the model that
    ``config`` (config.json's content) describes. ``keep_names``: the stored names as they are.
    ``config_path``: where config.json is, for the messages that refuse it. ``model_order``:
    the tensors are not listed in the model's order (an HF directory's files list them by
    name) and the order matters (the output is split into files): ask the model for it even
    where no mapping is needed. ``tied``: stored heads config.json ties to the input embedding
    (``hf.tied_duplicates``), left out unless the model transformers builds holds one apart
    (``NamePlan.untied``: BigBirdPegasus's causal LM under transformers 5 ties none)."""
    if keep_names:
        return NamePlan(tuple(_whole(n, n, s) for n, _, s in tensors), "--keep-names", True)
    # The export plans every save alike: the model class is built once per layout.
    described = json.dumps(config, sort_keys=True, default=str)
    listed = tuple((n, d, tuple(s)) for n, d, s in tensors)
    key = (listed, described, model_order, tuple((n, d, tuple(s)) for n, d, s in tied))
    if key not in _PLANS:
        if len(_PLANS) >= 4:
            _PLANS.pop(next(iter(_PLANS)))
        try:
            _PLANS[key] = _plan_names(listed, config, model_order, key[3])
        except CheckpointFormatError as exc:  # messages about it start "config.json"
            text = str(exc)
            if not text.startswith("config.json") or config_path == "config.json":
                raise
            said = config_path + text.removeprefix("config.json")
            if isinstance(exc, errors.NamesUnderPrefixError):
                raise errors.NamesUnderPrefixError(said, exc.prefix) from None
            raise CheckpointFormatError(said) from None
    return _PLANS[key]


_PLANS: dict[tuple, NamePlan] = {}


def plan_checkpoint_names(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]],
    config: dict,
    keep_names: bool = False,
    config_path: str = "config.json",
    model_order: bool = False,
    tied: Sequence[tuple[str, str, tuple[int, ...]]] = (),
) -> NamePlan:
    """``plan_names`` for a whole checkpoint's tensors, which config.json must describe
    (``check_config_agrees``): what merge, shardstream test, the export and inspect plan by."""
    plan = plan_names(tensors, config, keep_names, config_path, model_order, tied)
    plain = plan.stripped or {}
    written = [*tensors, *(t for t in tied if t[0] in plan.untied)]
    check_config_agrees([(plain.get(n, n), s) for n, _, s in written], config, config_path)
    if plan.missing and not keep_names:
        more = f" and {len(plan.missing) - 4} more" if len(plan.missing) > 4 else ""
        shown = ", ".join(plan.missing[:4]) + more
        why = native_names_hint([n for n, _, _ in tensors]) or (
            "saved without it: frozen parameters left out, as ignore_frozen_params=True does?"
        )
        raise CheckpointFormatError(
            f"the checkpoint holds nothing of {shown}, which the model {config_path} describes "
            f"holds ({why}); a model loaded from the output would start it at random "
            "(--hf_model_path names the config of the model the checkpoint holds)"
        )
    return plan


# The PyTorch-native libraries' own names of their Llama/Qwen models, at the top level, which
# only their converters map to Hugging Face's (Llama's q and k permuted besides): torchtitan's
# tok_embeddings, layers.N.attention[.qkv_linear].wq..wo, feed_forward.w1..w3; torchtune's
# layers.N.attn.q_proj..output_proj, mlp.w1..w3, sa_norm/mlp_norm/norm.scale.
TORCHTITAN_NAMES = re.compile(
    r"tok_embeddings\.weight|layers\.\d+\.(?:attention(?:\.qkv_linear)?\.w[qkvo]"
    r"|feed_forward\.w[123])\.weight"
)
TORCHTUNE_NAMES = re.compile(
    r"layers\.\d+\.(?:attn\.(?:[qkv]|output)_proj\.weight|mlp\.w[123]\.weight"
    r"|(?:sa|mlp)_norm\.scale)|norm\.scale"
)


def native_names_hint(names: Sequence[str]) -> str:
    """Why a checkpoint in torchtitan's or torchtune's own names is not a Hugging Face model's,
    and what gives one; "" for other names."""
    for library, pattern, converter in (
        ("torchtune", TORCHTUNE_NAMES, "its FullModelHFCheckpointer"),
        ("torchtitan", TORCHTITAN_NAMES, "checkpoint.last_save_in_hf"),
    ):
        if found := next((n for n in names if pattern.fullmatch(n)), None):
            return (
                f"the checkpoint's names are {library}'s own ({found!r}), which only "
                f"{library}'s converter maps to Hugging Face's (save with {converter}), or "
                "merge without a config.json, or with --keep-names, for the names as they are"
            )
    return ""


def check_config_agrees(
    tensors: Sequence[tuple[str, Sequence[int]]], config: dict, config_path: str = "config.json"
) -> None:
    """config.json describes the stored tensors ``(name, shape)`` of a whole checkpoint: its
    depth (``check_stored_layers``) and its embedding (``check_stored_embedding``)."""
    check_stored_layers([name for name, _ in tensors], config, config_path)
    check_stored_embedding(tensors, config, config_path)
    check_table_widths(tensors, config, config_path)
    check_whole_table_layers([name for name, _ in tensors], config)


def _table_decides(model_type: str) -> bool:
    """Whether ``NO_MAPPING_MODEL_TYPES`` answers for ``model_type`` with the transformers
    installed: none, or a version no newer than the newest the table was checked against.
    Reading the version imports nothing, so a dense merge skips transformers' import (seconds
    and ~100 MiB); a newer transformers is asked, since it may have added a conversion."""
    if model_type not in NO_MAPPING_MODEL_TYPES:
        return False
    from .hf_names_cache import transformers_version

    installed = transformers_version()
    if installed is None:
        return True
    numbers = re.findall(r"\d+", installed)[:2]
    return tuple(int(n) for n in numbers) <= TABLE_CHECKED_UP_TO


def _plan_names(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]],
    config: dict,
    model_order: bool = False,
    tied: Sequence[tuple[str, str, tuple[int, ...]]] = (),
) -> NamePlan:
    stripped = strip_wrappers([n for n, _, _ in (*tensors, *tied)])
    rule = "wrapper prefixes stripped" if any(k != v for k, v in stripped.items()) else ""
    plain = [(stripped[n], d, tuple(s)) for n, d, s in tensors]
    plain_tied = [(stripped[n], d, tuple(s)) for n, d, s in tied]
    back = {v: k for k, v in stripped.items()}
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if config and not model_type:  # said, not refused: a config.json of another tool's
        why = "config.json names no model_type, so transformers loads no model from the output"
        return _identity(plain, back, _join(rule, f"{why}: no mapping"))
    if not model_type:
        return _identity(
            plain, back, _join(rule, "no config.json, or no model type in it: no mapping")
        )
    if not isinstance(model_type, str):
        raise CheckpointFormatError(
            f"config.json: 'model_type' is {str(model_type)[:200]}, not a model type's name"
        )
    from . import hf_names_cache

    # the table's classes tie every head their config ties
    decided = _table_decides(model_type) and all(TABLE_NAMES.match(n) for n, _, _ in plain)
    if decided and not (model_order and hf_names_cache.transformers_version()):
        # without transformers the input's order stands: save_pretrained's is the model's
        unordered = "; files split in the input's order (transformers knows the model's)"
        why = f"{model_type}: needs no mapping" + (unordered if model_order else "")
        return _identity(plain, back, _join(rule, why))
    tied_names = {n for n, _, _ in tied}
    cached = hf_names_cache.load(tensors, config, tied)
    if cached is not None:  # computed by this transformers before: not imported now
        found, pieces, missing, buffers, aliases = cached
        return NamePlan(
            tuple(Piece(**p) for p in pieces),
            found,
            False,
            stripped,
            tuple(missing),
            tuple(buffers),
            tuple(sorted({p["stored"] for p in pieces} & tied_names)),
            tuple((left, kept) for left, kept in aliases),
        )
    # the child is for the import; without transformers the refusal is said here
    apart = PLAN_APART and hasattr(os, "fork") and hf_names_cache.transformers_version()
    plan_by = _planned_apart if apart else _with_transformers
    traced = plan_by(plain, config, model_type, plain_tied)
    pieces = tuple(dataclasses.replace(p, stored=back[p.stored]) for p in traced.pieces)
    aliases = tuple((back[left], back[kept]) for left, kept in traced.aliases)
    described = _join(rule, f"transformers {traced.version} {traced.rule}")
    untied = tuple(sorted({p.stored for p in pieces} & tied_names))
    missing, buffers = traced.missing, traced.buffers
    plan = NamePlan(pieces, described, False, stripped, missing, buffers, untied, aliases)
    hf_names_cache.store(tensors, config, plan.rule, pieces, missing, buffers, tied, aliases)
    return plan


def _with_transformers(plain, config: dict, model_type: str, tied=()) -> Traced:
    """The plan for stored tensors ``plain`` (wrapper prefixes stripped), as the installed
    transformers saves them; with the heads of ``tied`` the model holds apart
    (``_heads_held_apart``)."""
    from ..engine.memory import imports_collector_held  # here: it imports numpy

    with imports_collector_held():
        try:
            import transformers
        except ImportError:
            raise UsageError(
                f"model type {model_type!r}: the layout save_pretrained writes for it may differ "
                "from the in-memory names, and only transformers can tell: pip install "
                "transformers (or merge with --keep-names to write the in-memory names)"
            ) from None
        trace = _trace_v5 if has_weight_conversions() else _renames_v4
        traced = trace(plain, config, tied)
    return dataclasses.replace(traced, version=transformers.__version__)


def _planned_apart(plain, config: dict, model_type: str, tied=()):
    """``_with_transformers`` in a forked child process, its result sent back as JSON: this
    process never imports transformers, whose modules (~115 MiB) would stay resident through
    the copy. Only where ``PLAN_APART`` is set (the ``shardstream`` command)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of the readahead thread left behind
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            try:
                traced = _with_transformers(plain, config, model_type, tied)
                result = {"plan": dataclasses.asdict(traced)}
            except ShardstreamError as exc:
                result = {"error": type(exc).__name__, "message": str(exc)}
                result["prefix"] = getattr(exc, "prefix", None)
            with os.fdopen(write_end, "w") as out:
                json.dump(result, out)
            code = 0
        except KeyboardInterrupt:
            pass
        except BaseException:  # noqa: BLE001  (a bug: its traceback, then the parent says so)
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as got:
            text = got.read()
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status != 0 or not text:
        how = f"exit code {status}" if status >= 0 else f"signal {-status}"
        raise ShardstreamError(
            f"model type {model_type!r}: the process planning the save_pretrained layout "
            f"failed ({how}: killed, out of memory, or an error whose report precedes this)"
        )
    result = json.loads(text)
    if "error" in result:
        kind = getattr(errors, result["error"], None)
        if not (isinstance(kind, type) and issubclass(kind, ShardstreamError)):
            kind = ShardstreamError
        if kind is errors.NamesUnderPrefixError:
            raise kind(result["message"], result.get("prefix") or "")
        raise kind(result["message"])
    return Traced.from_json(result["plan"])


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _whole(name: str, stored: str, shape: Sequence[int]) -> Piece:
    shape = tuple(shape)
    dims = tuple(range(len(shape)))
    return Piece(name, stored, (0,) * len(shape), shape, dims, shape, stored_shape=shape)


def _identity(plain, back: dict[str, str], rule: str) -> NamePlan:
    pieces = tuple(_whole(n, back[n], s) for n, _, s in plain)
    return NamePlan(pieces, rule, False, {v: k for k, v in back.items()})


def has_weight_conversions() -> bool:
    """Whether the installed transformers has transformers 5's save-time rules (weight
    conversions, the tied head read from the top-level config), not 4.x's."""
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401
    except ImportError:
        return False
    return True


def config_object(config: dict) -> Any:
    """config.json as the installed transformers' config class for its ``model_type`` builds
    it, quietly (its warnings about the config are not ours). Raises what transformers
    raises for a type it does not know or a config it rejects."""
    cls = config_class_of(config)
    if cls is None:
        raise KeyError(config.get("model_type"))
    with transformers_quiet():
        return cls.from_dict(_special_floats(dict(config)))


def config_class_of(config: dict) -> type | None:
    """The installed transformers' config class for config.json: its ``model_type``'s, else
    (a type name the class writes but the mapping spells otherwise: 4.57's ``lfm2-vl``) the
    ``config_class`` of the model class ``architectures[0]`` names; None if neither."""
    import transformers
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    names = config.get("architectures")
    first = names[0] if isinstance(names, list) and names else None
    cls = getattr(transformers, first, None) if isinstance(first, str) else None
    own = getattr(cls, "config_class", None) if isinstance(cls, type) else None
    if isinstance(own, type) and getattr(own, "model_type", None) == model_type:
        return own
    return None


_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_floats(value: Any) -> Any:
    """transformers 5 writes a non-finite float into config.json as ``{"__float__":
    "Infinity"}`` (Mamba2's ``time_step_limit``) and reads it back as the float: so here."""
    if isinstance(value, dict):
        tag = value.get("__float__") if len(value) == 1 else None
        if isinstance(tag, str) and tag in _FLOAT_TAGS:
            return _FLOAT_TAGS[tag]
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


class _LargerThanStored(Exception):
    """Raised inside the model's constructor by the registration count."""


def _meta_model(config: dict, tensors: Sequence[tuple[str, str, tuple[int, ...]]]) -> Any:
    """The model class config.json's ``architectures`` names, built on the meta device.
    ``tensors``: the checkpoint's (name, dtype, shape); a model that registers far more
    parameters than it holds tensors (a config.json of 10**7 layers beside a small
    checkpoint), or more experts than any of them could hold, is refused as soon as it does,
    not built for hours."""
    import torch
    from torch.nn.modules.module import register_module_parameter_registration_hook

    model_type = config["model_type"]
    if config_class_of(config) is None:
        return None
    stored = len(tensors)
    limit = PARAMETERS_PER_STORED_TENSOR * stored + PARAMETERS_SLACK
    _check_layer_counts(config, limit, stored)
    # every expert is a stored tensor or a row of one (a fused tensor's first dimension)
    widest = max((max(shape, default=1) for _, _, shape in tensors), default=0)
    _check_expert_counts(config, max(stored, widest) + PARAMETERS_SLACK)
    try:
        hf_config = config_object(config)
    except Exception as exc:  # noqa: BLE001  (any config class may reject any field)
        raise CheckpointFormatError(
            f"config.json: transformers' {model_type!r} config rejects it ({_one_line(exc)})"
        ) from None
    cls = _model_class(config, type(hf_config))
    if cls is None:
        return None
    planner, registered = threading.get_ident(), 0

    def count(module, name, param):
        nonlocal registered
        if threading.get_ident() == planner:  # the export plans beside a training thread
            registered += 1
            if registered > limit:
                raise _LargerThanStored

    handle = register_module_parameter_registration_hook(count)
    try:
        with transformers_quiet(), torch.device("meta"):
            return cls(hf_config)
    except _LargerThanStored:
        raise CheckpointFormatError(
            f"config.json describes a larger model than the checkpoint: building {cls.__name__} "
            f"from it registered over {limit:,} parameters, and the checkpoint holds {stored:,} "
            "tensors (check num_hidden_layers and the other sizes there; --keep-names writes "
            "the in-memory names without building the model)"
        ) from None
    except Exception as exc:  # noqa: BLE001  (any model code may fail on meta)
        raise CheckpointFormatError(
            f"config.json: cannot build {cls.__name__} (model type {model_type!r}) from it to "
            f"learn the layout save_pretrained writes ({_one_line(exc)}); merge with "
            "--keep-names to write the in-memory names"
        ) from None
    finally:
        handle.remove()


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' logger at ERROR for the block, then as it was."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` for a one-line message: its type and text, whitespace runs made one space."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _check_shapes(model: Any, plain) -> None:
    """Every stored tensor the model also holds has the model's shape: a fused expert tensor
    of another size would otherwise be split into tensors no model of config.json loads."""
    held = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, _, shape in plain:
        want = held.get(name)
        if want is not None and tuple(shape) != want:
            raise CheckpointFormatError(
                f"tensor {name!r}: shape {list(shape)} in the checkpoint, but "
                f"{type(model).__name__} built from config.json holds {list(want)}: the "
                "checkpoint and config.json describe different models"
            )


def _check_layer_counts(config: dict, limit: int, stored: int) -> None:
    """Refuse a layer count (``num_hidden_layers`` and the like, in sub-configs too) beyond
    ``limit``, the bound on the parameters of ``stored`` tensors: config classes build lists
    as long as it (10**8 layers: minutes and gigabytes before any model exists)."""
    if over := _count_over(config, LAYER_COUNT, limit):
        raise CheckpointFormatError(
            f"config.json describes a larger model than the checkpoint: {over[0]} is "
            f"{over[1]:,}, and the checkpoint holds {stored:,} tensors"
        )


def _count_over(config: dict, key: re.Pattern, limit: int, where: str = "") -> tuple | None:
    """The first ``(dotted key, value)`` of config.json (sub-configs too, 8 deep) whose key
    ``key`` matches and whose integer value exceeds ``limit``; None if none does."""
    for name, value in config.items():
        if isinstance(value, dict) and where.count(".") < 8:
            if found := _count_over(value, key, limit, f"{where}{name}."):
                return found
        elif key.fullmatch(str(name)) and type(value) is int and value > limit:
            return f"{where}{name}", value
    return None


# How many experts each MoE layer has (mixtral's, qwen3_moe's, deepseek_v3's, ...); not the
# experts per token or the shared ones
EXPERT_COUNT = re.compile(r"(num_|n_|moe_num_)(local_|routed_)?experts")


def _check_expert_counts(config: dict, limit: int) -> None:
    """Refuse an expert count (``num_experts`` and the like, in sub-configs too) beyond
    ``limit``: transformers' conversion names every expert of every layer (10**5 experts
    beside a dense checkpoint: a gigabyte of names before the mismatch is seen)."""
    if over := _count_over(config, EXPERT_COUNT, limit):
        raise CheckpointFormatError(
            f"config.json describes a larger model than the checkpoint: {over[0]} is "
            f"{over[1]:,}, more experts than any of its tensors could hold"
        )


# Decoder layers of a language model, in-memory or saved: (as messages show them, their name
# pattern, the config sections their count is looked up in, first first). Vision towers and
# other stacks are not checked.
STORED_LAYERS = (
    ("model.layers.N", re.compile(r"model\.layers\.(\d+)\."), ("", "text_config")),
    (
        "model.language_model.layers.N",
        re.compile(r"model\.language_model\.layers\.(\d+)\."),
        ("text_config", ""),
    ),
)
EXTRA_LAYERS = re.compile(r"num_(nextn_predict|mtp)\w*layers")  # stored past the count


def check_stored_layers(
    names: Sequence[str], config: dict, config_path: str = "config.json"
) -> None:
    """The decoder layers among a whole checkpoint's tensor ``names`` are layers 0..N-1 for
    config.json's ``num_hidden_layers`` N (or N plus its multi-token-prediction layers): a
    config.json of another depth would be copied beside weights no model of it loads, or
    that it drops."""
    if not isinstance(config, dict):
        return
    for where, pattern, places in STORED_LAYERS:
        stored = {int(m[1]) for n in names if (m := pattern.match(n))}
        if not stored:
            continue
        sections = [config.get(p) if p else config for p in places]
        sections = [s for s in sections if isinstance(s, dict)]
        count = next(
            (s["num_hidden_layers"] for s in sections if type(s.get("num_hidden_layers")) is int),
            None,
        )
        if count is None:
            continue
        extra = {
            v
            for s in sections
            for k, v in s.items()
            if EXTRA_LAYERS.fullmatch(str(k)) and type(v) is int
        }
        # num_layers where a model counts its decoder layers so beside sublayers (4.57's
        # LongcatFlash: num_hidden_layers 4, two per layer)
        counts = {count} | {s["num_layers"] for s in sections if type(s.get("num_layers")) is int}
        if min(stored) == 0 and any(
            max(stored) + 1 == len(stored) == n + e for n in counts for e in {0, *extra}
        ):
            continue
        raise CheckpointFormatError(
            f"{config_path}: num_hidden_layers is {count}, but the checkpoint holds "
            f"{where} for N in {_ranges(sorted(stored))}: the checkpoint and "
            "config.json describe different models (--hf_model_path names the model's own)"
        )


TABLE_LAYER = re.compile(r"((?:model\.)?layers\.)(\d+)\.(.+)")


# The weights every decoder layer of the table's types holds (the same in transformers 4.57
# and 5.25, read from their classes on the meta device); biases: ``TABLE_BIASES``, and
# Starcoder2's layer norms', which it always holds.
_LLAMA_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
)  # fmt: skip
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_FEEDFORWARD_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
TABLE_LAYER_WEIGHTS: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_LAYER,
    "mistral": _LLAMA_LAYER,
    "qwen2": _LLAMA_LAYER,
    "gemma": _LLAMA_LAYER,
    "qwen3": (*_LLAMA_LAYER, *_QK_NORMS),
    "gemma2": (*_LLAMA_LAYER, *_FEEDFORWARD_NORMS),
    "olmo2": (*_LLAMA_LAYER[1:], *_QK_NORMS, _FEEDFORWARD_NORMS[1]),
    "phi3": (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
        "self_attn.qkv_proj.weight",
        "self_attn.o_proj.weight",
    ),  # fmt: skip
    "starcoder2": (
        "input_layernorm.weight",
        "input_layernorm.bias",
        "post_attention_layernorm.weight",
        "post_attention_layernorm.bias",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
        *_LLAMA_LAYER[5:],
    ),  # fmt: skip
}


def table_layer_tensors(model_type: str, config: dict) -> set[str]:
    """What every decoder layer of ``model_type`` built from ``config`` holds, by name under
    the layer: ``TABLE_LAYER_WEIGHTS`` and the biases ``TABLE_BIASES`` gives."""
    weights = TABLE_LAYER_WEIGHTS[model_type]
    modules = [w.removesuffix(".weight") for w in weights if w.endswith(".weight")]
    biases = {f"{m}.bias" for m in modules if table_bias_allowed(model_type, config, m)}
    return {*weights, *biases}


def check_whole_table_layers(names: Sequence[str], config: dict) -> None:
    """For a model type of ``NO_MAPPING_MODEL_TYPES`` (planned without building the model),
    whose decoder layers all hold the same weights: every layer holds what any other does;
    and where the names are the table's classes' own, what the model's layers hold
    (``table_layer_tensors``; unless the weights are quantized, under other names), a stated
    untied head, and the decoder's final norm. A weight missing from a layer would be written
    missing, and a model loaded from the output would start it at random."""
    if not isinstance(config, dict) or config.get("model_type") not in NO_MAPPING_MODEL_TYPES:
        return
    layers: dict[int, set[str]] = {}
    head = ""
    for name in names:
        if m := TABLE_LAYER.fullmatch(name):
            head = m[1]
            layers.setdefault(int(m[2]), set()).add(m[3])
    if not layers:
        return
    every = set().union(*layers.values())
    for index in sorted(layers):
        if missing := sorted(every - layers[index]):
            holding = sum(missing[0] in held for held in layers.values())
            raise CheckpointFormatError(
                f"the checkpoint holds no {head}{index}.{missing[0]} ({len(missing)} weight(s) "
                f"of layer {index} missing), which {holding} of its {len(layers)} layers hold: "
                "damaged or partly saved; a model loaded from the output would start it at "
                "random"
            )
    model_type = config["model_type"]
    # the table's classes' names only (torchtitan's attention.wq, torchtune's norm.scale are
    # refused by name elsewhere)
    if not all(TABLE_NAMES.match(f"model.layers.0.{name}") for name in every):
        return
    if config.get("quantization_config") is None:
        if missing := sorted(table_layer_tensors(model_type, config) - every):
            first = min(layers)
            raise CheckpointFormatError(
                f"the checkpoint holds no {head}{first}.{missing[0]} in any of its "
                f"{len(layers)} layers ({len(missing)} weight(s) missing from each: "
                f"{', '.join(missing[:4])}{', ...' * (len(missing) > 4)}), which every "
                f"{model_type} decoder layer holds: saved without them (frozen parameters left "
                "out?) or damaged; a model loaded from the output would start them at random"
            )
    architectures = config.get("architectures")
    causal = isinstance(architectures, list) and architectures
    causal = causal and all(isinstance(a, str) and a.endswith("ForCausalLM") for a in causal)
    untied = config.get("tie_word_embeddings") is False  # as stated: a default asks transformers
    # a critic's score head stands for it (verl saves its critic with the actor's config.json)
    other = any(n.split(".", 1)[0] in OTHER_HEADS for n in names)
    if head == DECODER_LAYERS and causal and untied and HEAD not in names and not other:
        raise CheckpointFormatError(
            f"the checkpoint holds no {HEAD}, which {architectures[0]} holds apart from its "
            "input embedding (config.json: tie_word_embeddings false): damaged, partly saved, "
            "or config.json is not the run's (a tied model's); a model loaded from the output "
            "would start it at random"
        )
    norm = head.removesuffix("layers.") + "norm.weight"
    if norm not in names:
        raise CheckpointFormatError(
            f"the checkpoint holds the decoder's layers but not its final norm {norm}: damaged "
            "or partly saved; a model loaded from the output would start it at random"
        )


EMBEDDING = "model.embed_tokens.weight"  # a decoder's input embedding, [vocab_size, hidden_size]
HEAD = "lm_head.weight"  # its output head, beside it
# Heads a checkpoint may hold in place of the config's (verl saves its critic's ``score`` beside
# the actor's CausalLM config.json): the first name of those of the table's classes
OTHER_HEADS = ("score", "classifier")
DECODER_LAYERS = "model.layers."  # the decoder layers of the same layout (Llama, Qwen, Mistral)
# Model types whose decoder (*ForCausalLM) holds its input embedding as EMBEDDING and its head
# as HEAD, under DECODER_LAYERS, in memory and saved: checked against transformers 5.25's
# classes on the meta device. Other model types name them otherwise (ModernBERT's
# model.embeddings.tok_embeddings, InternLM2's model.tok_embeddings and output).
EMBED_TOKENS_MODEL_TYPES = frozenset(
    {
        *NO_MAPPING_MODEL_TYPES,
        *("apertus", "arcee", "bitnet", "cohere", "deepseek_v2", "deepseek_v3", "ernie4_5"),
        *("ernie4_5_moe", "exaone4", "falcon_h1", "gemma3_text", "glm", "glm4", "glm4_moe"),
        *("gpt_oss", "granite", "granitemoe", "helium", "hunyuan_v1_dense", "jamba"),
        *("llama4_text", "minimax", "mixtral", "nemotron", "olmo", "olmoe", "persimmon", "phi"),
        *("qwen2_moe", "qwen3_moe", "qwen3_next", "seed_oss", "smollm3", "stablelm"),
    }
)


def check_stored_embedding(
    tensors: Sequence[tuple[str, Sequence[int]]], config: dict, config_path: str = "config.json"
) -> None:
    """A decoder checkpoint holds its input embedding (and its untied head), which
    ``ignore_frozen_params=True`` leaves out when they were frozen: a model loaded from the
    output would start them at random. For the model types of ``EMBED_TOKENS_MODEL_TYPES``,
    by name: ``model.embed_tokens.weight`` (or a PEFT module wrapping it), and ``lm_head.weight``
    for an untied ``*ForCausalLM`` unless another head (a critic's ``score``) is stored; for
    others, some stored tensor has a dimension of ``vocab_size``. A stored
    ``model.embed_tokens.weight`` of those types is [vocab_size, hidden_size] as config.json says,
    where it says both: a config.json of another vocabulary or width would be copied beside
    weights no model built from it loads."""
    if not isinstance(config, dict):
        return
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    if type(vocab) is not int or type(hidden) is not int:
        return
    names = set()
    known = config.get("model_type") in EMBED_TOKENS_MODEL_TYPES  # others: the built model's
    for name, shape in tensors:
        names.add(name)
        if known and name == EMBEDDING and tuple(shape) != (vocab, hidden):
            raise CheckpointFormatError(
                f"{config_path}: vocab_size {vocab} and hidden_size {hidden}, but the "
                f"checkpoint's {name} is {list(shape)}: the checkpoint and config.json "
                "describe different models (--hf_model_path names the model's own)"
            )
    if not any(name.startswith(DECODER_LAYERS) for name in names):
        return  # not a decoder of the layout these names belong to
    if config.get("model_type") not in EMBED_TOKENS_MODEL_TYPES:
        if vocab > 1 and not any(vocab in tuple(shape) for _, shape in tensors):
            _refuse_missing(f"tensor of vocab_size {vocab} rows (its input embedding)", config_path)
        return
    architectures = config.get("architectures")
    causal = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures
    )
    if not _holds_module(names, EMBEDDING):
        _refuse_missing(EMBEDDING, config_path)
    if causal and config.get("tie_word_embeddings") is False and not _holds_module(names, HEAD):
        if not any(name.split(".", 1)[0] in OTHER_HEADS for name in names):  # nor a critic's
            _refuse_missing(HEAD, config_path)


# The widths a decoder layer's weights of NO_MAPPING_MODEL_TYPES have, by config.json's fields:
# name suffix -> (rows, columns), each the product of the fields named ("2" a factor).
TABLE_WIDTHS = {
    "self_attn.q_proj.weight": (("num_attention_heads", "head_dim"), ("hidden_size",)),
    "self_attn.k_proj.weight": (("num_key_value_heads", "head_dim"), ("hidden_size",)),
    "self_attn.v_proj.weight": (("num_key_value_heads", "head_dim"), ("hidden_size",)),
    "self_attn.o_proj.weight": (("hidden_size",), ("num_attention_heads", "head_dim")),
    "mlp.gate_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "mlp.up_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "mlp.down_proj.weight": (("hidden_size",), ("intermediate_size",)),
    "mlp.gate_up_proj.weight": (("2", "intermediate_size"), ("hidden_size",)),  # phi3
    "mlp.c_fc.weight": (("intermediate_size",), ("hidden_size",)),  # starcoder2
    "mlp.c_proj.weight": (("hidden_size",), ("intermediate_size",)),
}
CLASSIFIERS = ("ForTokenClassification", "ForSequenceClassification")
# config.json's sizes for the table's types: positive integers wherever it states them
TABLE_SIZES = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "num_hidden_layers", "vocab_size", "head_dim",
)  # fmt: skip
# The biases their classes hold in a decoder layer (checked against 4.57 and 5.25): model type
# -> (config.json's switch, None: always; its default; the modules it gives a bias)
_ATTENTION = r"self_attn\.[qkvo]_proj"
TABLE_BIASES: dict[str, tuple[tuple[str | None, bool, str], ...]] = {
    "llama": (("attention_bias", False, _ATTENTION), ("mlp_bias", False, r"mlp\.\w+_proj")),
    "mistral": (),
    "phi3": (),
    "qwen2": ((None, True, r"self_attn\.[qkv]_proj"),),
    "qwen3": (("attention_bias", False, _ATTENTION),),
    "gemma": (("attention_bias", False, _ATTENTION),),
    "gemma2": (("attention_bias", False, _ATTENTION),),
    "olmo2": (("attention_bias", False, _ATTENTION),),
    "starcoder2": (("use_bias", True, rf"{_ATTENTION}|mlp\.c_(?:fc|proj)"),),
}
LAYER_BIAS = re.compile(r"model\.layers\.\d+\.((?:self_attn|mlp)\.\w+)\.bias")


def table_bias_allowed(model_type: str, config: dict, module: str) -> bool:
    """Whether a decoder layer of ``model_type`` built from ``config`` holds ``module``'s bias
    (``module``: ``self_attn.q_proj``, ``mlp.c_fc``; ``TABLE_BIASES``)."""
    return any(
        (switch is None or bool(config.get(switch, default))) and re.fullmatch(modules, module)
        for switch, default, modules in TABLE_BIASES.get(model_type, ())
    )


# Weights of width hidden_size in every class of the table (norms; starcoder2's carry a bias)
TABLE_HIDDEN = re.compile(
    r"model\.(?:norm|layers\.\d+\.(?:input_layernorm|post_attention_layernorm"
    r"|pre_feedforward_layernorm|post_feedforward_layernorm))\.(?:weight|bias)"
)


def _check_table_shapes(
    tensors: Sequence[tuple[str, Sequence[int]]], fields: dict[str, int], config_path: str
) -> None:
    """What holds without the fields config.json leaves out: a layer's weight of
    ``TABLE_WIDTHS`` is a matrix and its bias a vector of its rows; the key and value
    projections have as many rows per key-value head as the query per attention head; the
    norms are hidden_size wide, the head [vocab_size, hidden_size]."""
    shapes = {name: tuple(shape) for name, shape in tensors}

    def refuse(name: str, why: str) -> None:
        raise CheckpointFormatError(
            f"{config_path}: {why}, but the checkpoint's {name} is {list(shapes[name])}: the "
            "checkpoint and config.json describe different models (--hf_model_path names the "
            "model's own)"
        )

    hidden, vocab = fields.get("hidden_size"), fields.get("vocab_size")
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    for name, shape in shapes.items():
        match = re.fullmatch(r"(model\.layers\.\d+\.)(.+)\.(weight|bias)", name)
        if match and f"{match[2]}.weight" in TABLE_WIDTHS:
            weight = shapes.get(f"{match[1]}{match[2]}.weight")
            if match[3] == "weight" and len(shape) != 2:
                refuse(name, "its model type holds this weight as a matrix")
            if match[3] == "bias" and weight is not None and shape != weight[:1]:
                refuse(name, f"its weight is {list(weight)}, so its bias would be [{weight[0]}]")
            if match[2] == "self_attn.q_proj" and heads and kv_heads and len(shape) == 2:
                for kv in ("k_proj", "v_proj"):
                    other = shapes.get(f"{match[1]}self_attn.{kv}.weight")
                    if other and other[0] * heads != shape[0] * kv_heads:
                        rows = shape[0] * kv_heads // heads
                        refuse(
                            f"{match[1]}self_attn.{kv}.weight",
                            f"num_attention_heads {heads} and num_key_value_heads {kv_heads} "
                            f"with {name} of {shape[0]} rows, so {kv} would have {rows} rows",
                        )
        elif hidden and TABLE_HIDDEN.fullmatch(name) and shape != (hidden,):
            refuse(name, f"hidden_size {hidden}, so it would be [{hidden}]")
        elif name == HEAD and hidden and vocab and shape != (vocab, hidden):
            refuse(name, f"vocab_size {vocab} and hidden_size {hidden}, so it would be "
                   f"[{vocab}, {hidden}]")  # fmt: skip


def check_table_widths(
    tensors: Sequence[tuple[str, Sequence[int]]], config: dict, config_path: str = "config.json"
) -> None:
    """For a model type of ``NO_MAPPING_MODEL_TYPES`` (planned without building the model):
    its decoder layers' weights have the widths config.json gives (``TABLE_WIDTHS``), and a
    classifier it names (a critic's ``*ForTokenClassification``) has its ``score`` head
    stored: another config.json would be copied beside weights no model built from it loads,
    or whose head it starts at random."""
    if not isinstance(config, dict) or config.get("model_type") not in NO_MAPPING_MODEL_TYPES:
        return
    for field in TABLE_SIZES:
        value = config.get(field)
        if value is not None and (type(value) is not int or value <= 0):
            raise CheckpointFormatError(
                f"{config_path}: {field} is {str(value)[:40]}, not a positive integer "
                "(transformers would not load a model from it)"
            )
    model_type = config["model_type"]
    for name, _ in tensors:
        bias = LAYER_BIAS.fullmatch(name)
        if bias and not table_bias_allowed(model_type, config, bias.group(1)):
            switches = [
                f"{s} {json.dumps(config[s])}" if s in config else f"{s} unset ({str(d).lower()})"
                for s, d, _ in TABLE_BIASES[model_type]
                if s is not None
            ]
            said = f" ({', '.join(switches)})" if switches else ""
            raise CheckpointFormatError(
                f"{config_path}: a {model_type} model{said} holds no {name}, which the "
                "checkpoint stores: the checkpoint and config.json describe different models "
                "(a model loaded from the output would leave it out; --hf_model_path names the "
                "model's own)"
            )
    if config.get("quantization_config") is not None:  # packed weights: not these widths
        return
    # Only what config.json states: a field it leaves out takes its class's default (Qwen3's
    # head_dim 128, Mistral's 8 key-value heads), which only transformers knows.
    fields = {k: v for k, v in config.items() if type(v) is int and v > 0}
    fields["2"] = 2
    _check_table_shapes(tensors, fields, config_path)
    for name, shape in tensors:
        match = re.fullmatch(r"model\.layers\.\d+\.(.+)", name)
        wanted = TABLE_WIDTHS.get(match.group(1)) if match else None
        if wanted is None or not all(f in fields for f in sum(wanted, ())):
            continue
        rows, cols = (math.prod(fields[f] for f in dim) for dim in wanted)
        if tuple(shape) != (rows, cols):
            said = ", ".join(f"{f} {fields[f]}" for f in dict.fromkeys(sum(wanted, ())) if f != "2")
            raise CheckpointFormatError(
                f"{config_path}: {said}, so {name} would be [{rows}, {cols}], but the "
                f"checkpoint's is {list(shape)}: the checkpoint and config.json describe "
                "different models (--hf_model_path names the model's own)"
            )
    architectures = config.get("architectures")
    listed = architectures if isinstance(architectures, list) else []
    named = [a for a in listed if isinstance(a, str)]
    names = [name for name, _ in tensors]
    if named and all(a.endswith(CLASSIFIERS) for a in named):
        heads = ("score.", "classifier.")  # classifier: Phi3's, under transformers 4
        if any(n.startswith(DECODER_LAYERS) for n in names) and not any(
            n.startswith(heads) for n in names
        ):
            raise CheckpointFormatError(
                f"{config_path}: describes {named[0]}, whose score head the checkpoint does not "
                "hold (a causal LM's checkpoint, an actor's?): a model loaded from the output "
                "would start it at random (--hf_model_path names the model's own config)"
            )


def _holds_module(names: set[str], weight: str) -> bool:
    """``weight`` is stored, or the weight of a module wrapping its module is (PEFT's
    ``base_layer``, ``modules_to_save``, ``token_adapter``)."""
    module = weight.removesuffix(".weight") + "."
    return weight in names or any(n.startswith(module) and n.endswith(".weight") for n in names)


def _refuse_missing(what: str, config_path: str) -> None:
    raise CheckpointFormatError(
        f"the checkpoint holds no {what}, which the model {config_path} describes needs "
        "(saved without it: frozen parameters left out, as ignore_frozen_params=True does?); "
        "a model loaded from the output would start it at random"
    )


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:6])
    return text + (", ..." if len(runs) > 6 else "")


# Where a config.json names no architecture: the auto classes verl and trainers build from.
_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForVision2Seq",
    "AutoModel",
)


def _model_class(config: dict, config_class: type | None = None) -> type | None:
    """config.json's ``architectures[0]`` when transformers has a concrete model class of that
    name (not a ``*PreTrainedModel`` base) for config.json's model type, else the first auto
    class that maps its config. A class of another model type is refused: the weights are
    one model's, and its rules and the type's would disagree."""
    import transformers

    names = config.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointFormatError(
            f"config.json: 'architectures' is {str(names)[:200]}, not a list of class names"
        )
    if config_class is None:
        config_class = config_class_of(config)
    cls = getattr(transformers, names[0], None) if names else None
    if (
        isinstance(cls, type)
        and issubclass(cls, transformers.PreTrainedModel)
        and isinstance(own := getattr(cls, "config_class", None), type)
        and not cls.__name__.endswith("PreTrainedModel")
    ):
        if (
            config_class is not None
            and not (issubclass(config_class, own) or issubclass(own, config_class))
            and cls not in _auto_classes_of(config_class)  # transformers' own alias (EXAONE)
        ):
            raise CheckpointFormatError(
                f"config.json: architectures names {names[0]}, a model of type "
                f"{getattr(own, 'model_type', '?')!r}, but model_type is "
                f"{config.get('model_type')!r}: they describe different models"
            )
        return cls
    if config_class is None:
        return None
    autos = _AUTO_CLASSES
    if isinstance(config.get("vision_config"), dict):  # a VLM: its image-text class first
        autos = (_AUTO_CLASSES[1], _AUTO_CLASSES[2], _AUTO_CLASSES[0], *_AUTO_CLASSES[3:])
    for auto in autos:
        mapping = getattr(getattr(transformers, auto, None), "_model_mapping", None)
        try:
            return mapping[config_class]
        except (KeyError, TypeError):
            continue
    return None


def _auto_classes_of(config_class: type) -> list[type]:
    """The model classes transformers' auto classes build for ``config_class``: another model
    type's class at times (``exaone`` is built as ``LlamaForCausalLM``)."""
    import transformers

    found = []
    for auto in _AUTO_CLASSES:
        mapping = getattr(getattr(transformers, auto, None), "_model_mapping", None)
        try:
            found.append(mapping[config_class])
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return found


def _trace_v5(plain, config: dict, tied=()) -> Traced:
    """transformers 5: run ``revert_weight_conversion`` on meta views of one storage and read
    back where each output lies in the stored tensors; and the model's parts the output
    holds nothing of (``_missing_parts``). ``tied``: as ``_with_transformers``'s."""
    import torch
    from torch.overrides import TorchFunctionMode
    from transformers.core_model_loading import revert_weight_conversion

    from ..engine.dtypes import TORCH_BY_CODE

    model = _meta_model(config, [*plain, *tied])
    if model is None:
        unknown = "does not know this model: no mapping"
        return Traced(tuple(_whole(n, n, s) for n, _, s in plain), unknown)
    plain = [*plain, *_heads_held_apart(model, plain, tied)]
    saved = _saved_layout_held(model, plain, revert_weight_conversion)
    if saved is not None:  # a save_pretrained directory already: written as it is
        rule, missing, order = saved
        at = {name: i for i, name in enumerate(order)}  # save_pretrained's order, for the split
        ordered = sorted(plain, key=lambda t: at[t[0]])
        shared = _storage_of_outputs(model, revert_weight_conversion)
        pieces = [
            dataclasses.replace(_whole(n, n, s), storage=shared[n][0], storage_numel=shared[n][1])
            for n, _, s in ordered
        ]
        held = model.state_dict()
        try:  # the names save_pretrained gives the buffers
            with torch.inference_mode():
                named = revert_weight_conversion(model, {n: held[n] for n in _buffers(model)})
        except Exception:  # noqa: BLE001  (any model's rules, on its own meta buffers)
            named = {}
        stored = {n for n, _, _ in plain}
        return Traced(tuple(pieces), rule, missing, tuple(sorted(n for n in named if n in stored)))
    holder = _holding_the_tensors(model, config, plain)
    if holder is not model:
        model = holder
        plain = [*plain, *_heads_held_apart(model, plain, tied)]
    # In the model's own order, as save_pretrained converts and splits its state dict: a
    # checkpoint's files (an HF directory's, sorted by name) may list them otherwise.
    plain = _in_model_order(plain, model, {})
    what = f"save_pretrained layout of {type(model).__name__}"
    _check_shapes(model, plain)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    aliases = _aliases_left_out(model, [t[0] for t in plain])
    ignored |= set(aliases)
    plain = [t for t in plain if t[0] not in ignored]  # save_pretrained leaves them out

    class KeepViews(TorchFunctionMode):
        """``contiguous()`` answers the view itself, so that a slice stays a view."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.contiguous:
                return args[0]
            return func(*args, **(kwargs or {}))

    starts, fakes, offset = [], {}, 0
    # Each stored tensor gets the slots its contiguous strides span (a zero-size dim counts
    # as 1, as torch strides it), so that even a view of no element points into its own.
    total = sum(_span(s) for _, _, s in plain)
    bases = {}
    # Inference mode: views without autograd's record of their base, half the memory of one
    # (a model of 10**5 experts makes that many); a view is told by its storage instead.
    with torch.inference_mode():
        for name, dtype, shape in plain:
            code = TORCH_BY_CODE[dtype]
            if code not in bases:
                bases[code] = torch.empty(total, dtype=code, device="meta")
            fakes[name] = bases[code][offset : offset + math.prod(shape)].view(shape)
            starts.append(offset)
            offset += _span(shape)
    base_storages = {_storage_id(b) for b in bases.values()}
    try:
        with KeepViews(), torch.inference_mode():
            out = revert_weight_conversion(model, dict(fakes))
    except Exception as exc:  # noqa: BLE001  (names the model's rules do not expect)
        raise CheckpointFormatError(
            f"{what}: transformers' save-time conversion fails on the stored names "
            f"({_one_line(exc)}); rules: {_converter_of(model)}. Merge with "
            "--keep-names to write the in-memory names"
        ) from None
    pieces = []
    for name, view in out.items():
        index = bisect.bisect_right(starts, view.storage_offset()) - 1
        stored, dtype, shape = plain[index]
        if (
            _storage_id(view) not in base_storages
            or view.dtype != fakes[stored].dtype
            or (piece := _as_box(name, stored, shape, view, starts[index])) is None
        ):
            raise CheckpointFormatError(
                f"tensor {name!r}: {what} computes it from the stored tensors (transformers "
                f"{_converter_of(model)}), not a rename or a slice of one; shardstream "
                "writes only those. Merge with --keep-names to write the in-memory names"
            )
        pieces.append(piece)
    del out, fakes, bases, view  # a meta tensor a piece: freed before the next conversion
    pieces = _with_storage(pieces, model, plain, revert_weight_conversion)
    missing = _missing_parts(model, pieces, [*plain, *tied], ignored, revert_weight_conversion)
    stored_buffers = _buffers(model)
    return Traced(
        tuple(pieces),
        what,
        missing,
        tuple(sorted(p.name for p in pieces if p.stored in stored_buffers)),
        tuple(sorted(aliases.items())),
    )


def parameter_group(name: str) -> str:
    """The part of a model a saved tensor belongs to: its first name, or its first two under
    ``model.`` (``visual``, ``lm_head``, ``model.layers``, ``model.embed_tokens``)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "model" and len(parts) > 2 else parts[0]


def _missing_parts(
    model: Any, pieces: list[Piece], plain, ignored: set[str], revert
) -> tuple[str, ...]:
    """What ``save_pretrained`` writes of ``model``'s parameters (tied ones once) that the
    output lacks: the parts (``parameter_group``, as ``visual.*``) no output piece belongs to
    (a frozen vision tower or head ``ignore_frozen_params=True`` left out), then by name the
    tensors missing from the parts it holds (every layer's frozen ``q_proj``). Only the
    parameters the checkpoint does not store are converted (a model of 10**5 experts stores
    them all). A head-like part (not under ``model.``) is not counted when the checkpoint
    stores a head of ``OTHER_HEADS`` the model does not have (verl saves its critic's
    ``score`` with the actor's config). ``plain``: the stored tensors, with the heads left
    out as tied. () where the conversion fails: no check, rather than a refusal the model's
    rules do not make."""
    stored = {name for name, _, _ in plain}
    params = dict(model.named_parameters())  # tied parameters once
    # a tied parameter stored under another of its names (BLT's embedding as lm_head) is held
    held = {i for i, names in _names_by_parameter(model).items() if stored.intersection(names)}
    unstored = {n: p for n, p in params.items() if id(p) not in held and n not in ignored}
    if not unstored:
        return ()
    try:
        saved = list(revert(model, unstored))
    except Exception:  # noqa: BLE001  (any model's rules, on its own meta parameters)
        return ()
    lacking = _lacking(saved, {p.name for p in pieces})
    if any(n not in params and n.split(".", 1)[0] in OTHER_HEADS for n in stored):
        lacking = tuple(part for part in lacking if part.split(".")[0] == "model")
    return lacking


def _lacking(saved: Iterable[str], written: set[str], spared: Collection[str] = ()) -> tuple:
    """Of the names ``saved`` (what save_pretrained writes), what ``written`` lacks: the parts
    (``parameter_group``, as ``visual.*``) none of ``written`` belongs to, then by name the
    others missing from the parts it holds, but ``spared``."""
    saved = set(saved)
    parts = {parameter_group(n) for n in saved} - {parameter_group(n) for n in written}
    lost = saved - written - set(spared)
    lost = {n for n in lost if parameter_group(n) not in parts}
    return (*sorted(f"{part}.*" for part in parts), *sorted(lost))


def _aliases_left_out(model: Any, names: Sequence[str]) -> dict[str, str]:
    """The stored names ``save_pretrained`` leaves out as aliases, each with a stored name of
    its group that is written: of each group of names one parameter of the built model
    answers to (T5's ``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight`` are
    its ``shared.weight``), those the model's ``_tied_weights_keys`` patterns match, in
    sorted order, but the last match of a group that all match (transformers'
    ``remove_tied_weights_from_state_dict``). ``lm_head.weight`` is left to
    ``hf.tied_duplicates``, which also follows ``--tie-word-embedding`` and the live config."""
    from .hf import TIED_HEAD

    groups = _names_by_parameter(model)
    patterns = []
    for prefix, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None) or ()
        patterns += [f"{prefix}.{k}" if prefix else k for k in keys if isinstance(k, str)]
    stored = set(names)
    dropped = {}
    for group in groups.values():
        held = sorted(n for n in group if n in stored)
        matched = [n for n in held if any(re.search(p, n) for p in patterns)]
        left = [n for n in matched[: len(held) - 1] if n != TIED_HEAD]
        written = [n for n in held if n not in left]
        dropped |= {n: next((k for k in written if k != TIED_HEAD), written[0]) for n in left}
    return dropped


def _heads_held_apart(model: Any, plain, tied) -> list:
    """The heads of ``tied`` (config.json ties them) that ``model``, built from that config,
    holds as parameters of their own, shared with no other name: the class ties none
    (transformers 5 ties only what ``_tied_weights_keys`` names), so save_pretrained writes
    them. One the model does not hold under its name stays left out, as the config says."""
    if not tied:
        return []
    held = {n for n, _, _ in plain}
    alone = {names[0] for names in _names_by_parameter(model).values() if len(names) == 1}
    return [t for t in tied if t[0] not in held and t[0] in alone]


def _names_by_parameter(model: Any) -> dict[int, list[str]]:
    """Each parameter of ``model`` (by id) with every name it answers to (a tied one several)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return groups


def _saved_layout_held(model: Any, plain, revert) -> tuple[str, tuple[str, ...], list[str]] | None:
    """(rule, missing parts and tensors, the layout's names in its order) where the stored
    tensors are
    not all ``model``'s in-memory names but are all, names and shapes, in the layout
    ``save_pretrained`` writes it in (PaliGemma's or Gemma 3's own files:
    ``language_model.model.*`` for ``model.language_model.*``; or Kimi-K2.5's, whose
    renumbered ``norm1`` is an in-memory name too); None otherwise. The missing parts are
    those of that layout the checkpoint holds nothing of, then the tensors of that layout
    missing from the parts it holds."""
    import torch

    held = model.state_dict()
    if not plain or all(name in held for name, _, _ in plain):
        return None
    try:
        with torch.inference_mode():
            layout = revert(model, dict(held))  # persistent buffers and tied names too
            needed = revert(model, dict(model.named_parameters()))  # tied ones once
    except Exception:  # noqa: BLE001  (any model's rules, on its own meta parameters)
        return None
    if any(tuple(layout[n].shape) != tuple(s) if n in layout else True for n, _, s in plain):
        return None
    # by name, but for tied parameters, saved under whichever of their names (BLT's lm_head)
    tied = {n for group in _names_by_parameter(model).values() if len(group) > 1 for n in group}
    rule = f"save_pretrained layout of {type(model).__name__}, which the checkpoint is in"
    return rule, _lacking(needed, {n for n, _, _ in plain}, tied), list(layout)


def _holding_the_tensors(model: Any, config: dict, plain) -> Any:
    """``model``, or where it holds none of the stored tensors (config.json's architectures
    names the backbone, ``Qwen2_5_VLModel``, of a checkpoint of the model around it), the
    model transformers' auto classes build for config.json when that one holds some; else a
    refusal: no rule of a model that holds none of the tensors can name them."""
    held = model.state_dict().keys()
    if not plain or any(name in held for name, _, _ in plain):
        return model
    named = type(model).__name__
    if config.get("architectures"):
        other = _meta_model({**config, "architectures": []}, plain)
        if other is not None and any(name in other.state_dict() for name, _, _ in plain):
            return other
    under = _common_prefix([name for name, _, _ in plain], held)
    if under:
        raise errors.NamesUnderPrefixError(
            f"config.json: {named}, the model it describes, holds none of the checkpoint's "
            f"tensors, but every name starts with {under!r} and without it is the model's own "
            f"(e.g. {plain[0][0]!r}): saved from a module that holds the model as its "
            f"{under[:-1]!r} attribute (a training wrapper, such as a Lightning module). Read "
            f"the model under it with --prefix {under!r}, or merge with --keep-names to write "
            "the names as they are",
            under,
        )
    if native := native_names_hint([n for n, _, _ in plain]):
        raise CheckpointFormatError(
            f"config.json: {named}, the model it describes, holds none of the checkpoint's "
            f"tensors: {native}"
        )
    raise CheckpointFormatError(
        f"config.json: {named}, the model it describes, holds none of the checkpoint's tensors "
        f"(e.g. {plain[0][0]!r}; it holds {next(iter(held), 'none')!r}): they describe "
        "different models. Fix 'architectures' there, or merge with --keep-names to write "
        "the in-memory names"
    )


def _common_prefix(names: list[str], held) -> str:
    """The first name component every one of ``names`` starts with, if every name without it
    is one of ``held``; else ""."""
    first = names[0].split(".", 1)[0] + "." if names and "." in names[0] else ""
    if not first or not all(n.startswith(first) and n[len(first) :] in held for n in names):
        return ""
    return first


def _with_storage(pieces: list[Piece], model, plain, revert) -> list[Piece]:
    """Which outputs share a storage in a real ``save_pretrained``: ``revert`` again, on
    separate meta tensors and with ``contiguous()`` copying as it does there; outputs that
    are views of one tensor (a stored one, or a copy the conversion made) share its storage."""
    import torch

    from ..engine.dtypes import TORCH_BY_CODE

    with torch.inference_mode():
        fresh = {n: torch.empty(s, dtype=TORCH_BY_CODE[d], device="meta") for n, d, s in plain}
        out = revert(model, fresh)
    if list(out) != [p.name for p in pieces]:
        raise CheckpointFormatError(
            f"save_pretrained layout of {type(model).__name__}: transformers' conversion names "
            "the tensors differently on a second run; merge with --keep-names"
        )
    groups = _storage_groups(out)
    return [
        dataclasses.replace(
            piece, storage=groups[piece.name][0], storage_numel=groups[piece.name][1]
        )
        for piece in pieces
    ]


def _storage_groups(out: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """For each output of a conversion: (index of its storage, the storage's element count);
    outputs that are views of one tensor share one (a fused tensor's experts)."""
    roots: dict[int, tuple[int, int]] = {}
    groups = {}
    for name, tensor in out.items():
        numel = tensor.untyped_storage().nbytes() // tensor.element_size()
        groups[name] = roots.setdefault(_storage_id(tensor), (len(roots), numel))
    return groups


def _buffers(model: Any) -> set[str]:
    """The names of ``model``'s persistent buffers in its state dict: saved, but not counted
    in save_pretrained's ``total_parameters`` (``num_parameters()``)."""
    held = model.state_dict().keys()
    return {name for name, _ in model.named_buffers() if name in held}


def _storage_of_outputs(model: Any, revert) -> dict[str, tuple[int, int]]:
    """For each name save_pretrained writes of ``model``: (storage index, its element count),
    outputs of one storage (a fused tensor's experts) sharing one, as ``_with_storage``
    tells them; its shard split keeps them in one file."""
    import torch

    with torch.inference_mode():
        fresh = {n: torch.empty_like(t, device="meta") for n, t in model.state_dict().items()}
        return _storage_groups(revert(model, fresh))


def _storage_id(tensor: Any) -> int:
    """Which storage ``tensor`` lies in: the same for every view of one tensor."""
    return tensor.untyped_storage()._cdata


def _span(shape: Sequence[int]) -> int:
    return math.prod(max(n, 1) for n in shape)


def _as_box(name: str, stored: str, shape, view, base_offset: int) -> Piece | None:
    """The box of stored tensor ``stored`` (``shape``) that meta ``view`` is, or None."""
    if tuple(view.shape) == tuple(shape) and math.prod(shape) == 0:
        return _whole(name, stored, shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    empty = math.prod(view.shape) == 0  # no element tells where it lies, and none is copied
    if empty:
        start = [0] * len(shape)
    else:
        flat = view.storage_offset() - base_offset
        start = [flat // stride % size for size, stride in zip(shape, strides)]
    extent = [1] * len(shape)
    dims: list[int | None] = []
    nxt = 0
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            dims.append(None)
            continue
        fits = [j for j in range(nxt, len(shape)) if start[j] + size <= shape[j]]
        if empty:  # strides say nothing then: the first stored dim of that size, in order
            j = next((j for j in fits if shape[j] == size), None)
        else:
            j = next((j for j in fits if strides[j] == stride), None)
        if j is None:
            return None
        dims.append(j)
        extent[j] = size
        nxt = j + 1
    # An output size-1 dim maps to a stored dim when the stored tensor has one there.
    for k, d in enumerate(dims):
        if d is None:
            dims[k] = next((j for j in range(len(shape)) if shape[j] == 1 and j not in dims), None)
    piece = Piece(
        name, stored, tuple(start), tuple(extent), tuple(dims), tuple(view.shape),
        stored_shape=tuple(shape),
    )  # fmt: skip
    return _whole(name, stored, shape) if piece.whole else piece


def _converter_of(model: Any) -> str:
    """The conversion rules of ``model`` (for messages)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    rules = get_model_conversion_mapping(model, add_legacy=False)
    return "; ".join(repr(r) for r in rules) or "no rule"


def _in_model_order(plain, model: Any, mapping: dict[str, str]) -> list:
    """``plain`` in ``model``'s state-dict order, as save_pretrained writes and splits it: a
    stored name by its own place, or by the in-memory name ``mapping`` (checkpoint pattern ->
    in-memory name, 4.x's ``_checkpoint_conversion_mapping``) gives it; unknown ones last."""
    at = {name: i for i, name in enumerate(model.state_dict())}

    def place(name: str) -> int:
        if name in at:
            return at[name]
        for pattern, replacement in mapping.items():
            new, count = re.subn(pattern, replacement, name)
            if count:
                return at.get(new, len(at))
        return len(at)

    return sorted(plain, key=lambda t: place(t[0]))


def _renames_v4(plain, config: dict, tied=()) -> Traced:
    """transformers 4: ``save_pretrained`` reverses the class's ``_checkpoint_conversion_mapping``
    (in-memory pattern -> checkpoint name): the first pattern that matches a name renames it,
    its capture groups dropped from the replacement. ``tied``: as ``_with_transformers``'s."""
    from transformers import modeling_utils

    cls = _model_class(config)
    if cls is None:
        unknown = "does not know this model: no mapping"
        return Traced(tuple(_whole(n, n, s) for n, _, s in plain), unknown)
    try:  # the aliases save_pretrained leaves out, where the model builds on the meta device
        model = _meta_model(config, [*plain, *tied])
    except CheckpointFormatError:  # 4.x plans by the class alone: kept, as before
        model = None
    if model is not None:
        plain = [*plain, *_heads_held_apart(model, plain, tied)]
    mapping = getattr(cls, "_checkpoint_conversion_mapping", None) or {}
    buffers = _buffers(model) if model is not None else set()
    aliases: dict[str, str] = {}

    def traced(pieces: list[Piece], rule: str, of_buffers: bool = True) -> Traced:
        # the buffers' outputs for the index's total_parameters
        outputs = tuple(sorted(p.name for p in pieces if p.stored in buffers)) if of_buffers else ()
        return Traced(tuple(pieces), rule, (), outputs, tuple(sorted(aliases.items())))

    if model is not None:
        saved_layout = any(re.search(pattern, n) for pattern in mapping for n, _, _ in plain)
        if model.state_dict() and not saved_layout:  # names neither in memory nor saved
            model = _holding_the_tensors(model, config, plain)
        aliases = _aliases_left_out(model, [n for n, _, _ in plain])
        plain = [t for t in plain if t[0] not in aliases]
        plain = _in_model_order(plain, model, mapping)
    # transformers 4.5x reverses it only for the vision-language classes it lists
    listed = getattr(modeling_utils, "VLMS", None)
    if listed is not None and not any(
        name in base.__name__.lower() for base in cls.__mro__[:-1] for name in listed
    ):
        mapping = {}
    if not mapping:
        return traced([_whole(n, n, s) for n, _, s in plain], "no key mapping")
    if any(re.search(pattern, n) for pattern in mapping for n, _, _ in plain):
        # checkpoint names (``language_model.lm_head``), which no in-memory name matches: a
        # save_pretrained directory already, written as it is, not renamed a second time
        kept = f"key mapping of {cls.__name__}, which the checkpoint is in"
        return traced([_whole(n, n, s) for n, _, s in plain], kept, of_buffers=False)
    reverse = {v: k for k, v in mapping.items()}
    pieces = []
    for name, _, shape in plain:
        new = name
        for pattern, replacement in reverse.items():
            replacement = re.sub(r"\(.*\)", "", replacement.lstrip("^"))
            new, count = re.subn(pattern, replacement, name)
            if count:
                break
        pieces.append(_whole(new, name, shape))
    return traced(pieces, f"key mapping of {cls.__name__}")
