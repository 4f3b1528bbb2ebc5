"""verl's ``strategy: fsdp`` (FSDP1): verl's own FSDPCheckpointManager against the plug-in, with
and without the flat-shard reads of ``training/fsdp1_shards.py``.

    .venv/bin/python bench/fsdp1_bench.py            # 0.49 GB fp32 Qwen2 + AdamW, ws 2, 3 repeats
    .venv/bin/python bench/fsdp1_bench.py --quick    # 0.18 GB, 1 repeat, JSON only

The model is wrapped as verl's FSDP1 engine wraps it (one unit per decoder layer inside a root
unit, ``use_orig_params=False``) on a CPU mesh, after one AdamW step. Managers are built and
called as verl's engine calls them (``verl_bench._manager``). Modes:

- ``verl``: verl 0.9.1's FSDPCheckpointManager (torch's sharded state dict, ``torch.save``
  per rank); its save is timed with an fsync of the step, as in verl_bench;
- ``plugin-torch-sd``: the plug-in reading FSDP1 through torch's sharded state dict (the
  flat-shard path switched off in the worker process: the plug-in before it existed);
- ``plugin``: the plug-in reading the flat parameters' shards in place.

Per save and load: wall time (slowest rank) and per-rank peak RSS above the pre-save RSS
(``VmHWM``). Writes ``results/fsdp1-bench[-quick].json`` and the ``fsdp1`` section of
``docs/benchmarks-verl.md`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from harness import REPO, RESULTS, log
from harness.machine import git_revision, machine_facts, src_dirty
from harness.memory import cpu_seconds
from harness.render import DASH, fmt, generated_note, per_rank, table, write_section
from harness.training import BUDGET, run_in_scratch
from verl_bench import CONTENTS, KINDS, SIZES, WS, _manager, gb, save_and_load

MODES = ("verl", "plugin-torch-sd", "plugin")
# Observed: verl's hf_model save of FSDP1 on CPU raises inside torch's FSDP1 full state dict
# (``unflatten_as_params``: "setStorage: ... out of bounds for storage of size 0").
VERL_HF_MODEL = "verl's hf_model export of FSDP1 fails on CPU (torch's FSDP1 full state dict)"
DOC = REPO / "docs" / "benchmarks-verl.md"


def fsdp1_state(overrides: dict):
    """(config, FSDP1 model, optimizer, scheduler) after one zero-gradient AdamW step."""
    import torch
    import torch.distributed as dist
    from harness.training import make_config, make_optimizer, zero_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from shardstream.testing.tiny_models import build_tiny_model

    config = make_config(overrides)
    model = build_tiny_model(config, seed=0)
    model = FullyShardedDataParallel(
        model,
        device_mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
        device_id=torch.device("cpu"),
        use_orig_params=False,
        auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
    )
    optimizer, scheduler = make_optimizer(model)
    zero_step(model, optimizer, scheduler)
    return config, model, optimizer, scheduler


def _flat_shards(on: bool) -> None:
    """Switch the plug-in's flat-shard reads on or off in this process."""
    from shardstream.training import fsdp1_shards

    if not hasattr(fsdp1_shards, "_original"):
        fsdp1_shards._original = fsdp1_shards.layout
    off = lambda model: None  # noqa: E731 - save and restore then take torch's path
    fsdp1_shards.layout = fsdp1_shards._original if on else off


def worker(rank: int, ws: int, spec: dict) -> dict:
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as verls

    from shardstream.integrations.verl import FSDPCheckpointManager as ours
    from shardstream.testing.tiny_models import build_tiny_tokenizer

    os.environ["SHARDSTREAM_STAGING_BUDGET"] = BUDGET
    tokenizer = build_tiny_tokenizer()
    out = Path(spec["out"])
    classes = {"verl": verls, "plugin-torch-sd": ours, "plugin": ours}
    _, model, optimizer, scheduler = fsdp1_state(SIZES[spec["size"]])
    results = []
    for kind, contents in KINDS.items():
        for rep in range(-1, spec["repeats"]):  # rep -1: first-call costs, not reported
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                if mode == "verl" and "hf_model" in contents:
                    continue  # verl's FSDP1 full state dict fails on CPU (see VERL_HF_MODEL)
                _flat_shards(mode == "plugin")
                root = out / f"{mode}-{len(contents)}-{rep}"
                actor = str(root / "global_step_1" / "actor")
                m = _manager(classes[mode], model, optimizer, scheduler, contents, tokenizer)
                save, load, durable = save_and_load(m, mode, model, root, actor, 1)
                if rep >= 0:
                    results.append(
                        {
                            "kind": kind,
                            "rep": rep,
                            "mode": mode,
                            "save": save,
                            "load": load,
                            "fsync": durable,
                        }  # fmt: skip
                    )
                if rank == 0:
                    log(
                        f"  {kind} rep {rep} {mode}: save {save['wall_s']:.2f}s "
                        f"+{save['extra_rss_mib']:.0f} MiB, load {load['wall_s']:.2f}s "
                        f"+{load['extra_rss_mib']:.0f} MiB"
                    )
    return {"rank": rank, "runs": results, "cpu_s_total": cpu_seconds()}


