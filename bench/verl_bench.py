"""verl 0.9.1's own FSDPCheckpointManager against the plug-in's, on the same model and ranks.

    .venv/bin/python bench/verl_bench.py            # 0.18 and 0.49 GB fp32 Qwen2 + AdamW, ws 2
    .venv/bin/python bench/verl_bench.py --quick    # 0.14 and 0.18 GB, 1 repeat, no async part

Both managers are driven as verl's FSDP engine drives them (and as
tests/integration/test_verl_plugin.py does): built with the engine's keywords (``model``,
``optimizer``, ``lr_scheduler``, ``processing_class``, ``checkpoint_config``,
``trust_remote_code``), then ``save_checkpoint(ROOT/global_step_N/actor, None, N,
max_ckpt_to_keep=2)`` and ``load_checkpoint(ROOT/global_step_N/actor, None,
del_local_after_load=False)``, on FSDP2 over gloo on CPU ranks (the model, AdamW after one
step, a LambdaLR scheduler: ``harness.training``). verl's is
``verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager`` (the plug-in off); the
plug-in's is ``shardstream.integrations.verl.FSDPCheckpointManager`` with its default staging
budget (``SHARDSTREAM_STAGING_BUDGET``, 256 MiB).

For each model size and each ``save_contents`` (``model, optimizer, extra`` and the same with
``hf_model``), every repeat saves with both managers, alternating which goes first, into a
fresh root each, then loads what it saved (``model, optimizer, extra``). Per save and load:
the wall time (slowest rank; every rank starts after a barrier and after ``settle()``), the
peak RSS above the pre-save RSS per rank (``VmHWM``, ``harness.memory.Probe``), the share of
the machine's CPU others used meanwhile. RSS is sampled every 20 ms for the memory-over-time
plot (the largest model, with ``hf_model``, the first repeat).

Then, unless ``--no-async``, ``async_bench.run_async_bench(short_step=True)``: a step that is
only the optimizer's update (shorter than the time a save needs to read the state), with
shardstream sync and async saves and ``dcp.async_save`` in one run.

Writes ``results/verl-bench[-quick].json``, ``docs/benchmarks-verl.md`` and
``docs/img/verl_save_memory.png`` (``--quick``: only the JSON, unless ``--docs``).
``--render`` re-renders from the JSON.
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

import async_bench
from harness import REPO, RESULTS, MiB, log
from harness.machine import git_revision, machine_facts, src_dirty
from harness.memory import Probe, cpu_seconds, settle
from harness.process import busy_cpu_s
from harness.render import (
    fmt,
    generated_note,
    keep_sections,
    per_rank,
    pyplot,
    save_figure,
    table,
    write_doc,
)
from harness.training import (
    BUDGET,
    BUDGET_BYTES,
    MODEL_FULL,
    MODEL_QUICK,
    param_count,
    run_in_scratch,
)

WS = 2
CONTENTS = ["model", "optimizer", "extra"]
KINDS = {"model+optim+extra": CONTENTS, "+hf_model": [*CONTENTS, "hf_model"]}
MANAGERS = ("verl", "plugin")
LABELS = {"verl": "verl 0.9.1 FSDPCheckpointManager", "plugin": "shardstream plug-in"}
# Qwen2 widths of harness.training; the layer count sets the size.
SIZES = {
    "tiny": dict(MODEL_QUICK, num_hidden_layers=1),  # 0.14 GB
    "quick": MODEL_QUICK,  # 0.18 GB
    "mid": dict(MODEL_FULL, num_hidden_layers=5),  # 0.49 GB
    "full": MODEL_FULL,  # 1.12 GB
}
DOC = REPO / "docs" / "benchmarks-verl.md"
PLOT = REPO / "docs" / "img" / "verl_save_memory.png"


def gb(model: dict) -> float:
    return param_count(model) * 4 / 1e9


def _classes():
    """(verl's class, the plug-in's class): verl's straight from its module, plug-in off."""
    os.environ.pop("SHARDSTREAM_VERL", None)
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as verls

    from shardstream.integrations.verl import FSDPCheckpointManager as ours

    assert verls.__module__ == "verl.utils.checkpoint.fsdp_checkpoint_manager", verls.__module__
    return {"verl": verls, "plugin": ours}


