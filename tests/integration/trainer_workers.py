"""Trainers' own checkpoints, saved and restored on real processes (FSDP2 over gloo).

Each scenario saves at one world size with the tool's own saving code (``dcp.save`` of
PyTorch's ``{"app": AppState}`` recipe, accelerate's ``Accelerator.save_state``) and restores
through shardstream at another, returning full (gathered) state for the test to compare.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import random

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import get_cosine_schedule_with_warmup

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.testing.compare import clone_nested

from . import workers


def _build(world: int, seed: int, shard: bool = True):
    model, optimizer, _, config = workers.build((world,) if shard else None, seed=seed)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1, 10)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps=(1, 2)) -> None:
    for step in steps:
        workers.train_step(model, optimizer, scheduler, step)


class AppState:
    """PyTorch's DCP recipe: one Stateful holding model, optimizer and scheduler."""

    def __init__(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state):  # pragma: no cover - the recipe's own restore
        raise NotImplementedError


def recipe_run(rank: int, world: int, root: str, stage: str) -> dict:
    """stage "save": two steps, then ``dcp.save({"app": AppState})`` (transformers' cosine
    schedule); stage "restore": the manager's restore(path=...) at this world size."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, scheduler = _build(world, seed=0 if stage == "save" else 5)
    path = f"{root}/step-2"
    restored = None
    if stage == "save":
        _train(model, optimizer, scheduler)
        dcp.save({"app": AppState(model, optimizer, scheduler)}, checkpoint_id=path)
    else:
        cfg = CheckpointConfig(directory=f"{root}/run-{world}")
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        restored = manager.restore(path=path)
        manager.close()
    return {"state": workers.full_state(model, optimizer, scheduler), "step": restored}


def _sequential(optimizer, parts: int):
    lam = torch.optim.lr_scheduler.LambdaLR
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [lam(optimizer, functools.partial(_factor, i)) for i in range(parts)],
        milestones=list(range(2, 2 * parts, 2)),
    )


def _factor(i: int, step: int) -> float:
    return 1.0 / (1 + i + step)


def refused_run(rank: int, world: int, root: str) -> dict:
    """A train state whose SequentialLR chains three schedules, restored into objects whose
    SequentialLR chains two: the error, and the state before and after (untouched)."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, _ = _build(world, seed=0)
    scheduler = _sequential(optimizer, 3)
    _train(model, optimizer, scheduler, steps=(1,))
    dcp.save({"app": AppState(model, optimizer, scheduler)}, checkpoint_id=f"{root}/seq-1")

    model, optimizer, _ = _build(world, seed=5)
    scheduler = _sequential(optimizer, 2)
    before = workers.full_state(model, optimizer, scheduler)
    cfg = CheckpointConfig(directory=f"{root}/refused-{world}")
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    try:
        manager.restore(path=f"{root}/seq-1")
        error = None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        error = f"{type(exc).__name__}: {exc}"
    manager.close()
    after = workers.full_state(model, optimizer, scheduler)
    return {"error": error, "before": before, "after": after}


def _accelerate_env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # the process group exists already; accelerate does not open one
        OMP_NUM_THREADS="1",
    )


def _accelerator(rank: int, world: int, state_dict_type: str = "SHARDED_STATE_DICT"):
    """accelerate's ``Accelerator`` on CPU with the FSDP2 plugin (a sharded state dict unless
    ``state_dict_type`` says otherwise), in the process group that exists already; save
    through ``_save_state``."""
    _accelerate_env(rank, world)
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type=state_dict_type, reshard_after_forward=True
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    # accelerate enables FSDP only on accelerators (its AcceleratorState turns FSDP on
    # from GPU-like distributed types, never from MULTI_CPU); its FSDP2 preparation and
    # checkpoint code run on CPU all the same once the state says FSDP.
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _save_state(accelerator, path: str) -> None:
    """``Accelerator.save_state(path)`` through accelerate's FSDP code (the state says FSDP
    again, as ``_accelerator`` set it)."""
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.save_state(path)


