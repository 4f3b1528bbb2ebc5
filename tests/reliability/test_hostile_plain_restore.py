"""Hostile restores of checkpoints saved WITHOUT FSDP, and of a Hugging Face model directory.

The checkpoints are written once per module by the tools themselves, at one process
(``plain_restore_cases.py``): accelerate's ``Accelerator(cpu=True).save_state``
(``model.safetensors``, ``optimizer.bin`` = ``optimizer.state_dict()`` with integer parameter
ids, ``scheduler.bin``, ``random_states_0.pkl``) of a tiny Qwen2, untied and tied; the
Trainer's ``checkpoint-2`` (``model.safetensors`` + ``config.json``, ``optimizer.pt``,
``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``, ``training_args.bin``); and
``save_pretrained`` of a tiny Qwen3-MoE (one tensor per expert on disk, fused ones in the live
model). Each case is a copy, damaged the way a crash, a disk, a script or an attacker might:
the optimizer file (not a zip, truncated, a flipped byte, code in its pickle, ids and groups
that do not add up, state of the wrong shape, dtype or type), the model files (header, missing,
extra, reshaped tensors, a FIFO, a link out of the directory, two model files, a broken index),
the MoE's per-expert tensors and its config.json, a head tied in the live model but not in
the file, the scheduler and RNG files.

Every case is restored twice: at 2 ranks into FSDP2 (an explicit ``init_device_mesh("cpu",
(2,))`` over gloo) by ``CheckpointManager.restore(path=...)``, and at one process into the
plain model by ``shardstream.load``. The outcome must be one of:

* a legitimate variant (the copies as saved, a model in bf16 where the live one is fp32, a
  DDP ``module.`` prefix, an index and its shards...): restored bit for bit (after the cast to
  the live dtype where the file's differs, as ``tensor.to`` and the native path do), and one
  more training step works; or
* EVERY rank raises a ``ShardstreamError`` whose one-line message names the file or tensor at
  fault, nobody hangs, no pickled code runs, and the live model, optimizer, scheduler and
  torch's RNG are exactly as they were.

The cases of one family share one spawned job per mode (the ranks start once and restore
case after case into fresh live objects). ``run``'s timeout is only a hang guard. Where
shardstream does otherwise, the test keeps asserting the right behaviour and is marked
``xfail(strict=True)`` with what goes wrong.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardstream.testing.distributed import preload, run

from . import plain_restore_cases as pc
from .harness import assert_refused_everywhere, state_differences

preload(
    "torch._dynamo",  # FSDP2 imports it on its first fully_shard: a second per rank otherwise
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint.state_dict",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "accelerate",
    "pytest",
)

WORLD = 2
HANG_S = 300  # a safety net for a batch of restores, not a timing assertion
MODES = ("fsdp2", "plain")
MODEL = "model.safetensors"
SAFE_META = {"format": "pt"}


# --- the saves ----------------------------------------------------------------------------------


@dataclass
class Saved:
    base: Path
    acc: Path  # accelerate's save_state directory (untied Qwen2)
    tied: Path  # the same of a tied Qwen2 (save_pretrained's safetensors leaves lm_head out)
    trainer: Path  # the Trainer's checkpoint-2
    moe: Path  # save_pretrained of a Qwen3-MoE
    refs: dict  # acc, tied, trainer: {"model", "optim", "scheduler"}; moe: {"model"}
    order: dict  # acc, trainer: the FQN of optimizer id i (param group after param group)
    tree: dict = field(default_factory=dict)


def _tree(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        out[str(path)] = hashlib.sha1(path.read_bytes()).hexdigest() if path.is_file() else "d"
    return out


def _id_order(reference: dict) -> list[str]:
    """accelerate's and the Trainer's two param groups (matrices, then vectors), each in
    ``named_parameters`` order: the FQN of each integer id of ``optimizer.state_dict()``."""
    names = list(reference["model"])  # state_dict order = named_parameters order here
    model = reference["model"]
    return [n for n in names if model[n].ndim >= 2] + [n for n in names if model[n].ndim < 2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    base = tmp_path_factory.mktemp("hostile-plain")
    run(pc.save_accelerate, 1, str(base / "acc"), False, timeout=HANG_S)
    run(pc.save_accelerate, 1, str(base / "tied"), True, timeout=HANG_S)
    run(pc.save_trainer_and_moe, 1, str(base / "trainer"), str(base / "moe"), timeout=HANG_S)
    refs = {
        name: torch.load(base / name / "reference.pt", weights_only=True)
        for name in ("acc", "tied", "trainer")
    }
    refs["moe"] = {"model": torch.load(base / "moe-reference.pt", weights_only=True)}
    out = Saved(
        base,
        base / "acc" / "accelerate_state",
        base / "tied" / "accelerate_state",
        base / "trainer" / "out" / "checkpoint-2",
        base / "moe",
        refs,
        {"acc": _id_order(refs["acc"]), "trainer": _id_order(refs["trainer"])},
    )
    for name in ("acc", "tied", "trainer", "moe"):
        out.tree[name] = _tree(getattr(out, name))
    return out


# --- damage -------------------------------------------------------------------------------------


def _sentinel(case: Path) -> Path:
    """The file a code-calling pickle of ``case`` would create: it must never exist."""
    return case.parent / f"{case.name}.PWNED"


class _Call:
    """Pickled as a call of ``os.system`` (GLOBAL posix system + REDUCE): what torch.save
    writes for an object whose ``__reduce__`` calls a function."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _touch(case: Path) -> _Call:
    return _Call(f"touch {_sentinel(case)}")