def summarize(ranks: list[dict]) -> list[dict]:
    """One row per (kind, mode): medians over repeats of the slowest rank's wall time and of
    each rank's extra RSS; verl's save time without the fsync it was measured with."""
    rows = []
    for kind in KINDS:
        for mode in MODES:
            picks = [
                i for i, r in enumerate(ranks[0]["runs"]) if (r["kind"], r["mode"]) == (kind, mode)
            ]
            if not picks:
                continue
            row = {"kind": kind, "mode": mode}
            for op in ("save", "load"):
                walls = [max(r["runs"][i][op]["wall_s"] for r in ranks) for i in picks]
                row[f"{op}_s"] = statistics.median(walls)
                row[f"{op}_extra_mib"] = [
                    statistics.median(r["runs"][i][op]["extra_rss_mib"] for i in picks)
                    for r in ranks
                ]
            if mode == "verl":
                fsyncs = [max(r["runs"][i]["fsync"]["wall_s"] for r in ranks) for i in picks]
                row["fsync_s"] = statistics.median(fsyncs)
            rows.append(row)
    return rows


def render(res: dict) -> None:
    rows = {(r["kind"], r["mode"]): r for r in res["rows"]}
    lines = [
        "## verl's `strategy: fsdp` (FSDP1)",
        "",
        generated_note("bench/fsdp1_bench.py", "bench/results/fsdp1-bench.json"),
        "",
        f"{gb(SIZES[res['size']]):.2f} GB fp32 Qwen2 + AdamW, world size {res['world_size']}, "
        f"FSDP1 with one unit per decoder layer (`use_orig_params=False`, as verl wraps it), "
        f"median of {res['repeats']} repeats; staging budget {BUDGET}. `plugin-torch-sd` is "
        "the plug-in reading FSDP1 through torch's sharded state dict (the flat-shard reads "
        "switched off), i.e. before `training/fsdp1_shards.py`. verl's save time includes an "
        "fsync of the step made after verl returns (that part in brackets), as the plug-in's "
        "commit makes its own files durable.",
        "",
    ]
    head = [
        "contents",
        "manager",
        "save s",
        "save extra MiB per rank",
        "load s",
        "load extra MiB per rank",
    ]
    body = []
    for kind in KINDS:
        for mode in MODES:
            r = rows.get((kind, mode))
            if r is None:
                body.append([kind, mode, DASH, DASH, DASH, DASH])
                continue
            save = fmt(r["save_s"])
            if "fsync_s" in r:
                save += f" (fsync {fmt(r['fsync_s'])})"
            body.append(
                [
                    kind,
                    mode,
                    save,
                    per_rank(r["save_extra_mib"]),
                    fmt(r["load_s"]),
                    per_rank(r["load_extra_mib"]),
                ]
            )
    lines += table(head, "llrrrr", body)
    lines.append("")
    for kind in KINDS:
        verl, before, after = (rows.get((kind, m)) for m in MODES)
        against = (
            f"plug-in ÷ verl: save {after['save_s'] / verl['save_s']:.2f}, load "
            f"{after['load_s'] / verl['load_s']:.2f}; "
            if verl
            else f"no verl figure ({VERL_HF_MODEL}); "
        )
        lines.append(
            f"- {kind}: {against}plug-in ÷ torch-state-dict plug-in: save "
            f"{after['save_s'] / before['save_s']:.2f}, load "
            f"{after['load_s'] / before['load_s']:.2f}. Extra save RSS of the largest rank: "
            f"plug-in {max(after['save_extra_mib']):.0f} MiB, torch-state-dict plug-in "
            f"{max(before['save_extra_mib']):.0f} MiB"
            + (f", verl {max(verl['save_extra_mib']):.0f} MiB." if verl else ".")
        )
    write_section(DOC, "fsdp1", "\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--render", action="store_true", help="re-render from the JSON only")
    a = p.parse_args(argv)
    path = RESULTS / ("fsdp1-bench-quick.json" if a.quick else "fsdp1-bench.json")
    if a.render:
        render(json.loads(path.read_text()))
        return 0
    size, repeats = ("quick", 1) if a.quick else ("mid", 3)
    log(f"fsdp1 bench: {gb(SIZES[size]):.2f} GB, {repeats} repeats, ws {WS}")
    spec = {"size": size, "repeats": repeats}
    ranks, wall, others = run_in_scratch(worker, WS, spec, RESULTS / "fsdp1-bench-out")
    res = {
        "quick": a.quick,
        "world_size": WS,
        "size": size,
        "repeats": repeats,
        "contents": CONTENTS,
        "wall_s": wall,
        "others_cpu_share": others,
        "machine": dict(machine_facts(RESULTS), git=git_revision(), src_dirty=src_dirty()),
        "rows": summarize(ranks),
        "ranks": ranks,
    }
    path.write_text(json.dumps(res, indent=1) + "\n")
    for r in res["rows"]:
        log(
            f"{r['kind']} {r['mode']}: save {r['save_s']:.2f}s "
            f"+{per_rank(r['save_extra_mib'])} MiB, load {r['load_s']:.2f}s"
        )
    if not a.quick:
        render(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
