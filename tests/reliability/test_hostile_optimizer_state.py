"""Hostile restores of optimizer state where some parameters have none (FSDP2, FSDP1, gloo).

A model with a trained body, a top-1 routed mixture of experts whose last two experts are never
routed to, a frozen layer kept in the optimizer and a tower the forward pass never uses. It is
trained and saved once per module at 2 ranks (FSDP2) by shardstream's ``CheckpointManager``, by
``dcp.save`` of torch's state-dict API and in verl's per-rank ``.pt`` layout, some copies edited
the way a script or another tool might (one kind of state of one parameter dropped, a
parameter's whole state dropped on every rank or on one, a parameter left out of the saved
param groups). Each case restores one at 1, 3 or 4 ranks (at 4 some ranks hold empty shards of
the small parameters) into FSDP2, FSDP1 (``use_orig_params`` True and False) or a plain model,
with a live optimizer that is fresh or has already stepped every parameter. Other saves keep
state for every parameter (the frozen layer trained then), step counts that differ between
parameters (experts first routed to at the second step), two param groups in torchtitan's
flattened DCP form. Restores of the model alone or the optimizer alone leave the other part
as the live run had it. The outcome must be one of:

* success: the restored optimizer equals, bit for bit, what torch's own single-process
  ``Optimizer.load_state_dict`` gives for the saved state (computed here, in this process):
  parameters without saved state have none (whatever the live optimizer had), the others
  exactly the saved state, each param group the saved hyperparameters; every rank agrees on
  which parameters have state, and one more ``optimizer.step()`` works on every rank; or
* EVERY rank raises a one-line ``ShardstreamError`` naming the parameter or kind of state at
  fault, nobody hangs, and the live model and optimizer are as they were.

The cases of one world size share one job (the ranks start once and restore case after
case, each into fresh live objects with a process group of its own for the test's
collectives), so the ranks' caches are warm after the first. A case whose rank function
raises fails alone; a job that crashes or hangs fails every case of it. ``run``'s timeout is
only a hang guard. Where shardstream does otherwise, the test keeps asserting the right
behaviour and is marked ``xfail(strict=True)`` with what goes wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from shardstream.formats import native
from shardstream.testing.compare import clone_nested, gathered_state
from shardstream.testing.distributed import preload, run, shard_units
from shardstream.testing.verl_checkpoint import save_rank_files, write_fsdp_config

from .harness import (
    assert_refused_everywhere,
    attempt_restore,
    job_reports,
    jobs_by_world,
    local_state,
    same_nested,
)

preload(
    "torch._dynamo",  # FSDP2 imports it on its first fully_shard: a second per rank otherwise
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint.state_dict",
    "pytest",
)

SAVED_AT = 2  # ranks of the saving run
STEPS = 2  # steps it trains before it saves (but for "fresh")
HANG_S = 120  # a safety net against a rank stuck in a collective, not a timing assertion
EXPERTS = 4
UNROUTED = [f"moe.experts.{e}.{k}" for e in (2, 3) for k in ("weight", "bias")]
FROZEN = ["frozen.weight", "frozen.bias"]
TOWER = ["tower.weight", "tower.bias"]
NO_GRADIENT = sorted(UNROUTED + FROZEN + TOWER)  # never given a gradient by ``_step``


# --- what every rank runs -----------------------------------------------------------------------


class MoE(nn.Module):
    """Top-1 routing over per-expert modules; experts 2 and 3 are never chosen (their router
    bias), unless ``every`` deals the tokens round-robin."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(5, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(5, 5) for _ in range(EXPERTS))
        with torch.no_grad():
            self.router.bias[2:] = -100.0

    def forward(self, h: torch.Tensor, every: bool = False) -> torch.Tensor:
        gates = self.router(h).softmax(-1)
        choice = gates.argmax(-1)
        if every:  # round-robin, each expert's output in full
            choice, gates = torch.arange(len(h)) % EXPERTS, gates + 1
        out = h
        for e, expert in enumerate(self.experts):  # every rank routes the same tokens
            idx = (choice == e).nonzero().flatten()
            if idx.numel():
                out = out.index_add(0, idx, gates[idx, e : e + 1] * expert(h[idx]))
        return out


