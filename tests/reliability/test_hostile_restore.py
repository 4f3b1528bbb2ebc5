"""Realistic-but-wrong restores through ``CheckpointManager.restore`` on real FSDP2 over gloo.

Each case saves (once per module) or damages a checkpoint, then restores it on 2 spawned ranks
(1 or 3 where the world size is what changes) into a model or optimizer that may differ from
the saved one. The outcome must be one of:

* the restore succeeds and the model, optimizer and scheduler equal what was saved, bit for
  bit (after a cast to the live dtype where the model's dtype changed), or
* EVERY rank raises a ``ShardstreamError`` whose one-line message names the tensor or file at
  fault, and no rank hangs; the live model and optimizer are as they were (except after a
  flipped data byte, found only as its chunk is read into them: the raise says so).

In both cases the checkpoint on disk is unchanged.

The restores of one world size share one job (the ranks start once and restore case after
case, each into fresh live objects with a process group of its own for the test's
collectives), so the ranks' caches are warm after the first. A damaged checkpoint, a run
directory or a resume path a case needs is its own, made before the job (no case sees files
another wrote), and each test checks its case's report. A case whose rank function raises
fails alone; a job that crashes or hangs fails every case of it. ``run``'s timeout is only a
hang guard. Where shardstream does otherwise, the test keeps asserting the right behaviour and
is marked ``xfail(strict=True)`` with what goes wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.errors import UsageError
from shardstream.formats import native
from shardstream.testing.compare import clone_nested, gathered_state
from shardstream.testing.distributed import preload, run, shard_units

from .harness import (
    assert_refused_everywhere,
    attempt_restore,
    job_reports,
    jobs_by_world,
    local_state,
    same_nested,
)

# What every rank imports, imported once by the fork server the ranks start from (a rank then
# starts in a fraction of a second instead of importing FSDP and a transformers model).
preload(
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint.state_dict",
    "transformers.models.qwen2.modeling_qwen2",
    "pytest",  # this module's own import, in every rank
)

WORLD = 2
HANG_S = 120  # a safety net against a rank stuck in a collective, not a timing assertion
WIDTHS = (8, 13, 11, 5)  # uneven rows at world sizes 2 and 3
STEPS = 2


# --- what every rank runs -----------------------------------------------------------------------


def _mlp(widths=WIDTHS, dtype=torch.float32, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers).to(dtype)


def _qwen(seed=0, **overrides) -> nn.Module:
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    tie = overrides.pop("tie_word_embeddings", False)
    config = tiny_config("qwen2", tie_word_embeddings=tie, overrides=overrides)
    return build_tiny_model(config, seed=seed)


def _shard(model: nn.Module, world: int, layout: str) -> None:
    if layout == "plain":
        return
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    inner = getattr(getattr(model, "model", None), "layers", None)
    units = list(inner) if inner is not None else [m for m in model if isinstance(m, nn.Linear)]
    shard_units(model, units, mesh)


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if name == "amsgrad":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    if name == "adamw2g":  # biases without weight decay: two param groups
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if not n.endswith("bias")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if name == "sgdm":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    raise ValueError(name)


def _train_step(model, optimizer, scheduler, step: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    if kind == "qwen":
        ids = torch.randint(0, 101, (2, 8), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
    else:
        dtype = next(model.parameters()).dtype
        x = torch.randn(4, WIDTHS[0], generator=generator).to(dtype)
        loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _build(rank: int, world: int, spec: dict):
    """Model, optimizer, scheduler for ``spec`` (``per_rank`` overrides keys on one rank)."""
    spec = {**spec, **spec.get("per_rank", {}).get(rank, {})}
    kind = spec.get("kind", "mlp")
    if kind == "qwen":
        model = _qwen(seed=spec.get("seed", 0), **spec.get("qwen", {}))
    else:
        model = _mlp(spec.get("widths", WIDTHS), getattr(torch, spec.get("dtype", "float32")))
        if spec.get("seed"):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(spec["seed"] / 100)
    _shard(model, world, spec.get("layout", "fsdp"))
    optimizer = _optimizer(model, spec.get("optim", "adamw"))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return spec, kind, model, optimizer, scheduler


def _full_state(model, optimizer, scheduler) -> dict:
    """The whole model, optimizer and scheduler state, gathered (a collective)."""
    return {**gathered_state(model, optimizer), "scheduler": clone_nested(scheduler.state_dict())}


def _unchanged(before: dict, after: dict) -> bool:
    """Parameters and hyperparameters as they were; optimizer state that existed too (an
    optimizer never stepped may have had its state initialised, as torch's state-dict API
    does)."""
    return (
        same_nested(before["params"], after["params"])
        and same_nested(before["groups"], after["groups"])
        and all(same_nested(v, after["state"].get(k)) for k, v in before["state"].items())
    )


def save_variants(rank: int, world: int, roots: dict) -> dict:
    """Train and save every variant the cases restore; rank 0 returns their full states."""
    import torch.distributed as dist

    plans = {  # name: (spec, steps saved)
        "mlp": ({}, (1, 2)),
        "fresh": ({}, ()),  # optimizer created, never stepped: saved at step 0
        "sgd": ({"optim": "sgd"}, (2,)),
        "sgdm": ({"optim": "sgdm"}, (2,)),
        "amsgrad": ({"optim": "amsgrad"}, (2,)),
        "groups2": ({"optim": "adamw2g"}, (2,)),
        "bf16": ({"dtype": "bfloat16"}, (2,)),
        "qwen": ({"kind": "qwen"}, (1,)),
    }
    out: dict = {}
    for name, (spec, saved_steps) in plans.items():
        _, kind, model, optimizer, scheduler = _build(rank, world, spec)
        manager = CheckpointManager(
            CheckpointConfig(roots[name]),
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
        )
        states = {}
        if not saved_steps:
            manager.save(0, extra={"seen": 0})
            states[0] = _full_state(model, optimizer, scheduler)
        for step in range(1, STEPS + 1):
            _train_step(model, optimizer, scheduler, step, kind)
            if step in saved_steps:
                manager.save(step, extra={"seen": step})
                states[step] = _full_state(model, optimizer, scheduler)
        manager.close()
        out[name] = states
        dist.barrier()
    return out if rank == 0 else {}


def restore_case(rank: int, world: int, spec: dict) -> dict:
    """Build the live objects ``spec`` describes, train ``pre_steps`` steps (so the optimizer
    holds state the restore must replace), restore, and report what happened."""
    import torch.distributed as dist

    mine = dist.new_group(backend="gloo")  # the test's own collectives never meet the restore's
    spec, kind, model, optimizer, scheduler = _build(rank, world, spec)
    for step in range(spec.get("pre_steps", 0)):
        _train_step(model, optimizer, scheduler, 50 + step, kind)
    before = local_state(model, optimizer)
    config = CheckpointConfig(spec["root"], **spec.get("config", {}))
    manager = CheckpointManager(config, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    report: dict = {"rank": rank, "ok": False}
    try:
        attempt_restore(report, lambda: manager.restore(**spec.get("restore", {})))
        if not report["ok"]:
            report["unchanged"] = _unchanged(before, local_state(model, optimizer))
    finally:
        manager.close()
    outcomes = [None] * world
    dist.all_gather_object(outcomes, report["ok"], group=mine)
    if all(outcomes) and spec.get("gather", True):  # not where the ranks' models differ
        report["state"] = _full_state(model, optimizer, scheduler)
        if spec.get("step_after"):  # the restored optimizer must still be usable
            try:
                _train_step(model, optimizer, scheduler, 99, kind)
                report["stepped"] = True
            except Exception as exc:  # noqa: BLE001
                report["stepped"] = f"{type(exc).__name__}: {exc}"
    dist.barrier(group=mine)
    dist.destroy_process_group(mine)
    return report


# --- the test side ------------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, str]:
    """Every file below ``root`` with its digest (and every directory)."""
    found = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.join(dirpath, name)] = "dir"
        for name in files:
            path = os.path.join(dirpath, name)
            found[path] = hashlib.sha1(Path(path).read_bytes()).hexdigest()
    return found


VARIANTS = ("mlp", "fresh", "sgd", "sgdm", "amsgrad", "groups2", "bf16", "qwen")
CASE_S = 30  # more hang guard per case of a job, not a timing assertion


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile-restore")
    roots = {name: str(base / name) for name in VARIANTS}
    states = run(save_variants, WORLD, roots, timeout=HANG_S)[0]
    return {"roots": roots, "states": states, "tree": _tree(base), "base": base}


@pytest.fixture
def untouched(saved):
    """The shared checkpoints are byte for byte as saved after the test."""
    yield
    assert _tree(saved["base"]) == saved["tree"]


def _assert_restored(reports: list[dict], want: dict, step: int, seen: int | None = None) -> None:
    """Every rank restored ``step``; the gathered state equals ``want`` bit for bit (cast to
    the live dtype where it differs, see ``_cast``)."""
    for report in reports:
        assert report["ok"], f"rank {report['rank']}: {report['error']['traceback']}"
        restored_step, extra = report["restored"]
        assert restored_step == step
        if seen is not None:
            assert extra == {"seen": seen}
    got = reports[0]["state"]
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        _assert_cast_equal(got["model"][name], tensor, name)
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys()
    for fqn, entries in want["optim"]["state"].items():
        assert got["optim"]["state"][fqn].keys() == entries.keys(), fqn
        for key, value in entries.items():
            _assert_cast_equal(got["optim"]["state"][fqn][key], value, f"{fqn}.{key}")
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert got["scheduler"] == want["scheduler"]


def _assert_cast_equal(got, want, name: str) -> None:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert got.shape == want.shape, name
    assert torch.equal(got, want.to(got.dtype)), name


# --- each case's own files (a damaged copy of the run, a directory), made before the restores ---


def _copy_run(saved, tmp_path, variant="mlp") -> Path:
    root = tmp_path / "run"
    shutil.copytree(saved["roots"][variant], root)
    return root


def _data_start(path: Path) -> int:
    raw = path.read_bytes()
    return 8 + int.from_bytes(raw[:8], "little")


def _remove(path: Path) -> None:
    path.unlink()


def _truncate(path: Path) -> None:
    size = path.stat().st_size
    start = _data_start(path)
    os.truncate(path, start + (size - start) // 2)


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    at = _data_start(path) + 5
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def _flip_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"shape"') + 2
    raw[at] = ord("S")
    path.write_bytes(bytes(raw))


def _flip_bytes_anywhere(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 3] ^= 0x01
    path.write_bytes(bytes(raw))


def _damaged_rank_file(saved, place: Path, damage, rank_file: int) -> dict:
    root = _copy_run(saved, place)
    victim = root / "global_step_2" / native.rank_file(rank_file)
    damage(victim)
    return {"root": root, "victim": victim.name}


def _damaged_extra_state(saved, place: Path, which: str) -> dict:
    root = _copy_run(saved, place)
    step = root / "global_step_2"
    names = sorted(p.name for p in step.iterdir() if "extra" in p.name and "00001" in p.name)
    victim = next(step / n for n in names if n.endswith(".json") == (which == "json"))
    _flip_bytes_anywhere(victim)
    return {"root": root, "victim": victim.name}


def _hand_edited_manifest(saved, place: Path) -> dict:
    root = _copy_run(saved, place)
    manifest = root / "global_step_2" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step":2', '"step":3', 1))
    return {"root": root, "edited": '"step":3' in manifest.read_text()}


def _resealed_manifest(saved, place: Path, edit: str) -> dict:
    """A manifest edited and re-sealed with a valid checksum (by a script 'fixing' it)."""
    root = _copy_run(saved, place)
    step = root / "global_step_2"
    doc = json.loads((step / "manifest.json").read_text())
    entry = doc["tensors"]["model.2.weight"]
    if edit == "step":
        doc["step"] = 3
        needles = ("step 3",)
    elif edit == "shape":
        entry["shape"] = [11, 12]
        needles = ("model.2.weight",)
    elif edit == "dtype":
        entry["dtype"] = "F16"
        needles = ("model.2.weight",)
    else:
        del doc["tensors"]["model.2.weight"]  # its records are still in the rank files
        needles = ("no entry for ('model.2.weight@",)
    native.write_manifest(step, doc)
    return {"root": root, "needles": needles}


def _rank_file_of_another_step(saved, place: Path) -> dict:
    root = _copy_run(saved, place)
    name = native.rank_file(1)
    shutil.copy(root / "global_step_1" / name, root / "global_step_2" / name)
    return {"root": root, "victim": name}


def _manifest_removed(saved, place: Path) -> dict:
    root = _copy_run(saved, place)
    (root / "global_step_2" / "manifest.json").unlink()
    return {"root": root}


def _run_directory(place: Path, made: str) -> dict:
    """A run directory without a committed step; ``watched``: where nothing may change (all
    of ``place``, as the test had its whole tmp_path)."""
    root = place / "run"
    root.mkdir()
    if made == "uncommitted":
        (root / "global_step_4").mkdir()
        (root / "global_step_4" / native.rank_file(0)).write_bytes(b"\0" * 64)
        (root / "global_step_5.tmp-0123abcd").mkdir()
    return {"root": root, "watched": place}


def _place_for(place: Path, name: str, make: bool = False) -> dict:
    """``path``: ``name`` in a directory of the case's own, made (``make``) or not there."""
    path = place / name
    if make:
        path.mkdir()
    return {"path": str(path)}


