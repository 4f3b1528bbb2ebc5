"""Render bench/results/merge.json into docs/benchmarks.md and the plots in docs/img/.

    python bench/report.py [bench/results/merge.json]
    python bench/report.py --moe [bench/results/moe-merge.json]   # the MoE merge section only

run.py calls this at the end of a full run; call it alone to re-render without re-measuring.
bench/moe_merge.py calls it with --moe: that section comes from moe-merge.json alone.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from harness import BENCH, REPO
from harness.render import (
    bar_offset,
    fmt,
    generated_note,
    pyplot,
    save_figure,
    table,
    write_doc,
)

TOOL_ORDER = ("shardstream", "verl", "cp", "cp_fsync", "cast_floor")
TOOL_LABEL = {
    "shardstream": "shardstream merge",
    "verl": "verl model_merger",
    "cp": "cp -r",
    "cp_fsync": "cp -r + fsync",
    "cast_floor": "Python cast floor",
}
TOOLS_CMD_ORDER = ("cp", "cp_fsync", "shardstream", "verl", "disk_write_floor", "cast_floor")
COLORS = {"shardstream": "#1f77b4", "verl": "#d62728", "cp": "#7f7f7f", "cp_fsync": "#bcbcbc"}


def _ckpt_label(r: dict, size: str) -> str:
    c = r["checkpoints"][size]
    return f"{size} GB ({c['bytes_on_disk'] / 2**30:.2f} GiB on disk)"


def cpu_s(r: dict, size: str, cache: str, tool: str) -> float | None:
    """Median user+sys CPU seconds of the successful runs of one case."""
    xs = [
        x["user_s"] + x["sys_s"]
        for x in r["runs"]
        if x["size_gb"] == size and x["cache"] == cache and x["tool"] == tool
        if x["returncode"] == 0
    ]
    return statistics.median(xs) if xs else None


RESULT_HEAD = (
    "checkpoint | cache | tool | wall s (median) | CPU s (median) | peak RSS MiB (median) "
    "| time ÷ shardstream | RSS ÷ shardstream | time ÷ cp -r | time ÷ cp -r + fsync "
    "| written GiB | others' CPU | runs"
)


def render_table(r: dict) -> str:
    rows = []
    for size, by_cache in r["summary"].items():
        for cache, by_tool in by_cache.items():
            for tool in TOOL_ORDER:
                s = by_tool.get(tool)
                if not s:
                    continue
                case = [_ckpt_label(r, size), cache, TOOL_LABEL[tool]]
                if s["wall_s"] is None:
                    rows.append([*case, "FAILED", "", "FAILED", *[""] * 6, f"0/{s['n_failed']}"])
                    continue
                rows.append(
                    [
                        *case,
                        f"{s['wall_s']:.2f}",
                        fmt(cpu_s(r, size, cache, tool)),
                        f"{s['peak_rss_mib']:.0f}",
                        fmt(s.get("time_vs_shardstream")),
                        fmt(s.get("rss_vs_shardstream")),
                        fmt(s.get("time_vs_cp")),
                        fmt(s.get("time_vs_cp_fsync")),
                        fmt((s.get("out_bytes") or 0) / 2**30),
                        fmt(s.get("background_cpu_share"), ".0%"),
                        f"{s['n_ok']}/{s['n_ok'] + s['n_failed']}",
                    ]
                )
    return "\n".join(table(RESULT_HEAD, "lll" + "r" * 10, rows))


def render_targets(r: dict) -> str:
    if not r["targets"]:
        return "_No targets evaluated (shardstream did not run)._"
    rows = [
        (
            t["name"],
            t["value"],
            t["target"],
            {True: "**pass**", False: "**FAIL**", None: "n/a"}[t["passed"]],
        )
        for t in r["targets"]
    ]
    return "\n".join(table("target | measured | goal | result", "lrll", rows))


def plot(r: dict, img_dir: Path) -> list[Path]:
    plt = pyplot()
    sizes = list(r["summary"])
    caches = list(r["options"]["cache_modes"])
    tools = [t for t in TOOL_ORDER if t in r["options"]["tools"]]
    paths = []
    for metric, ylabel, fname, line in (
        ("wall_s", "wall time, s (median)", "merge_time.png", None),
        ("peak_rss_mib", "peak RSS, MiB (median, log scale)", "merge_rss.png", 512),
    ):
        fig, axes = plt.subplots(
            1, len(caches), figsize=(5.2 * len(caches), 4.2), squeeze=False, sharey=True
        )
        for ax, cache in zip(axes[0], caches, strict=True):
            width = 0.8 / max(1, len(tools))
            for i, tool in enumerate(tools):
                xs, ys = [], []
                for j, size in enumerate(sizes):
                    s = r["summary"][size].get(cache, {}).get(tool) or {}
                    if s.get(metric) is not None:
                        xs.append(j + bar_offset(i, len(tools), width))
                        ys.append(s[metric])
                bars = ax.bar(xs, ys, width, label=TOOL_LABEL[tool], color=COLORS[tool])
                fmt = "{:.1f}" if metric == "wall_s" else "{:.0f}"
                ax.bar_label(bars, labels=[fmt.format(y) for y in ys], fontsize=8, padding=2)
            if line is not None:
                # log scale: cp's ~2 MiB and verl's GiBs on one axis, ratios read as distances
                ax.set_yscale("log")
                ax.axhline(line, color="k", ls="--", lw=0.8)
                ax.text(
                    len(sizes) - 0.55,
                    line,
                    f"target {line} MiB",
                    va="bottom",
                    ha="right",
                    fontsize=8,
                    color="k",
                )
            ax.set_xticks(range(len(sizes)), [f"{s} GB fp32" for s in sizes])
            ax.set_title(f"{cache} page cache")
            ax.set_ylabel(ylabel)
            ax.margins(y=0.12)
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(loc="upper left", fontsize=8)
        title = "Merge wall time" if metric == "wall_s" else "Merge peak RSS (kernel ru_maxrss)"
        fig.suptitle(f"{title} — {r['machine']['cpu_count']} cores, {r['started'][:10]}")
        paths.append(save_figure(fig, img_dir / fname))
    return paths


def startup_of(r: dict, by_tool: dict, tool: str) -> dict | None:
    """Same-case start-up floor; older results kept one global floor per tool."""
    return by_tool.get(f"{tool}_startup") or (r.get("startup_floor") or {}).get(tool)


def merge_call_of(r: dict, size: str, cache: str) -> tuple[float, float] | None:
    """Median wall time of shardstream's merge call as it reports it (everything after the
    interpreter, imports and argument parsing), and the output MiB/s it implies."""
    calls = [
        x["self_report"]
        for x in r.get("runs", [])
        if x.get("tool") == "shardstream"
        and str(x.get("size_gb")) == str(size)
        and x.get("cache") == cache
        and (x.get("self_report") or {}).get("wall_s")
    ]
    if not calls:
        return None
    wall = statistics.median(c["wall_s"] for c in calls)
    written = statistics.median(c["bytes_written"] for c in calls)
    return wall, written / 2**20 / wall


def render_reading(r: dict) -> list[str]:
    """Derived facts that help read the table; all computed from the JSON."""
    out = ["## Reading the numbers", ""]
    for size, by_cache in r["summary"].items():
        on_disk = r["checkpoints"][size]["bytes_on_disk"]
        for cache, by_tool in by_cache.items():
            bits = []
            for tool in ("shardstream", "verl"):
                s, f = by_tool.get(tool) or {}, startup_of(r, by_tool, tool) or {}
                if s.get("wall_s") is None or f.get("wall_s") is None:
                    continue
                work = s["wall_s"] - f["wall_s"]
                rate = on_disk / 2**20 / work if work > 0 else float("nan")
                extra = s["peak_rss_mib"] - f["peak_rss_mib"]
                bits.append(
                    f"{TOOL_LABEL[tool]} {work:.1f} s past start-up "
                    f"(≈ {rate:.0f} MiB/s of checkpoint), +{extra:.0f} MiB over its start-up RSS"
                )
                inner = merge_call_of(r, size, cache) if tool == "shardstream" else None
                if inner:
                    bits[-1] += (
                        f", of which {inner[0]:.2f} s in the merge itself (open, plan, copy, "
                        f"fsync, rename; from `--json`), writing {inner[1]:.0f} MiB/s of output"
                    )
                    floor = by_tool.get("disk_write_floor") or {}
                    if floor.get("wall_s"):
                        bits[-1] += (
                            f" ({inner[0] / floor['wall_s']:.2f}× the {floor['wall_s']:.2f} s "
                            "dd took to write as many bytes with O_DIRECT and fsync)"
                        )
                    cast = by_tool.get("cast_floor") or {}
                    if cast.get("wall_s"):
                        # issue #20: the merge's own work against the whole cast floor; the
                        # rest of the merge's wall is start-up (mostly importing torch) and exit
                        bits[-1] += (
                            f"; that merge call is {inner[0] / cast['wall_s']:.2f}× the whole "
                            f"Python cast floor run ({cast['wall_s']:.2f} s), and the other "
                            f"{s['wall_s'] - inner[0]:.2f} s of the merge's wall are interpreter "
                            "start, imports (torch above all) and exit"
                        )
            loads = [s.get("loadavg_1m_before") for s in by_tool.values()]
            loads = [x for x in loads if x is not None]
            if bits:
                load = ""
                if loads:
                    load = f" 1-min load average before runs: median up to {max(loads):.1f}."
                out.append(f"- {size} GB, {cache}: " + "; ".join(bits) + "." + load)
    prof = r.get("shardstream_profile") or {}
    if prof.get("buckets_s"):
        total = prof["profiled_s"]
        parts = [
            f"{k} {v:.1f} s ({v / total:.0%})"
            for k, v in sorted(prof["buckets_s"].items(), key=lambda kv: -kv[1])
        ]
        out += [
            "",
            f"Where shardstream's time goes (one extra warm run on {prof['size_gb']} GB under "
            f"cProfile, {total:.1f} s profiled, main thread only, by the innermost call): "
            + "; ".join(parts)
            + ".",
        ]
        threads = prof.get("threads") or {}
        if threads.get("buckets_s") and threads.get("profiled_s"):
            t_total = threads["profiled_s"]
            t_parts = [
                f"{k} {v:.1f} s ({v / t_total:.0%})"
                for k, v in sorted(threads["buckets_s"].items(), key=lambda kv: -kv[1])
                if v >= 0.05
            ]
            out[-1] += (
                f" The window-writer thread, profiled alongside ({t_total:.1f} s of its own "
                "time, overlapping the main thread's): " + "; ".join(t_parts) + "."
            )
        out += [
            "",
            "A part-by-part account of a 4 GB merge against `bench/cast_floor.py` is in "
            "[benchmarks-merge-profile.md](benchmarks-merge-profile.md).",
        ]
    out += [
        "",
        "What differs between the tools, beyond speed:",
        "",
        "- `cp -r` (coreutils 9 on ext4) copies in the kernel (`copy_file_range`), converts "
        "nothing, and leaves its output as dirty page cache; it writes the fp32 shards, i.e. "
        "twice the bytes of a bf16 merge. `cp -r + fsync` also fsyncs every copied file.",
        "- `shardstream merge` maps byte ranges of the rank files a buffer's worth at a time, "
        "checks every zip record against the CRC-32 torch stored for it, casts into a bounded "
        "window, checksums its output, writes with O_DIRECT and fsyncs it before renaming it "
        "into place (crash-safe).",
        "- verl's merger `torch.load`s every rank file whole, casts to bf16 (hard-coded), "
        "concatenates in memory and writes with `save_pretrained`; it does not fsync.",
        "- *Python cast floor* (`bench/cast_floor.py`) is not a merger: the least work any "
        "Python merge into bf16 does. It starts the interpreter, imports numpy, maps the rank "
        "files, rounds every 4-byte word to bf16 in 1 MiB steps, writes the halves to one file "
        "and fsyncs it; no torch (so no `weights_only` unpickling), no checks, no header, no "
        "rename. What `shardstream merge` adds to it at the small size is mostly importing "
        "torch (1–1.5 s here), which opening `.pt` files with torch's `weights_only=True` "
        "loader requires.",
        "",
    ]
    return out


def render_doc(r: dict, img_rel: str, images: list[Path]) -> str:
    m, v, o = r["machine"], r["versions"], r["options"]
    sizes = ", ".join(f"{s} GB" for s in o["sizes_gb"])
    dirty = " (+uncommitted changes in src/)" if v.get("shardstream_git_dirty") else ""
    lines = [
        "# Merge benchmark",
        "",
        generated_note("bench/report.py", "bench/results/merge.json"),
        "",
        "`shardstream merge` against verl's own FSDP merger (`python -m verl.model_merger merge "
        "--backend fsdp`) and against a plain `cp -r` of the same checkpoint directory, on real "
        "verl FSDP2 checkpoints of a Qwen2 model. Reproduce with `make bench` (full run) or "
        "`.venv/bin/python bench/run.py --quick` (0.5 GB case only).",
        "",
        f"- **Run:** {r['started']} → {r['finished']} ({r['duration_s'] / 60:.1f} min), "
        f"`{'/'.join(Path(r['argv'][0]).parts[-2:]) if r['argv'] else ''}"
        f"{' ' + ' '.join(r['argv'][1:]) if len(r['argv']) > 1 else ''}`",
        f"- **Machine:** {m['cpu_count']} cores ({m['cpu_model']}), {m['mem_total_gib']} GiB RAM, "
        f"swap: {m['swap']}; disk {m['disk_device']} ({m['disk_fs']}, {m['disk_size_gib']} GiB, "
        f"{m['disk_free_gib']} GiB free); Linux {m['kernel']}; Python {m['python']}. "
        "A shared VM: absolute numbers are noisy; the ratios (same run, interleaved) are the "
        "point.",
        f"- **Software:** torch {v.get('torch')}, safetensors {v.get('safetensors')}, shardstream "
        f"@ {v.get('shardstream_git')}{dirty}"
        + (
            f"; verl {v['verl']} in `.bench-venv` (torch {v.get('verl_venv_torch')}, "
            f"transformers {v.get('verl_venv_transformers')})"
            if v.get("verl")
            else ""
        )
        + f"; {v.get('cp')}.",
        f"- **Design:** checkpoints {sizes} of fp32 weights; {o['repeats']} runs per tool and "
        "case, **median** reported; tool order rotated each repeat; `sync` before every run.",
        "",
        "## Targets",
        "",
        render_targets(r),
        "",
        "## Results",
        "",
        render_table(r),
        "",
        "Ratios are median ÷ median within the same case. `time ÷ cp -r` > 1 means slower than "
        "copying the checkpoint directory. *CPU s*: user + system time of the command itself "
        "(from `time`), less sensitive to a busy machine than wall time. *others' CPU*: the "
        "share of the machine's CPU time (all cores) that was busy *outside* the measured "
        "command while it ran (median over runs; from `/proc/stat`, so it includes kernel "
        "writeback of the tool's own dirty pages) — the noise indicator on a shared machine.",
        "",
    ]
    floor_rows = []
    for size, by_cache in r["summary"].items():
        for cache, by_tool in by_cache.items():
            parts = []
            for t in ("shardstream", "verl"):
                f = startup_of(r, by_tool, t)
                if f and f.get("wall_s") is not None:
                    parts.append(
                        f"{TOOL_LABEL[t]} {f['wall_s']:.2f} s / {f['peak_rss_mib']:.0f} MiB"
                    )
            if parts:
                floor_rows.append(f"{size} GB {cache}: " + "; ".join(parts))
    if floor_rows:
        lines += [
            "**Start-up floor**: the same command with `--help` (interpreter, imports, argument "
            "parsing, no data), run inside each case's rotation so it sees the same page cache "
            "and load; median wall / peak RSS — " + " · ".join(floor_rows) + ". `cp -r` has no "
            "such floor, which dominates the small case. shardstream's CLI imports lazily, so its "
            "`--help` no longer loads torch: its *past start-up* figures below include importing "
            "torch (about 1–1.5 s and 200+ MiB on this machine), verl's do not.",
            "",
        ]
    for p in images:
        lines += [f"![{p.stem}]({img_rel}/{p.name})", ""]

    lines += render_reading(r)
    lines += ["## Output check", ""]
    if not r["output_checks"]:
        lines += ["_Not run (needs both shardstream and verl outputs)._", ""]
    for size, c in r["output_checks"].items():
        if c.get("identical"):
            lines.append(
                f"- {size} GB: shardstream and verl outputs **identical** — {c['n_common']} "
                f"tensors, same keys, {c['bytes_compared_bitwise'] / 2**20:.0f} MiB compared bit "
                "for bit with `safe_open`, tensor by tensor."
            )
        else:
            lines.append(f"- {size} GB: **MISMATCH** — `{json.dumps(c)[:1500]}`")
    lines.append("")

    if r["problems"]:
        lines += ["## Problems in this run", ""]
        lines += [f"- {p.splitlines()[0][:300]}" for p in r["problems"]]
        lines.append("")

    lines += [
        "## Method",
        "",
        "Commands, as timed (`CKPT` is `bench/results/ckpt/<name>`, `OUT` a fresh directory "
        "removed before each run):",
        "",
        "```",
        *[r["commands"][t] for t in TOOLS_CMD_ORDER if t in r["commands"]],
        "```",
        "",
        "- **Wall time:** `time.perf_counter()` from spawning the command to reaping it, so "
        "interpreter start-up and imports count (they are part of what a user waits for).",
        "- **Peak RSS:** the kernel's `ru_maxrss` for the command, read by running it under GNU "
        "`/usr/bin/time -f %M` (the *Maximum resident set size* of `time -v`). Not `os.wait4` "
        "on a child of the Python driver: Linux keeps the RSS high-water mark of the address "
        "space a process had before `exec`, so a command forked from a driver that imported "
        "torch would inherit its ~230 MiB (`cp -r` measured 229 MiB that way, 2 MiB under "
        "`time`). A 50 ms sampler also sums the RSS of the whole process tree "
        "(`tree_peak_rss_mib` in the JSON) so a tool that forks helpers cannot hide memory in "
        "them.",
        "- **Page cache:** *warm* — every checkpoint file is read once (like `cat > /dev/null`) "
        "right before each run of each tool, so all three read from memory. "
        + (
            "*cold* — `sync; echo 3 > /proc/sys/vm/drop_caches` right before each run, so "
            "the checkpoint (and each tool's own Python libraries) come from disk."
            if "cold" in o["cache_modes"]
            else f"*cold*: {r['notes'].get('cold_cache', 'not requested in this run')}."
        ),
        "- Written data is not fsynced by the harness; a `sync` (untimed) before each run keeps "
        "one run's dirty pages from being flushed on the next run's clock.",
        "- **Output check:** after the last repeat, shardstream's and verl's merged directories "
        "are compared with `bench/compare.py`: same key set, same dtypes and shapes, identical "
        "bytes. Any difference is printed with `!!!`, listed here and makes `bench/run.py` exit "
        "non-zero.",
        "",
        "### Checkpoints",
        "",
        "Generated once by `shardstream.testing.verl_checkpoint.write_verl_checkpoint` (real FSDP2 "
        "on CPU/gloo, verl's on-disk layout, no optimizer state, 0 train steps) and cached under "
        "`bench/results/ckpt/`.",
        "",
        "| name | world size | params | fp32 weights | on disk | config overrides | generated in |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for c in r["checkpoints"].values():
        spec = c["spec"]
        gen = f"{c['generated_s']:.0f} s" if c.get("generated_s") is not None else "–"
        lines.append(
            f"| {Path(c['root']).name} | {spec['world_size']} "
            f"| {c['fp32_param_bytes'] / 4e6:.0f} M | {c['fp32_param_bytes'] / 1e9:.2f} GB "
            f"| {c['bytes_on_disk'] / 2**30:.2f} GiB | `{json.dumps(spec['config_overrides'])}` "
            f"| {gen} |"
        )
    lines += [
        "",
        "## Reproduce",
        "",
        "```sh",
        "make bench                                  # = .venv/bin/python bench/run.py",
        ".venv/bin/python bench/run.py --quick       # 0.5 GB only, warm cache, 2 repeats",
        ".venv/bin/python bench/run.py --sizes 0.5,2 --repeats 5 --cache warm",
        ".venv/bin/python bench/report.py            # re-render this page from merge.json",
        "```",
        "",
        "`bench/setup_verl_venv.sh` builds `.bench-venv` (verl 0.9.1 installed with `--no-deps`, "
        "plus only what its merger imports, torch pinned to the CPU build). Raw per-run numbers "
        "are in `bench/results/merge.json` (not committed). Dropping the page cache needs root; "
        "without it the cold rows are skipped and the reason recorded.",
        "",
        "## Other benchmarks",
        "",
        "- [Training: save, restore, hf_model export and async save]"
        "(benchmarks-training.md) (`bench/save_bench.py`, `bench/async_bench.py`)",
        "- [Distributed merge speed-up](benchmarks-distributed.md) "
        "(`bench/distributed_merge_bench.py`)",
        "- [Merging PyTorch DCP checkpoints](benchmarks-dcp.md) (`bench/dcp_merge_bench.py`)",
        "- [Merging a checkpoint saved by many ranks](benchmarks-wide-merge.md) "
        "(`bench/wide_merge_bench.py`)",
        "- [Scaling to 70B on 1,024 and 8,192 ranks](scaling.md) (`bench/scale_sim.py`)",
        "- GPU: `bench/gpu_check.py` (pinned ring, async stall, restore) has not run on a GPU "
        "yet; every figure here is from CPU.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# MoE merge (bench/moe_merge.py, issue #22): its own section of docs/benchmarks.md, rendered from
# results/moe-merge.json alone and spliced in, so it re-renders without merge.json and a full
# render from merge.json keeps it.

MOE_HEADING = "## MoE merge"
MOE_BEFORE = "## Other benchmarks"  # where the section goes when the page has none yet
MOE_LABEL = {
    "dense": "dense Qwen3 (`Qwen3ForCausalLM`)",
    "moe": "Qwen3-MoE, fused experts → per-expert tensors, **cold** (empty layout cache)",
    "moe_warm": "Qwen3-MoE, the same merge **warm** (layout plan read from the cache)",
    "moe_fused": "Qwen3-MoE with `--keep-names` (fused, no split; informational)",
}
MOE_CHECKPOINT = {"dense": "dense", "moe": "moe", "moe_warm": "moe", "moe_fused": "moe"}
MOE_SHORT = {
    "dense": "dense",
    "moe": "MoE cold",
    "moe_warm": "MoE warm",
    "moe_fused": "MoE `--keep-names`",
}
MOE_BIG = "_big"  # bench/moe_merge.py's BIG: the same merges of --scale times deeper checkpoints
for _kind in ("dense", "moe", "moe_warm"):
    MOE_LABEL[_kind + MOE_BIG] = MOE_LABEL[_kind] + ", **larger**"
    MOE_CHECKPOINT[_kind + MOE_BIG] = MOE_CHECKPOINT[_kind] + MOE_BIG
    MOE_SHORT[_kind + MOE_BIG] = MOE_SHORT[_kind] + " (larger)"


def _met(ok: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "n/a"}[ok]


def _ratio_met(s: dict, which: str) -> bool | None:
    """The time goal's verdict for the cold or warm MoE merge (a result from before the
    layout cache holds one bool, for the only MoE merge it timed: cold)."""
    met = s.get("ratio_met")
    if isinstance(met, dict):
        return met.get(which)
    return bool(met) if which == "cold" else None


def _time_verdict(s: dict, goal: float) -> str | None:
    """One line on the time goal, cold and warm, neither hidden."""
    cold, warm = s.get("ratio_moe_dense"), s.get("ratio_moe_warm_dense")
    if cold is None or warm is None:
        return None
    met_cold, met_warm = _ratio_met(s, "cold"), _ratio_met(s, "warm")
    figures = (
        f"Cold (the first merge of a layout on a machine: transformers imported, meta model "
        f"built, conversion traced, plan cached) **{cold:.3f}×** dense's time per byte; warm "
        f"(every later merge of the same layout, transformers version and config: plan read "
        f"from the cache, transformers not imported) **{warm:.3f}×**"
    )
    if met_cold and met_warm:
        verdict = f"**met** cold and warm (≤ {goal:.2f}×)"
    elif met_warm:
        verdict = f"**met only warm** (≤ {goal:.2f}×); **not met cold**"
    elif met_cold:
        verdict = f"met cold but **not met warm** (≤ {goal:.2f}×)"
    else:
        verdict = f"**not met**, cold nor warm (≤ {goal:.2f}×)"
    return f"- **Time goal:** {verdict}. {figures}."


def _larger_note(m: dict) -> str:
    big = m.get("model_big")
    if not big or "dense" + MOE_BIG not in m["checkpoints"]:
        return ""
    c = m["checkpoints"]
    return (
        f" **Larger** (rows marked so): the same two models at {big['layers']} layers "
        f"(MoE {m['params_big']['moe']:,} parameters, {c['moe' + MOE_BIG]['bytes']:,} bytes; "
        f"dense MLP width {big['dense_intermediate']}, {m['params_big']['dense']:,} "
        f"parameters, {c['dense' + MOE_BIG]['bytes']:,} bytes); the dense, MoE cold and MoE "
        "warm merges run on them in every repeat too."
    )


def _margin_lines(m: dict, goal: float) -> str | None:
    """What the two checkpoint sizes say: each merge's time per byte at the margin and its
    fixed cost, and the size from which a cold MoE merge meets the goal."""
    margin, big = m["summary"].get("margin") or {}, m.get("model_big")
    if not {"dense", "moe"} <= set(margin) or not big:
        return None
    d, cold, warm = margin["dense"], margin["moe"], margin.get("moe_warm")
    if "ratio_to_dense" not in cold:
        return (
            f"- **Per byte at the margin:** not measured: dense's median wall time does not grow "
            f"from the smaller checkpoint to the larger ({d['s_per_gb']:.3f} s/GB), so the "
            "sizes are too close for this machine's noise."
        )
    sizes = (
        f"{m['checkpoints']['dense']['bytes'] / 1e9:.2f} and "
        f"{m['checkpoints']['dense' + MOE_BIG]['bytes'] / 1e9:.2f} GB"
    )
    where = cold.get("goal_from_gb")
    reach = (
        "at no size (its time per byte at the margin is above the goal)"
        if where is None
        else "at every size measured"
        if where == 0
        else f"from **{where:.1f} GB** of checkpoint"
    )
    line = (
        f"- **Per byte at the margin** (the slope of median wall time between the two sizes, "
        f"{big['layers']} against {m['model']['layers']} layers; {sizes}): dense "
        f"{d['s_per_gb']:.3f} s/GB, MoE cold {cold['s_per_gb']:.3f} s/GB "
        f"(**{cold['ratio_to_dense']:.3f}×** dense)"
    )
    if warm:
        line += f", MoE warm {warm['s_per_gb']:.3f} s/GB (**{warm['ratio_to_dense']:.3f}×**)"
    calls = [
        (n, k) for n, k in (("cold", cold), ("warm", warm)) if k and "call_ratio_to_dense" in k
    ]
    if calls:
        line += (
            "; the merge call alone (no interpreter start-up or import, so steadier): dense "
            f"{d['call_s_per_gb']:.3f} s/GB, "
            + ", ".join(
                f"MoE {n} {k['call_s_per_gb']:.3f} s/GB (**{k['call_ratio_to_dense']:.3f}×**)"
                for n, k in calls
            )
        )
    line += (
        f". Fixed cost (the intercept: interpreter, imports, planning) beyond dense's: MoE cold "
        f"{cold['fixed_beyond_dense_s']:.2f} s"
        + (f", MoE warm {warm['fixed_beyond_dense_s']:+.2f} s" if warm else "")
        + f". Counting that fixed cost, a cold MoE merge is within {goal:.2f}× dense's time "
        f"per byte {reach} (the line through the two sizes)."
    )
    return line


def render_moe_evicted(e: dict) -> list[str]:
    """The MoE section's part on checkpoints read from disk (moe-merge-evicted.json)."""
    s, goal = e["summary"], e["targets"]["ratio"]
    rows = []
    for kind, label in MOE_SHORT.items():
        k = s.get(kind)
        if not k or kind == "moe_fused":
            continue
        ckpt = e["checkpoints"][MOE_CHECKPOINT[kind]]
        if not k.get("n_ok"):
            rows.append([label, f"{ckpt['bytes']:,}", f"FAILED ({k['n']} runs)", "", "", "", ""])
            continue
        ratio = k.get("ratio_to_dense")
        call = k.get("call_ratio_to_dense")
        rows.append(
            [
                label,
                f"{ckpt['bytes']:,}",
                f"{k['median_wall_s']:.2f}",
                f"{k['s_per_gb']:.3f}",
                "1 (reference)" if ratio is None else f"{ratio:.3f}",
                "–" if call is None else f"{call:.3f}",
                f"{k['max_peak_rss_mib']:.0f} ({k['median_peak_rss_mib']:.0f})",
            ]
        )
    head = (
        "merge | checkpoint bytes | median wall s | s/GB | ratio to dense (per byte) "
        "| merge call alone, ratio | peak RSS MiB, max (median)"
    )
    lines = [
        "### Checkpoints read from disk",
        "",
        generated_note(
            "bench/moe_merge.py --source-cache evicted and bench/report.py",
            "bench/results/moe-merge-evicted.json",
        ),
        "",
        f"The same merges with the page cache {e['cache']}. Run {e['started']} → "
        f"{e['finished']} ({e['duration_s'] / 60:.1f} min), `{' '.join(e['argv'])}`; "
        f"shardstream @ {e['revision']}"
        + (" (+uncommitted changes in src/)" if e.get("src_dirty") else "")
        + f"; {e['repeats']} runs of each, interleaved; medians. While a cold merge plans its "
        "layout, the disk already reads the first source bytes (`engine/readahead.py`).",
        "",
        *table(head, "lrrrrrr", rows),
        "",
    ]
    margin = _margin_lines(e, goal)
    if margin:
        lines += [margin, ""]
    return lines


