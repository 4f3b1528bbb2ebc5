"""Distributed merge speed-up: `torchrun --nproc_per_node=K -m shardstream merge --distributed`.

Usage: python bench/distributed_merge_bench.py [--ckpt DIR] [--procs 1 2 4] [--repeats 2]
Default checkpoint: the 0.5 GB verl checkpoint `bench/run.py` builds (bench/results/ckpt/).
Writes bench/results/distributed_merge.json and docs/benchmarks-distributed.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness import REPO, RESULTS
from harness.process import run_measured, torchrun
from harness.render import generated_note, table, write_doc

DEFAULT_CKPT = RESULTS / "ckpt/qwen2-0.5gb-ws4/global_step_1/actor"


def merge_once(ckpt: Path, target: Path, procs: int) -> float:
    shutil.rmtree(target, ignore_errors=True)
    args = ["--local_dir", str(ckpt), "--target_dir", str(target), "--quiet"]
    if procs == 1:
        cmd = [sys.executable, "-m", "shardstream", "merge", *args]
    else:
        cmd = torchrun(procs, "-m", "shardstream", "merge", *args, "--distributed")
    os.sync()
    m = run_measured(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if m.returncode != 0:
        raise SystemExit(f"!!! {' '.join(cmd)} failed:\n{m.stderr_tail[-2000:]}")
    return m.wall_s


def identical(a: Path, b: Path) -> bool:
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


def _verdict(rows: list[dict]) -> str:
    best = max(rows, key=lambda r: r["speedup"])
    if best["speedup"] > 1.05:
        return f"Best: K={best['procs']}, {best['speedup']:.2f}x faster than one process."
    return "No speed-up here: one process was fastest on this machine for this checkpoint."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ckpt", type=Path, default=DEFAULT_CKPT)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not args.ckpt.is_dir():
        raise SystemExit(f"{args.ckpt}: no checkpoint; run `python bench/run.py --quick` first")
    scratch = RESULTS / "distributed"
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    for procs in args.procs:
        times = [merge_once(args.ckpt, scratch / f"k{procs}", procs) for _ in range(args.repeats)]
        rows.append({"procs": procs, "times_s": times, "median_s": statistics.median(times)})
    base = rows[0]["median_s"]
    same = all(identical(scratch / f"k{args.procs[0]}", scratch / f"k{r['procs']}") for r in rows)
    for row in rows:
        row["speedup"] = base / row["median_s"]
    result = {
        "checkpoint": str(args.ckpt),
        "rows": rows,
        "byte_identical": same,
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    (RESULTS / "distributed_merge.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Distributed merge",
        "",
        generated_note("bench/distributed_merge_bench.py"),
        "",
        f"`torchrun --standalone --nproc_per_node=K -m shardstream merge ... --distributed` on "
        f"`{args.ckpt.relative_to(REPO) if args.ckpt.is_relative_to(REPO) else args.ckpt}`, "
        f"{args.repeats} runs each, median; {result['date']}; {os.cpu_count()} cores.",
        "",
    ]
    lines += table(
        "processes K | median wall s | runs (s) | speed-up vs K=1",
        "rrlr",
        [
            (r["procs"], f"{r['median_s']:.2f}", " / ".join(f"{t:.1f}" for t in r["times_s"]),
             f"{r['speedup']:.2f}")
            for r in rows
        ],
    )  # fmt: skip
    lines += [
        "",
        f"Outputs byte-identical to K=1: **{same}**.",
        "",
        _verdict(rows),
        "",
        "Why: this machine has 2 cores, so the ceiling is about 2x at K=2 and K=4 only adds "
        "contention; every rank also pays its own start-up (torchrun, importing torch), a few "
        "seconds that a small checkpoint cannot repay. The rank files' layouts are read a share "
        "per process (each parses N/K of them and they exchange the results), so that part "
        "shrinks with K instead of being paid K times. Each "
        "rank streams disjoint chunk-aligned ranges, so on a node with many cores and a "
        "parallel filesystem the merge scales with the processes until the filesystem's "
        "bandwidth is reached; across nodes, use `torchrun --nnodes=N --node_rank=i "
        "--rdzv_endpoint=HOST:PORT` with the target on a shared filesystem.",
        "",
    ]
    write_doc(REPO / "docs/benchmarks-distributed.md", "\n".join(lines))
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