def _manager(cls, model, optimizer, scheduler, contents, tokenizer):
    from verl.trainer.config import CheckpointConfig

    config = CheckpointConfig(save_contents=list(contents), load_contents=CONTENTS)
    # the keywords verl's FSDPEngine.initialize passes
    return cls(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        processing_class=tokenizer,
        checkpoint_config=config,
        trust_remote_code=False,
    )


def _tree_bytes(path: Path) -> dict:
    """Bytes under ``path``: all, and under ``huggingface/`` (the hf_model export)."""
    total = hf = 0
    for p in path.rglob("*"):
        if p.is_file():
            n = p.stat().st_size
            total += n
            hf += n if "huggingface" in p.relative_to(path).parts else 0
    return {"bytes": total, "hf_bytes": hf}


def _save_keeping_config(m, which: str, model, *args) -> None:
    """verl's save, restoring the model config it changes: on rank 0 its hf_model export
    (``from_config(model_config, torch_dtype=bfloat16)``) leaves ``model.config.dtype`` at
    bfloat16, so rank 0's config no longer matches the other ranks' (and the next save's
    export would read another dtype on rank 0 than elsewhere)."""
    dtype = getattr(model.config, "dtype", None)
    try:
        m.save_checkpoint(*args)
    finally:
        if which == "verl":
            model.config.dtype = dtype


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``: what verl's save leaves in the page
    cache made durable, as the plug-in's commit makes its own before it returns."""
    for p in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _save_then_sync(args: tuple, root: Path, durable: dict | None) -> None:
    """The manager's save; for verl (``durable`` given) then, once every rank has returned,
    rank 0 fsyncs the step and ``durable`` gets ``wall_s``: the save's own time is the
    caller's measurement minus it."""
    import torch.distributed as dist

    _save_keeping_config(*args)
    if durable is None:
        return
    dist.barrier()
    t0 = time.perf_counter()
    if dist.get_rank() == 0:
        _fsync_tree(root)
    dist.barrier()
    durable["wall_s"] = time.perf_counter() - t0


def _timed(fn, sample: bool) -> dict:
    import torch.distributed as dist

    settle()
    dist.barrier()
    busy0 = busy_cpu_s()
    probe = Probe(0.02 if sample else None).start()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    used = probe.stop()
    busy1 = busy_cpu_s()
    used["wall_s"] = wall
    used["busy_s"] = None if busy0 is None or busy1 is None else busy1 - busy0
    dist.barrier()
    return used


def save_and_load(
    m, which: str, model, root: Path, actor: str, step: int, sample: bool = False
) -> tuple[dict, dict, dict | None]:
    """One timed save of ``actor`` (verl's made durable: ``_save_then_sync``) and the timed
    load of what it wrote, on every rank; then the manager is closed and ``root`` removed.
    Returns (save, load, verl's fsync or None); ``save`` also holds rank 0's bytes written."""
    import torch.distributed as dist

    durable: dict | None = {} if which == "verl" else None
    args = (m, which, model, actor, None, step, 2)
    save = _timed(lambda: _save_then_sync(args, root, durable), sample)
    dist.barrier()
    save.update(_tree_bytes(root) if dist.get_rank() == 0 else {})
    load = _timed(lambda: m.load_checkpoint(actor, None, False), False)
    if hasattr(m, "close"):
        m.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    os.sync()
    dist.barrier()
    return save, load, durable