def render_moe(m: dict, evicted: dict | None = None) -> str:
    """The MoE merge section, from moe-merge.json (and moe-merge-evicted.json, ``evicted``)."""
    s, mach, model = m["summary"], m["machine"], m["model"]
    rss_goal, ratio_goal = m["targets"]["peak_rss_mib"], m["targets"]["ratio"]
    rows = []
    for kind, label in MOE_LABEL.items():
        if kind not in s:
            continue
        k, ckpt = s[kind], m["checkpoints"][MOE_CHECKPOINT[kind]]
        if not k.get("n_ok"):
            rows.append([label, f"{ckpt['bytes']:,}", f"FAILED ({k['n']} runs)", *[""] * 5])
            continue
        rss_ok = k["max_peak_rss_mib"] <= rss_goal
        goal = f"RSS ≤ {rss_goal} MiB"
        ratio = "1 (reference)" if kind == "dense" else fmt(k.get("ratio_to_dense"), ".3f")
        result = _met(rss_ok)
        if kind in ("moe", "moe_warm"):
            goal += f"; s/GB ≤ {ratio_goal:.2f}× dense"
            which = "warm" if kind == "moe_warm" else "cold"
            result = f"RSS {_met(rss_ok)}; time {_met(_ratio_met(s, which))}"
        elif kind.startswith("moe") and kind.endswith(MOE_BIG):
            goal += f"; s/GB ≤ {ratio_goal:.2f}× dense (larger)"
            ok = k.get("ratio_to_dense")
            result = f"RSS {_met(rss_ok)}; time {_met(None if ok is None else ok <= ratio_goal)}"
        elif kind == "moe_fused":
            goal, result = "–", "n/a"
        rows.append(
            [
                label,
                f"{ckpt['bytes']:,}",
                f"{k['median_wall_s']:.2f}",
                f"{k['s_per_gb']:.3f}",
                ratio,
                f"{k['max_peak_rss_mib']:.0f} ({k['median_peak_rss_mib']:.0f})",
                goal,
                result,
            ]
        )
    head = (
        "model | checkpoint bytes | median wall s | s/GB | ratio to dense (per byte) "
        "| peak RSS MiB, max (median) | goal | result"
    )
    first = [r["kind"] for r in m["runs"] if r["repeat"] == 0]
    names = {"dense": "dense", "moe": "MoE", "moe_fused": "MoE --keep-names"}
    names["moe_warm"] = "MoE warm"
    if "moe_warm" in first:
        names["moe"] = "MoE cold"
    order = ", ".join(names.get(k, MOE_SHORT.get(k, k)) for k in first)
    layout_cache = (
        " Layout cache (`SHARDSTREAM_CACHE_DIR`, see docs/hf-layout.md): every run gets a fresh "
        "empty directory except the warm MoE run, which gets the one the cold MoE run of the "
        "same repeat just filled (`cache_files_before` in the JSON); likewise for `inspect`."
        if "moe_warm" in first
        else ""
    )
    lines = [
        MOE_HEADING,
        "",
        generated_note("bench/moe_merge.py and bench/report.py", "bench/results/moe-merge.json"),
        "",
        "Issue #22's goal: merging an MoE checkpoint of at least 2 GB keeps peak RSS ≤ "
        f"{rss_goal} MiB, and its wall time per checkpoint byte is within "
        f"{(ratio_goal - 1) * 100:.0f}% of a dense checkpoint of the same size. The MoE merge "
        "splits every fused expert tensor (`mlp.experts.gate_up_proj` [E, 2I, H], "
        "`mlp.experts.down_proj` [E, H, I]) into the per-expert `experts.{e}.gate_proj`, "
        "`up_proj` and `down_proj` tensors `save_pretrained` writes, as byte ranges of the "
        "rank files.",
        "",
        f"- **Run:** {m['started']} → {m['finished']} ({m['duration_s'] / 60:.1f} min), "
        f"`{' '.join(m['argv'])}`; shardstream @ {m['revision']}"
        + (" (+uncommitted changes in src/)" if m.get("src_dirty") else "")
        + f"; {mach['cpu_count']} cores ({mach['cpu_model']}), {mach['mem_total_gib']} GiB RAM, "
        f"{mach['disk_fs']} on {mach['disk_device']}. A shared VM: the ratio (same run, "
        "interleaved) is the point.",
        f"- **Checkpoints:** verl's FSDP2 layout (`model_world_size_{model['world']}_rank_R.pt`, "
        f"fp32, {model['world']} ranks over gloo). MoE: `Qwen3MoeForCausalLM`, "
        f"{model['layers']} layers, hidden {model['hidden']}, {model['experts']} experts of "
        f"width {model['moe_inter']} ({m['params']['moe']:,} parameters). Dense: "
        f"`Qwen3ForCausalLM` with the same attention, embeddings and layers and MLP width "
        f"{model['dense_intermediate']}, chosen to match the parameter count "
        f"({m['params']['dense']:,}); on disk the two differ by "
        f"{abs(m['checkpoints']['moe']['bytes'] / m['checkpoints']['dense']['bytes'] - 1):.3%}."
        + _larger_note(m),
        f"- **Design:** `shardstream merge --dtype bfloat16 --json`, {m['options']}; "
        f"{m['repeats']} runs of each, interleaved ({order}, and again); {m['cache']}. "
        "Wall time and peak RSS per run from `harness.process.run_measured` (spawn to reap; the "
        "kernel's peak RSS of the process, i.e. its VmHWM, via GNU `time`). **Medians** of the "
        "runs; the goal is checked on the largest peak RSS of any run." + layout_cache,
        "",
        *table(head, "lrrrrrll", rows),
        "",
    ]
    kinds = [k for k in MOE_LABEL if s.get(k, {}).get("n_ok")]
    short = dict(MOE_SHORT)
    if "moe_warm" not in s:
        short["moe"] = "MoE"
    extra = []
    verdict = _time_verdict(s, ratio_goal)
    if verdict:
        extra.append(verdict)
    margin = _margin_lines(m, ratio_goal)
    if margin:
        extra.append(margin)
    calls = [k for k in kinds if s[k].get("median_merge_call_s") is not None]
    if "dense" in calls and len(calls) > 1:
        extra.append(
            "- The merge call alone (`wall_s` of `--json`: open, plan, copy, fsync, rename; no "
            "interpreter start-up or torch import), median: "
            + "; ".join(
                f"{short[k]} {s[k]['median_merge_call_s']:.2f} s"
                + (
                    ""
                    if k.startswith("dense")
                    else f" ({s[k]['call_ratio_to_dense']:.3f}× dense per byte)"
                )
                for k in calls
            )
            + "."
        )
    planned = [k for k in calls if s[k].get("median_layout_s") is not None]
    if "dense" in planned and len(planned) > 1:
        extra.append(_layout_time_line(s, planned, short))
    if "moe" in kinds and "moe_fused" in kinds:
        extra.append(
            f"- Where the MoE merge's extra time goes: {short['moe']} − MoE `--keep-names` = "
            f"{s['moe']['median_wall_s'] - s['moe_fused']['median_wall_s']:.2f} s of median "
            "wall: planning the save_pretrained layout (importing transformers, building the "
            "model on the meta device, tracing its save-time conversion) and the split itself; "
            f"MoE `--keep-names` − dense = "
            f"{s['moe_fused']['median_wall_s'] - s['dense']['median_wall_s']:.2f} s: the same "
            "bytes in fused rather than dense tensors."
        )
    if "moe_warm" in kinds and "moe_fused" in kinds:
        extra.append(
            f"- What is left warm: MoE warm − MoE `--keep-names` = "
            f"{s['moe_warm']['median_wall_s'] - s['moe_fused']['median_wall_s']:.2f} s of median "
            "wall (merge call alone: "
            f"{s['moe_warm']['median_merge_call_s'] - s['moe_fused']['median_merge_call_s']:.2f}"
            " s): reading the cached plan and the split itself (per-expert output tensors, each "
            "a strided box of a fused record)."
        )
    if s.get("planning_s") is not None:
        i = s["inspect_median_wall_s"]
        extra.append(
            "- Planning the layout alone: `shardstream inspect --json` (reads the rank files' "
            "layouts and plans the output names as merge does; copies nothing), run after each "
            f"repeat, median {i['moe']:.2f} s on the MoE checkpoint against {i['dense']:.2f} s "
            f"on the dense one: **{s['planning_s']:.2f} s** to import transformers, build the "
            "model on the meta device and trace its save-time conversion, which the dense merge "
            "(a model type that needs no mapping) does not pay; "
            f"{s['planning_s'] / s['moe']['median_wall_s']:.0%} of the MoE merge's median wall. "
            "It reads no tensor data, so it does not grow with the bytes: without it the MoE "
            "merge would take "
            f"{s['ratio_without_planning']:.3f}× dense's time per byte (informational)."
        )
    if s.get("planning_warm_s") is not None:
        i = s["inspect_median_wall_s"]
        extra.append(
            "- Planning the layout from the cache: `inspect --json` with the cache the cold "
            f"`inspect` filled, median {i['moe_warm']:.2f} s on the MoE checkpoint against "
            f"{i['dense']:.2f} s on the dense one ({s['planning_warm_s']:+.2f} s)."
        )
    if kinds:
        extra.append(
            "- CPU (user + system, median): "
            + "; ".join(f"{short[k]} {s[k]['median_user_sys_s']:.2f} s" for k in kinds)
            + ". Others' share of the machine's CPU while the merges ran (median): "
            + "; ".join(f"{short[k]} {s[k]['median_others_cpu_share']:.0%}" for k in kinds)
            + "."
        )
        walls = {
            k: " / ".join(f"{r['wall_s']:.2f}" for r in m["runs"] if r["kind"] == k) for k in kinds
        }
        extra.append(
            "- Wall s per run, in run order: "
            + "; ".join(f"{short[k]} {walls[k]}" for k in kinds)
            + "."
        )
    lc = m.get("layout_check") or {}
    if lc:
        extra.append(
            "- **MoE layout:** "
            + (
                f"per-expert keys only — {lc['per_expert_keys']:,} of "
                f"{lc['per_expert_keys_expected']:,} expected `experts.{{e}}.*_proj.weight` "
                "tensors, no fused `experts.gate_up_proj` / `experts.down_proj`."
                if lc.get("ok")
                else f"**WRONG** — `{json.dumps(lc)[:600]}`"
            )
        )
    wc = m.get("warm_check")
    if wc:
        extra.append(
            (
                f"- **Warm against cold:** the warm MoE merge's output (cached plan) is "
                f"**identical** to the cold one's — {wc['tensors']:,} tensors, same keys and "
                f"index, {wc['bytes_compared'] / 2**20:.0f} MiB compared bit for bit"
                + ("; the same layout rule every run." if s.get("warm_layout_same") else ".")
            )
            if wc.get("identical")
            else f"- **Warm against cold: MISMATCH** — `{json.dumps(wc)[:600]}`"
        )
    rc = m.get("reference_check")
    if rc:
        sp = m.get("save_pretrained") or {}
        if rc.get("identical"):
            extra.append(
                f"- **Against `save_pretrained`** of the same MoE weights cast to bf16, at the "
                f"full size: **identical** — {rc['tensors']:,} tensors, same keys and index, "
                f"{rc['bytes_compared'] / 2**20:.0f} MiB compared bit for bit. "
                f"`save_pretrained` (model built and held whole) took {sp.get('wall_s', 0):.1f} s "
                f"and {sp.get('peak_rss_mib', 0):.0f} MiB."
            )
        else:
            extra.append(f"- **Against `save_pretrained`: MISMATCH** — `{json.dumps(rc)[:600]}`")
    else:
        extra.append("- Not compared with `save_pretrained` in this run (`--no-reference`).")
    lines += extra
    lines += ["", *(render_moe_evicted(evicted) if evicted else [])]
    lines += [
        "Reproduce: `.venv/bin/python bench/moe_merge.py` and `bench/moe_merge.py "
        "--source-cache evicted` (part of `make bench`; `bench/report.py --moe` re-renders "
        "this section from the JSON).",
        "",
    ]
    return "\n".join(lines) + "\n"


