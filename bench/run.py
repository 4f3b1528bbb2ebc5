"""Merge benchmark: `shardstream merge` vs verl's model merger vs `cp -r`, same checkpoints.

    python bench/run.py                 # full run: 0.5 GB and 4 GB checkpoints, warm + cold cache
    python bench/run.py --quick         # only the 0.5 GB case, warm cache, 2 repeats
    python bench/run.py --sizes 0.5,2   # any fp32 sizes in GB (1e9 bytes)

Writes bench/results/merge.json (bench/results/merge-quick.json for --quick) and, unless
--quick or --no-doc, regenerates docs/benchmarks.md and the plots in docs/img/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from checkpoints import CkptSpec, ensure_checkpoint
from compare import compare_dirs, summarize
from harness import BENCH, REPO, MiB, log
from harness.cache import drop_caches, prepare, tree_bytes
from harness.machine import git_revision, machine_facts, src_dirty
from harness.process import output, run_measured

TOOLS = ("cp", "cp_fsync", "shardstream", "verl")
COPY_TOOLS = ("cp", "cp_fsync")
# Start-up floor of each Python tool: the same command with `--help` (interpreter, imports,
# argument parsing, no data), measured inside every case's rotation so it sees the same
# page cache and machine load as the real runs.
STARTUP = {"shardstream": "shardstream_startup", "verl": "verl_startup"}
# The disk's own pace for a merge's output: dd writes as many bytes as the merged model has
# (from the page-cached rank files, so no zero-detection in the storage stack flatters it),
# with O_DIRECT and a final fsync, as the merge does. Run in each case's rotation.
DISK_FLOOR = "disk_write_floor"
CAST_FLOOR = "cast_floor"  # bench/cast_floor.py: the least Python work a bf16 merge needs

# Targets from the issue; evaluated into merge.json and the doc.
TARGET_RSS_MIB = 512
TARGET_FLAT_MIB = 64
TARGET_VS_CP = 1.3
TARGET_VERL_SPEEDUP = 3.0
TARGET_VERL_MEM = 4.0


# ---------------------------------------------------------------------------------------------
# environment facts


def tool_versions(py: str, bench_py: str | None) -> dict:
    def version(python: str, module: str) -> str:
        return output([python, "-c", f"import {module}; print({module}.__version__)"])

    v = {
        "cp": output(["cp", "--version"]).splitlines()[0:1],
        "shardstream_git": git_revision(),
        "shardstream_git_dirty": src_dirty(),
        "torch": version(py, "torch"),
        "safetensors": version(py, "safetensors"),
    }
    v["cp"] = v["cp"][0] if v["cp"] else ""
    if bench_py:
        v["verl"] = version(bench_py, "verl")
        v["verl_venv_torch"] = version(bench_py, "torch")
        v["verl_venv_transformers"] = version(bench_py, "transformers")
    return v


# ---------------------------------------------------------------------------------------------
# tools


def shardstream_available(py: str) -> tuple[bool, str]:
    r = subprocess.run(
        [py, "-m", "shardstream", "merge", "--help"], capture_output=True, text=True, timeout=120
    )
    return r.returncode == 0, (r.stderr or r.stdout)[-2000:]


def tool_argv(tool: str, actor: Path, out: Path, a: argparse.Namespace) -> list[str]:
    if tool.endswith("_startup"):
        return [*tool_argv(tool.removesuffix("_startup"), actor, out, a)[:4], "--help"]
    if tool == "cp":
        return ["cp", "-r", str(actor), str(out)]
    if tool == DISK_FLOOR:
        out_bytes = merged_bytes(actor, a.dtype)
        return [
            "sh",
            "-c",
            'f="$1"; n="$2"; shift 2; cat "$@" | dd of="$f" bs=4M count="$n" iflag=fullblock '
            "oflag=direct conv=fsync status=none",
            DISK_FLOOR,
            str(out),
            str(-(-out_bytes // (4 << 20))),
            *map(str, sorted(actor.glob("model_world_size_*_rank_*.pt"))),
        ]
    if tool == CAST_FLOOR:
        rank_files = sorted(actor.glob("model_world_size_*_rank_*.pt"))
        return [a.python, str(BENCH / "cast_floor.py"), str(out), *map(str, rank_files)]
    if tool == "cp_fsync":
        # The durable copy: shardstream fsyncs what it writes, plain cp leaves dirty pages.
        # coreutils `sync FILE...` fsyncs exactly those files (not the whole machine).
        return [
            "sh",
            "-c",
            'cp -r "$1" "$2" && find "$2" -type f -exec sync -- {} +',
            "cp_fsync",
            str(actor),
            str(out),
        ]
    if tool == "shardstream":
        return [
            a.python,
            "-m",
            "shardstream",
            "merge",
            "--local_dir",
            str(actor),
            "--target_dir",
            str(out),
            "--overwrite",
            "--quiet",
            "--json",
            *([] if a.dtype == "config" else ["--dtype", a.dtype]),
            *a.shardstream_args,
        ]
    if tool == "verl":
        return [
            a.bench_python,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(actor),
            "--target_dir",
            str(out),
        ]
    raise ValueError(tool)


def merged_bytes(actor: Path, dtype: str) -> int:
    """About the bytes a merge of ``actor``'s fp32 rank files writes in ``dtype``."""
    fp32 = sum(f.stat().st_size for f in actor.glob("model_world_size_*_rank_*.pt"))
    return fp32 if dtype == "float32" else fp32 // 2


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # No tool may reach for the network (the HF hub) or a GPU during a timed run.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    return env