def worker(rank: int, ws: int, spec: dict) -> dict:
    from harness.training import fsdp_state

    from shardstream.testing.tiny_models import build_tiny_tokenizer

    os.environ["SHARDSTREAM_STAGING_BUDGET"] = BUDGET
    classes = _classes()
    tokenizer = build_tiny_tokenizer()
    out = Path(spec["out"])
    # First-call costs (imports, lazy initialisation) on a tiny model, both managers, both kinds.
    tiny = SIZES["tiny"] | {"hidden_size": 128, "intermediate_size": 256}
    _, model, optimizer, scheduler = fsdp_state(tiny)
    for which, cls in classes.items():
        for kind, contents in KINDS.items():
            root = out / f"warm-{which}-{len(contents)}"
            m = _manager(cls, model, optimizer, scheduler, contents, tokenizer)
            if rank == 0:
                log(f"  warm-up: {which} {kind}")
            _save_keeping_config(m, which, model, str(root / "global_step_1" / "actor"), None, 1, 2)
            m.load_checkpoint(str(root / "global_step_1" / "actor"), None, False)
            if hasattr(m, "close"):
                m.close()
    del model, optimizer, scheduler
    results = []
    for size in spec["sizes"]:
        _, model, optimizer, scheduler = fsdp_state(SIZES[size])
        for kind, contents in KINDS.items():
            for rep in range(spec["repeats"]):
                order = MANAGERS if (rep + len(results)) % 2 == 0 else MANAGERS[::-1]
                for which in order:
                    root = out / f"{size}-{which}-{len(contents)}-{rep}"
                    actor = str(root / f"global_step_{rep + 1}" / "actor")
                    m = _manager(classes[which], model, optimizer, scheduler, contents, tokenizer)
                    sample = rep == 0 and kind == "+hf_model" and size == spec["sizes"][-1]
                    save, load, durable = save_and_load(
                        m, which, model, root, actor, rep + 1, sample
                    )
                    results.append(
                        {
                            "size": size,
                            "kind": kind,
                            "rep": rep,
                            "manager": which,
                            "order": list(order),
                            "save": save,
                            "fsync": durable,
                            "load": load,
                        }  # fmt: skip
                    )
                    if rank == 0:
                        log(
                            f"  {size} {kind} rep {rep} {which}: save {save['wall_s']:.2f}s "
                            f"+{save['extra_rss_mib']:.0f} MiB, load {load['wall_s']:.2f}s "
                            f"+{load['extra_rss_mib']:.0f} MiB"
                        )
        del model, optimizer, scheduler
    return {"rank": rank, "runs": results, "cpu_s_total": cpu_seconds()}


def summarize(ranks: list[dict], sizes: list[str]) -> list[dict]:
    """One row per (size, kind, manager): medians over repeats of the slowest rank's wall time,
    of each rank's extra RSS; the per-repeat ratios plug-in ÷ verl."""
    n = len(ranks[0]["runs"])
    ncpu = os.cpu_count() or 1
    runs = []
    for i in range(n):
        r0 = ranks[0]["runs"][i]
        entry = {k: r0[k] for k in ("size", "kind", "rep", "manager")}
        entry["save"] = {"bytes": r0["save"]["bytes"], "hf_bytes": r0["save"]["hf_bytes"]}
        for op in ("save", "load"):
            wall = max(r["runs"][i][op]["wall_s"] for r in ranks)
            cpu = sum(r["runs"][i][op]["cpu_s"] for r in ranks)
            busy = r0[op]["busy_s"]
            entry.setdefault(op, {}).update(
                {
                    "wall_s": wall,
                    "extra_rss_mib": [r["runs"][i][op]["extra_rss_mib"] for r in ranks],
                    "base_rss_mib": [r["runs"][i][op]["base_rss_mib"] for r in ranks],
                    "others_cpu_share": None
                    if busy is None
                    else max(0.0, busy - cpu) / wall / ncpu,
                }
            )
        if r0.get("fsync"):  # verl: the measured call included the fsync; split it out
            entry["fsync_s"] = max(r["runs"][i]["fsync"]["wall_s"] for r in ranks)
            entry["save"]["wall_s"] -= entry["fsync_s"]
        runs.append(entry)
    rows = []
    for size in sizes:
        for kind in KINDS:
            by = {
                m: [e for e in runs if (e["size"], e["kind"], e["manager"]) == (size, kind, m)]
                for m in MANAGERS
            }
            row = {"size": size, "gb": gb(SIZES[size]), "kind": kind}
            for m, es in by.items():
                for op in ("save", "load"):
                    row[f"{m}_{op}_s"] = statistics.median(e[op]["wall_s"] for e in es)
                    row[f"{m}_{op}_extra_mib"] = [
                        statistics.median(e[op]["extra_rss_mib"][k] for e in es) for k in range(WS)
                    ]
                    shares = [e[op]["others_cpu_share"] for e in es if e[op]["others_cpu_share"]]
                    row[f"{m}_{op}_others"] = statistics.median(shares) if shares else None
                row[f"{m}_bytes"] = statistics.median(e["save"]["bytes"] for e in es)
                row[f"{m}_hf_bytes"] = statistics.median(e["save"]["hf_bytes"] for e in es)
            for op in ("save", "load"):
                ratios = [
                    p[op]["wall_s"] / v[op]["wall_s"] for p, v in zip(by["plugin"], by["verl"])
                ]
                row[f"{op}_ratio"] = statistics.median(ratios)
                row[f"{op}_ratios"] = ratios
            if all("fsync_s" in v for v in by["verl"]):
                row["verl_fsync_s"] = statistics.median(v["fsync_s"] for v in by["verl"])
                durable = [
                    p["save"]["wall_s"] / (v["save"]["wall_s"] + v["fsync_s"])
                    for p, v in zip(by["plugin"], by["verl"])
                ]
                row["save_vs_durable_ratio"] = statistics.median(durable)
                row["save_vs_durable_ratios"] = durable
            row["repeats"] = len(by["verl"])
            rows.append(row)
    return rows