class Net(nn.Module):
    """Body and router always trained; two experts never routed to; a frozen layer (kept in
    the optimizer); a tower used only by ``every``. Rows of 3 and 5: at 4 ranks the last rank
    holds empty shards of the tower and of every expert."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 5))
        self.moe = MoE()
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.tower = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, every: bool = False) -> torch.Tensor:
        out = self.moe(self.frozen(self.body(x)), every)
        if every:
            out = out + self.tower(x[:, :6]).sum(-1, keepdim=True)
        return out


def _units(model: Net, wrap: str) -> list[nn.Module]:
    """The modules sharded as units of their own (the root is one more)."""
    if wrap == "fsdp1-flat-moe":  # the MoE block one unit, as verl wraps a decoder layer
        return [model.body[0], model.body[2], model.moe, model.frozen, model.tower]
    return [model.body[0], model.body[2], model.moe.router, *model.moe.experts]


def _build(world: int, wrap: str = "fsdp2", optim: str = "adamw", unfreeze: bool = False):
    """``wrap``: plain, fsdp2, fsdp1-orig / fsdp1-flat (FSDP1 with use_orig_params True /
    False), fsdp1-flat-moe (the whole MoE block one flat parameter). ``unfreeze``: the frozen
    layer trained too."""
    model = Net()
    model.frozen.requires_grad_(unfreeze)
    if wrap != "plain":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        units = _units(model, wrap)
        if wrap != "fsdp1-flat-moe":
            units += [model.frozen, model.tower]
        model = shard_units(model, units, mesh, wrap)
    return model, _optimizer(model, optim)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "adamw-other":  # other hyperparameters: the restore must bring the saved ones
        return torch.optim.AdamW(params, lr=5e-2, weight_decay=0.0, betas=(0.8, 0.9))
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=5e-2, weight_decay=0.1, fused=True)
    if name == "adamw-loop":
        return torch.optim.AdamW(params, lr=5e-2, weight_decay=0.1, foreach=False)
    if name == "adamw-trainable":  # the frozen layer left out of the optimizer
        return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2)
    if name == "amsgrad":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True)
    if name == "sgdm":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name.startswith("groups"):  # tower and frozen layer: a group of their own, no state
        aside = [
            p for n, p in model.named_parameters() if _clean(n).startswith(("tower", "frozen"))
        ]
        rest = [p for p in params if all(p is not q for q in aside)]
        lrs = (1e-2, 3e-3) if name == "groups" else (7e-2, 7e-2)
        return torch.optim.AdamW(
            [{"params": rest}, {"params": aside, "lr": lrs[1], "weight_decay": 0.0}],
            lr=lrs[0],
            weight_decay=0.1,
        )
    raise ValueError(name)


def _step(model, optimizer, seed: int, every: bool = False) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))
    model(x, every).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _optimizer_ids(model, optimizer) -> dict[str, int]:
    """FQN -> the integer id ``optimizer.state_dict()`` gives the parameter (FSDP2)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    return {names[id(p)]: i for i, p in enumerate(order)}


def _write_verl(actor: Path, rank: int, world: int, model, optim_state: dict) -> None:
    """verl's FSDPCheckpointManager layout: per-rank model, optimizer and extra state."""
    actor.mkdir(parents=True, exist_ok=True)
    save_rank_files(actor, rank, world, model.state_dict(), optim_state)
    if rank == 0:
        write_fsdp_config(actor, world)


def _edited(state: dict, ids: dict[str, int], rank: int, edit: str) -> dict:
    """``optimizer.state_dict()`` as a script or another tool might have changed it."""
    state = {
        "state": {k: dict(v) for k, v in state["state"].items()},
        "param_groups": [dict(g) for g in state["param_groups"]],
    }
    entries = state["state"]
    if edit == "drop-kind":  # one kind of state of one parameter, on every rank
        del entries[ids["body.0.weight"]]["exp_avg_sq"]
    elif edit == "drop-kind-rank1":
        if rank == 1:
            del entries[ids["body.0.weight"]]["exp_avg_sq"]
    elif edit == "drop-step":
        del entries[ids["moe.router.weight"]]["step"]
    elif edit == "drop-max":
        del entries[ids["body.2.weight"]]["max_exp_avg_sq"]
    elif edit == "drop-param":  # a trained parameter's whole state, on every rank
        del entries[ids["body.2.bias"]]
    elif edit == "drop-param-rank1":
        if rank == 1:
            del entries[ids["moe.experts.0.weight"]]
    elif edit == "ungrouped":  # a parameter with state left out of the saved param groups
        group = state["param_groups"][0]
        group["params"] = [p for p in group["params"] if p != ids["body.0.bias"]]
    elif edit == "empty":  # saved before any step: no state at all
        entries.clear()
    else:
        raise ValueError(edit)
    return state


# variant: (optimizer, steps, formats, verl edits, DCP edits)
VARIANTS = {
    "adamw": (
        "adamw",
        STEPS,
        ("native", "dcp", "verl"),
        (
            "drop-kind",
            "drop-kind-rank1",
            "drop-step",
            "drop-param",
            "drop-param-rank1",
            "ungrouped",
        ),
        ("drop-kind", "drop-param", "flat"),
    ),
    "amsgrad": ("amsgrad", STEPS, ("native", "verl"), ("drop-max",), ()),
    "sgdm": ("sgdm", STEPS, ("native", "verl"), (), ()),
    "groups": ("groups", STEPS, ("native", "dcp"), (), ("flat",)),
    "fresh": ("adamw", 0, ("native",), ("empty",), ()),  # never stepped: saved at step 0
    # every expert routed to, the tower used, the frozen layer trained (a later stage of the
    # run unfroze it): state for every parameter
    "everything": ("adamw", STEPS, ("native", "dcp", "verl"), (), ()),
    # the tower and unrouted experts trained from the second step on: their step counts lag
    "late": ("adamw", STEPS, ("native",), (), ()),
}


