"""Render bench/results/merge.json into docs/benchmarks.md and the plots in docs/img/.

    python bench/report.py [bench/results/merge.json]

run.py calls this at the end of a full run; call it alone to re-render without re-measuring.
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


def write_report(r: dict, doc: Path, img_dir: Path) -> Path:
    images = plot(r, img_dir)
    rel = Path("img") if img_dir.parent == doc.parent else img_dir
    return write_doc(doc, render_doc(r, str(rel), images))


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else BENCH / "results" / "merge.json"
    r = json.loads(src.read_text())
    doc = write_report(r, REPO / "docs" / "benchmarks.md", REPO / "docs" / "img")
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