def samples(ranks: list[dict], size: str) -> dict:
    """RSS over time during the sampled save: {manager: [rank samples]}."""
    out = {}
    for i, r0 in enumerate(ranks[0]["runs"]):
        if r0["size"] == size and r0["kind"] == "+hf_model" and r0["rep"] == 0:
            out[r0["manager"]] = [r["runs"][i]["save"].get("samples", []) for r in ranks]
    return out


# --- rendering ------------------------------------------------------------------------------------


def plot(res: dict, path: Path) -> Path:
    plt = pyplot()
    size = res["sizes"][-1]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = {"verl": ("#c0392b", "#e67e22"), "plugin": ("#1f618d", "#48c9b0")}
    for m, per in res["samples"].items():
        for rank, s in enumerate(per):
            if s:
                ax.plot([t for t, _ in s], [v for _, v in s], color=colors[m][rank % 2],
                        label=f"{LABELS[m]}, rank {rank}")  # fmt: skip
    ax.axhline(256, color="grey", ls=":", lw=1, label="plug-in staging budget (256 MiB)")
    ax.set_xlabel("seconds into save_checkpoint")
    ax.set_ylabel("RSS above the pre-save RSS (MiB)")
    ax.set_title(f"One save, model+optimizer+extra+hf_model, {gb(SIZES[size]):.2f} GB fp32 "
                 f"Qwen2 + AdamW, FSDP2 ws {res['world_size']}")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _findings(res: dict) -> list[str]:
    """The figures the issue asks about, read off the rows: memory growth, the ratios."""
    rows = res["rows"]
    hf = [r for r in rows if r["kind"] == "+hf_model"]
    plain = [r for r in rows if r["kind"] != "+hf_model"]
    L = []
    if hf:
        lo, hi = hf[0], hf[-1]
        ours = max(max(r["plugin_save_extra_mib"]) for r in rows)
        L.append(
            f"- **Memory, save with `hf_model`.** verl's rank 0 holds "
            f"{lo['verl_save_extra_mib'][0]:.0f} MiB more than before the save at "
            f"{lo['gb']:.2f} GB and {hi['verl_save_extra_mib'][0]:.0f} MiB at {hi['gb']:.2f} GB "
            f"(the other rank {per_rank(lo['verl_save_extra_mib'][1:])} and "
            f"{per_rank(hi['verl_save_extra_mib'][1:])}). The plug-in's largest per-rank "
            f"increase in any save here is {ours:.0f} MiB, "
            + ("within" if ours * MiB <= BUDGET_BYTES else "**above**")
            + f" its {BUDGET} staging budget."
        )
    if plain:
        L.append(
            "- **Memory, save without `hf_model`** (per rank): "
            + "; ".join(
                f"{r['gb']:.2f} GB: verl {per_rank(r['verl_save_extra_mib'])}, plug-in "
                f"{per_rank(r['plugin_save_extra_mib'])} MiB"
                for r in plain
            )
            + "."
        )
    L.append(
        "- **Save time, plug-in ÷ verl** (median of per-repeat ratios): "
        + "; ".join(f"{r['gb']:.2f} GB {r['kind']}: {r['save_ratio']:.2f}" for r in rows)
        + "."
    )
    if all("save_vs_durable_ratio" in r for r in rows):
        L.append(
            "- **Save time, plug-in ÷ (verl + fsync of verl's files)**, both durable when they "
            "return: "
            + "; ".join(
                f"{r['gb']:.2f} GB {r['kind']}: {r['save_vs_durable_ratio']:.2f}" for r in rows
            )
            + "."
        )
    L.append(
        "- **Load time, plug-in ÷ verl:** "
        + "; ".join(f"{r['gb']:.2f} GB {r['kind']}: {r['load_ratio']:.2f}" for r in rows)
        + f". Load memory per rank: verl {per_rank(rows[-1]['verl_load_extra_mib'])} MiB, the "
        f"plug-in {per_rank(rows[-1]['plugin_load_extra_mib'])} MiB at {rows[-1]['gb']:.2f} GB."
    )
    a = res.get("async")
    if a:
        su = a["summary"]
        sync = su["shardstream_sync"]["stall_per_save_s"]
        parts = []
        for mode in su:
            if mode.startswith("shardstream_async") or mode == "dcp_async":
                r = su[mode]
                parts.append(
                    f"{async_bench.LABELS[mode]} {fmt(r.get('stall_vs_sync'), '.0%')} of a sync "
                    f"save's stall over all saves, {fmt(r.get('later_vs_sync'), '.1%')} over the "
                    f"saves after the first, peak RSS "
                    f"{per_rank(r['peak_vs_none_mib_per_rank'])} MiB per rank above no "
                    "checkpointing"
                )
        L.append(
            "- **Async save, step shorter than a save** (goal: stall ≤ 5% of a sync save's): "
            + "; ".join(parts)
            + f". A sync save stalls {sync:.2f} s per save; a step takes "
            f"{su['none']['mean_step_s']:.2f} s."
        )
    return L