# The cases, by the test that checks them (each test's parameters, as its ids show them).
WORLD_SIZES = [(2, "fsdp"), (1, "fsdp"), (3, "fsdp"), (2, "plain")]
WORLD_SIZE_IDS = ["fsdp2", "fsdp1rank", "fsdp3", "unsharded2"]
CHANGED_ARCHITECTURE = [
    ({"widths": (8, 14, 11, 5)}, ("model tensor '0.weight'", "[13, 8]", "[14, 8]")),
    ({"widths": (8, 13, 11, 5, 5)}, ("model tensor '6.weight'",)),
    ({"widths": (8, 13, 11)}, ("model tensor '4.",)),
    ({"widths": (9, 13, 11, 5)}, ("model tensor '0.weight'",)),
]
CHANGED_ARCHITECTURE_IDS = ["wider-layer", "added-layer", "removed-layer", "wider-input"]
UNTIED_CONTENTS = [("model",), ("model", "optimizer", "extra")]
OTHER_OPTIMIZER = [
    ("mlp", "sgdm", ("momentum_buffer",)),
    ("sgdm", "adamw", ("optimizer.state.0.weight.",)),
    ("sgd", "sgdm", ("momentum_buffer",)),
    ("mlp", "amsgrad", ("max_exp_avg_sq",)),
    ("mlp", "adamw2g", ("param_groups",)),
    ("groups2", "adamw", ("param_groups",)),
]
STATE_THE_LIVE_OPTIMIZER_LACKS = [("mlp", "sgd", "exp_avg"), ("sgdm", "sgd", "momentum_buffer")]
DAMAGES = (_remove, _truncate, _flip, _flip_header)
RESEALED_EDITS = ["step", "shape", "dtype", "drop-tensor"]
RUN_DIRECTORIES = ["empty", "uncommitted"]
ONE_RANK_WITH_ANOTHER_MODEL = [
    ({"widths": (8, 14, 11, 5)}, ("model tensor '0.weight'",)),
    ({"widths": (8, 13, 11, 5, 5)}, ("model tensor '6.weight'",)),
    ({"widths": (8, 13, 11)}, ("model tensor '4.",)),
    ({"optim": "sgdm"}, ("momentum_buffer",)),
    ({"optim": "adamw2g"}, ("param_groups",)),
]
ONE_RANK_IDS = ["wider-layer", "added-layer", "removed-layer", "momentum-sgd", "two-groups"]


