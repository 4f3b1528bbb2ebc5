"""DCP merge benchmark: `shardstream merge` vs torch's dcp_to_torch_save + safetensors, and
`accelerate merge-weights`, on one FSDP2 checkpoint of a ~2.5 GB fp32 Qwen2 model.

    python bench/dcp_merge_bench.py              # generate (cached) + 2 runs per tool
    python bench/dcp_merge_bench.py --runs 3 --gb 4

The checkpoint is written once by N gloo ranks (``fully_shard`` per decoder layer and at the
root, ``dcp.save({"model": get_model_state_dict(model)})``: accelerate's SHARDED_STATE_DICT
layout) and cached in bench/results/dcp_ckpt/. Every tool runs as its own command under GNU
``/usr/bin/time -v`` (peak RSS = its "Maximum resident set size"); wall time is measured
around the command. The page cache is warmed before each run (all tools read warm data).
The outputs of the first runs are compared tensor by tensor. Results go to
bench/results/dcp_merge.json and a table on stdout.

Tools:
  shardstream   .venv/bin/python -m shardstream merge --local_dir CKPT --target_dir OUT
  torch         dcp_to_torch_save(CKPT, tmp.pt); torch.load(tmp.pt); save_file(...)
                (the documented torch route; run in .venv)
  accelerate    .bench-venv/bin/accelerate merge-weights CKPT OUT  (when available)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, RESULTS, MiB, log
from harness.cache import tree_bytes, warm_cache
from harness.machine import mem_total_bytes
from harness.process import run_measured
from harness.training import param_count

CKPT_ROOT = RESULTS / "dcp_ckpt"
MODEL_DIR = "pytorch_model_fsdp_0"
PYTHON = REPO / ".venv" / "bin" / "python"
BENCH_VENVS = (REPO / ".bench-venv", REPO / ".bench-venv-dcp")

# Qwen2-0.5B-like shapes with an untied head; the layer count is solved for the target size.
BASE_CONFIG = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


# --------------------------------------------------------------------------- checkpoint


def config_for(gb: float) -> dict:
    c = dict(BASE_CONFIG, num_hidden_layers=1)
    per_layer = param_count(dict(c, num_hidden_layers=2)) - param_count(c)
    fixed = param_count(c) - per_layer
    c["num_hidden_layers"] = max(1, round((gb * 1e9 / 4 - fixed) / per_layer))
    return c


def _generate_worker(rank: int, world_size: int, init_file: str, out: str, config: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    cfg = Qwen2Config(**json.loads(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + rank)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0.0, 0.02, generator=gen)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=Path(out) / MODEL_DIR)
    dist.barrier()
    dist.destroy_process_group()


def ensure_checkpoint(gb: float, world_size: int) -> tuple[Path, dict]:
    config = config_for(gb)
    spec = {"config": config, "world_size": world_size, "dtype": "float32"}
    stamp = CKPT_ROOT / "spec.json"
    target = CKPT_ROOT / MODEL_DIR
    cached = stamp.is_file() and json.loads(stamp.read_text()) == spec
    if cached and (target / ".metadata").is_file():
        log(f"reusing cached checkpoint {target}")
        return target, spec
    shutil.rmtree(CKPT_ROOT, ignore_errors=True)
    CKPT_ROOT.mkdir(parents=True)
    log(f"generating {param_count(config) * 4 / 1e9:.2f} GB DCP checkpoint, {world_size} ranks")
    start = time.perf_counter()
    init = CKPT_ROOT / "gloo-init"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [
                str(PYTHON),
                __file__,
                "_worker",
                str(r),
                str(world_size),
                str(init),
                str(CKPT_ROOT),
                json.dumps(config),
            ],  # fmt: skip
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world_size)
    ]
    outs = [p.communicate()[0].decode(errors="replace") for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("checkpoint generation failed:\n" + "\n".join(outs))
    init.unlink(missing_ok=True)
    stamp.write_text(json.dumps(spec, indent=2))
    log(f"generated in {time.perf_counter() - start:.1f} s")
    return target, spec


# --------------------------------------------------------------------------- torch baseline


def _torch_baseline(ckpt: str, out: str) -> None:
    """The documented torch route: DCP -> one torch.save file -> safetensors."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "consolidated.pt"
    dcp_to_torch_save(ckpt, tmp)
    state = torch.load(tmp, weights_only=True)
    if list(state) == ["model"]:
        state = state["model"]
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tmp.unlink()


# --------------------------------------------------------------------------- measuring


def _accelerate() -> Path | None:
    for venv in BENCH_VENVS:
        exe = venv / "bin" / "accelerate"
        if exe.is_file():
            return exe
    return None