def _async_section(a: dict | None) -> list[str]:
    if not a:
        return ["(not run: `--quick` or `--no-async`)"]
    s = a["summary"]
    sync = s["shardstream_sync"]["stall_per_save_s"]
    L = [
        f"`async_bench.run_async_bench(short_step=True)`: world size {a['world_size']}, the "
        f"{a['model_gb']:.2f} GB model, {a['steps']} steps per mode, a save (model, optimizer, "
        f"extra) after every {a['every']} (never after the last), one set of ranks running the "
        f"modes in turn; {a.get('repeats', 1)} runs, the modes after `none` in forward then "
        f"reverse order, medians over runs (the ratio: median of the per-run ratios). "
        f"A step here is only `optimizer.step()` + the scheduler (gradients set "
        f"once and kept): {s['none']['mean_step_s']:.2f} s, against "
        f"{sync:.2f} s for a synchronous save, so an async save is still reading the "
        f"state when the next step's optimizer pre-hook runs. Saves are "
        f"{a['every'] * s['none']['mean_step_s']:.1f} s of steps apart, longer than a "
        f"synchronous save; a save call that finds the previous save still running waits for "
        f"it, and that wait counts as stall too (the training steps here are CPU work, so a "
        f"background save shares the cores with them and runs longer than a synchronous one). "
        f"{a['world_size']} rank(s) on {a.get('cores', 2)} cores; others used "
        f"{fmt(a['others_cpu_share'], '.0%')} of the machine's CPU meanwhile."
        + (f" Run at git {a['git']}, finished {a['finished']}." if a.get("git") else ""),
        "",
        *table(
            "mode | mean step s | stall per save s | stall ÷ sync save (per run) | first save's "
            "stall s | later saves: stall ÷ sync save (per run) | lost per save s "
            "(loop + drain − no-ckpt loop) | peak RSS above no-ckpt, MiB per rank",
            "lrrrrrrr",
            [
                [
                    async_bench.LABELS[mode],
                    fmt(r["mean_step_s"]),
                    fmt(r["stall_per_save_s"]),
                    fmt(r.get("stall_vs_sync"), ".0%")
                    + (
                        " (" + ", ".join(f"{x:.0%}" for x in r["stall_vs_sync_runs"]) + ")"
                        if len(r.get("stall_vs_sync_runs") or []) > 1
                        else ""
                    ),
                    fmt(r.get("first_stall_s")),
                    fmt(r.get("later_vs_sync"), ".1%")
                    + (
                        " (" + ", ".join(f"{x:.1%}" for x in r["later_vs_sync_runs"]) + ")"
                        if len(r.get("later_vs_sync_runs") or []) > 1
                        else ""
                    ),
                    fmt(r.get("lost_per_save_s")),
                    per_rank(r.get("peak_vs_none_mib_per_rank", [])),
                ]
                for mode, r in s.items()
            ],
        ),
        "",
        "The stall of a save is the time inside the save call plus, for shardstream async, the "
        "optimizer pre-hook's waits for tensors the save has not read yet. The goal in issue #21 "
        "is an async stall of at most 5% of a synchronous save's. A shardstream async save "
        "copies into host memory it faults in once and reuses (it is held while the manager "
        "lives). That happens on a thread of its own right after the first optimizer step, when "
        "the optimizer's state can be sized, so the fault-in overlaps training steps (it counts "
        "in their time, not in a save's stall); the first save's stall is still shown apart, "
        "and the saves after it are the steady state. `dcp.async_save` allocates its full copy "
        "at every call. Peak RSS is each mode's peak above the peak of the run without "
        "checkpoints (the optimizer's own temporaries excluded); a mode that runs right after "
        "`dcp.async_save` tends to peak higher (the per-run figures are in "
        "`bench/results/verl-bench.json`).",
    ]
    return L