def _frozen(spec: dict) -> tuple:
    """A spec of a parameter table as part of a case key."""
    return tuple(sorted(spec.items()))


def _preparations(saved) -> dict[tuple, object]:
    """Case key -> what makes its own files in a directory of its own (``place``)."""
    out: dict[tuple, object] = {}
    for damage in DAMAGES:
        for rank_file in (0, 1):
            key = ("damaged-rank-file", damage.__name__, rank_file)
            out[key] = lambda p, d=damage, r=rank_file: _damaged_rank_file(saved, p, d, r)
    for which in ("json", "tensors"):
        out[("damaged-extra-state", which)] = lambda p, w=which: _damaged_extra_state(saved, p, w)
    out[("hand-edited-manifest",)] = lambda p: _hand_edited_manifest(saved, p)
    for edit in RESEALED_EDITS:
        out[("resealed-manifest", edit)] = lambda p, e=edit: _resealed_manifest(saved, p, e)
    out[("rank-file-of-another-step",)] = lambda p: _rank_file_of_another_step(saved, p)
    out[("manifest-removed",)] = lambda p: _manifest_removed(saved, p)
    for made in RUN_DIRECTORIES:  # the second restore in a run directory of its own
        for then in ("newest", "step-4"):
            out[("run-directory", made, then)] = lambda p, m=made: _run_directory(p, m)
    out[("resume-path-missing",)] = lambda p: _place_for(p, "global_step_9")
    out[("resume-path-empty",)] = lambda p: _place_for(p, "global_step_3", make=True)
    for mode in ("disable", "auto"):
        out[("resume-path-ignored", mode)] = lambda p: _place_for(p, "nowhere")
    out[("one-rank-bad-resume-path",)] = lambda p: _place_for(p, "global_step_2")
    return out