def _every(variant: str, seed: int) -> bool:
    """Whether the saving run's step ``seed`` trains every parameter."""
    return variant == "everything" or (variant == "late" and seed > 1)


def _drop_dcp(state: dict, edit: str) -> dict:
    if edit == "flat":  # as torchtitan saves it
        return state
    entries = {k: dict(v) for k, v in state["state"].items()}
    if edit == "drop-kind":
        del entries["body.0.weight"]["exp_avg_sq"]
    else:
        del entries["body.2.bias"]
    return {"state": entries, "param_groups": state["param_groups"]}


def _where(root: str | Path, variant: str, source: str) -> Path:
    """Where a variant is saved. ``source``: ``run`` (the manager's run directory), ``native``
    (its step), ``dcp[-edit]`` or ``verl[-edit]`` (named for the step as verl and torchtitan
    name theirs: the step restored)."""
    step = f"global_step_{VARIANTS[variant][1]}"
    base = Path(root, variant)
    if source == "run":
        return base / "native"
    if source == "native":
        return base / "native" / step
    if source.startswith("dcp"):
        return base / source / step
    return base / source / step / "actor"  # as verl's FSDPCheckpointManager


def save_variants(rank: int, world: int, root: str) -> dict:
    """Train and save every variant; rank 0 returns each one's gathered state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from shardstream import CheckpointConfig, CheckpointManager

    out = {}
    for variant, (optim, steps, formats, verl_edits, dcp_edits) in VARIANTS.items():
        everything = variant == "everything"
        model, optimizer = _build(world, "fsdp2", optim, unfreeze=everything)
        for seed in range(1, steps + 1):
            _step(model, optimizer, seed, every=_every(variant, seed))
        ids = _optimizer_ids(model, optimizer)
        # verl first: torch's state-dict API (the other two) initialises a fresh optimizer
        for edit in ("",) * ("verl" in formats) + verl_edits:
            state = optimizer.state_dict()
            if edit:
                state = _edited(state, ids, rank, edit)
            _write_verl(
                _where(root, variant, f"verl{edit and '-' + edit}"), rank, world, model, state
            )
        if "native" in formats:
            manager = CheckpointManager(
                CheckpointConfig(str(_where(root, variant, "run"))),
                model=model,
                optimizer=optimizer,
            )
            manager.save(steps)
            manager.close()
        for edit in ("", *dcp_edits) if "dcp" in formats else ():
            options = StateDictOptions(flatten_optimizer_state_dict=edit == "flat")
            state = get_optimizer_state_dict(model, optimizer, options=options)
            if edit:
                state = _drop_dcp(state, edit)
            dcp.save(
                {"model": get_model_state_dict(model), "optim": state},
                checkpoint_id=str(_where(root, variant, f"dcp{edit and '-' + edit}")),
            )
        out[variant] = gathered_state(model, optimizer)
        dist.barrier()
    return out if rank == 0 else {}


def _held(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel() > 0


def _owners(model) -> dict[int, list[tuple[str, bool]]]:
    """id of what the optimizer keys its state by -> [(FQN, this rank holds some of it)]:
    the parameter itself, or an FSDP1 flat parameter for each of its parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    owners = {id(p): [(_clean(n), _held(p))] for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        handle = getattr(module, "_handle", None)
        if isinstance(module, FullyShardedDataParallel) and handle is not None:
            flat = handle.flat_param
            if flat._params is None:  # use_orig_params=False: one entry for the unit
                prefix = _clean(f"{name}.") if name else ""
                owners[id(flat)] = [(_clean(prefix + f), True) for f in flat._fqns]
    return owners


def _kinds(model, optimizer) -> dict:
    """This rank's view, no collective: which parameters have which kinds of state, and which
    parameters it holds some elements of."""
    owners = _owners(model)
    kinds = {}
    for param, entries in optimizer.state.items():
        for fqn, _ in owners[id(param)]:
            kinds[fqn] = sorted(entries)
    held = sorted(fqn for group in owners.values() for fqn, h in group if h)
    return {"kinds": kinds, "held": held}


def restore_case(rank: int, world: int, spec: dict) -> dict:
    """Build the live objects, step them ``pre`` times (``every``: with every parameter
    trained, so the optimizer holds state the restore must replace or drop), restore, report
    what each rank holds and whether one more step works."""
    import torch.distributed as dist

    import shardstream
    from shardstream import CheckpointConfig, CheckpointManager

    mine = dist.new_group(backend="gloo")  # the test's own collectives never meet the restore's
    model, optimizer = _build(world, spec["wrap"], spec["optim"])
    for seed in range(spec["pre"]):
        _step(model, optimizer, 50 + seed, every=spec.get("every", True))
    before = local_state(model, optimizer)
    report: dict = {"rank": rank, "ok": False}

    def restore() -> int:
        if spec["api"] == "manager":
            manager = CheckpointManager(
                CheckpointConfig(spec["path"]), model=model, optimizer=optimizer
            )
            try:
                return manager.restore()[0]
            finally:
                manager.close()
        contents = spec.get("contents", ("model", "optimizer"))
        return shardstream.load(
            spec["path"], model=model, optimizer=optimizer, contents=contents
        ).step

    attempt_restore(report, restore)
    now = local_state(model, optimizer)
    if not report["ok"]:
        report["unchanged"] = same_nested(before, now)
    report["kept"] = {  # this rank's part of each, as before the restore
        "model": same_nested(before["params"], now["params"]),
        "optimizer": same_nested(before["state"], now["state"])
        and same_nested(before["groups"], now["groups"]),
    }
    outcomes = [None] * world
    dist.all_gather_object(outcomes, report["ok"], group=mine)
    if all(outcomes):
        report.update(_kinds(model, optimizer))
        full = gathered_state(model, optimizer)
        if rank == 0:
            report["full"] = full
        try:  # training goes on, on every rank
            _step(model, optimizer, 99)
            report["stepped"] = True
            report["after"] = _kinds(model, optimizer)["kinds"]
        except Exception as exc:  # noqa: BLE001
            report["stepped"] = f"{type(exc).__name__}: {exc}"
    dist.barrier(group=mine)
    dist.destroy_process_group(mine)
    return report


# --- the test side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hostile-optimizer-state")
    states = run(save_variants, SAVED_AT, str(root), timeout=HANG_S)[0]
    return {"root": root, "states": states}


STEP = f"global_step_{STEPS}"
CASE_S = 30  # more hang guard per case of a job, not a timing assertion

# The cases, by the test that checks them (each test's parameters, as its ids show them).
# (source, api, world, wrap, pre): the AdamW save into a live AdamW
WITHOUT_SAVED_STATE = [
    ("native", "manager", 4, "fsdp2", 2),
    ("native", "load", 1, "plain", 0),
    ("native", "manager", 4, "fsdp1-orig", 2),
    ("native", "load", 3, "fsdp1-flat", 2),
    ("dcp", "load", 3, "fsdp2", 2),
    ("dcp", "load", 4, "fsdp1-orig", 0),
    ("dcp-flat", "load", 3, "fsdp2", 0),
    ("verl", "load", 4, "fsdp2", 0),
    ("verl", "load", 4, "fsdp1-flat", 2),
    ("verl", "load", 1, "fsdp2", 2),
]
# (variant, source, world, wrap, live optimizer)
OTHER_OPTIMIZERS = [
    ("amsgrad", "native", 4, "fsdp2", "amsgrad"),
    ("amsgrad", "verl", 3, "fsdp1-orig", "amsgrad"),
    ("sgdm", "native", 3, "fsdp2", "sgdm"),
    ("sgdm", "verl", 1, "plain", "sgdm"),
    ("groups", "native", 3, "fsdp2", "groups-other"),
    ("groups", "dcp", 3, "fsdp1-orig", "groups-other"),
    ("groups", "dcp-flat", 3, "fsdp2", "groups-other"),
    ("adamw", "native", 3, "fsdp2", "adamw-other"),
    ("adamw", "dcp", 3, "fsdp2", "adamw-loop"),
    ("adamw", "verl", 3, "fsdp2", "adamw-fused"),
]
# (source, world, wrap, pre): the "everything" save
SAVED_FOR_EVERY_PARAMETER = [
    ("native", 3, "fsdp2", 0),
    ("verl", 4, "fsdp2", 2),
    ("dcp", 3, "fsdp1-orig", 2),
]
# (source, world, wrap, the part restored)
ONE_PART = [
    ("native", 3, "fsdp2", "model"),
    ("native", 3, "fsdp2", "optimizer"),
    ("verl", 3, "fsdp1-flat", "model"),
    ("verl", 3, "fsdp1-orig", "optimizer"),
    ("dcp", 3, "fsdp1-flat", "optimizer"),
    ("dcp", 1, "plain", "model"),
    ("native", 3, "fsdp1-orig", "model"),
    ("native", 4, "fsdp1-flat", "optimizer"),
]
DROPPED_EVERYWHERE = [("verl", 3), ("dcp", 4)]  # (source, world)
# (variant/source, world, wrap, what the refusal names)
ONE_KIND_MISSING = [
    ("adamw/verl-drop-kind", 3, "fsdp2", ("body.0.weight", "exp_avg_sq")),
    ("adamw/verl-drop-kind", 3, "fsdp1-flat", ("body.0.weight", "exp_avg_sq")),
    ("adamw/dcp-drop-kind", 1, "plain", ("body.0.weight", "exp_avg_sq")),
    ("adamw/verl-drop-step", 3, "fsdp2", ("moe.router.weight", "step")),
    ("amsgrad/verl-drop-max", 3, "fsdp2", ("body.2.weight", "max_exp_avg_sq")),
]
# (verl edit, world, what the refusal names)
ONE_RANK_FILE = [
    ("drop-kind-rank1", 3, ("exp_avg_sq",)),
    ("drop-param-rank1", 3, ("moe.experts.0.weight",)),
]


def _without_one_kind(doc: dict) -> None:
    doc["tensors"].pop("optimizer.state.moe.experts.1.weight.exp_avg")


def _parameter_out_of_the_groups(doc: dict) -> None:
    doc["objects"]["optimizer"]["param_groups"][0]["params"].remove("body.0.bias")


def _without_a_parameters_state(doc: dict) -> None:
    for name in [n for n in doc["tensors"] if n.startswith("optimizer.state.body.2.bias.")]:
        del doc["tensors"][name]


# copies of the AdamW native step, their manifests edited and resealed: name -> (edit, world)
RESEALED = {
    "without-one-kind": (_without_one_kind, 4),
    "parameter-out-of-the-groups": (_parameter_out_of_the_groups, 3),
    "without-a-parameters-state": (_without_a_parameters_state, 3),
}


def _spec(variant, source, world, wrap, optim, pre, api="load", every=True, contents=None):
    """One restore (see ``restore_case``) of ``_where(root, variant, source)``, or of the
    resealed copy ``source`` names (``resealed-<name>``)."""
    spec = {"variant": variant, "source": source, "world": world, "wrap": wrap}
    spec.update(optim=optim, pre=pre, api=api, every=every)
    if contents is not None:
        spec["contents"] = contents
    return spec


def _cases() -> dict[tuple, dict]:
    """Every restore a test checks, by the key its test looks it up with."""
    out = {}
    for source, api, world, wrap, pre in WITHOUT_SAVED_STATE:
        at = "run" if api == "manager" else source
        key = ("without-saved-state", source, api, world, wrap, pre)
        out[key] = _spec("adamw", at, world, wrap, "adamw", pre, api)
    out[("mixed-flat-parameter",)] = _spec("adamw", "native", 3, "fsdp1-flat-moe", "adamw", 2)
    for variant, source, world, wrap, live in OTHER_OPTIMIZERS:
        key = ("other-optimizers", variant, source, world, wrap, live)
        out[key] = _spec(variant, source, world, wrap, live, 2)
    for source, world, wrap, pre in SAVED_FOR_EVERY_PARAMETER:
        key = ("saved-for-every-parameter", source, world, wrap, pre)
        out[key] = _spec("everything", source, world, wrap, "adamw", pre, every=False)
    for source, world, wrap, part in ONE_PART:
        key = ("one-part", source, world, wrap, part)
        out[key] = _spec("adamw", source, world, wrap, "adamw", 2, contents=(part,))
    out[("late",)] = _spec("late", "native", 3, "fsdp2", "adamw", 2)
    out[("late-flat",)] = _spec("late", "native", 3, "fsdp1-flat-moe", "adamw", 2)
    out[("flattened-groups",)] = _spec("groups", "dcp-flat", 3, "fsdp2", "adamw", 2)
    out[("before-any-step",)] = _spec("fresh", "run", 3, "fsdp2", "adamw", 2, "manager")
    for source, world in DROPPED_EVERYWHERE:
        out[("dropped-everywhere", source, world)] = _spec(
            "adamw", f"{source}-drop-param", world, "fsdp2", "adamw", 2
        )
    for path, world, wrap, _ in ONE_KIND_MISSING:
        variant, source = path.split("/")
        out[("one-kind-missing", path, world, wrap)] = _spec(
            variant, source, world, wrap, variant, 2
        )
    for edit, world, _ in ONE_RANK_FILE:
        out[("one-rank-file", edit, world)] = _spec(
            "adamw", f"verl-{edit}", world, "fsdp2", "adamw", 2
        )
    out[("verl-ungrouped",)] = _spec("adamw", "verl-ungrouped", 3, "fsdp2", "adamw", 2)
    out[("verl-empty",)] = _spec("fresh", "verl-empty", 3, "fsdp2", "adamw", 2)
    out[("frozen-not-live",)] = _spec("adamw", "native", 3, "fsdp2", "adamw-trainable", 2)
    for name, (_, world) in RESEALED.items():
        out[("resealed", name)] = _spec("adamw", f"resealed-{name}", world, "fsdp2", "adamw", 2)
    out[("refused-fresh",)] = _spec("adamw", "verl-drop-kind", 3, "fsdp2", "adamw", 0)
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def resealed(saved, tmp_path_factory) -> dict[str, Path]:
    """name -> the step directory of that resealed copy of the AdamW native step."""
    root = tmp_path_factory.mktemp("resealed")
    out = {}
    for name, (edit, _) in RESEALED.items():
        step = root / name / STEP
        shutil.copytree(_where(saved["root"], "adamw", "native"), step)
        doc = json.loads((step / native.MANIFEST).read_text())
        edit(doc)
        native.write_manifest(step, doc)
        out[name] = step
    return out


@pytest.fixture(scope="module")
def outcomes(saved, resealed) -> dict:
    """Case key -> every rank's report, or the text of its job's failure: one job for the
    cases of each world size."""
    cases = {}
    for key, spec in CASES.items():
        spec = dict(spec)
        variant, source = spec.pop("variant"), spec.pop("source")
        if source.startswith("resealed-"):
            path = resealed[source.removeprefix("resealed-")]
        else:
            path = _where(saved["root"], variant, source)
        spec["path"] = str(path)
        cases[key] = (spec["world"], spec)
    return jobs_by_world(restore_case, cases, lambda count: HANG_S + CASE_S * count)


def torch_reference(saved_full: dict, optim: str, drop: tuple[str, ...] = ()) -> dict:
    """What torch's single-process ``Optimizer.load_state_dict`` makes of the saved state
    (less the parameters in ``drop``), loaded into a plain model's optimizer that has stepped
    every parameter first: ``{"state": {fqn: {kind: tensor}}, "param_groups": [...]}``, each
    group's ``params`` as sorted FQNs."""
    model = Net()
    optimizer = _optimizer(model, optim)
    for seed in range(2):
        _step(model, optimizer, 70 + seed, every=True)
    assert optimizer.state  # the state the load must replace
    names = {id(p): n for n, p in model.named_parameters()}
    ids = _optimizer_ids(model, optimizer)
    saved = saved_full["optim"]
    groups = []
    for saved_group, live in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        fqns = [names[id(p)] for p in live["params"]]
        assert sorted(saved_group["params"]) == sorted(fqns)
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        groups.append({**hyper, "params": [ids[f] for f in fqns]})
    state = {ids[f]: clone_nested(v) for f, v in saved["state"].items() if f not in drop}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return {
        "state": {names[id(p)]: clone_nested(dict(s)) for p, s in optimizer.state.items()},
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": sorted(names[id(p)] for p in g["params"]),
            }
            for g in optimizer.param_groups
        ],
    }