def render(res: dict) -> None:
    rows = res["rows"]
    quick = " (`--quick` run: fewer sizes and repeats)" if res.get("quick") else ""
    m = res["machine"]
    L = [
        generated_note("bench/verl_bench.py", "bench/results/verl-bench.json"),
        "",
        "# verl's checkpoint manager and the shardstream plug-in" + quick,
        "",
        "verl 0.9.1's own `FSDPCheckpointManager` (the plug-in off) against "
        "`shardstream.integrations.verl.FSDPCheckpointManager` (what verl builds with "
        "`SHARDSTREAM_VERL=1`, see [verl.md](verl.md)), driven with the calls verl's FSDP "
        "engine makes: `save_checkpoint(ROOT/global_step_N/actor, None, N, "
        "max_ckpt_to_keep=2)` and `load_checkpoint(..., None, del_local_after_load=False)`. "
        f"FSDP2 over gloo on {res['world_size']} CPU ranks; a Qwen2-shaped model with AdamW "
        "after one step and a LambdaLR scheduler (`bench/harness/training.py`), a tiny "
        "tokenizer as `processing_class`; the plug-in's staging budget is its default, "
        f"{BUDGET}. Each repeat saves with both managers in alternating order into fresh roots, "
        "then loads what it saved (`load_contents`: model, optimizer, extra). Wall time: the "
        "slowest rank, from a barrier; memory: per rank, the peak RSS (`VmHWM`) above the RSS "
        f"right before the call. Medians of {rows[0]['repeats']} repeats; the ratio is the "
        "median of the per-repeat ratios plug-in ÷ verl (below 1: the plug-in is faster).",
        "",
        f"Machine: {m.get('cpu_model', '?')}, {m.get('affinity_cpus', '?')} cores, "
        f"{m.get('mem_total_gib', '?')} GiB, {m.get('disk_fs', '?')} disk; git {m.get('git', '?')}"
        f"{' (src/ modified)' if m.get('src_dirty') else ''}. The machine was shared: others "
        f"used {fmt(res.get('others_cpu_share'), '.0%')} of its CPU over the whole run (per "
        "call in the JSON), so absolute times are noisy; the ratios come from interleaved "
        "runs.",
        "",
        "## Findings",
        "",
        *_findings(res),
        "",
        "## Save",
        "",
        *table(
            "model (fp32 params) | save_contents | verl save s | verl's files fsynced after "
            "it, s | plug-in save s (fsynced, committed) | plug-in ÷ verl | plug-in ÷ (verl + "
            "fsync) | verl extra RSS MiB per rank | plug-in extra RSS MiB per rank | written MB "
            "verl / plug-in (hf_model part)",
            "llrrrrrrrr",
            [
                [
                    f"{r['gb']:.2f} GB",
                    r["kind"],
                    fmt(r["verl_save_s"]),
                    fmt(r.get("verl_fsync_s")),
                    fmt(r["plugin_save_s"]),
                    fmt(r["save_ratio"]),
                    fmt(r.get("save_vs_durable_ratio")),
                    per_rank(r["verl_save_extra_mib"]),
                    per_rank(r["plugin_save_extra_mib"]),
                    f"{r['verl_bytes'] / 1e6:.0f} / {r['plugin_bytes'] / 1e6:.0f} "
                    f"({r['verl_hf_bytes'] / 1e6:.0f} / {r['plugin_hf_bytes'] / 1e6:.0f})",
                ]
                for r in rows
            ],
        ),
        "",
        "verl's `save_checkpoint` returns with its files in the page cache: nothing is "
        "fsynced, so a crash or power loss in the next seconds can lose or tear a step that "
        "verl's tracker file already names. The plug-in returns once every file and directory "
        "is fsynced and the step committed. The fsync column times what making verl's step "
        "equally durable costs (rank 0 fsyncs every file and directory of the step, after a "
        "barrier), and the ratio beside it compares like with like.",
        "",
        "verl's save without `hf_model` is `torch.save` of each rank's shards as they are "
        "(nothing gathered, nothing copied), so neither manager holds extra memory there. With "
        "`hf_model`, verl gathers the full state dict to rank 0 "
        "(`get_fsdp_full_state_dict(offload_to_cpu=True, rank0_only=True)`) and builds a "
        "bfloat16 model there for `save_pretrained`; the plug-in's ranks each write their own "
        "byte ranges of the safetensors files through the staging budget.",
        "",
        "## Load",
        "",
        *table(
            "model (fp32 params) | saved with | verl load s | plug-in load s | plug-in ÷ verl | "
            "verl extra RSS MiB per rank | plug-in extra RSS MiB per rank",
            "llrrrrr",
            [
                [
                    f"{r['gb']:.2f} GB",
                    r["kind"],
                    fmt(r["verl_load_s"]),
                    fmt(r["plugin_load_s"]),
                    fmt(r["load_ratio"]),
                    per_rank(r["verl_load_extra_mib"]),
                    per_rank(r["plugin_load_extra_mib"]),
                ]
                for r in rows
            ],
        ),
        "",
        "The plug-in's load checks every file it reads (checksums, split between the ranks) "
        "before the model changes ([verl.md](verl.md), Loading); verl's `torch.load`s its "
        "rank's files whole and checks nothing.",
        "",
        "## Memory during one save",
        "",
        f"![RSS during a save](img/{PLOT.name})",
        "",
        "RSS above the pre-save RSS, sampled every 20 ms on each rank, for one save with "
        "`hf_model` of the largest model (first repeat).",
        "",
        "## Async save when a step is shorter than a save",
        "",
        *_async_section(res.get("async")),
        "",
    ]
    write_doc(DOC, keep_sections(DOC, "\n".join(L)))
    plot(res, PLOT)
    log(f"wrote {DOC.relative_to(REPO)} and {PLOT.relative_to(REPO)}")


