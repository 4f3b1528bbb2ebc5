"""Checkpointing while training: how much does each save stall the training loop?

    python bench/async_bench.py            # ~1.1 GB fp32 model, world size 2
    python bench/async_bench.py --quick    # ~0.18 GB model
    python bench/async_bench.py --short-step [--world-size 1]   # steps shorter than a save

``--short-step`` is the case the CPU training loop never reaches and a GPU one does: a step
shorter than the time a save needs to read the state. A step is then ``optimizer.step()`` and
the scheduler's (gradients set once and kept, no forward or backward), so an async save is
still reading the state when the next step's optimizer pre-hook runs.

FSDP2 on 2 gloo ranks (one set of processes, one model whose training continues from mode to
mode) trains ``steps`` steps per mode after one warm-up step, saving model + optimizer + extra
after every ``every``-th step but never after a mode's last step, so every save is followed by an
optimizer step. Modes, in this order:

* ``none``               no checkpointing (the reference step time);
* ``shardstream_sync``   ``CheckpointManager(...).save(step)``;
* ``shardstream_async``  the same with ``CheckpointConfig(async_save=True)``: ``save()`` returns at
                          once; an optimizer pre-hook waits for unread tensors
                          (``manager._async.stalls``);
* ``dcp_async``          ``torch.distributed.checkpoint.async_save`` (THREAD mode, on a gloo group
                          of its own); a save waits for the previous one's future first.

The stall of a save is the time the training loop spends inside the save call plus, for
shardstream async, the optimizer pre-hook waits that follow it. Peak RSS is per rank, above the
RSS right before the mode's first step. Every kind of save first runs once on a tiny model
(first-call costs). The driver (``save_bench.py``) calls ``run_async_bench``; run alone, this
prints the summary and writes ``results/async[-quick].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness import RESULTS, log
from harness.memory import Probe, cpu_seconds, settle
from harness.training import (
    BUDGET,
    MODEL_FULL,
    MODEL_QUICK,
    build_fsdp_model,
    fsdp_state,
    make_config,
    make_optimizer,
    run_ranks,
    train_step,
    zero_step,
)

MODES = ("none", "shardstream_sync", "shardstream_async", "dcp_async")
# --short-step adds an async save with staging_budget="state" (the rank's whole state, model and
# optimizer shards, plus the writer's buffers): a step then copies what the save has not read
# yet and never waits for the disk.
STATE_BUDGET = "shardstream_async_state"
SHORT_MODES = (*MODES, STATE_BUDGET)
LABELS = {
    "none": "no checkpointing",
    "shardstream_sync": "shardstream save (sync)",
    "shardstream_async": f"shardstream save (async_save=True, staging_budget={BUDGET})",
    "dcp_async": "dcp.async_save (THREAD)",
    STATE_BUDGET: 'shardstream save (async_save=True, staging_budget="state")',
}


def _warm_up(out: Path) -> None:
    """One save of every kind on a tiny FSDP2 model, so the first measured save does not pay
    for imports and lazy initialisation."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardstream import CheckpointConfig, CheckpointManager

    _, model, optimizer, scheduler = fsdp_state({})
    for async_save in (False, True):
        cfg = CheckpointConfig(str(out / f"ss-{async_save}"), async_save=async_save)
        with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
            mgr.save(0, extra={"warm": True})
            zero_step(model, optimizer, scheduler)
            mgr.wait()
    pg = dist.new_group(backend="gloo")
    msd, osd = get_state_dict(model, optimizer)
    dcp.async_save(
        {"model": msd, "optim": osd}, checkpoint_id=str(out / "dcp"), process_group=pg
    ).result()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()