def _layout_time_line(s: dict, kinds: list[str], short: dict) -> str:
    """Inside the merge call: planning the output names, the copy after it, and how much of
    the cold plan is transformers' own import (the probe)."""
    line = (
        "- Inside the merge call (`layout_s` of `--json`, the planning of the output names; "
        "the rest of the call is the copy), median: "
        + "; ".join(
            f"{short[k]} plan {s[k]['median_layout_s']:.2f} s, copy {s[k]['median_copy_s']:.2f} s"
            + (
                f" ({s[k]['copy_ratio_to_dense']:.3f}× dense per byte)"
                if s[k].get("copy_ratio_to_dense") is not None
                else ""
            )
            for k in kinds
        )
        + "."
    )
    floor = s.get("transformers_import_s")
    if None not in (floor, s.get("plan_after_import_s"), s.get("cold_layout_range_s")):
        cold, (lo, hi) = s["moe"]["median_layout_s"], s["cold_layout_range_s"]
        f_lo, f_hi = s["transformers_import_range_s"]
        line += (
            f" The cold plan (median {cold:.2f} s, {lo:.2f}–{hi:.2f} s over the runs) is mostly "
            "importing the transformers modules it uses: timed alone after each repeat, in a "
            "fresh interpreter that has imported what merge has by then (torch, shardstream's "
            "merge), `transformers`, `transformers.core_model_loading`, the config mapping and "
            f"the model class take a median **{floor:.2f} s** ({f_lo:.2f}–{f_hi:.2f} s), a "
            "cost any tool that follows transformers' own conversion rules pays; the plan "
            "after them, in the same process (the config, the model on the meta device, the "
            f"trace), a median {s['plan_after_import_s']:.2f} s."
        )
    return line


