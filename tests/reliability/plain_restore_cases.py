"""What the ranks of ``test_hostile_plain_restore.py`` run: the tools' own saves without FSDP,
and batches of restores of (damaged) copies of them into fresh live objects.

The saves are the integration tests' (``tests/integration/unsharded_save_workers.py``):
accelerate's ``Accelerator(cpu=True).save_state`` and transformers' ``Trainer`` at one process,
with a tiny Qwen2; and ``save_pretrained`` of a tiny Qwen3-MoE (per-expert tensors on disk,
fused ones in memory).

A batch restores case after case in one job (the ranks start once): for each, live objects
built as the saving run built them (differently seeded, one training step taken, so every
tensor and the optimizer state differ from the saved ones), the full state gathered before,
the restore (``CheckpointManager(...).restore(path=...)`` into FSDP2 at several ranks,
``shardstream.load`` into a plain model at one), the full state gathered after. A case's
report says whether it restored, the error (``harness.attempt_restore``), whether the live state
(model, optimizer, scheduler, torch's RNG) is as it was, and for a restore that worked the
gathered state and whether one more training step works.
"""

from __future__ import annotations

import os
import random
from functools import partial

import numpy as np
import torch

from .harness import attempt_restore, same_nested

LIVE_SEED = 5  # the restoring run's models: every tensor differs from the saved ones


# --- the saving runs ----------------------------------------------------------------------------


def save_accelerate(rank: int, world: int, root: str, tie: bool) -> dict:
    """accelerate's ``save_state`` without FSDP (one process), as the integration test does it:
    ``root/accelerate_state`` and the state at the save in ``root/reference.pt``."""
    from integration import unsharded_save_workers as uw

    return uw.accelerate_save_run(rank, world, root, tie, True)


def save_trainer_and_moe(rank: int, world: int, root: str, moe_dir: str) -> dict:
    """The Trainer's ``checkpoint-2`` without FSDP (one process) under ``root/out``, the state
    at the save in ``root/reference.pt``; then ``save_pretrained`` of a tiny Qwen3-MoE into
    ``moe_dir`` (its per-expert tensors), its state dict in ``moe_dir/../moe-reference.pt``."""
    from integration import unsharded_save_workers as uw

    from shardstream.testing.tiny_models import build_layout_model

    out = uw.trainer_save_run(rank, world, root, False)
    model = build_layout_model("qwen3_moe", seed=0)
    model.save_pretrained(moe_dir)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(reference, os.path.join(os.path.dirname(moe_dir), "moe-reference.pt"))
    return out


# --- the restoring side -------------------------------------------------------------------------


class _NoScheduler:
    def state_dict(self) -> dict:
        return {}


def _fully_shard(model: torch.nn.Module, world: int) -> None:
    """FSDP2 on an explicit 1-D CPU mesh: each decoder layer (and MoE block) a unit, then the
    root."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardstream.testing.distributed import shard_units

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    units = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    shard_units(model, units, mesh)


def build_live(live: str, root: str, world: int, shard: bool):
    """Model, optimizer, scheduler as the saving run built them (``live``: ``accelerate``,
    ``accelerate-tied``, ``trainer``, ``moe``; the MoE model alone), seeded otherwise."""
    from integration import unsharded_save_workers as uw

    from shardstream.testing.tiny_models import build_layout_model

    if live == "moe":
        model = build_layout_model("qwen3_moe", seed=LIVE_SEED)
        if shard:
            _fully_shard(model, world)
        return model, None, None
    if live == "trainer":
        return uw._trainer_objects(root, world, False, shard)
    model = uw._model(seed=LIVE_SEED, tie=live == "accelerate-tied")
    if shard:
        _fully_shard(model, world)
    return (model, *uw._accelerate_objects(model))


def _train_step(model, optimizer, scheduler, step: int) -> None:
    from integration import workers

    if optimizer is None:  # the model alone: change its values as a step would
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        return
    workers.train_step(model, optimizer, scheduler, step)


def full_state(model, optimizer, scheduler) -> dict:
    """Model, optimizer (by FQN) and scheduler, gathered in full (a collective)."""
    from integration import workers

    from shardstream.testing.gathered import full_state_dicts

    if optimizer is None:
        return {"model": full_state_dicts(model)[0]}
    return workers.full_state(model, optimizer, scheduler)


def _restore(case: dict, mode: str, model, optimizer, scheduler, scratch: str) -> int:
    import shardstream
    from shardstream import CheckpointConfig, CheckpointManager

    contents = tuple(case.get("contents", ("model", "optimizer", "extra")))
    if mode == "plain":
        result = shardstream.load(
            case["path"], model=model, optimizer=optimizer, lr_scheduler=scheduler,
            contents=contents,
        )  # fmt: skip
        return result.step
    config = CheckpointConfig(directory=scratch, load_contents=contents)
    manager = CheckpointManager(config, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    try:
        return manager.restore(path=case["path"])[0]
    finally:
        manager.close()


def restore_batch(rank: int, world: int, cases: list[dict], mode: str, scratch: str) -> list:
    """Every case in turn (see the module docstring); ``mode``: ``fsdp2`` (the model sharded
    over every rank, ``CheckpointManager.restore(path=)``) or ``plain`` (``shardstream.load``,
    no FSDP). Returns this rank's report of each case."""
    import torch.distributed as dist
    from integration import unsharded_save_workers as uw

    uw._env(rank, world)
    mine = dist.new_group(backend="gloo")  # the test's own collectives never meet the restore's
    reports = []
    for number, case in enumerate(cases):
        model, optimizer, scheduler = build_live(case["live"], scratch, world, mode == "fsdp2")
        _train_step(model, optimizer, scheduler, 40)
        fresh = bool(case.get("fresh")) and optimizer is not None
        if fresh:  # a live optimizer never stepped (its model trained by other means)
            optimizer.state.clear()
        before = full_state(model, None if fresh else optimizer, scheduler)
        torch.manual_seed(77 + rank)
        random.seed(78)
        np.random.seed(79)
        rng_before = torch.get_rng_state()
        report: dict = {"rank": rank, "case": case["name"], "ok": False}
        where = f"{scratch}/{mode}-{number}"
        attempt_restore(report, partial(_restore, case, mode, model, optimizer, scheduler, where))
        rng_same = torch.equal(torch.get_rng_state(), rng_before)
        outcomes = [None] * world
        dist.all_gather_object(outcomes, report["ok"], group=mine)
        if fresh and not all(outcomes):  # torch's state-dict API would initialise its state
            after = full_state(model, None, scheduler)
            report["unchanged"] = same_nested(before, after) and not optimizer.state
        else:
            after = full_state(model, optimizer, scheduler)
            report["unchanged"] = same_nested(before, after)
        report["unchanged"] = report["unchanged"] and rng_same
        if all(outcomes):
            if rank == 0:
                report["state"] = after
            if optimizer is not None:
                try:  # training goes on from the restored state
                    _train_step(model, optimizer, scheduler, 41)
                    report["stepped"] = True
                except Exception as exc:  # noqa: BLE001
                    report["stepped"] = f"{type(exc).__name__}: {exc}"
        report["outcomes"] = outcomes
        dist.barrier(group=mine)
        reports.append(report)
    return reports