def _torch_zip(pickled: bytes, like: Path) -> bytes:
    """A torch archive laid out as ``like`` (its record prefix), its data.pkl ``pickled``."""
    out = io.BytesIO()
    with zipfile.ZipFile(like) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pickled if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()


def _system_pickle(command: str) -> bytes:
    """Protocol 2 by hand: ``posix.system(command)`` at the top level."""
    raw = command.encode()
    return (
        b"\x80\x02cposix\nsystem\nX" + struct.pack("<I", len(raw)) + raw + b"\x85R."
    )  # fmt: skip


def _record_data_offset(file: Path, suffix: str) -> tuple[int, int]:
    """Where the bytes of the zip record whose name ends with ``suffix`` lie: (start, size)."""
    with zipfile.ZipFile(file) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    with open(file, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _flip(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _truncate(file: Path, fraction: float = 0.6) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * fraction)])


def _edit_pickle(name: str, edit: Callable[[dict, Path], object]) -> Callable[[Path], None]:
    """Load ``name`` (torch.save's), change it (``edit`` returns a replacement or None for
    in place), save it again with torch.save."""

    def apply(case: Path) -> None:
        file = case / name
        state = torch.load(file, weights_only=False, map_location="cpu")
        new = edit(state, case)
        torch.save(state if new is None else new, file)

    return apply


def _edit_model(edit: Callable[[dict], dict | None]) -> Callable[[Path], None]:
    def apply(case: Path) -> None:
        tensors = load_file(case / MODEL)
        new = edit(tensors)
        save_file(tensors if new is None else new, case / MODEL, metadata=SAFE_META)

    return apply


def _raw(name: str, transform: Callable[[bytes, Path], bytes]) -> Callable[[Path], None]:
    def apply(case: Path) -> None:
        file = case / name
        file.write_bytes(transform(file.read_bytes(), case))

    return apply


def _both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def apply(case: Path) -> None:
        for edit in edits:
            edit(case)

    return apply


# optimizer.state_dict() edits (``o`` the loaded dict)


def _state_not_a_dict(o, case):
    o["state"] = list(o["state"].values())


def _ids_as_some_strings(o, case):
    ids = o["param_groups"][0]["params"]
    ids[1] = str(ids[1])
    o["state"][str(ids[1])] = o["state"].pop(int(ids[1]))


def _id_in_two_groups(o, case):
    groups = o["param_groups"]
    groups[1]["params"][0] = groups[0]["params"][0]  # id 16 now in no group; 0 in both


def _state_for_unlisted_id(o, case):
    o["state"][99] = {k: v.clone() for k, v in o["state"][0].items()}


def _group_sizes_moved(o, case):
    groups = o["param_groups"]
    groups[1]["params"].insert(0, groups[0]["params"].pop())  # [15, 12] for [16, 11]


def _group_without_params(o, case):
    del o["param_groups"][1]["params"]


def _exp_avg_transposed(o, case):
    o["state"][0]["exp_avg"] = o["state"][0]["exp_avg"].t().contiguous()  # [48, 101]


def _exp_avg_float64(o, case):
    o["state"][0]["exp_avg"] = o["state"][0]["exp_avg"].double()


def _exp_avg_int(o, case):
    o["state"][0]["exp_avg"] = o["state"][0]["exp_avg"].mul(1e4).to(torch.int32)


def _exp_avg_a_list(o, case):
    o["state"][0]["exp_avg"] = o["state"][0]["exp_avg"].tolist()


def _step_a_string(o, case):
    o["state"][2]["step"] = "2"


def _momentum_into_adamw(o, case):
    o["state"][3]["momentum_buffer"] = o["state"][3]["exp_avg"].clone()


def _amsgrad_into_adamw(o, case):
    """What AdamW(amsgrad=True) keeps besides: restored into AdamW without it."""
    for entries in o["state"].values():
        entries["max_exp_avg_sq"] = entries["exp_avg_sq"].clone()


def _bool_ids(o, case):
    groups = o["param_groups"]
    groups[0]["params"][:2] = [False, True]  # == 0, 1 as keys: still the same state entries


def _param_state_a_tensor(o, case):
    o["state"][4] = o["state"][4]["exp_avg"]


def _lr_a_string(o, case):
    o["param_groups"][0]["lr"] = "0.01"