def _run_mode(mode: str, rank: int, model, optimizer, scheduler, spec: dict, out: Path) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from shardstream import CheckpointConfig, CheckpointManager

    seq, vocab, first = spec["seq"], spec["vocab"], spec["first_step"]
    step_fn = _short_step if spec.get("short_step") else train_step
    mgr = None
    future = None
    if mode.startswith("shardstream"):
        cfg = CheckpointConfig(
            str(out / mode),
            save_contents=("model", "optimizer", "extra"),
            staging_budget="state" if mode == STATE_BUDGET else BUDGET,
            async_save=mode.startswith("shardstream_async"),
        )
        mgr = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    elif mode == "dcp_async":
        pg = spec["dcp_group"]

    settle()
    dist.barrier()
    probe = Probe(0.05).start()
    loop0 = time.perf_counter()
    steps = []
    for i in range(1, spec["steps"] + 1):
        step = first + i
        t0 = time.perf_counter()
        stalls_before = len(mgr._async.stalls) if mgr is not None and mgr._async else 0
        loss = step_fn(model, optimizer, scheduler, step, seq, vocab)
        hook = 0.0
        if mgr is not None and mgr._async is not None:
            hook = sum(mgr._async.stalls[stalls_before:])
        train_s = time.perf_counter() - t0
        save_call = None
        # Save after every `every`-th step, but never after the last: every save is followed by
        # an optimizer step, where an async save's pre-hook may stall.
        if i % spec["every"] == 0 and i < spec["steps"] and mode != "none":
            ts = time.perf_counter()
            if mgr is not None:
                mgr.save(step, extra={"dataloader": {"batch": step}})
            else:
                if future is not None:
                    future.result()  # a second async_save must wait for the first
                msd, osd = get_state_dict(model, optimizer)
                future = dcp.async_save(
                    {"model": msd, "optim": osd, "extra": {"lr_scheduler": scheduler.state_dict()}},
                    checkpoint_id=str(out / mode / f"global_step_{step}"),
                    process_group=pg,
                    async_checkpointer_type=AsyncCheckpointerType.THREAD,
                )
            save_call = time.perf_counter() - ts
        steps.append(
            {
                "step": i,
                "t_start": t0 - loop0,
                "step_s": time.perf_counter() - t0,
                "train_s": train_s,
                "hook_stall_s": hook,
                "save_call_s": save_call,
                "loss": loss,
            }
        )
    loop_s = time.perf_counter() - loop0
    td = time.perf_counter()
    if mgr is not None:
        mgr.wait()
    if future is not None:
        future.result()
    drain_s = time.perf_counter() - td
    used = probe.stop()
    stalls = list(mgr._async.stalls) if mgr is not None and mgr._async else []
    if mgr is not None:
        mgr.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(out / mode, ignore_errors=True)
        os.sync()
    dist.barrier()
    return {
        "rank": rank,
        "mode": mode,
        "loop_s": loop_s,
        "drain_s": drain_s,
        "cpu_s": used["cpu_s"],
        "base_rss_mib": used["base_rss_mib"],
        "peak_rss_mib": used["peak_rss_mib"],
        "extra_rss_mib": used["extra_rss_mib"],
        "steps": steps,
        "hook_stalls_s": stalls,
        "samples": used["samples"],
    }


def _short_step(model, optimizer, scheduler, step: int, seq: int, vocab: int) -> float:
    """A step with no forward or backward: the optimizer's update on the gradients kept from
    ``_fixed_grads`` (the part of a GPU step that writes the state a save reads)."""
    optimizer.step()
    scheduler.step()
    return 0.0


def _fixed_grads(model) -> None:
    """Small random gradients, set once and kept (``--short-step``)."""
    import torch

    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a DTensor like its FSDP2 parameter
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        local.normal_(0.0, 1e-3, generator=g)


def async_worker(rank: int, ws: int, spec: dict) -> dict:
    """All modes, one after the other, on one model (its training continues across modes)."""
    import torch.distributed as dist

    out = Path(spec["out"])
    _warm_up(out / "warmup")
    config = make_config(spec["model"])
    model = build_fsdp_model(config)
    optimizer, scheduler = make_optimizer(model)
    if spec.get("short_step"):
        _fixed_grads(model)
    t = time.perf_counter()
    step_fn = _short_step if spec.get("short_step") else train_step
    step_fn(model, optimizer, scheduler, 0, spec["seq"], config.vocab_size)  # warm-up
    warmup_s = time.perf_counter() - t
    spec = dict(spec, vocab=config.vocab_size, dcp_group=dist.new_group(backend="gloo"))
    modes = {}
    for k, mode in enumerate(spec["modes"]):
        spec["first_step"] = k * spec["steps"]
        modes[mode] = _run_mode(mode, rank, model, optimizer, scheduler, spec, out)
        if rank == 0:
            r = modes[mode]
            calls = [round(s["save_call_s"], 2) for s in r["steps"] if s["save_call_s"] is not None]
            log(
                f"  {mode}: loop {r['loop_s']:.1f}s, drain {r['drain_s']:.1f}s, steps "
                f"{[round(s['step_s'], 1) for s in r['steps']]}, save calls {calls}"
                f", hook stalls {[round(x, 2) for x in r['hook_stalls_s']]}, extra RSS "
                f"{r['extra_rss_mib']:.0f} MiB"
            )
    return {
        "rank": rank,
        "warmup_step_s": warmup_s,
        "modes": modes,
        "cpu_s_total": cpu_seconds(),
    }