def accelerate_run(rank: int, world: int, root: str, stage: str) -> dict:
    """stage "save": accelerate's own prepare (FSDP2, sharded state dict) and two steps, then
    ``Accelerator.save_state``; stage "restore": the manager's restore(path=...) of that
    directory into FSDP2 objects at this world size. Both return the full state and this
    rank's torch RNG state after the save / restore."""
    path = f"{root}/accelerate_state"
    restored = None
    if stage == "save":
        accelerator = _accelerator(rank, world)
        model, optimizer, scheduler = _build(world, seed=0, shard=False)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        _train(model, optimizer, scheduler)
        torch.manual_seed(1234 + rank)
        random.seed(99 + rank)
        _save_state(accelerator, path)
        optimizer, scheduler = optimizer.optimizer, scheduler.scheduler
        names = sorted(os.listdir(path))
    else:
        model, optimizer, scheduler = _build(world, seed=5)
        torch.manual_seed(0)
        cfg = CheckpointConfig(directory=f"{root}/run-{world}")
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        restored = manager.restore(path=path)
        manager.close()
        names = None
    return {
        "state": workers.full_state(model, optimizer, scheduler),
        "rng": (torch.get_rng_state(), random.getstate()),
        "step": restored,
        "files": names,
    }


# --------------------------------------------------------------------------- fused QKV


class FusedQKV(torch.nn.Module):
    """One ``wqkv`` parameter that state dicts present as ``wq``/``wk``/``wv`` (torchtitan's
    fused attention projection): a state-dict hook splits it, a load pre-hook fuses."""

    def __init__(self, dim: int, kv_dim: int):
        super().__init__()
        self.sizes = (dim, kv_dim, kv_dim)
        self.wqkv = torch.nn.Linear(dim, dim + 2 * kv_dim, bias=False)
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(self._fuse)

    @staticmethod
    def _split(module, state, prefix, metadata):
        fused = state.pop(prefix + "wqkv.weight")
        for name, part in zip(("wq", "wk", "wv"), torch.split(fused, module.sizes, 0)):
            state[f"{prefix}{name}.weight"] = part

    def _fuse(self, state, prefix, *args):
        parts = [state.pop(f"{prefix}{name}.weight") for name in ("wq", "wk", "wv")]
        state[prefix + "wqkv.weight"] = torch.cat(parts, 0)

    def forward(self, x):
        q, k, v = torch.split(self.wqkv(x), self.sizes, -1)
        return q * (k * v).sum(-1, keepdim=True)


class FusedLayer(torch.nn.Module):
    def __init__(self, dim: int, kv_dim: int):
        super().__init__()
        self.attention = FusedQKV(dim, kv_dim)
        self.wo = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.wo(self.attention(x))