@pytest.fixture(scope="module")
def prepared(saved, tmp_path_factory) -> dict[tuple, dict]:
    """Case key -> its own files (``root``, ``path`` ...; ``tree``: what is below ``root``, or
    ``watched``, before the restore), or ``error``: how making them failed (its test fails)."""
    import traceback

    base = tmp_path_factory.mktemp("hostile-restore-cases")
    out: dict[tuple, dict] = {}
    for i, (key, make) in enumerate(_preparations(saved).items()):
        place = base / f"case{i}"
        place.mkdir()
        try:
            info = make(place)
            if "root" in info:
                info["tree"] = _tree(info.get("watched", info["root"]))
        except Exception:  # noqa: BLE001 - the case's test reports it
            info = {"error": traceback.format_exc()}
        out[key] = info
    return out


def _cases(roots: dict, prepared: dict) -> dict[tuple, tuple[int, dict]]:
    """Every restore a test checks, by the key its test looks it up with: (world, spec)."""
    out: dict[tuple, tuple[int, dict]] = {}

    def case(key, spec, variant="mlp", world=WORLD, root=None):
        out[key] = (world, {"root": str(root or roots[variant]), **spec})

    def own(key, name="root"):
        return prepared[key].get(name)  # None where making it failed (the case is not run)

    def resume(path) -> dict:
        return {"resume_mode": "resume_path", "resume_from_path": str(path)}

    for world, layout in WORLD_SIZES:
        case(("any-world-size", world, layout), {"layout": layout, "pre_steps": 1}, world=world)
    case(("older-step",), {"restore": {"step": 1}, "pre_steps": 1})
    case(("never-stepped-before-the-restore",), {"pre_steps": 0, "step_after": True})
    for pre_steps in (0, 3):
        case(("never-stepped-before-the-save", pre_steps), {"pre_steps": pre_steps}, "fresh")
    case(("two-param-groups",), {"optim": "adamw2g", "pre_steps": 1}, "groups2")
    case(("momentum-sgd",), {"optim": "sgdm", "pre_steps": 1}, "sgdm")
    case(("stateless-sgd",), {"optim": "sgd", "pre_steps": 0}, "sgd")
    case(("bf16-into-fp32",), {"pre_steps": 1}, "bf16")
    case(("fp32-into-bf16",), {"dtype": "bfloat16", "pre_steps": 1})

    for spec, _ in CHANGED_ARCHITECTURE:
        case(("changed-architecture", _frozen(spec)), spec)
    qwen = {"kind": "qwen", "seed": 3}
    spec = {**qwen, "pre_steps": 1, "qwen": {"vocab_size": 103}}
    case(("changed-vocabulary",), spec, "qwen")
    for contents in UNTIED_CONTENTS:
        spec = {**qwen, "qwen": {"tie_word_embeddings": True}}
        spec["config"] = {"load_contents": contents}
        case(("untied-into-tied", contents), spec, "qwen")
    case(("qwen-round-trip",), {**qwen, "pre_steps": 1}, "qwen")

    for variant, optim, _ in OTHER_OPTIMIZER:
        case(("other-optimizer", variant, optim), {"optim": optim, "pre_steps": 1}, variant)
    for variant, optim, _ in STATE_THE_LIVE_OPTIMIZER_LACKS:
        case(("state-not-dropped", variant, optim), {"optim": optim, "pre_steps": 1}, variant)
    spec = {"optim": "adamw", "pre_steps": 1, "step_after": True}
    case(("amsgrad-into-adamw",), spec, "amsgrad")

    damaged = [("damaged-rank-file", d.__name__, r) for d in DAMAGES for r in (0, 1)]
    damaged += [("damaged-extra-state", which) for which in ("json", "tensors")]
    damaged += [("hand-edited-manifest",), ("rank-file-of-another-step",)]
    damaged += [("resealed-manifest", edit) for edit in RESEALED_EDITS]
    damaged += [("manifest-removed",)]
    for key in damaged:
        case(key, {"pre_steps": 1}, root=own(key))

    case(("step-that-does-not-exist",), {"restore": {"step": 7}})
    for made in RUN_DIRECTORIES:
        key = ("run-directory", made, "newest")
        case(key, {"pre_steps": 1}, root=own(key))
        key = ("run-directory", made, "step-4")
        case(key, {"pre_steps": 1, "restore": {"step": 4}}, root=own(key))
    mlp = Path(roots["mlp"])
    case(("resume-path-missing",), {"config": resume(own(("resume-path-missing",), "path"))})
    case(("resume-path-run-directory",), {"config": resume(mlp), "pre_steps": 1})
    case(("resume-path-file",), {"config": resume(mlp / "global_step_2" / "manifest.json")})
    case(("resume-path-empty",), {"config": resume(own(("resume-path-empty",), "path"))})
    case(("resume-path-older-step",), {"config": resume(mlp / "global_step_1"), "pre_steps": 1})
    for mode in ("disable", "auto"):
        nowhere = own(("resume-path-ignored", mode), "path")
        spec = {"config": {"resume_mode": mode, "resume_from_path": nowhere}, "pre_steps": 1}
        case(("resume-path-ignored", mode), spec)

    for odd, _ in ONE_RANK_WITH_ANOTHER_MODEL:
        case(("one-rank-with-another-model", _frozen(odd)), {"per_rank": {1: odd}, "gather": False})
    bad = own(("one-rank-bad-resume-path",), "path")
    spec = {"config": resume(mlp / "global_step_2"), "per_rank": {1: {"config": resume(bad)}}}
    case(("one-rank-bad-resume-path",), spec)
    spec = {"restore": {"step": 2}, "per_rank": {1: {"restore": {"step": 1}}}}
    case(("different-steps",), spec)
    spec = {"pre_steps": 1, "per_rank": {1: {"config": {"load_contents": ("model",)}}}}
    case(("different-contents",), spec)
    return out