def _async_part(a) -> dict:
    """``--async-repeats`` runs of the short-step async bench, the modes in forward then reverse
    order (after ``none``); per mode the median over runs, and the median of the per-run ratios
    of the stall per save to the sync save's."""
    model = SIZES[a.async_size]
    runs = []
    for k in range(a.async_repeats):
        rest = async_bench.SHORT_MODES[1:]
        order = ("none", *(rest if k % 2 == 0 else rest[::-1]))
        r = async_bench.run_async_bench(
            model,
            steps=a.async_steps,
            every=a.async_every,
            short_step=True,
            world_size=a.async_ws,
            modes=order,
        )
        r["order"] = order
        r.pop("modes")  # per-step records: kept in the summary only
        runs.append(r)
    first = runs[0]
    summary = {}
    for mode in async_bench.SHORT_MODES:
        per = [run["summary"][mode] for run in runs]
        sync = [run["summary"]["shardstream_sync"]["stall_per_save_s"] for run in runs]
        m = {}
        for key in ("mean_step_s", "stall_per_save_s", "later_stall_per_save_s", "lost_per_save_s"):
            vals = [x[key] for x in per if x.get(key) is not None]
            m[key] = statistics.median(vals) if vals else None
        peaks = [x["peak_vs_none_mib_per_rank"] for x in per]
        m["peak_vs_none_mib_per_rank"] = [statistics.median(v) for v in zip(*peaks)]
        ratios = [x["stall_per_save_s"] / y for x, y in zip(per, sync) if x["stall_per_save_s"]]
        m["stall_vs_sync"] = statistics.median(ratios) if ratios else None
        m["stall_vs_sync_runs"] = ratios
        # saves after each mode's first (whose async staging memory is faulted in by then)
        later_sync = [run["summary"]["shardstream_sync"]["later_stall_per_save_s"] for run in runs]
        later = [
            x["later_stall_per_save_s"] / y
            for x, y in zip(per, later_sync)
            if x.get("later_stall_per_save_s") is not None and y
        ]
        m["later_vs_sync"] = statistics.median(later) if later else None
        m["later_vs_sync_runs"] = later
        firsts = [x["stalls_per_save_s"][0] for x in per if x.get("stalls_per_save_s")]
        m["first_stall_s"] = statistics.median(firsts) if firsts else None
        summary[mode] = m
    shares = [run["others_cpu_share"] for run in runs if run["others_cpu_share"] is not None]
    return dict(
        {k: first[k] for k in ("world_size", "steps", "every", "seq", "short_step")},
        summary=summary,
        runs=runs,
        repeats=len(runs),
        others_cpu_share=statistics.median(shares) if shares else None,
        model_gb=gb(model),
        cores=len(os.sched_getaffinity(0)),
        git=git_revision(),
        finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None, help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-async", action="store_true", help="keep the JSON's async part, if any")
    p.add_argument("--async-size", default="mid", choices=list(SIZES))
    p.add_argument("--async-ws", type=int, default=1)
    p.add_argument("--async-steps", type=int, default=49)
    p.add_argument("--async-every", type=int, default=16)
    p.add_argument("--async-repeats", type=int, default=3)
    p.add_argument("--docs", action="store_true", help="with --quick: write the docs too")
    p.add_argument("--render", action="store_true", help="re-render from the JSON only")
    p.add_argument("--async-only", action="store_true", help="rerun the async part into the JSON")
    a = p.parse_args(argv)
    path = RESULTS / ("verl-bench-quick.json" if a.quick else "verl-bench.json")
    if a.render:
        render(json.loads(path.read_text()))
        return 0
    if a.async_only:
        res = json.loads(path.read_text())
        res["async"] = _async_part(a)
        path.write_text(json.dumps(res, indent=1) + "\n")
        render(res)
        return 0
    sizes = a.sizes.split(",") if a.sizes else (["tiny", "quick"] if a.quick else ["quick", "mid"])
    repeats = a.repeats or (1 if a.quick else 3)
    shown = [f"{gb(SIZES[s]):.2f} GB" for s in sizes]
    log(f"verl bench: sizes {shown}, {repeats} repeats, ws {WS}")
    spec = {"sizes": sizes, "repeats": repeats}
    ranks, wall, others = run_in_scratch(worker, WS, spec, RESULTS / "verl-bench-out")
    res = {
        "quick": a.quick,
        "world_size": WS,
        "sizes": sizes,
        "repeats": repeats,
        "wall_s": wall,
        "others_cpu_share": others,
        "machine": dict(machine_facts(RESULTS), git=git_revision(), src_dirty=src_dirty()),
        "rows": summarize(ranks, sizes),
        "samples": samples(ranks, sizes[-1]),
        "ranks": ranks,
    }
    if not (a.no_async or a.quick):
        path.write_text(json.dumps(res, indent=1) + "\n")  # kept should the async part fail
        res["async"] = _async_part(a)
    elif path.exists() and "async" in json.loads(path.read_text()):
        res["async"] = json.loads(path.read_text())["async"]  # --no-async keeps the last one
    path.write_text(json.dumps(res, indent=1) + "\n")
    for r in res["rows"]:
        log(
            f"{r['gb']:.2f} GB {r['kind']}: save plug-in/verl {r['save_ratio']:.2f}, load "
            f"{r['load_ratio']:.2f}; extra MiB verl {per_rank(r['verl_save_extra_mib'])} plug-in "
            f"{per_rank(r['plugin_save_extra_mib'])}"
        )
    if not a.quick or a.docs:
        render(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