def _assert_restored(reports: list[dict], want: dict, saved_full: dict, step: int) -> None:
    """Every rank restored ``step``; the gathered optimizer is ``want`` (``torch_reference``)
    bit for bit, the model the saved one; every rank has state for exactly the parameters
    it holds that ``want`` gives state (the same kinds); one more step works everywhere."""
    for report in reports:
        assert report["ok"], f"rank {report['rank']}: {report['error']['traceback']}"
        assert report["restored"] == step
    got = reports[0]["full"]
    for name, tensor in saved_full["model"].items():
        assert same_nested(got["model"][name], tensor), name
    state = got["optim"]["state"]
    extra, lacking = (
        sorted(set(state) - set(want["state"])),
        sorted(set(want["state"]) - set(state)),
    )
    assert not extra and not lacking, f"state where torch has none: {extra}; missing: {lacking}"
    for fqn, entries in want["state"].items():
        assert sorted(state[fqn]) == sorted(entries), fqn
        for kind, value in entries.items():
            assert same_nested(state[fqn][kind], value), f"{fqn}.{kind}"
    got_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": sorted(g["params"])}
        for g in got["optim"]["param_groups"]
    ]
    assert got_groups == want["param_groups"]
    wanted = {fqn: sorted(entries) for fqn, entries in want["state"].items()}
    for report in reports:
        where = f"rank {report['rank']}"
        held = set(report["held"])
        kinds = report["kinds"]
        assert set(kinds) <= set(wanted), (where, sorted(set(kinds) - set(wanted)))
        assert {f: k for f, k in wanted.items() if f in held} == {
            f: k for f, k in kinds.items() if f in held
        }, where
        assert report["stepped"] is True, (where, report["stepped"])
        # after a step: the state it had, and state for the trained parameters it holds
        trained = held - set(NO_GRADIENT)
        assert set(report["after"]) & held == (set(wanted) & held) | trained, where