def summarize(modes: dict) -> dict:
    out = {}
    for mode, r in modes.items():
        ranks = r["ranks"]
        n = len(ranks[0]["steps"])
        step_s = [max(rk["steps"][i]["step_s"] for rk in ranks) for i in range(n)]
        train_s = [max(rk["steps"][i]["train_s"] for rk in ranks) for i in range(n)]
        save_idx = [i for i in range(n) if ranks[0]["steps"][i]["save_call_s"] is not None]
        calls = [max(rk["steps"][i]["save_call_s"] for rk in ranks) for i in save_idx]
        hook = [max(sum(rk["hook_stalls_s"]) for rk in ranks)] if save_idx else [0.0]
        saves = len(save_idx)
        stall_total = sum(calls) + hook[0]
        per_save = _stall_per_save(ranks)
        out[mode] = {
            "steps": n,
            "saves": saves,
            "mean_step_s": statistics.mean(step_s),
            "mean_train_s": statistics.mean(train_s),
            "loop_s": max(rk["loop_s"] for rk in ranks),
            "drain_s": max(rk["drain_s"] for rk in ranks),
            "save_call_s": statistics.mean(calls) if calls else None,
            "hook_stall_s_total": hook[0],
            "stall_per_save_s": stall_total / saves if saves else None,
            # each save's own: its call and the hook waits of the steps up to the next save
            "stalls_per_save_s": per_save,
            "later_stall_per_save_s": statistics.mean(per_save[1:]) if saves > 1 else None,
            "extra_rss_mib_per_rank": [rk["extra_rss_mib"] for rk in ranks],
            "base_rss_mib_per_rank": [rk["base_rss_mib"] for rk in ranks],
            "peak_rss_mib_per_rank": [rk["peak_rss_mib"] for rk in ranks],
        }
    ref = out.get("none")
    if ref:
        for s in out.values():
            s["mean_step_vs_none"] = s["mean_step_s"] / ref["mean_step_s"]
            s["peak_vs_none_mib_per_rank"] = [
                p - q for p, q in zip(s["peak_rss_mib_per_rank"], ref["peak_rss_mib_per_rank"])
            ]
            s["lost_per_save_s"] = (
                (s["loop_s"] + s["drain_s"] - ref["loop_s"]) / s["saves"] if s["saves"] else None
            )
    return out


def _stall_per_save(ranks: list[dict]) -> list[float]:
    """Per save, the slowest rank's stall: the save call plus the pre-hook waits of the steps
    that follow it, up to the next save (the first save also faults in staging memory)."""
    per_rank = []
    for rk in ranks:
        saves: list[float] = []
        for st in rk["steps"]:
            if saves:
                saves[-1] += st["hook_stall_s"]
            if st["save_call_s"] is not None:
                saves.append(st["save_call_s"])
        per_rank.append(saves)
    return [max(v) for v in zip(*per_rank)]


def run_async_bench(
    model: dict,
    quick: bool = False,
    log=log,
    steps=None,
    every=None,
    short_step: bool = False,
    world_size: int = 2,
    modes: tuple[str, ...] | None = None,
) -> dict:
    ws, seq = world_size, 16
    steps = steps or 4
    every = every or 1
    out = RESULTS / "train-out" / "async"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    modes = modes or (SHORT_MODES if short_step else MODES)
    log(f"async bench: modes {modes}, {steps} steps each, a save after every {every} (not after "
        f"the last), ws={ws}{', short steps (optimizer only)' if short_step else ''}")  # fmt: skip
    spec = {"modes": modes, "out": str(out), "model": model, "steps": steps, "every": every,
            "seq": seq, "short_step": short_step}  # fmt: skip
    ranks, wall, others = run_ranks(async_worker, ws, spec)
    shutil.rmtree(out, ignore_errors=True)
    result = {
        "world_size": ws,
        "steps": steps,
        "every": every,
        "seq": seq,
        "short_step": short_step,
        "wall_s": wall,
        "others_cpu_share": others,
        "warmup_step_s": max(r["warmup_step_s"] for r in ranks),
        "modes": {mode: {"ranks": [r["modes"][mode] for r in ranks]} for mode in modes},
    }
    result["summary"] = summarize(result["modes"])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--short-step", action="store_true", help="steps are optimizer.step() only")
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args(argv)
    model = MODEL_QUICK if a.quick else MODEL_FULL
    res = run_async_bench(model, quick=a.quick, steps=a.steps, every=a.every,
                          short_step=a.short_step, world_size=a.world_size)  # fmt: skip
    name = "async" + ("-short" if a.short_step else "") + ("-quick" if a.quick else "")
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    for mode, s in res["summary"].items():
        print(mode, {k: v for k, v in s.items() if not isinstance(v, list)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