@pytest.fixture(scope="module")
def outcomes(saved, prepared) -> dict:
    """Case key -> every rank's report, or the text of what failed its job (a crash or a hang)
    or the making of its files: one job for the cases of each world size."""
    out: dict = {}
    cases = _cases(saved["roots"], prepared)
    for key, info in prepared.items():
        if "error" in info:
            out[key] = f"making the case's files failed:\n{info['error']}"
            del cases[key]
    out.update(jobs_by_world(restore_case, cases, lambda count: HANG_S + CASE_S * count))
    return out


def _own(prepared: dict, *key) -> dict:
    """What the case ``key`` made of its own (call after ``_reports``, which fails the test
    where making it failed)."""
    return prepared[key]


# --- a legitimate restore comes back bit for bit ------------------------------------------------


@pytest.mark.parametrize(("world", "layout"), WORLD_SIZES, ids=WORLD_SIZE_IDS)
def test_restore_at_any_world_size_is_bit_for_bit(saved, outcomes, untouched, world, layout):
    reports = job_reports(outcomes, "any-world-size", world, layout)
    _assert_restored(reports, saved["states"]["mlp"][2], 2, seen=2)


def test_restore_of_an_older_step_is_bit_for_bit(saved, outcomes, untouched):
    reports = job_reports(outcomes, "older-step")
    _assert_restored(reports, saved["states"]["mlp"][1], 1, seen=1)