# --- what was saved -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["adamw", "amsgrad", "sgdm", "groups"])
def test_the_saving_run_kept_no_state_for_parameters_without_gradient(saved, variant):
    full = saved["states"][variant]
    assert sorted(set(full["model"]) - set(full["optim"]["state"])) == NO_GRADIENT


# --- legitimate checkpoints restore as torch's load_state_dict does -----------------------------


@pytest.mark.parametrize(
    ("source", "api", "world", "wrap", "pre"), WITHOUT_SAVED_STATE, ids=lambda v: str(v)
)
def test_parameters_without_saved_state_get_none(saved, outcomes, source, api, world, wrap, pre):
    """A live optimizer that stepped every parameter (``pre``) loses the state of those the
    checkpoint keeps none for; a fresh one (state initialised by torch's state-dict API) too."""
    reports = job_reports(outcomes, "without-saved-state", source, api, world, wrap, pre)
    want = torch_reference(saved["states"]["adamw"], "adamw")
    assert sorted(set(want["state"])) == sorted(
        set(saved["states"]["adamw"]["model"]) - set(NO_GRADIENT)
    )
    _assert_restored(reports, want, saved["states"]["adamw"], STEPS)


def test_mixed_flat_parameter_of_fsdp1_gets_zeros_not_stale_state(saved, outcomes):
    """FSDP1 with use_orig_params=False, the MoE block one flat parameter: routed and unrouted
    experts share one optimizer entry, so the unrouted ones cannot be left without state.
    Either the restore is refused naming them, or it does what torch's own FSDP1 loading
    (``_flatten_optim_state``) does: zeros for them, which is what no AdamW state means. The
    live optimizer's stale moments (it stepped every expert) must not survive."""
    reports = job_reports(outcomes, "mixed-flat-parameter")
    if not all(r["ok"] for r in reports):
        assert_refused_everywhere(reports, "moe.experts.")
        return
    want = torch_reference(saved["states"]["adamw"], "adamw")
    step = want["state"]["moe.router.weight"]["step"]
    for fqn in UNROUTED:
        shape = saved["states"]["adamw"]["model"][fqn].shape
        zeros = torch.zeros(shape)
        want["state"][fqn] = {"exp_avg": zeros, "exp_avg_sq": zeros.clone(), "step": step.clone()}
    for report in reports:
        assert report["ok"], report["error"]["traceback"]
    state = reports[0]["full"]["optim"]["state"]
    assert sorted(state) == sorted(want["state"])
    for fqn, entries in want["state"].items():
        for kind, value in entries.items():
            assert same_nested(state[fqn][kind], value), f"{fqn}.{kind}"
    assert all(r["stepped"] is True for r in reports), [r["stepped"] for r in reports]