def _code_in_state(o, case):
    o["state"][0]["exp_avg"] = _touch(case)


# scheduler edits


def _scheduler_code(s, case):
    s["base_lrs"] = _touch(case)


def _scheduler_last_epoch_string(s, case):
    s["last_epoch"] = "2"


def _scheduler_overwrites_optimizer(s, case):
    s["optimizer"] = "not an optimizer"


def _scheduler_three_groups(s, case):
    s["lr_lambdas"] = [{}, {}, {}]
    s["base_lrs"] = [0.01, 0.01, 0.01]


# RNG edits (accelerate's random_states_0.pkl, the Trainer's rng_state.pth)


def _rng_code(r, case):
    r["torch_manual_seed" if "torch_manual_seed" in r else "cpu"] = _touch(case)


def _rng_torch_float(r, case):
    key = "torch_manual_seed" if "torch_manual_seed" in r else "cpu"
    r[key] = r[key].float()


def _rng_python_string(r, case):
    r["random_state" if "random_state" in r else "python"] = "not a state"


# model edits (``t`` the tensors of model.safetensors)


def _drop(name: str):
    def edit(t):
        del t[name]

    return edit


def _extra_tensor(t):
    t["model.layers.7.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].clone()


def _transposed(name: str):
    def edit(t):
        t[name] = t[name].t().contiguous()

    return edit


def _all_bf16(t):
    return {k: v.bfloat16() for k, v in t.items()}


def _one_bf16(name: str):
    def edit(t):
        t[name] = t[name].bfloat16()

    return edit


def _one_int(name: str):
    def edit(t):
        t[name] = t[name].mul(100).to(torch.int32)

    return edit


def _extra_expert(t):
    """A fourth expert's tensor where config.json and the live model have three."""
    t[E_GATE.replace(".1.", ".3.")] = t[E_GATE].clone()


def _module_prefix(t):
    return {f"module.{k}": v for k, v in t.items()}


def _header_garbled(data: bytes, case: Path) -> bytes:
    return data[:8] + b"\xff" * 16 + data[24:]


def _header_huge(data: bytes, case: Path) -> bytes:
    return struct.pack("<Q", 1 << 40) + data[8:]


def _data_cut(data: bytes, case: Path) -> bytes:
    return data[:-4096]


def _fifo(case: Path) -> None:
    (case / MODEL).unlink()
    os.mkfifo(case / MODEL)


def _link_out(case: Path) -> None:
    outside = case.parent / f"{case.name}-outside"
    outside.mkdir()
    (case / MODEL).rename(outside / MODEL)
    (case / MODEL).symlink_to(outside / MODEL)


def _bin_beside(differs: bool) -> Callable[[Path], None]:
    """pytorch_model.bin (torch.save of the state dict, as save_state(safe_serialization=False)
    writes it) beside model.safetensors: the same values, or other ones (an older save)."""

    def apply(case: Path) -> None:
        tensors = load_file(case / MODEL)
        if differs:
            tensors = {k: v + 1.0 for k, v in tensors.items()}
        torch.save(tensors, case / "pytorch_model.bin")

    return apply


def _as_bin(case: Path) -> None:
    """The model as save_state(safe_serialization=False) writes it: pytorch_model.bin."""
    torch.save(load_file(case / MODEL), case / "pytorch_model.bin")
    (case / MODEL).unlink()


def _bin_code(case: Path) -> None:
    _as_bin(case)
    file = case / "pytorch_model.bin"
    file.write_bytes(_torch_zip(_system_pickle(f"touch {_sentinel(case)}"), file))


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _sharded(case: Path) -> None:
    """An index and two shards, as save_pretrained(max_shard_size=...) writes them."""
    tensors = load_file(case / MODEL)
    names = sorted(tensors)
    half = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2 :]}
    weight_map = {}
    for shard, listed in half.items():
        save_file({n: tensors[n] for n in listed}, case / shard, metadata=SAFE_META)
        weight_map.update({n: shard for n in listed})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (case / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (case / MODEL).unlink()


def _shard_missing(case: Path) -> None:
    _sharded(case)
    (case / SHARDS[1]).unlink()


def _index_misplaces(case: Path) -> None:
    """The index lists a tensor in the shard that does not hold it."""
    _sharded(case)
    path = case / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = next(n for n, s in sorted(index["weight_map"].items()) if s == SHARDS[0])
    index["weight_map"][name] = SHARDS[1]
    path.write_text(json.dumps(index))


def _config_edit(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(case: Path) -> None:
        path = case / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))

    return apply


def _experts(n: int):
    def edit(c):
        c["num_local_experts"] = n

    return edit


def _architecture(name: str):
    def edit(c):
        c["architectures"] = [name]

    return edit


def _tied_bin(case: Path) -> None:
    """A tied model as torch.save writes it (save_state(safe_serialization=False)): both
    names kept, one storage."""
    tensors = load_file(case / MODEL)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    torch.save(tensors, case / "pytorch_model.bin")
    (case / MODEL).unlink()


