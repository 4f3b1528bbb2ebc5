"""Rank functions of test_tensor_parallel.py: a small decoder block trained with tensor
parallelism (``parallelize_module``, plain Colwise/Rowwise, no sequence parallelism) and FSDP2
over a ``(dp, tp)`` mesh on gloo, saved by shardstream's ``CheckpointManager`` and by
``dcp.save``, and restored into other layouts.

Layouts (``build``): ``"tp-fsdp"`` (dp = world / 2, tp = 2: ``parallelize_module`` on the tp
submesh, then ``fully_shard`` on the dp submesh, as torchtitan does), ``"fsdp"`` (FSDP2 over
all ranks, no TP), ``"tp"`` (TP over all ranks, no FSDP) and ``"plain"`` (one process).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEAD_DIM, HEADS, HIDDEN = 97, 40, 12, 4, 70  # 97 and 70: uneven TP and FSDP rows
STEPS = 2  # steps the saving runs train before they save
LR = 1e-2

# Colwise on each first projection, Rowwise on each second; the head's logits replicated.
# The embedding and the norm are left to FSDP alone (replicated over tp), as Hugging Face
# models' TP plans leave the embedding.
TP_PLAN = {
    "q": "colwise",
    "k": "colwise",
    "v": "colwise",
    "o": "rowwise",
    "up": "colwise",
    "down": "rowwise",
    "head": "colwise-replicated",
}


class Block(nn.Module):
    """Embedding, norm, causal attention (q/k/v, o), an MLP with one bias (up, down), head.
    Under TP each rank runs its heads and its slice of the MLP's hidden units."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH, bias=False)
        self.q = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        x = self.norm(h)
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        h = h + self.down(F.gelu(self.up(h)))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