@pytest.mark.parametrize(
    ("variant", "source", "world", "wrap", "live"), OTHER_OPTIMIZERS, ids=lambda v: str(v)
)
def test_other_optimizers_and_groups_restore_as_torch_does(
    saved, outcomes, variant, source, world, wrap, live
):
    """AdamW with amsgrad, SGD with momentum (no momentum_buffer for the parameters never
    given a gradient), a whole param group without state; live hyperparameters (lr, betas,
    foreach) other than the saved ones, which torch's load_state_dict replaces."""
    reports = job_reports(outcomes, "other-optimizers", variant, source, world, wrap, live)
    want = torch_reference(saved["states"][variant], live)
    _assert_restored(reports, want, saved["states"][variant], STEPS)


@pytest.mark.parametrize(
    ("source", "world", "wrap", "pre"), SAVED_FOR_EVERY_PARAMETER, ids=lambda v: str(v)
)
def test_saved_state_for_parameters_the_live_optimizer_has_none_for(
    saved, outcomes, source, world, wrap, pre
):
    """The checkpoint keeps state for every parameter (the frozen layer was trained then); the
    live optimizer has none for the frozen layer (fresh: torch's state-dict API initialises
    only parameters that require gradients) or, after ``pre`` steps as the run first trained,
    for the tower and unrouted experts either. torch's load_state_dict gives every parameter
    its saved state, which the frozen layer keeps until it is unfrozen."""
    full = saved["states"]["everything"]
    reports = job_reports(outcomes, "saved-for-every-parameter", source, world, wrap, pre)
    want = torch_reference(full, "adamw")
    assert sorted(want["state"]) == sorted(full["model"])
    _assert_restored(reports, want, full, STEPS)