def _no_config(case: Path) -> None:
    (case / "config.json").unlink()


def _head_as_embedding(differs: bool):
    """A tied save's model file with lm_head.weight written out (save_pretrained leaves it
    out): the embedding's values, or other ones (saved from an untied model)."""

    def edit(t):
        head = t["model.embed_tokens.weight"].clone()
        t["lm_head.weight"] = head + 1e-3 if differs else head

    return edit


# --- the cases ----------------------------------------------------------------------------------

OPT, OPT_T = "optimizer.bin", "optimizer.pt"
EMB = "model.embed_tokens.weight"
E_GATE = "model.layers.0.mlp.experts.1.gate_proj.weight"
E_DOWN = "model.layers.1.mlp.experts.2.down_proj.weight"
FUSED_GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
FUSED_DOWN = "model.layers.1.mlp.experts.down_proj"


@dataclass(frozen=True)
class Case:
    base: str  # acc, tied, trainer, moe
    edit: Callable[[Path], None] | None
    # refused: alternatives, each a tuple of strings the message must all name ({opt}: the
    # optimizer file's name, {idN}: the FQN of optimizer id N); None: a legitimate variant
    needles: tuple | None
    family: str
    want: str = "saved"  # restored: saved, or cast (the file's tensors cast to the live dtype)
    live: str = ""  # the live objects; default: the base's
    contents: tuple = ("model", "optimizer", "extra")
    either: bool = False  # refused naming the needles, or restored as ``want``
    plain_restores: bool = False  # at one process the damage is never read: restored
    sentinel: bool = False  # a code-calling pickle: its file must never appear
    fresh: bool = False  # the live optimizer never stepped


def one(*needles: str) -> tuple:
    return (needles,)


def _opt_file(base: str) -> str:
    return OPT if base == "acc" else OPT_T


def _on_optimizer(transform):
    return lambda base: _raw(_opt_file(base), transform)


def _optimizer_pickle(edit):
    return lambda base: _edit_pickle(_opt_file(base), edit)