class FusedModel(torch.nn.Module):
    def __init__(self, dim: int = 10, kv_dim: int = 3, layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(FusedLayer(dim, kv_dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _fused(world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = FusedModel()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer


def _fused_state(model, optimizer) -> dict:
    """Every parameter and optimizer entry in full, by live FQN (``get_model_state_dict``
    cannot name a hooked model's parameters)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    params = {name: full(p) for name, p in model.named_parameters()}
    optim = get_optimizer_state_dict(model, optimizer)
    state = {
        fqn: {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
        for fqn, entries in optim["state"].items()
    }
    return {"model": params, "optim": state, "groups": clone_nested(optim["param_groups"])}


def _presented(name: str, value, sizes) -> dict:
    """A live ``...wqkv.weight`` entry as the hook presents it (split along dim 0; a value
    without ``sizes`` is repeated, as a 0-d step or a name is)."""
    if not name.endswith("wqkv.weight"):
        return {name: value}
    head = name[: -len("wqkv.weight")]
    parts = torch.split(value, sizes, 0) if sizes else (value,) * 3
    return {f"{head}{n}.weight": p for n, p in zip(("wq", "wk", "wv"), parts)}


class Loader:
    """torchtitan's ParallelAwareDataloader: its state pickled under its data-parallel rank."""

    def __init__(self, rank: int, position: int = 0):
        self.rank, self.position = rank, position

    def state_dict(self):
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position})}

    def load_state_dict(self, state):
        raw = state.get(f"dp_rank_{self.rank}")
        if raw is not None:  # a rank the run did not have starts its data afresh
            self.position = pickle.loads(raw)["position"]


class TrainState:
    """torchtitan's TrainState: the step, and loss histories as torch.save'd BytesIO."""

    def __init__(self, step: int = 0, losses=()):
        self.step, self.losses = step, list(losses)

    def state_dict(self):
        buffer = io.BytesIO()
        torch.save(self.losses, buffer)
        return {"step": self.step, "global_avg_losses": buffer}

    def load_state_dict(self, state):
        self.step = state["step"]
        state["global_avg_losses"].seek(0)
        self.losses = torch.load(state["global_avg_losses"])


def fused_run(rank: int, world: int, root: str, stage: str) -> dict:
    """stage "save": two AdamW steps on a FSDP2 model with fused-QKV hooks, then ``dcp.save``
    of a torchtitan-style train state whose model and optimizer keys are the presented ones
    (wq/wk/wv); stage "restore": the manager's restore(path=...) at this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer = _fused(world, seed=0 if stage == "save" else 5)
    sizes = model.layers[0].attention.sizes
    path = f"{root}/step-2"
    restored = None
    if stage == "save":
        for step in (1, 2):
            x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        full = _fused_state(model, optimizer)
        model_sd = {}
        for name, value in full["model"].items():
            model_sd.update(_presented(name, value, sizes))
        optim = get_optimizer_state_dict(model, optimizer)
        optim_state = {}
        for fqn, entries in optim["state"].items():
            for key, value in entries.items():
                value = full["optim"][fqn][key]
                for name, part in _presented(fqn, value, sizes if value.dim() else None).items():
                    optim_state.setdefault(name, {})[key] = part
        groups = [
            {**g, "params": [n for p in g["params"] for n in _presented(p, None, None)]}
            for g in optim["param_groups"]
        ]
        state = {
            **model_sd,  # torchtitan: the model's keys at the top level
            "optimizer": {"state": optim_state, "param_groups": groups},
            "dataloader": Loader(rank, 10 + rank),
            "train_state": TrainState(2, [1.0, 0.5]),
        }
        dcp.save(state, checkpoint_id=path)
        loader, train_state = state["dataloader"], state["train_state"]
    else:
        loader, train_state = Loader(rank), TrainState()
        cfg = CheckpointConfig(directory=f"{root}/run-{world}")
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
        stateful = {"dataloader": loader, "train_state": train_state}
        restored = manager.restore(path=path, states=stateful)
        manager.close()
    return {
        "state": _fused_state(model, optimizer),
        "step": restored,
        "position": loader.position,
        "train_step": train_state.step,
    }


# --------------------------------------------------------------------------- HF storage writer


def hf_writer_run(rank: int, world: int, root: str, stage: str, consolidate: bool) -> dict:
    """stage "save": ``dcp.save`` of the model through DCP's HuggingFaceStorageWriter
    (save_distributed=True, consolidated or not); "save-undistributed": the same without
    save_distributed, each rank into hf-rank{rank}/ (the files a shared directory would hold,
    whichever rank wrote last); stage "restore": the manager's restore(path=...) of the model
    at this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, optimizer, scheduler = _build(world, seed=0 if stage == "save" else 5)
    path = f"{root}/hf"
    if stage.startswith("save"):
        _train(model, optimizer, scheduler, steps=(1,))
        writer = HuggingFaceStorageWriter(
            path=path, save_distributed=True, enable_consolidation=consolidate
        )
        if stage == "save-undistributed":
            writer = HuggingFaceStorageWriter(path=f"{root}/hf-rank{rank}")
        dcp.save(get_model_state_dict(model), storage_writer=writer)
    else:
        cfg = CheckpointConfig(directory=f"{root}/run-{world}", load_contents=("model",))
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
        manager.restore(path=path)
        manager.close()
    return workers.full_state(model, optimizer, scheduler)["model"]