@pytest.mark.parametrize(("source", "world", "wrap", "part"), ONE_PART, ids=lambda v: str(v))
def test_one_part_restored_the_other_left_as_it_was(saved, outcomes, source, world, wrap, part):
    """``contents`` naming the model alone, or the optimizer alone, into a live run that has
    stepped: that part as saved (the optimizer as torch's load_state_dict gives it), the
    other exactly as the live run had it, on every rank."""
    full = saved["states"]["adamw"]
    reports = job_reports(outcomes, "one-part", source, world, wrap, part)
    for report in reports:
        assert report["ok"], f"rank {report['rank']}: {report['error']['traceback']}"
        other = "optimizer" if part == "model" else "model"
        assert report["kept"][other], f"rank {report['rank']}: the {other} changed"
    got = reports[0]["full"]
    if part == "model":
        for name, tensor in full["model"].items():
            assert same_nested(got["model"][name], tensor), name
        return
    want = torch_reference(full, "adamw")
    state = got["optim"]["state"]
    assert sorted(state) == sorted(want["state"])
    for fqn, entries in want["state"].items():
        for kind, value in entries.items():
            assert same_nested(state[fqn][kind], value), f"{fqn}.{kind}"


def test_step_counts_that_differ_between_parameters(saved, outcomes):
    """The tower and the unrouted experts first trained at the second step: step 1 where the
    rest has step 2, as torch keeps a step per parameter."""
    full = saved["states"]["late"]
    assert full["optim"]["state"]["moe.experts.2.weight"]["step"] == 1
    assert full["optim"]["state"]["moe.experts.0.weight"]["step"] == 2
    reports = job_reports(outcomes, "late")
    _assert_restored(reports, torch_reference(full, "adamw"), full, STEPS)