def test_optimizer_never_stepped_before_the_restore(saved, outcomes, untouched):
    reports = job_reports(outcomes, "never-stepped-before-the-restore")
    _assert_restored(reports, saved["states"]["mlp"][2], 2)
    assert all(r["stepped"] is True for r in reports), [r["stepped"] for r in reports]


@pytest.mark.parametrize("pre_steps", [0, 3], ids=["fresh", "stepped"])
def test_optimizer_never_stepped_before_the_save(saved, outcomes, untouched, pre_steps):
    """A restore replaces state the live optimizer built since with what the save held."""
    reports = job_reports(outcomes, "never-stepped-before-the-save", pre_steps)
    _assert_restored(reports, saved["states"]["fresh"][0], 0, seen=0)


def test_two_param_groups_round_trip(saved, outcomes, untouched):
    reports = job_reports(outcomes, "two-param-groups")
    _assert_restored(reports, saved["states"]["groups2"][2], 2)


def test_momentum_sgd_round_trips(saved, outcomes, untouched):
    reports = job_reports(outcomes, "momentum-sgd")
    _assert_restored(reports, saved["states"]["sgdm"][2], 2)


def test_stateless_sgd_param_groups_round_trip(saved, outcomes, untouched):
    reports = job_reports(outcomes, "stateless-sgd")
    _assert_restored(reports, saved["states"]["sgd"][2], 2)


def test_bf16_checkpoint_into_an_fp32_model_is_an_exact_upcast(saved, outcomes, untouched):
    reports = job_reports(outcomes, "bf16-into-fp32")
    got = reports[0]["state"]
    assert all(t.dtype == torch.float32 for t in got["model"].values())
    _assert_restored(reports, saved["states"]["bf16"][2], 2)


def test_fp32_checkpoint_into_a_bf16_model_is_cast(saved, outcomes, untouched):
    """docs/design.md: a restore converts as ``tensor.to(dtype)`` does."""
    reports = job_reports(outcomes, "fp32-into-bf16")
    got = reports[0]["state"]
    assert all(t.dtype == torch.bfloat16 for t in got["model"].values())
    _assert_restored(reports, saved["states"]["mlp"][2], 2)


# --- the model changed since the save -----------------------------------------------------------


@pytest.mark.parametrize(("spec", "needles"), CHANGED_ARCHITECTURE, ids=CHANGED_ARCHITECTURE_IDS)
def test_changed_architecture_is_refused_naming_the_tensor(outcomes, untouched, spec, needles):
    assert_refused_everywhere(
        job_reports(outcomes, "changed-architecture", _frozen(spec)), *needles
    )