def _crc_flip(base: str):
    def apply(case: Path) -> None:
        file = case / _opt_file(base)
        start, size = _record_data_offset(file, "/data/1")  # exp_avg of id 0
        _flip(file, start + size // 2)

    return apply


def _code_top(base: str):
    def apply(case: Path) -> None:
        file = case / _opt_file(base)
        file.write_bytes(_torch_zip(_system_pickle(f"touch {_sentinel(case)}"), file))

    return apply


def _optimizer_gone(base: str):
    return lambda case: (case / _opt_file(base)).unlink()


def _pickle_crc(name: str) -> Callable[[Path], None]:
    """A flipped byte in the pickle record (data.pkl) of ``name``: its CRC-32 fails."""

    def apply(case: Path) -> None:
        start, size = _record_data_offset(case / name, "/data.pkl")
        _flip(case / name, start + size // 2)

    return apply


def _bin_crc(case: Path) -> None:
    _as_bin(case)
    start, size = _record_data_offset(case / "pytorch_model.bin", "/data/1")
    _flip(case / "pytorch_model.bin", start + size // 2)


def _second_rank_rng(content: str) -> Callable[[Path], None]:
    """A save of 2 processes (random_states_0 and _1); rank 1's file hostile."""

    def apply(case: Path) -> None:
        second = case / "random_states_1.pkl"
        if content == "code":
            state = torch.load(case / "random_states_0.pkl", weights_only=False)
            state["torch_manual_seed"] = _touch(case)
            torch.save(state, second)
        else:
            second.write_bytes(b"garbage\n" * 30)

    return apply


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    only = ("model",)

    # legitimate: as the tools saved them, and a live optimizer that never stepped
    for base in ("acc", "trainer", "tied"):
        cases[f"{base}-as-saved"] = Case(base, None, None, "legit")
    cases["moe-as-saved"] = Case("moe", None, None, "legit", contents=only)
    cases["acc-fresh-optimizer"] = Case("acc", None, None, "legit", fresh=True)

    # the optimizer file, accelerate's optimizer.bin and the Trainer's optimizer.pt
    opt = one("{opt}")
    optimizer_cases = {
        "opt-not-a-zip": (_on_optimizer(lambda d, c: b"not a zip archive at all\n" * 40), opt),
        "opt-empty": (_on_optimizer(lambda d, c: b""), opt),
        "opt-truncated": (_on_optimizer(lambda d, c: d[: len(d) * 6 // 10]), opt),
        "opt-crc": (_crc_flip, opt),
        "opt-code-top": (_code_top, opt),
        "opt-code-nested": (_optimizer_pickle(_code_in_state), opt),
        "opt-missing": (_optimizer_gone, one("optimizer")),
        "opt-state-not-dict": (_optimizer_pickle(_state_not_a_dict), opt),
        "opt-str-ids": (_optimizer_pickle(_ids_as_some_strings), opt),
        "opt-bool-ids": (_optimizer_pickle(_bool_ids), opt),
        "opt-id-two-groups": (_optimizer_pickle(_id_in_two_groups), one("{opt}", "two")),
        "opt-unlisted-id": (_optimizer_pickle(_state_for_unlisted_id), one("{opt}", "99")),
        "opt-group-sizes": (_optimizer_pickle(_group_sizes_moved), one("{opt}", "param groups")),
        "opt-group-no-params": (_optimizer_pickle(_group_without_params), one("{opt}", "params")),
        "opt-param-state-tensor": (_optimizer_pickle(_param_state_a_tensor), one("{opt}", "{id4}")),
        "opt-exp-avg-transposed": (
            _optimizer_pickle(_exp_avg_transposed),
            one("{id0}", "exp_avg", "[48, 101]"),
        ),
        "opt-exp-avg-list": (_optimizer_pickle(_exp_avg_a_list), one("{id0}", "exp_avg")),
        "opt-step-string": (_optimizer_pickle(_step_a_string), one("{id2}", "step")),
        "opt-momentum-in-adamw": (_optimizer_pickle(_momentum_into_adamw), one("momentum_buffer")),
        "opt-amsgrad-in-adamw": (_optimizer_pickle(_amsgrad_into_adamw), one("max_exp_avg_sq")),
        "opt-lr-string": (_optimizer_pickle(_lr_a_string), one("{opt}", "lr")),
    }
    for name, (edit, needles) in optimizer_cases.items():
        for base in ("acc", "trainer"):
            cases[f"{base}-{name}"] = Case(
                base, edit(base), needles, "optimizer", sentinel="code" in name
            )
    # a moment in another float dtype: torch's Optimizer.load_state_dict casts state to the
    # parameter's dtype, as a restore casts (docs/design.md: as tensor.to does)
    cases["acc-opt-exp-avg-float64"] = Case(
        "acc", _optimizer_pickle(_exp_avg_float64)("acc"), None, "optimizer", "cast"
    )
    # integer moments: no optimizer writes them; refused, or cast as documented
    cases["acc-opt-exp-avg-int"] = Case(
        "acc", _optimizer_pickle(_exp_avg_int)("acc"), one("{id0}", "exp_avg"), "optimizer",
        "cast", either=True,
    )  # fmt: skip
    cases["acc-opt-crc-fresh"] = Case("acc", _crc_flip("acc"), opt, "optimizer", fresh=True)

    # the model files
    model_cases = {
        "model-header-garbled": (_raw(MODEL, _header_garbled), one(MODEL)),
        "model-header-huge": (_raw(MODEL, _header_huge), one(MODEL)),
        "model-data-cut": (_raw(MODEL, _data_cut), one(MODEL)),
        "model-empty": (_raw(MODEL, lambda d, c: b""), one(MODEL)),
        "model-missing-tensor": (
            _edit_model(_drop("model.layers.1.mlp.up_proj.weight")),
            one("model.layers.1.mlp.up_proj.weight"),
        ),
        "model-extra-tensor": (
            _edit_model(_extra_tensor),
            one("model.layers.7.mlp.up_proj.weight"),
        ),
        "model-transposed": (
            _edit_model(_transposed("model.layers.0.mlp.down_proj.weight")),
            one("model.layers.0.mlp.down_proj.weight", "[86, 48]"),
        ),
        "model-fifo": (_fifo, one(MODEL)),
        "model-link-out": (_link_out, one(MODEL)),
        "model-shard-missing": (_shard_missing, one(SHARDS[1])),
        "model-index-misplaces": (_index_misplaces, one("model.safetensors.index.json")),
    }
    for name, (edit, needles) in model_cases.items():
        for base in ("acc", "trainer"):
            cases[f"{base}-{name}"] = Case(base, edit, needles, "model")
    bin_cases = {
        "model-bin-code": (_bin_code, True),
        "model-bin-truncated": (
            _both(_as_bin, _raw("pytorch_model.bin", lambda d, c: d[: len(d) // 2])),
            False,
        ),
        "model-bin-crc": (_bin_crc, False),
    }
    for name, (edit, sentinel) in bin_cases.items():
        cases[f"acc-{name}"] = Case(
            "acc", edit, one("pytorch_model.bin"), "model", sentinel=sentinel
        )
    legit_models = {
        "model-bf16": (_edit_model(_all_bf16), "cast"),
        "model-one-bf16": (_edit_model(_one_bf16("model.layers.0.mlp.gate_proj.weight")), "cast"),
        "model-sharded": (_sharded, "saved"),
        "model-as-bin": (_as_bin, "saved"),
    }
    for name, (edit, want) in legit_models.items():
        cases[f"acc-{name}"] = Case("acc", edit, None, "model", want)
    # a float parameter stored as integers: refused, or cast as documented
    cases["acc-model-one-int"] = Case(
        "acc", _edit_model(_one_int("model.norm.weight")), one("model.norm.weight"), "model",
        "cast", either=True,
    )  # fmt: skip
    # the state dict of the DDP wrapper (module.*), which accelerate and the Trainer unwrap
    cases["acc-model-ddp-prefix"] = Case(
        "acc", _edit_model(_module_prefix), one(EMB), "model", either=True
    )
    # two model files: accelerate's load_state and the Trainer take model.safetensors
    cases["acc-model-bin-beside-differs"] = Case(
        "acc", _bin_beside(True), one(MODEL, "pytorch_model.bin"), "model", either=True
    )
    cases["acc-model-file-gone"] = Case("acc", lambda c: (c / MODEL).unlink(), one(MODEL), "model")

    # the layout model (Qwen3-MoE: save_pretrained's per-expert tensors), the model alone
    moe_cases = {
        "moe-expert-missing": (_edit_model(_drop(E_GATE)), (one(E_GATE) + one(FUSED_GATE_UP))),
        "moe-expert-transposed": (_edit_model(_transposed(E_DOWN)), one(E_DOWN)),
        "moe-expert-bf16": (_edit_model(_one_bf16(E_GATE)), one(E_GATE) + one(FUSED_GATE_UP)),
        "moe-extra-expert": (_edit_model(_extra_expert), one(E_GATE.replace(".1.", ".3."))),
        "moe-4-experts": (_config_edit(_experts(4)), one("config.json") + one(FUSED_GATE_UP)),
        "moe-2-experts": (_config_edit(_experts(2)), one("config.json") + one(FUSED_GATE_UP)),
        "moe-dense-arch": (
            _config_edit(_architecture("Qwen3ForCausalLM")),
            one("config.json") + one(FUSED_GATE_UP),
        ),
        "moe-no-config": (_no_config, one(FUSED_GATE_UP) + one(FUSED_DOWN) + one(E_GATE)),
        "moe-config-garbled": (
            _raw("config.json", lambda d, c: d[: len(d) // 2]),
            one("config.json"),
        ),
    }
    for name, (edit, needles) in moe_cases.items():
        cases[name] = Case("moe", edit, needles, "layout", contents=only)
    # a model alone may hold tensors its in-memory model has no place for (DeepSeek's
    # multi-token-prediction layers), as from_pretrained allows: refused naming it, or ignored
    cases["moe-extra-expert"] = Case(
        "moe", _edit_model(_extra_expert), one(E_GATE.replace(".1.", ".3.")), "layout",
        contents=only, either=True,
    )  # fmt: skip
    # an architecture transformers does not know, the model type its own: the live model's
    # names decide; refused naming config.json, or restored as saved
    cases["moe-unknown-arch"] = Case(
        "moe", _config_edit(_architecture("NoSuchModelForCausalLM")), one("config.json"),
        "layout", contents=only, either=True,
    )  # fmt: skip

    # heads the live model ties to its embedding
    both = one(EMB, "lm_head.weight")
    cases["tied-untied-file-model-only"] = Case(
        "acc", None, both, "tied", live="accelerate-tied", contents=only
    )
    cases["tied-head-differs"] = Case("tied", _edit_model(_head_as_embedding(True)), both, "tied")
    cases["tied-head-equal"] = Case("tied", _edit_model(_head_as_embedding(False)), None, "tied")
    cases["tied-head-as-bin"] = Case("tied", _tied_bin, None, "tied")

    # scheduler and RNG files
    state_cases = {
        "sched-not-a-zip": (lambda b: _raw(_sched(b), lambda d, c: b"garbage\n" * 30), ()),
        "sched-truncated": (lambda b: _raw(_sched(b), lambda d, c: d[: len(d) // 2]), ()),
        "sched-crc": (lambda b: _pickle_crc(_sched(b)), ()),
        "sched-code": (lambda b: _edit_pickle(_sched(b), _scheduler_code), ()),
        "sched-a-list": (lambda b: _edit_pickle(_sched(b), lambda s, c: [1, 2, 3]), ()),
        "sched-three-groups": (lambda b: _edit_pickle(_sched(b), _scheduler_three_groups), ()),
        "sched-last-epoch-string": (
            lambda b: _edit_pickle(_sched(b), _scheduler_last_epoch_string),
            ("last_epoch",),
        ),
        "sched-overwrites-optimizer": (
            lambda b: _edit_pickle(_sched(b), _scheduler_overwrites_optimizer),
            ("optimizer",),
        ),
        "rng-not-a-zip": (lambda b: _raw(_rng(b), lambda d, c: b"garbage\n" * 30), ()),
        "rng-crc": (lambda b: _pickle_crc(_rng(b)), ()),
        "rng-code": (lambda b: _edit_pickle(_rng(b), _rng_code), ()),
        "rng-a-list": (lambda b: _edit_pickle(_rng(b), lambda r, c: [1, 2]), ()),
        "rng-torch-float": (lambda b: _edit_pickle(_rng(b), _rng_torch_float), ()),
        "rng-python-string": (lambda b: _edit_pickle(_rng(b), _rng_python_string), ()),
    }
    for name, (edit, needles) in state_cases.items():
        for base in ("acc", "trainer"):
            file = _sched(base) if name.startswith("sched") else _rng(base)
            cases[f"{base}-{name}"] = Case(
                base, edit(base), one(file, *needles), "state", sentinel="code" in name
            )
    # a save of two processes, rank 1's RNG file hostile: at 2 ranks rank 1 reads it and every
    # rank must refuse; one process reads rank 0's only
    for content in ("garbage", "code"):
        cases[f"acc-rng-rank1-{content}"] = Case(
            "acc", _second_rank_rng(content), one("random_states_1.pkl"), "state",
            plain_restores=True, sentinel=content == "code",
        )  # fmt: skip
    # the Trainer's arguments and trainer_state.json are no state to restore: a hostile
    # pickle there must never run; refused naming it, or restored without it
    args_code = _raw(
        "training_args.bin",
        lambda d, c: _torch_zip(_system_pickle(f"touch {_sentinel(c)}"), c / "training_args.bin"),
    )
    cases["trainer-args-code"] = Case(
        "trainer", args_code, one("training_args.bin"), "state", either=True, sentinel=True
    )
    cases["trainer-state-json-garbled"] = Case(
        "trainer", _raw("trainer_state.json", lambda d, c: b"{not json"),
        one("trainer_state.json"), "state", either=True,
    )  # fmt: skip
    return cases


def _sched(base: str) -> str:
    return "scheduler.bin" if base == "acc" else "scheduler.pt"


def _rng(base: str) -> str:
    return "random_states_0.pkl" if base == "acc" else "rng_state.pth"


CASES = _cases()
LIVE = {"acc": "accelerate", "tied": "accelerate-tied", "trainer": "trainer", "moe": "moe"}
FAMILIES = ("legit", "optimizer", "model", "layout", "tied", "state")


@pytest.fixture(scope="module")
def cases(saved) -> dict[str, Path]:
    """Every case's directory: a copy of its base, damaged."""
    root = saved.base / "cases"
    out = {}
    for name, case in CASES.items():
        target = root / name
        shutil.copytree(getattr(saved, case.base), target, symlinks=True)
        if case.edit is not None:
            case.edit(target)
        out[name] = target
    return out


@pytest.fixture(scope="module")
def outcomes(saved, cases, tmp_path_factory) -> dict:
    """(case, mode) -> every rank's report, or the text of the batch's failure."""
    scratch = tmp_path_factory.mktemp("hostile-plain-restores")
    out: dict = {}
    for family in FAMILIES:
        names = [n for n, c in CASES.items() if c.family == family]
        specs = [
            {
                "name": n,
                "path": str(cases[n]),
                "live": CASES[n].live or LIVE[CASES[n].base],
                "contents": list(CASES[n].contents),
                "fresh": CASES[n].fresh,
            }
            for n in names
        ]
        for mode in MODES:
            world = WORLD if mode == "fsdp2" else 1
            try:
                ranks = run(
                    pc.restore_batch, world, specs, mode, str(scratch / family), timeout=HANG_S
                )
            except Exception as exc:  # noqa: BLE001 - each case's test reports it
                for n in names:
                    out[(n, mode)] = f"{type(exc).__name__}: {exc}"
                continue
            for i, n in enumerate(names):
                out[(n, mode)] = [rank[i] for rank in ranks]
    return out


def _reports(outcomes: dict, name: str, mode: str) -> list[dict]:
    reports = outcomes[(name, mode)]
    if isinstance(reports, str):
        pytest.fail(f"the batch of restores failed (a crash or a hang): {reports[-12000:]}")
    return reports


def _needles(case: Case, saved: Saved) -> list[tuple[str, ...]]:
    """The alternatives, each a tuple of strings the message must all name."""
    alternatives = case.needles
    if alternatives and isinstance(alternatives[0], str):
        alternatives = (alternatives,)
    names = {f"id{i}": fqn for i, fqn in enumerate(saved.order.get(case.base, []))}
    return [
        tuple(n.format(opt=_opt_file(case.base), **names) for n in needles)
        for needles in alternatives
    ]


def _expected(case: Case, saved: Saved, path: Path) -> dict:
    """What a restore of ``path`` must give: the saved state; with ``want="cast"`` the
    tensors of the case's model and optimizer files cast to the live dtypes, as ``tensor.to``
    casts; the model alone for ``contents=("model",)``."""
    ref = saved.refs[case.base]
    model = dict(ref["model"])
    if case.want == "cast" and (path / MODEL).exists():
        in_file = load_file(path / MODEL)
        model = {k: in_file[k].to(v.dtype) if k in in_file else v for k, v in model.items()}
        if "lm_head.weight" not in in_file and "lm_head.weight" in model:  # tied
            model["lm_head.weight"] = model[EMB]
    if "optimizer" not in case.contents:
        return {"model": model}
    optim = ref["optim"]
    if case.want == "cast":
        raw = torch.load(path / _opt_file(case.base), weights_only=True)
        fqns = saved.order[case.base]
        state = {}
        for fqn, entries in optim["state"].items():
            in_file = raw["state"][fqns.index(fqn)]
            state[fqn] = {
                k: in_file[k].to(v.dtype) if isinstance(v, torch.Tensor) else v
                for k, v in entries.items()
            }
        optim = {**optim, "state": state}
    return {"model": model, "optim": optim, "scheduler": ref["scheduler"]}


def _assert_restored(reports: list[dict], want: dict, where: str) -> None:
    for report in reports:
        assert report["ok"], f"{where}: rank {report['rank']}: {report['error']['traceback']}"
        assert report.get("stepped", True) is True, f"{where}: {report['stepped']}"
    got = reports[0]["state"]
    diffs = []
    for part, value in want.items():
        diffs += state_differences(got[part], value, f"{where}.{part}")
    assert not diffs, "not restored bit for bit:\n" + "\n".join(diffs[:10])


def _assert_refused(reports: list[dict], alternatives: list[tuple[str, ...]]) -> None:
    """Refused on every rank, the live state untouched, naming all of one alternative."""
    failures = []
    for needles in alternatives:
        try:
            assert_refused_everywhere(reports, *needles)
            return
        except AssertionError as exc:
            failures.append(str(exc))
    raise AssertionError(" | or | ".join(failures))


# case (both modes) or (case, mode) -> what shardstream does instead today
XFAIL: dict = {}  # none left


def _params(names: list[str]) -> list:
    out = []
    for name in names:
        for mode in MODES:
            reason = XFAIL.get((name, mode)) or XFAIL.get(name)
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)]
            out.append(pytest.param(name, mode, marks=marks if reason else [], id=f"{name}-{mode}"))
    return out


LEGIT = [n for n, c in CASES.items() if c.needles is None]
HOSTILE = [n for n, c in CASES.items() if c.needles is not None]


# --- what the tools wrote -----------------------------------------------------------------------


def test_the_tools_wrote_what_the_cases_damage(saved):
    """The premise: accelerate's and the Trainer's files, integer parameter ids in two groups,
    save_pretrained's per-expert MoE tensors, a tied head left out of the safetensors."""
    assert {p.name for p in saved.acc.iterdir()} == {
        MODEL, OPT, "scheduler.bin", "random_states_0.pkl"
    }  # fmt: skip
    trainer = {p.name for p in saved.trainer.iterdir()}
    assert {MODEL, "config.json", OPT_T, "scheduler.pt", "rng_state.pth"} <= trainer, trainer
    assert {"trainer_state.json", "training_args.bin"} <= trainer, trainer
    for base, file in (("acc", saved.acc / OPT), ("trainer", saved.trainer / OPT_T)):
        raw = torch.load(file, weights_only=True)
        ids = [p for g in raw["param_groups"] for p in g["params"]]
        assert ids == list(range(len(saved.order[base]))) and len(raw["param_groups"]) == 2
        assert sorted(raw["state"]) == ids
        assert raw["state"][0]["exp_avg"].shape == saved.refs[base]["model"][EMB].shape
    assert "lm_head.weight" not in load_file(saved.tied / MODEL)
    moe = load_file(saved.moe / MODEL)
    assert E_GATE in moe and FUSED_GATE_UP not in moe
    assert FUSED_GATE_UP in saved.refs["moe"]["model"]


# --- legitimate variants restore bit for bit ----------------------------------------------------


@pytest.mark.parametrize(("name", "mode"), _params(LEGIT))
def test_legitimate_variant_restores_bit_for_bit(saved, cases, outcomes, name, mode):
    case = CASES[name]
    reports = _reports(outcomes, name, mode)
    _assert_restored(reports, _expected(case, saved, cases[name]), f"{name} {mode}")


# --- hostile cases are refused, naming the culprit, touching nothing ----------------------------


@pytest.mark.parametrize(("name", "mode"), _params(HOSTILE))
def test_hostile_case_is_refused(saved, cases, outcomes, name, mode):
    case = CASES[name]
    reports = _reports(outcomes, name, mode)
    if case.sentinel:
        assert not _sentinel(cases[name]).exists(), "the pickle's code ran"
    must_restore = case.plain_restores and mode == "plain"
    if must_restore or (case.either and all(r["ok"] for r in reports)):
        _assert_restored(reports, _expected(case, saved, cases[name]), f"{name} {mode}")
        return
    _assert_refused(reports, _needles(case, saved))


def test_the_saved_checkpoints_were_never_changed(saved, outcomes):
    for name in ("acc", "tied", "trainer", "moe"):
        assert _tree(getattr(saved, name)) == saved.tree[name], name