def tools(ckpt: Path, out: Path) -> dict[str, list[str]]:
    found = {
        "shardstream": [
            str(PYTHON),
            "-m",
            "shardstream",
            "merge",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(out),
            "--quiet",
        ],  # fmt: skip
        "torch": [str(PYTHON), __file__, "_torch", str(ckpt), str(out)],
    }
    accelerate = _accelerate()
    if accelerate is not None:
        found["accelerate"] = [str(accelerate), "merge-weights", str(ckpt), str(out)]
    return found


def measure(argv: list[str]) -> dict:
    """Wall time and the kernel's peak RSS of one tool run (under GNU time)."""
    m = run_measured(argv, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if m.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({m.returncode}):\n{m.stderr_tail[-3000:]}")
    return {"wall_s": round(m.wall_s, 3), "peak_rss_mib": round(m.peak_rss_bytes / MiB, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.5, help="fp32 model size (default 2.5)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated tools")
    args = parser.parse_args(argv)

    ckpt, spec = ensure_checkpoint(args.gb, args.world_size)
    ckpt_bytes = tree_bytes(ckpt)
    work = RESULTS / "dcp_merge_out"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    selected = tools(ckpt, work / "x")
    if args.only:
        selected = {k: v for k, v in selected.items() if k in args.only.split(",")}
    results: dict[str, dict] = {}
    kept: dict[str, Path] = {}
    for run in range(args.runs):
        for name in selected:
            out = work / f"{name}-{run}"
            argv_ = tools(ckpt, out)[name]
            warm_cache(ckpt)
            log(f"run {run + 1}/{args.runs}: {name}")
            m = measure(argv_)
            m["output_bytes"] = tree_bytes(out)
            log(f"  {m['wall_s']:.2f} s, peak RSS {m['peak_rss_mib']:.0f} MiB")
            results.setdefault(name, {"argv": argv_, "runs": []})["runs"].append(m)
            if run == 0:
                kept[name] = out
            else:
                shutil.rmtree(out)

    checks = {}
    if "shardstream" in kept:
        from compare import compare_dirs  # here: the measured `_torch` child imports this file

        for name, out in kept.items():
            if name != "shardstream":
                report = compare_dirs(kept["shardstream"], out)
                ok, count = report["identical"], report["n_common"]
                checks[f"shardstream == {name}"] = ok
                log(f"outputs identical (shardstream vs {name}, {count} tensors): {ok}")
    for r in results.values():
        r["median_wall_s"] = round(statistics.median(x["wall_s"] for x in r["runs"]), 3)
        r["median_peak_rss_mib"] = round(statistics.median(x["peak_rss_mib"] for x in r["runs"]), 1)
        r["throughput_mib_s"] = round(ckpt_bytes / MiB / r["median_wall_s"], 1)
    shutil.rmtree(work, ignore_errors=True)

    doc = {
        "benchmark": "dcp_merge",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(mem_total_bytes() / 2**30),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg(),
        },
        "checkpoint": {
            **spec,
            "params": param_count(spec["config"]),
            "bytes_on_disk": ckpt_bytes,
            "files": len([p for p in ckpt.iterdir() if p.suffix == ".distcp"]),
            "layout": "accelerate SHARDED_STATE_DICT ({'model': ...}), FSDP2 over gloo",
        },
        "cache": "warm (checkpoint read once before every run)",
        "runs_per_tool": args.runs,
        "tools": results,
        "outputs_identical": checks,
    }
    (RESULTS / "dcp_merge.json").write_text(json.dumps(doc, indent=2) + "\n")

    base = results.get("shardstream")
    print()
    print(f"DCP merge, {ckpt_bytes / 1e9:.2f} GB fp32 checkpoint, {args.world_size} ranks, "
          f"median of {args.runs} (warm cache)")  # fmt: skip
    print(f"{'tool':<12} {'wall s':>8} {'MiB/s':>8} {'peak RSS MiB':>13} {'vs shardstream':>16}")
    for name, r in results.items():
        rel = (
            f"{r['median_wall_s'] / base['median_wall_s']:.1f}x time, "
            f"{r['median_peak_rss_mib'] / base['median_peak_rss_mib']:.1f}x mem"
            if base and name != "shardstream"
            else ""
        )
        print(
            f"{name:<12} {r['median_wall_s']:>8.2f} {r['throughput_mib_s']:>8.0f} "
            f"{r['median_peak_rss_mib']:>13.0f}  {rel}"
        )
    print(f"\nwrote {RESULTS / 'dcp_merge.json'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "_worker":
        _generate_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
    elif len(sys.argv) >= 2 and sys.argv[1] == "_torch":
        _torch_baseline(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