def test_changed_vocabulary_is_refused_naming_the_embedding(outcomes, untouched):
    assert_refused_everywhere(
        job_reports(outcomes, "changed-vocabulary"), "embed_tokens.weight", "[101, 48]"
    )


@pytest.mark.parametrize(
    "contents",
    [pytest.param(contents) for contents in UNTIED_CONTENTS],
    ids=["model-only", "with-optimizer"],
)
def test_untied_checkpoint_into_a_tied_model(outcomes, untouched, contents):
    """The saved embedding and head differ; one shared parameter cannot hold both."""
    assert_refused_everywhere(job_reports(outcomes, "untied-into-tied", contents), "lm_head.weight")


def test_qwen_round_trip(saved, outcomes, untouched):
    reports = job_reports(outcomes, "qwen-round-trip")
    _assert_restored(reports, saved["states"]["qwen"][1], 1, seen=1)


# --- the optimizer changed since the save -------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "optim", "needles"),
    OTHER_OPTIMIZER,
    ids=[
        "adamw-into-momentum-sgd",
        "momentum-sgd-into-adamw",
        "plain-sgd-into-momentum-sgd",
        "adamw-into-amsgrad",
        "1-group-into-2",
        "2-groups-into-1",
    ],
)
def test_other_optimizer_is_refused_naming_what_is_missing(
    outcomes, untouched, variant, optim, needles
):
    assert_refused_everywhere(job_reports(outcomes, "other-optimizer", variant, optim), *needles)


@pytest.mark.parametrize(
    ("variant", "optim", "needle"),
    [pytest.param(*case) for case in STATE_THE_LIVE_OPTIMIZER_LACKS],
    ids=["adamw-into-plain-sgd", "momentum-sgd-into-plain-sgd"],
)
def test_saved_optimizer_state_the_live_optimizer_lacks_is_not_dropped(
    outcomes, untouched, variant, optim, needle
):
    assert_refused_everywhere(job_reports(outcomes, "state-not-dropped", variant, optim), needle)


def test_amsgrad_checkpoint_into_plain_adamw(saved, outcomes, untouched):
    """Either the saved max_exp_avg_sq comes back with the rest and the optimizer steps, or
    the restore is refused naming it; never a success that leaves the next step broken."""
    reports = job_reports(outcomes, "amsgrad-into-adamw")
    if all(r["ok"] for r in reports):
        _assert_restored(reports, saved["states"]["amsgrad"][2], 2)
        assert all(r["stepped"] is True for r in reports), [r["stepped"] for r in reports]
    else:
        assert_refused_everywhere(reports, "max_exp_avg_sq")


# --- the checkpoint was damaged between save and restore ----------------------------------------


@pytest.mark.parametrize("rank_file", [0, 1])
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__[1:])
def test_damaged_rank_file_fails_every_rank_naming_it(outcomes, prepared, damage, rank_file):
    key = ("damaged-rank-file", damage.__name__, rank_file)
    reports = job_reports(outcomes, *key)
    own = _own(prepared, *key)
    # A flipped data byte is found as the chunk is read into the live tensors, so the failed
    # restore may have written some of them: it says so by raising (not asserted untouched).
    assert_refused_everywhere(reports, own["victim"], untouched=damage is not _flip)
    assert _tree(own["root"]) == own["tree"]


@pytest.mark.parametrize("which", ["json", "tensors"])
def test_damaged_extra_state_of_rank_1_fails_every_rank(outcomes, prepared, which):
    reports = job_reports(outcomes, "damaged-extra-state", which)
    own = _own(prepared, "damaged-extra-state", which)
    assert_refused_everywhere(reports, own["victim"])
    assert _tree(own["root"]) == own["tree"]


def test_hand_edited_manifest_is_refused_naming_it(outcomes, prepared):
    reports = job_reports(outcomes, "hand-edited-manifest")
    own = _own(prepared, "hand-edited-manifest")
    assert own["edited"]
    assert_refused_everywhere(reports, "manifest.json")
    assert _tree(own["root"]) == own["tree"]


@pytest.mark.parametrize("edit", RESEALED_EDITS)
def test_resealed_manifest_that_lies_is_refused(outcomes, prepared, edit):
    """A manifest edited and re-sealed with a valid checksum (by a script 'fixing' it)."""
    reports = job_reports(outcomes, "resealed-manifest", edit)
    own = _own(prepared, "resealed-manifest", edit)
    assert_refused_everywhere(reports, *own["needles"])
    assert _tree(own["root"]) == own["tree"]