def test_step_counts_that_differ_within_one_fsdp1_flat_parameter(outcomes):
    """One flat parameter keeps one step count; torch's own FSDP1 loading refuses parameters
    of one flat parameter with different scalar state. Taking one of them silently would
    give the others another bias correction."""
    assert_refused_everywhere(job_reports(outcomes, "late-flat"), "step")


def test_flattened_dcp_groups_with_other_hyperparameters_merged_into_one(outcomes):
    """torchtitan's flattened optimizer state dict keeps every parameter's hyperparameters
    (``param_groups.<fqn>.<key>``). Two saved groups (the tower and frozen layer without
    weight decay, at another lr) into a live optimizer of one group: the restored group
    cannot hold both, so the restore is refused (as torch's load_state_dict refuses it), not
    done with the first parameter's values for all."""
    reports = job_reports(outcomes, "flattened-groups")
    assert_refused_everywhere(reports, "param group", "saved with different settings")


def test_checkpoint_saved_before_any_step(saved, outcomes):
    """shardstream's own step-0 checkpoint holds the state torch's state-dict API initialised
    at the save (zero moments): it comes back as saved."""
    reports = job_reports(outcomes, "before-any-step")
    full = saved["states"]["fresh"]
    want = torch_reference(full, "adamw")
    _assert_restored(reports, want, full, 0)


@pytest.mark.parametrize(("source", "world"), DROPPED_EVERYWHERE)
def test_trained_parameter_whose_state_was_dropped_everywhere_gets_none(
    saved, outcomes, source, world
):
    """A checkpoint written without any state for ``body.2.bias`` (on every rank): restored
    as torch loads it, that parameter without state."""
    reports = job_reports(outcomes, "dropped-everywhere", source, world)
    want = torch_reference(saved["states"]["adamw"], "adamw", drop=("body.2.bias",))
    assert "body.2.bias" not in want["state"]
    _assert_restored(reports, want, saved["states"]["adamw"], STEPS)


# --- checkpoints that cannot be restored as saved are refused -----------------------------------


@pytest.mark.parametrize(
    ("path", "world", "wrap", "needles"), ONE_KIND_MISSING, ids=lambda v: str(v)
)
def test_one_kind_of_state_missing_for_one_parameter(outcomes, path, world, wrap, needles):
    reports = job_reports(outcomes, "one-kind-missing", path, world, wrap)
    assert_refused_everywhere(reports, *needles)


@pytest.mark.parametrize(("edit", "world", "needles"), ONE_RANK_FILE)
def test_state_missing_in_one_saved_rank_file_only(outcomes, edit, world, needles):
    """verl's rank 1 file lacks what rank 0's has: no rank may restore it."""
    assert_refused_everywhere(job_reports(outcomes, "one-rank-file", edit, world), *needles)


def test_parameter_with_state_left_out_of_verl_param_groups(outcomes):
    """torch's load_state_dict refuses groups of another size; verl's ids give no FQN."""
    assert_refused_everywhere(job_reports(outcomes, "verl-ungrouped"), "param groups")


def test_verl_checkpoint_without_any_state_into_adamw(outcomes):
    assert_refused_everywhere(job_reports(outcomes, "verl-empty"), "optimizer.state.")


def test_frozen_layer_in_the_saved_groups_but_not_in_the_live_optimizer(outcomes):
    assert_refused_everywhere(job_reports(outcomes, "frozen-not-live"), "frozen.weight")


def test_native_manifest_resealed_without_one_kind_of_state(outcomes):
    reports = job_reports(outcomes, "resealed", "without-one-kind")
    assert_refused_everywhere(reports, "moe.experts.1.weight.exp_avg")


def test_native_manifest_resealed_with_a_parameter_left_out_of_the_groups(outcomes):
    reports = job_reports(outcomes, "resealed", "parameter-out-of-the-groups")
    assert_refused_everywhere(reports, "body.0.bias")


def test_native_manifest_resealed_without_a_parameters_state(saved, outcomes):
    """Either restored as torch would load it (``body.2.bias`` without state) or refused as a
    manifest that does not describe its files, naming the tensor."""
    reports = job_reports(outcomes, "resealed", "without-a-parameters-state")
    if all(r["ok"] for r in reports):
        want = torch_reference(saved["states"]["adamw"], "adamw", drop=("body.2.bias",))
        _assert_restored(reports, want, saved["states"]["adamw"], STEPS)
    else:
        assert_refused_everywhere(reports, "optimizer.state.body.2.bias.")


def test_refused_restore_leaves_a_fresh_optimizer_fresh(outcomes):
    """A live optimizer never stepped, the restore refused: it must still have no state (an
    AdamW step counter of 1 would change the next update's bias correction)."""
    assert_refused_everywhere(job_reports(outcomes, "refused-fresh"), "exp_avg_sq")