def parse_json_stdout(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        return None


# ---------------------------------------------------------------------------------------------
# the benchmark


def run_one(tool: str, actor: Path, out: Path, cache: str, a: argparse.Namespace) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prepare(cache, actor)
    load = os.getloadavg()[0]
    m = run_measured(
        tool_argv(tool, actor, out, a),
        env=child_env(),
        capture_stdout=(tool == "shardstream"),
        timeout_s=a.timeout,
    )
    rec = m.to_dict()
    rec.update(
        tool=tool,
        cache=cache,
        out_bytes=tree_bytes(out) if out.exists() else 0,
        loadavg_1m_before=round(load, 2),
    )
    if tool == "shardstream":
        rec["self_report"] = parse_json_stdout(m.stdout)
    rec["stdout"] = rec["stdout"][-2000:]
    if m.returncode != 0:
        rec["error"] = f"exit {m.returncode}: {m.stderr_tail[-1500:]}"
    return rec


# Buckets for the profile of one shardstream run: which calls the time goes to.
PROFILE_BUCKETS = (
    ("read (preadv/pread)", ("posix.preadv", "posix.pread", "preadv", "readinto")),
    ("map / unmap source pages (mmap)", ("mmap.mmap", "mmap' objects", "_map")),
    ("write (pwrite)", ("posix.pwrite", "posix.pwritev", "posix.write")),
    ("fsync", ("posix.fsync", "posix.fdatasync")),
    (
        "dtype cast / copy, faulting in mapped source pages (torch copy_, numpy copyto)",
        ("copy_", "'to' of", "numpy.ndarray' objects", "copyto"),
    ),
    ("checksum (xxhash)", ("xxhash",)),
    (
        "CRC-32 of .pt records, faulting in mapped source pages (zlib-ng crc32)",
        ("crc32",),
    ),
    (
        "waiting on other threads (lock.acquire, queue get)",
        ("'acquire' of '_thread.lock'", "'get' of '_queue.SimpleQueue'"),
    ),
)


def profile_buckets(prof: Path) -> dict:
    """Sum cProfile's own-time (tottime) per bucket; the rest is imports, planning, Python."""
    import pstats

    st = pstats.Stats(str(prof))
    total = st.total_tt
    buckets = {name: 0.0 for name, _ in PROFILE_BUCKETS}
    for (_file, _line, func), (_cc, _nc, tt, _ct, _callers) in st.stats.items():
        for name, needles in PROFILE_BUCKETS:
            if any(n in func for n in needles):
                buckets[name] += tt
                break
    buckets["everything else (imports, planning, Python)"] = total - sum(buckets.values())
    return {
        "profiled_s": total,
        "buckets_s": {k: round(v, 3) for k, v in buckets.items()},
    }


# The profiled child. `shardstream`'s console entry point ends in os._exit (skipping torch's
# slow teardown), so `python -m cProfile -m shardstream` never gets to write its profile: the
# child calls `shardstream.cli.main` itself and dumps the profiles before it exits the same way.
# Threads the merge starts (the window writer) get a profiler of their own through
# threading.setprofile; their stats are dumped to a second file.
_PROFILE_CHILD = """
import cProfile, os, sys, threading
main_prof, thread_prof, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
threads = []
def _start(*_):
    p = cProfile.Profile()
    threads.append(p)
    p.enable()
threading.setprofile(_start)
profile = cProfile.Profile()
profile.enable()
from shardstream.cli import main
code = main(argv)
profile.disable()
profile.dump_stats(main_prof)
if threads:
    import pstats
    for p in threads:
        p.disable()
    stats = pstats.Stats(threads[0])
    for p in threads[1:]:
        stats.add(p)
    stats.dump_stats(thread_prof)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def profile_shardstream(actor: Path, out: Path, a: argparse.Namespace) -> dict:
    """One extra warm run under cProfile: where does shardstream's own time go?

    Returns the main thread's buckets, and the other threads' (the window writer: pwrite,
    xxh3 of the output) under ``threads``.
    """
    main_prof = a.results / "shardstream.prof"
    thread_prof = a.results / "shardstream-threads.prof"
    for stale in (main_prof, thread_prof):
        stale.unlink(missing_ok=True)  # never report an earlier run's profile
    argv = tool_argv("shardstream", actor, out, a)
    argv = [argv[0], "-c", _PROFILE_CHILD, str(main_prof), str(thread_prof), *argv[3:]]
    if out.exists():
        shutil.rmtree(out)
    prepare("warm", actor)
    m = run_measured(argv, env=child_env(), capture_stdout=True, timeout_s=a.timeout)
    shutil.rmtree(out, ignore_errors=True)
    if m.returncode != 0 or not main_prof.exists():
        return {"error": f"exit {m.returncode}: {m.stderr_tail[-800:]}"}
    result = {"wall_s": m.wall_s, **profile_buckets(main_prof)}
    result["threads_note"] = "main thread; the other threads' own time is under `threads`"
    if thread_prof.exists():
        result["threads"] = profile_buckets(thread_prof)
    return result


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize_runs(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["returncode"] == 0]
    s = {
        "n_ok": len(ok),
        "n_failed": len(runs) - len(ok),
        "wall_s": median([r["wall_s"] for r in ok]),
        "peak_rss_mib": median([r["peak_rss_bytes"] / MiB for r in ok]),
        "tree_peak_rss_mib": median([r["tree_peak_rss_bytes"] / MiB for r in ok]),
        "wall_s_all": [round(r["wall_s"], 3) for r in ok],
        "peak_rss_mib_all": [round(r["peak_rss_bytes"] / MiB, 1) for r in ok],
        "out_bytes": ok[-1]["out_bytes"] if ok else None,
        "max_tree_procs": max((r["max_tree_procs"] for r in ok), default=None),
        "loadavg_1m_before": median([r.get("loadavg_1m_before", 0.0) for r in runs]),
        # share of the machine's CPU time that other processes used while this tool ran
        "background_cpu_share": median(
            [
                r["other_cpu_s"] / (r["wall_s"] * (os.cpu_count() or 1))
                for r in ok
                if r.get("other_cpu_s") is not None and r["wall_s"] > 0
            ]
        ),
    }
    selfr = [r.get("self_report") or {} for r in ok]
    if any("peak_rss_bytes" in x for x in selfr):
        s["self_reported_peak_rss_mib"] = median(
            [x["peak_rss_bytes"] / MiB for x in selfr if "peak_rss_bytes" in x]
        )
    return s


def add_ratios(summary: dict) -> None:
    """summary[size][cache][tool] -> adds ratio fields in place."""
    for by_cache in summary.values():
        for by_tool in by_cache.values():
            ss, cp = by_tool.get("shardstream"), by_tool.get("cp")
            cpf = by_tool.get("cp_fsync")
            for s in by_tool.values():
                if s.get("wall_s") is None:
                    continue
                if ss and ss.get("wall_s"):
                    s["time_vs_shardstream"] = s["wall_s"] / ss["wall_s"]
                    s["rss_vs_shardstream"] = s["peak_rss_mib"] / ss["peak_rss_mib"]
                if cp and cp.get("wall_s"):
                    s["time_vs_cp"] = s["wall_s"] / cp["wall_s"]
                if cpf and cpf.get("wall_s"):
                    s["time_vs_cp_fsync"] = s["wall_s"] / cpf["wall_s"]


def evaluate_targets(summary: dict, sizes: list[str]) -> list[dict]:
    out: list[dict] = []

    def add(name: str, value, target: str, passed: bool | None, note: str = "") -> None:
        out.append(dict(name=name, value=value, target=target, passed=passed, note=note))

    for size in sizes:
        for cache, by_tool in summary[size].items():
            ss = by_tool.get("shardstream") or {}
            if ss.get("wall_s") is None:
                add(f"shardstream ran ({size} GB, {cache})", None, "exit 0", False)
                continue
            add(
                f"peak RSS ({size} GB, {cache})",
                round(ss["peak_rss_mib"], 1),
                f"<= {TARGET_RSS_MIB} MiB",
                ss["peak_rss_mib"] <= TARGET_RSS_MIB,
            )
            floor = by_tool.get(CAST_FLOOR) or {}
            case = f"{size} GB, {cache}"
            vs_cp = (
                (ss, "time_vs_cp", f"wall vs cp -r ({case})"),
                (ss, "time_vs_cp_fsync", f"wall vs cp -r + fsync ({case}; informational)"),
                (floor, "time_vs_cp",
                 f"Python cast floor vs cp -r ({case}; informational: no torch, no checks)"),
            )  # fmt: skip
            for s, key, name in vs_cp:
                if key in s:
                    add(name, round(s[key], 2), f"<= {TARGET_VS_CP}x", s[key] <= TARGET_VS_CP)
    if len(sizes) >= 2:
        lo, hi = sizes[0], sizes[-1]
        for cache in summary[hi]:
            a = (summary[lo].get(cache, {}).get("shardstream") or {}).get("peak_rss_mib")
            b = (summary[hi].get(cache, {}).get("shardstream") or {}).get("peak_rss_mib")
            if a is not None and b is not None:
                add(
                    f"RSS flatness {lo} GB -> {hi} GB ({cache})",
                    round(b - a, 1),
                    f"|delta| <= {TARGET_FLAT_MIB} MiB",
                    abs(b - a) <= TARGET_FLAT_MIB,
                )
    big = sizes[-1]
    for cache, by_tool in summary[big].items():
        verl = by_tool.get("verl") or {}
        if "time_vs_shardstream" in verl:
            add(
                f"verl / shardstream wall ({big} GB, {cache})",
                round(verl["time_vs_shardstream"], 2),
                f">= {TARGET_VERL_SPEEDUP}x",
                verl["time_vs_shardstream"] >= TARGET_VERL_SPEEDUP,
            )
            add(
                f"verl / shardstream peak RSS ({big} GB, {cache})",
                round(verl["rss_vs_shardstream"], 2),
                f">= {TARGET_VERL_MEM}x",
                verl["rss_vs_shardstream"] >= TARGET_VERL_MEM,
            )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="only the 0.5 GB case, warm, 2 repeats")
    p.add_argument("--sizes", default=None, help="comma-separated fp32 sizes in GB [0.5,4]")
    p.add_argument("--repeats", type=int, default=None, help="runs per tool and case [3]")
    p.add_argument(
        "--cache",
        default=None,
        help="comma-separated cache modes: warm, cold [warm,cold; cold skipped if not permitted]",
    )
    p.add_argument("--tools", default=",".join(TOOLS), help=f"subset of {','.join(TOOLS)}")
    p.add_argument("--world-size", type=int, default=4, help="ranks of the generated checkpoint")
    p.add_argument("--results", type=Path, default=BENCH / "results")
    p.add_argument("--json-out", type=Path, default=None, help="default: RESULTS/merge.json")
    p.add_argument("--no-doc", action="store_true", help="do not regenerate docs/benchmarks.md")
    p.add_argument("--no-profile", action="store_true", help="skip the cProfile run of shardstream")
    p.add_argument(
        "--no-startup", action="store_true", help="skip the `--help` start-up floor runs"
    )
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when a target is missed (not only on errors)"
    )
    p.add_argument("--keep-outputs", action="store_true", help="keep merged models after checks")
    p.add_argument("--timeout", type=float, default=1800, help="per-run timeout in seconds")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    p.add_argument("--bench-python", default=str(REPO / ".bench-venv" / "bin" / "python"))
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="output dtype passed to `shardstream merge --dtype` [bfloat16: what verl's merger "
        "always writes, so outputs can be compared bit for bit]; 'config' passes nothing",
    )
    p.add_argument(
        "--ckpt",
        type=Path,
        action="append",
        default=[],
        help="benchmark this existing actor dir instead of generating checkpoints (repeatable)",
    )
    p.add_argument(
        "--shardstream-arg",
        dest="shardstream_args",
        action="append",
        default=[],
        help="extra argument passed to `shardstream merge` (repeatable)",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.sizes = a.sizes or "0.5"
        a.repeats = a.repeats or 2
        a.cache = a.cache or "warm"
    a.sizes = [f"{float(s):g}" for s in (a.sizes or "0.5,4").split(",")]
    a.repeats = a.repeats or 3
    a.cache = [c.strip() for c in (a.cache or "warm,cold").split(",")]
    a.tools = [t.strip() for t in a.tools.split(",")]
    for t in a.tools:
        if t not in TOOLS:
            p.error(f"unknown tool {t!r}")
    for c in a.cache:
        if c not in ("warm", "cold"):
            p.error(f"unknown cache mode {c!r}")
    if a.json_out is None:
        a.json_out = a.results / ("merge-quick.json" if a.quick else "merge.json")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    started = time.time()
    a.results.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []

    notes: dict[str, str] = {}
    if "cold" in a.cache:
        ok, why = drop_caches()
        if not ok:
            a.cache.remove("cold")
            notes["cold_cache"] = f"not measured: dropping the page cache is not permitted ({why})"
            log(f"cold cache: {notes['cold_cache']}")
        else:
            notes["cold_cache"] = "sync; echo 3 > /proc/sys/vm/drop_caches before every cold run"

    if "verl" in a.tools:
        log("setting up .bench-venv (verl 0.9.1, CPU torch) ...")
        subprocess.run(["bash", str(BENCH / "setup_verl_venv.sh")], check=True)
    if "shardstream" in a.tools:
        ok, why = shardstream_available(a.python)
        if not ok:
            msg = f"`shardstream merge` is not runnable yet; skipped:\n{why}"
            log("!!! " + msg)
            problems.append(msg)
            a.tools.remove("shardstream")

    facts = machine_facts(a.results)
    versions = tool_versions(a.python, a.bench_python if "verl" in a.tools else None)
    log(f"machine: {facts}")
    log(f"versions: {versions}")

    ckpts: dict[str, dict] = {}
    if a.ckpt:
        a.sizes = []
        for actor in a.ckpt:
            nbytes = tree_bytes(actor)
            size = f"{nbytes / 1e9:.2g}"
            a.sizes.append(size)
            ckpts[size] = {
                "root": str(actor),
                "actor_dir": str(actor),
                "bytes_on_disk": nbytes,
                "fp32_param_bytes": nbytes,
                "spec": {"world_size": None, "config_overrides": "user-supplied checkpoint"},
                "generated_s": None,
            }
    for size in [] if a.ckpt else a.sizes:
        spec = CkptSpec(target_gb=float(size), world_size=a.world_size)
        info = ensure_checkpoint(spec, a.results / "ckpt", a.python, log=log)
        info["bytes_on_disk"] = tree_bytes(Path(info["actor_dir"]))
        info["fp32_param_bytes"] = spec.fp32_bytes
        ckpts[size] = info

    case_tools = list(a.tools)
    if not a.no_startup:
        case_tools += [STARTUP[t] for t in a.tools if t in STARTUP]
    if "shardstream" in a.tools:
        case_tools.append(DISK_FLOOR)
        if a.dtype in ("config", "bfloat16"):  # the checkpoints' config.json names bfloat16
            case_tools.append(CAST_FLOOR)

    runs: list[dict] = []
    summary: dict[str, dict[str, dict[str, dict]]] = {}
    checks: dict[str, dict] = {}
    for size in a.sizes:
        actor = Path(ckpts[size]["actor_dir"])
        outroot = a.results / "out" / size
        summary[size] = {}
        for cache in a.cache:
            per_tool: dict[str, list[dict]] = {t: [] for t in case_tools}
            for rep in range(a.repeats):
                # rotate the order so no tool always runs first / right after another
                k = rep % len(case_tools)
                order = case_tools[k:] + case_tools[:k]
                for tool in order:
                    rec = run_one(tool, actor, outroot / tool, cache, a)
                    rec.update(size_gb=size, rep=rep)
                    runs.append(rec)
                    per_tool[tool].append(rec)
                    log(
                        f"{size:>4} GB {cache:4} {tool:19} rep {rep}: "
                        f"{rec['wall_s']:7.2f} s  peak RSS {rec['peak_rss_mib']:8.1f} MiB"
                        f"  (tree {rec['tree_peak_rss_mib']:.1f} MiB, rc {rec['returncode']})"
                    )
                    if rec["returncode"] != 0:
                        msg = f"{tool} failed on {size} GB ({cache}): {rec.get('error', '')}"
                        log("!!! " + msg)
                        problems.append(msg)
                    if tool in COPY_TOOLS:
                        shutil.rmtree(outroot / tool, ignore_errors=True)
                    if tool in (DISK_FLOOR, CAST_FLOOR):
                        (outroot / tool).unlink(missing_ok=True)
            summary[size][cache] = {t: summarize_runs(rs) for t, rs in per_tool.items()}

        # Sanity check: the last shardstream and verl outputs must hold the same tensors.
        ss_out, verl_out = outroot / "shardstream", outroot / "verl"
        if {"shardstream", "verl"} <= set(a.tools) and ss_out.exists() and verl_out.exists():
            log(f"comparing merged outputs for {size} GB (shardstream vs verl) ...")
            try:
                rep = compare_dirs(ss_out, verl_out)
            except Exception as e:  # a broken output is a finding, not a crash
                rep = {"identical": False, "error": f"{type(e).__name__}: {e}"}
            checks[size] = rep
            text = summarize(rep) if "error" not in rep else rep["error"]
            if rep["identical"]:
                log(text)
            else:
                log("!!! " + text)
                problems.append(f"output check {size} GB: {text}")
        if not a.keep_outputs:
            shutil.rmtree(outroot, ignore_errors=True)

    profile = None
    if "shardstream" in a.tools and not a.no_profile:
        big = a.sizes[-1]
        log(f"profiling one warm shardstream run on {big} GB (cProfile) ...")
        profile = profile_shardstream(
            Path(ckpts[big]["actor_dir"]), a.results / "out" / "profile", a
        )
        profile["size_gb"] = big
        log(f"profile: {profile}")

    add_ratios(summary)
    targets = evaluate_targets(summary, a.sizes) if "shardstream" in a.tools else []
    result = {
        "schema": 1,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.time() - started, 1),
        "argv": sys.argv,
        "options": {
            "sizes_gb": a.sizes,
            "repeats": a.repeats,
            "cache_modes": a.cache,
            "tools": a.tools,
            "world_size": a.world_size,
            "quick": a.quick,
            "shardstream_args": a.shardstream_args,
            "dtype": a.dtype,
        },
        "commands": {
            t: " ".join(tool_argv(t, Path("CKPT/global_step_1/actor"), Path("OUT"), a))
            .replace(str(REPO) + "/", "")
            .replace(a.python, ".venv/bin/python")
            .replace("'", "")
            for t in TOOLS
        }
        | (
            {
                DISK_FLOOR: "cat CKPT/global_step_1/actor/model_world_size_*_rank_*.pt | dd of=OUT "
                "bs=4M count=<merged bytes / 4 MiB> iflag=fullblock oflag=direct conv=fsync"
            }
            if DISK_FLOOR in case_tools
            else {}
        )
        | (
            {
                CAST_FLOOR: "python bench/cast_floor.py OUT "
                "CKPT/global_step_1/actor/model_world_size_*_rank_*.pt"
            }
            if CAST_FLOOR in case_tools
            else {}
        ),
        "machine": facts,
        "versions": versions,
        "notes": notes,
        "checkpoints": ckpts,
        "summary": summary,
        "shardstream_profile": profile,
        "targets": targets,
        "output_checks": checks,
        "problems": problems,
        "runs": runs,
    }
    a.json_out.parent.mkdir(parents=True, exist_ok=True)
    a.json_out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {a.json_out}")

    if not a.quick and not a.no_doc:
        from report import write_report

        doc = write_report(result, REPO / "docs" / "benchmarks.md", REPO / "docs" / "img")
        log(f"wrote {doc}")
    else:
        from report import render_table

        print(render_table(result))

    for t in targets:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[t["passed"]]
        log(f"target {mark}: {t['name']}: {t['value']} (target {t['target']})")
    missed = [t for t in targets if t["passed"] is False and "informational" not in t["name"]]
    if a.strict and missed:
        problems.append(f"--strict: {len(missed)} target(s) missed")
    if problems:
        log(f"!!! {len(problems)} problem(s):")
        for p in problems:
            log("!!!   " + p.replace("\n", "\n!!!   "))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