def test_rank_file_of_another_step_swapped_in(outcomes, prepared):
    reports = job_reports(outcomes, "rank-file-of-another-step")
    own = _own(prepared, "rank-file-of-another-step")
    assert_refused_everywhere(reports, own["victim"])
    assert _tree(own["root"]) == own["tree"]


def test_manifest_removed_from_the_newest_step_falls_back_to_the_older(saved, outcomes, prepared):
    """Without its manifest a step is not committed: restore() takes the newest that is."""
    reports = job_reports(outcomes, "manifest-removed")
    own = _own(prepared, "manifest-removed")
    _assert_restored(reports, saved["states"]["mlp"][1], 1, seen=1)
    assert _tree(own["root"]) == own["tree"]


# --- steps and paths that are not there ---------------------------------------------------------


def test_step_that_does_not_exist(outcomes, untouched):
    assert_refused_everywhere(job_reports(outcomes, "step-that-does-not-exist"), "step 7")


@pytest.mark.parametrize("made", RUN_DIRECTORIES)
def test_run_directory_without_a_committed_step(outcomes, prepared, made):
    reports = job_reports(outcomes, "run-directory", made, "newest")
    own = _own(prepared, "run-directory", made, "newest")
    for report in reports:
        assert report["ok"] and report["restored"] is None, report.get("error")
    assert _tree(own["watched"]) == own["tree"]
    # Asking for a step there is an error on every rank.
    assert_refused_everywhere(job_reports(outcomes, "run-directory", made, "step-4"), "step 4")


def test_resume_path_that_does_not_exist(outcomes, prepared, untouched):
    reports = job_reports(outcomes, "resume-path-missing")
    assert_refused_everywhere(reports, _own(prepared, "resume-path-missing")["path"])


def test_resume_path_that_is_the_run_directory_restores_its_newest_step(saved, outcomes, untouched):
    """As ``source.checkpoints_below`` documents: a run directory means its latest step."""
    reports = job_reports(outcomes, "resume-path-run-directory")
    _assert_restored(reports, saved["states"]["mlp"][2], 2, seen=2)


def test_resume_path_that_is_a_file(saved, outcomes, untouched):
    manifest = str(Path(saved["roots"]["mlp"]) / "global_step_2" / "manifest.json")
    assert_refused_everywhere(job_reports(outcomes, "resume-path-file"), manifest)


def test_resume_path_that_is_an_empty_directory(outcomes, prepared, untouched):
    reports = job_reports(outcomes, "resume-path-empty")
    assert_refused_everywhere(reports, _own(prepared, "resume-path-empty")["path"])


def test_resume_path_to_an_older_step_restores_it(saved, outcomes, untouched):
    reports = job_reports(outcomes, "resume-path-older-step")
    _assert_restored(reports, saved["states"]["mlp"][1], 1, 1)


@pytest.mark.parametrize("mode", ["disable", "auto"])
def test_resume_from_path_is_ignored_outside_resume_path_mode(saved, outcomes, untouched, mode):
    """As in verl: "disable" restores nothing, "auto" the newest step, whatever the path."""
    reports = job_reports(outcomes, "resume-path-ignored", mode)
    if mode == "auto":
        _assert_restored(reports, saved["states"]["mlp"][2], 2, seen=2)
    else:
        assert all(r["ok"] and r["restored"] is None for r in reports)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"resume_mode": "resume"}, "resume_mode"),
        ({"resume_mode": "resume_path"}, "resume_from_path"),
        ({"resume_mode": "resume_path", "resume_from_path": ""}, "resume_from_path"),
    ],
)
def test_bad_resume_settings_are_refused_at_once(tmp_path, values, needle):
    with pytest.raises(UsageError, match=needle):
        CheckpointConfig(str(tmp_path), **values)


# --- only one rank was given something else -----------------------------------------------------


@pytest.mark.parametrize(("odd", "needles"), ONE_RANK_WITH_ANOTHER_MODEL, ids=ONE_RANK_IDS)
def test_one_rank_with_another_model_fails_every_rank(outcomes, untouched, odd, needles):
    reports = job_reports(outcomes, "one-rank-with-another-model", _frozen(odd))
    assert_refused_everywhere(reports, *needles)


def test_one_rank_with_a_bad_resume_path_fails_every_rank(outcomes, untouched):
    assert_refused_everywhere(job_reports(outcomes, "one-rank-bad-resume-path"), "global_step_2")


def test_ranks_asking_for_different_steps_fail_every_rank(outcomes, untouched):
    assert_refused_everywhere(job_reports(outcomes, "different-steps"), "step")


def test_ranks_loading_different_contents_fail_every_rank(outcomes, untouched):
    assert_refused_everywhere(job_reports(outcomes, "different-contents"), "optimizer")