def moe_section(text: str) -> str | None:
    """The MoE section of a rendered page (heading to the next ``## `` heading), or None."""
    lines = text.split("\n")
    if MOE_HEADING not in lines:
        return None
    start = lines.index(MOE_HEADING)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def splice_moe(text: str, section: str) -> str:
    """``text`` with its MoE section replaced by ``section`` (which ends in a blank line), or
    with ``section`` put before "Other benchmarks" (at the end when that is missing)."""
    old = moe_section(text)
    if old is not None:
        return text.replace(old + "\n" if old + "\n" in text else old, section, 1)
    if "\n" + MOE_BEFORE + "\n" in text:
        return text.replace("\n" + MOE_BEFORE + "\n", "\n" + section + MOE_BEFORE + "\n", 1)
    return text.rstrip("\n") + "\n\n" + section


def _moe_results(src: Path) -> str:
    """The MoE section from ``src`` and the evicted run's JSON beside it, where there is one."""
    evicted = src.with_name(src.stem + "-evicted" + src.suffix)
    return render_moe(
        json.loads(src.read_text()),
        json.loads(evicted.read_text()) if evicted.is_file() else None,
    )


def write_moe(src: Path, doc: Path) -> Path:
    """Re-render only the MoE section of ``doc`` from ``src``."""
    text = doc.read_text() if doc.is_file() else ""
    return write_doc(doc, splice_moe(text, _moe_results(src)))


def write_report(r: dict, doc: Path, img_dir: Path) -> Path:
    images = plot(r, img_dir)
    rel = Path("img") if img_dir.parent == doc.parent else img_dir
    text = render_doc(r, str(rel), images)
    # Keep the MoE section: fresh from its JSON where there is one, else as the page had it.
    moe_json = BENCH / "results" / "moe-merge.json"
    if moe_json.is_file():
        text = splice_moe(text, _moe_results(moe_json))
    elif doc.is_file() and (old := moe_section(doc.read_text())) is not None:
        text = splice_moe(text, old + "\n")
    return write_doc(doc, text)


def main(argv: list[str]) -> int:
    doc_path = REPO / "docs" / "benchmarks.md"
    if argv[:1] == ["--moe"]:
        src = Path(argv[1]) if len(argv) > 1 else BENCH / "results" / "moe-merge.json"
        print(f"wrote {write_moe(src, doc_path)} (MoE section)")
        return 0
    src = Path(argv[0]) if argv else BENCH / "results" / "merge.json"
    r = json.loads(src.read_text())
    doc = write_report(r, doc_path, REPO / "docs" / "img")
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