class Run:
    """The live objects of one rank: model, AdamW, an LR schedule, and which data shard
    (``dp_rank``) it trains on."""

    def __init__(self, layout: str, world: int):
        self.layout = layout
        self.model = Block()
        self.dp_rank = 0
        self.tp = 1
        if layout != "plain":
            self._parallelize(world)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1 / (1 + s))

    def _parallelize(self, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {
            "colwise": ColwiseParallel,
            "rowwise": RowwiseParallel,
            "colwise-replicated": lambda: ColwiseParallel(output_layouts=Replicate()),
        }
        if self.layout == "fsdp":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            fully_shard(self.model, mesh=mesh)
            self.dp_rank = mesh.get_local_rank()
            return
        if self.layout == "tp":
            tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        else:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            tp_mesh = mesh["tp"]
        plan = {name: styles[style]() for name, style in TP_PLAN.items()}
        parallelize_module(self.model, tp_mesh, plan)
        self.tp = tp_mesh.size()
        if self.layout == "tp-fsdp":
            fully_shard(self.model, mesh=mesh["dp"])
            self.dp_rank = mesh["dp"].get_local_rank()

    def train_step(self, seed: int) -> float:
        """One forward, backward and AdamW step on this data shard's batch of ``seed``."""
        gen = torch.Generator().manual_seed(1000 * seed + self.dp_rank)
        ids = torch.randint(0, VOCAB, (3, 6), generator=gen)
        loss = self.model(ids, ids.roll(-1, 1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        return float(loss)


def _full(run: Run) -> dict:
    """The whole model and optimizer state, gathered (a collective) and cloned."""
    from shardstream.testing.compare import clone_nested, gathered_state

    if run.layout == "plain":
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        return clone_nested(
            {
                "model": get_model_state_dict(run.model),
                "optim": get_optimizer_state_dict(run.model, run.optimizer),
            }
        )
    return gathered_state(run.model, run.optimizer)


def _expected_local(full: torch.Tensor, name: str, run: Run, rank: int, world: int):
    """What this rank should hold of the whole ``full`` in the tp-fsdp layout: its TP slice
    (rows for Colwise, columns for Rowwise, all for the rest), then its FSDP rows of that."""
    fqn = name.rpartition(".")[0]
    style = TP_PLAN.get(fqn)
    tp_rank = rank % run.tp
    local = full
    if style is not None:
        local = torch.chunk(full, run.tp, dim=1 if style == "rowwise" else 0)[tp_rank]
    return torch.chunk(local, world // run.tp, dim=0)[run.dp_rank]


def layout_report(run: Run, full: dict, rank: int, world: int) -> dict:
    """Each parameter's mesh dims and placements on this rank, and every parameter or AdamW
    moment whose local shard is not the one TP's and FSDP's chunking gives it: the gathered
    reference the tests compare with is then what the ranks hold."""
    from torch.distributed.tensor import DTensor

    placements, wrong = {}, []
    state = run.optimizer.state
    for name, param in run.model.named_parameters():
        assert isinstance(param, DTensor), name
        placements[name] = (
            list(param.device_mesh.mesh_dim_names),
            [type(p).__name__ for p in param.placements],
        )
        pairs = [(name, param, full["model"][name])]
        for kind in ("exp_avg", "exp_avg_sq"):
            pairs.append((f"{name}.{kind}", state[param][kind], full["optim"]["state"][name][kind]))
        for label, live, whole in pairs:
            want = _expected_local(whole, name, run, rank, world)
            if not torch.equal(live.to_local(), want):
                wrong.append(label)
    return {"placements": placements, "wrong": wrong}


def save_tp_fsdp(rank: int, world: int, root: str) -> dict:
    """Train ``STEPS`` steps in the tp-fsdp layout; save with the CheckpointManager (model,
    optimizer, LR schedule) into ``root/run`` and with ``dcp.save`` of torch's state-dict API
    into ``root/dcp/step-2``; then train one more step. Rank 0 returns the state saved and the
    state after that step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from shardstream import CheckpointConfig, CheckpointManager

    run = Run("tp-fsdp", world)
    for seed in range(STEPS):
        run.train_step(seed)
    full = _full(run)
    report = layout_report(run, full, rank, world)
    manager = CheckpointManager(
        CheckpointConfig(f"{root}/run"),
        model=run.model,
        optimizer=run.optimizer,
        lr_scheduler=run.scheduler,
    )
    manager.save(STEPS)
    manager.close()
    state = {
        "model": get_model_state_dict(run.model),
        "optim": get_optimizer_state_dict(run.model, run.optimizer),
    }
    dcp.save(state, checkpoint_id=f"{root}/dcp/step-{STEPS}")
    scheduler = run.scheduler.state_dict()
    run.train_step(STEPS)
    after = _full(run)
    if rank == 0:
        report.update(full=full, after=after, scheduler=scheduler)
    return report


def save_fsdp(rank: int, world: int, root: str) -> dict | None:
    """Train ``STEPS`` steps with FSDP2 alone and save with ``shardstream.save`` into
    ``root/fsdp``; rank 0 returns the state saved."""
    import shardstream

    run = Run("fsdp", world)
    for seed in range(STEPS):
        run.train_step(seed)
    full = _full(run)
    shardstream.save(f"{root}/fsdp", model=run.model, optimizer=run.optimizer, step=STEPS)
    return full if rank == 0 else None


def restore_run(rank: int, world: int, layout: str, cases: dict[str, dict]) -> dict:
    """For each case (``path``; ``api``: "manager", whose restore() also brings the LR
    schedule, or "load"; ``pre``: steps the live run takes first, else its optimizer is
    fresh), a live run of ``layout`` restores the checkpoint; every rank reports whether it
    did, rank 0 the gathered state, then all take one more step (rank 0: the state after)."""
    import traceback

    import torch.distributed as dist

    import shardstream
    from shardstream import CheckpointConfig, CheckpointManager

    mine = dist.new_group(backend="gloo")  # the test's own collectives never meet shardstream's
    reports = {}
    for label, case in cases.items():
        run = Run(layout, world)
        for seed in range(case.get("pre", 0)):
            run.train_step(50 + seed)
        report: dict = {"rank": rank, "ok": False}
        try:
            if case["api"] == "manager":
                manager = CheckpointManager(
                    CheckpointConfig(case["path"]),
                    model=run.model,
                    optimizer=run.optimizer,
                    lr_scheduler=run.scheduler,
                )
                try:
                    report["step"] = manager.restore()[0]
                finally:
                    manager.close()
            else:
                report["step"] = shardstream.load(
                    case["path"], model=run.model, optimizer=run.optimizer
                ).step
            report["ok"] = True
        except Exception:  # noqa: BLE001 - reported, every rank compared by the test
            report["error"] = traceback.format_exc()
        outcomes = [None] * world
        dist.all_gather_object(outcomes, report["ok"], group=mine)
        if all(outcomes):
            full = _full(run)
            scheduler = run.scheduler.state_dict()
            try:
                loss = run.train_step(STEPS)
                report["stepped"] = loss == loss  # a number, not NaN
            except Exception:  # noqa: BLE001
                report["stepped"] = traceback.format_exc()
            dist.all_gather_object(outcomes, report["stepped"] is True, group=mine)
            after = _full(run) if all(outcomes) else None
            if rank == 0:
                report.update(full=full, scheduler=scheduler, after=after)
        dist.barrier(group=mine)
        reports[label] = report
    return reports
