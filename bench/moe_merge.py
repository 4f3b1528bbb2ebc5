"""Merge of a fused-expert Qwen3-MoE verl checkpoint (transformers 5) into save_pretrained's
per-expert layout, against a dense checkpoint of the same size (issue #22's benchmark).

    python bench/moe_merge.py [--experts 64] [--layers 6] [--hidden 1024] [--moe-inter 512]
                              [--world 2] [--repeats 7] [--scale 3] [--workdir DIR] [--no-doc]

1. One process per rank (``--world``, FSDP2 over gloo) saves each model as verl does
   (``model_world_size_W_rank_R.pt``, fp32): a ``Qwen3MoeForCausalLM`` (fused
   ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]) and a dense
   ``Qwen3ForCausalLM`` with the same attention, embeddings and layer count whose MLP width is
   chosen so that both hold the same number of parameters (so the same checkpoint bytes).
2. ``shardstream merge --dtype bfloat16 --json`` runs ``--repeats`` times on each, interleaved
   (dense, MoE cold, MoE warm, MoE with ``--keep-names``, dense, ...), each run under
   ``harness.process.run_measured`` (wall time, the kernel's peak RSS of the process) after
   ``sync`` and a read of the checkpoint (warm page cache). The MoE merge splits every fused
   expert tensor into per-expert tensors. "Cold": ``SHARDSTREAM_CACHE_DIR`` is a fresh empty
   directory, so the layout is planned by transformers (imported, meta model, trace) and
   cached; "warm": the directory that cold run filled, so the plan is read from the layout
   cache and transformers is not imported. Every other run gets a fresh empty directory. The
   ``--keep-names`` run (informational) writes the fused tensors whole and never imports
   transformers.
3. The same dense, MoE cold and MoE warm merges run again on a second pair of checkpoints
   ``--scale`` times as deep (``--layers`` × ``--scale`` layers, so that many times the bytes;
   ``--scale 1`` skips them). The two sizes give each merge's time per byte at the margin (the
   slope of wall time against checkpoint bytes) apart from its fixed cost (the intercept:
   interpreter, imports, planning), and the size from which a cold MoE merge, fixed cost
   included, stays within the goal.
4. The MoE output is checked: no fused key left, every expert's ``gate_proj``, ``up_proj``
   and ``down_proj`` present, and, tensor by tensor (names, dtypes, bytes) and by index, equal
   to what ``save_pretrained`` writes for the same weights cast to bf16 (built whole in one
   process, at the full size). The warm run's output must equal the cold run's, tensor by
   tensor.

Writes ``results/moe-merge.json``, prints the numbers and, unless ``--no-doc``, re-renders the
MoE section of docs/benchmarks.md (``bench/report.py --moe``). The checkpoints live in a
temporary directory removed at the end unless ``--workdir`` names one to keep and reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import BENCH, REPO, RESULTS, MiB, log
from harness.cache import evict, prepare, tree_bytes
from harness.machine import git_revision, machine_facts, src_dirty
from harness.process import run_measured

from shardstream.formats.hf import default_shard_bytes

sys.path.insert(0, str(REPO / "src"))

TARGET_RSS_MIB = 512
TARGET_RATIO = 1.10  # MoE wall time per checkpoint byte ÷ dense's
KINDS = ("dense", "moe")  # the two models
BIG = "_big"  # suffix of the checkpoints (and their runs) --scale times as deep
# What is timed, interleaved in this order every repeat: (name, checkpoint, extra merge flags,
# layout cache). "cold": a fresh empty SHARDSTREAM_CACHE_DIR (transformers plans the layout);
# "warm": the directory the cold run of the same checkpoint filled just before (the plan is
# read from the cache, transformers is not imported). "moe_fused" merges the MoE checkpoint
# with --keep-names: the fused tensors written whole, transformers not imported.
# Informational: it splits the MoE merge's extra time into planning the save_pretrained
# layout (transformers' import and trace) and the rest.
VARIANTS = (
    ("dense", "dense", (), "cold"),
    ("moe", "moe", (), "cold"),
    ("moe_warm", "moe", (), "warm"),
    ("moe_fused", "moe", ("--keep-names",), "cold"),
)
# The same merges of the --scale times deeper checkpoints (when --scale > 1).
BIG_VARIANTS = tuple(
    (kind + BIG, checkpoint + BIG, flags, cache)
    for kind, checkpoint, flags, cache in VARIANTS
    if kind != "moe_fused"
)
CHECKPOINT_OF = {kind: checkpoint for kind, checkpoint, _, _ in VARIANTS + BIG_VARIANTS}
# inspect after each repeat: (name, checkpoint, layout cache), as above
INSPECTS = (("dense", "dense", "cold"), ("moe", "moe", "cold"), ("moe_warm", "moe", "warm"))
TIMED = ("dense", "moe", "moe_warm")  # the runs the RSS goal is checked on (and their _big)
SHAPE = ("experts", "layers", "hidden", "moe_inter", "world")  # what a checkpoint is built from
EVICTED_NOTE = (
    "evicted: before each run, sync, then every checkpoint of the bench evicted from the page "
    "cache (`POSIX_FADV_DONTNEED`), so each merge reads its checkpoint from the disk, as a "
    "merge of checkpoints written long ago or elsewhere does; the interpreter's and the "
    "libraries' files stay cached"
)


def _common(args: argparse.Namespace) -> dict:
    return {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": args.hidden // 8,
        "vocab_size": 8192,
        "tie_word_embeddings": False,
    }


def config(args: argparse.Namespace, kind: str = "moe"):
    import transformers

    if kind == "moe":
        c = transformers.Qwen3MoeConfig(
            **_common(args),
            intermediate_size=args.hidden * 2,
            moe_intermediate_size=args.moe_inter,
            num_experts=args.experts,
            num_experts_per_tok=2,
        )
        c.architectures = ["Qwen3MoeForCausalLM"]
    else:
        c = transformers.Qwen3Config(**_common(args), intermediate_size=dense_intermediate(args))
        c.architectures = ["Qwen3ForCausalLM"]
    c.dtype = "bfloat16"
    return c


def _model_class(kind: str):
    import transformers

    return transformers.Qwen3MoeForCausalLM if kind == "moe" else transformers.Qwen3ForCausalLM


def param_count(args: argparse.Namespace, kind: str, intermediate: int | None = None) -> int:
    import torch

    c = config(args, kind) if intermediate is None else None
    if c is None:
        import transformers

        c = transformers.Qwen3Config(**_common(args), intermediate_size=intermediate)
    with torch.device("meta"):
        model = _model_class(kind)(c)
    return sum(p.numel() for p in model.parameters())


def dense_intermediate(args: argparse.Namespace) -> int:
    """The dense MLP width that gives the dense model the MoE model's parameter count: the
    dense MLP holds 3 * hidden * width parameters a layer, so solve from a width-1 model."""
    moe = param_count(args, "moe")
    base = param_count(args, "dense", intermediate=1)
    per_unit = 3 * args.hidden * args.layers
    return max(1, 1 + round((moe - base) / per_unit))


def build(args: argparse.Namespace, kind: str = "moe"):
    import torch

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _model_class(kind)(config(args, kind))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.float()


def save_rank(rank: int, world: int, args: argparse.Namespace, kind: str, actor: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = build(args, kind)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = Path(actor)
    if rank == 0:
        (out / "huggingface").mkdir(parents=True)
        model.config.save_pretrained(out / "huggingface")
        # verl saves the generation config of the model it loaded; without one, merge derives
        # it (importing transformers), which is not what this bench measures
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(model.config).save_pretrained(out / "huggingface")
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    dist.barrier()
    torch.save(model.state_dict(), out / f"model_world_size_{world}_rank_{rank}.pt")


SAVE_PRETRAINED = """
import sys, json, argparse, torch
sys.path.insert(0, {bench!r})
import moe_merge
args = argparse.Namespace(**json.loads({args!r}))
moe_merge.build(args, "moe").to(torch.bfloat16).save_pretrained({target!r})
"""


# A cold layout plan taken apart, in a fresh interpreter that has imported what merge has by
# then (torch, shardstream's merge and layout modules) and opened the MoE checkpoint: first
# the transformers modules the plan imports (the package, its save-time conversion, the config
# mapping, the model class), a cost any tool using transformers' own rules pays, then the plan
# itself (config, meta model, trace; the layout cache off). Prints both, in seconds.
IMPORT_PROBE = """
import os, time, torch
os.environ["SHARDSTREAM_CACHE_DIR"] = ""
import shardstream.commands.merge
from shardstream.formats import hf
from shardstream.formats.hf_writer import output_layout
from shardstream.formats.source import open_checkpoint
checkpoint = open_checkpoint({actor!r}, model_only=True)
config = hf.read_config(checkpoint.config_dir())
t = time.perf_counter()
import transformers
from transformers.core_model_loading import revert_weight_conversion
from transformers import CONFIG_MAPPING
CONFIG_MAPPING[config["model_type"]]
getattr(transformers, config["architectures"][0])
imported = time.perf_counter()
output_layout(checkpoint.tensors, "BF16", set(), config)
print(imported - t, time.perf_counter() - imported)
"""


def import_probe(actor: Path, env: dict) -> dict:
    code = IMPORT_PROBE.format(actor=str(actor))
    m = run_measured([sys.executable, "-c", code], env=env, capture_stdout=True)
    try:
        seconds = [float(x) for x in m.stdout.strip().splitlines()[-1].split()]
    except (ValueError, IndexError):
        seconds = [None, None]
    return {"import_s": seconds[0], "plan_s": seconds[-1], "wall_s": m.wall_s, "rc": m.returncode}


def _tensors(directory: Path) -> dict[str, tuple[Path, str]]:
    """Every tensor name in ``directory``'s safetensors files, with its file."""
    from safetensors import safe_open

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                found[key] = path
    return found


def layout_check(merged: Path, args: argparse.Namespace) -> dict:
    """The MoE output holds per-expert keys only: none of the fused tensors, and each expert's
    three projections in every layer."""
    keys = set(_tensors(merged))
    fused = sorted(k for k in keys if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    expected = {
        f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"
        for n in range(args.layers)
        for e in range(args.experts)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    present = expected & keys
    return {
        "fused_keys": fused[:8],
        "per_expert_keys": len(present),
        "per_expert_keys_expected": len(expected),
        "ok": not fused and present == expected,
    }


def same_output(a: Path, b: Path) -> dict:
    """Compare two HF directories tensor by tensor (one pair in memory at a time)."""
    import torch
    from safetensors import safe_open

    index = "model.safetensors.index.json"
    out = {"index_equal": (a / index).is_file() == (b / index).is_file()}
    if out["index_equal"] and (a / index).is_file():
        out["index_equal"] = (a / index).read_bytes() == (b / index).read_bytes()
    ta, tb = _tensors(a), _tensors(b)
    out["keys_equal"] = sorted(ta) == sorted(tb)
    out["tensors"] = len(ta)
    differ, compared = [], 0
    for key in sorted(set(ta) & set(tb)):
        with safe_open(ta[key], "pt") as fa, safe_open(tb[key], "pt") as fb:
            x, y = fa.get_tensor(key), fb.get_tensor(key)
        same = x.dtype == y.dtype and x.shape == y.shape
        same = same and x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8))
        compared += x.numel() * x.element_size()
        if not same:
            differ.append(key)
    out["bytes_compared"] = compared
    out["differing"] = differ[:8]
    out["identical"] = out["index_equal"] and out["keys_equal"] and not differ
    return out


def parse_json_stdout(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.strip().startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def parse_json_stdout_any(stdout: str) -> dict | None:
    """The JSON document ``stdout`` is (inspect prints it over several lines)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        return None


def merge_once(
    actor: Path,
    target: Path,
    env: dict,
    flags: tuple[str, ...] = (),
    work: Path | None = None,
    source_cache: str = "warm",
) -> dict:
    shutil.rmtree(target, ignore_errors=True)
    if source_cache == "evicted":  # sync, evict every checkpoint: this one is read from disk
        os.sync()
        evict(work or actor)
    else:
        prepare("warm", actor, evict_first=work)  # sync, evict every checkpoint, read this one
    argv = ["merge", "--local_dir", str(actor), "--target_dir", str(target)]
    argv += ["--dtype", "bfloat16", "--json", *flags]
    m = run_measured([sys.executable, "-m", "shardstream", *argv], env=env, capture_stdout=True)
    me = parse_json_stdout(m.stdout) or {}
    return {
        "wall_s": m.wall_s,
        "peak_rss_mib": m.peak_rss_bytes / MiB,
        "rss_source": m.rss_source,
        "user_s": m.user_s,
        "sys_s": m.sys_s,
        "others_cpu_share": (
            None
            if m.other_cpu_s is None or m.wall_s <= 0
            else m.other_cpu_s / (m.wall_s * (os.cpu_count() or 1))
        ),
        "rc": m.returncode,
        "stderr_tail": "" if m.returncode == 0 else m.stderr_tail[-1500:],
        "merge_call_s": me.get("wall_s"),
        "self_peak_rss_mib": (me["peak_rss_bytes"] / MiB) if me.get("peak_rss_bytes") else None,
        "bytes_written": me.get("bytes_written"),
        "tensors": me.get("tensors"),
        "layout": me.get("layout"),
        "layout_s": me.get("layout_s"),
    }


def summarize(result: dict) -> dict:
    """Medians per model, s/GB of checkpoint, the MoE/dense per-byte ratio and the goals."""
    s = {}
    for kind, checkpoint, _, _ in VARIANTS + BIG_VARIANTS:
        if not any(r["kind"] == kind for r in result["runs"]):
            continue
        runs = [r for r in result["runs"] if r["kind"] == kind and r["rc"] == 0]
        ckpt = result["checkpoints"][checkpoint]["bytes"]
        if not runs:
            s[kind] = {"n_ok": 0, "n": sum(r["kind"] == kind for r in result["runs"])}
            continue
        wall = statistics.median(r["wall_s"] for r in runs)
        calls = [r["merge_call_s"] for r in runs if r["merge_call_s"]]
        layouts = [r["layout_s"] for r in runs if r.get("layout_s") is not None]
        copies = [r["merge_call_s"] - r["layout_s"] for r in runs if r.get("layout_s") is not None]
        s[kind] = {
            "n_ok": len(runs),
            "n": sum(r["kind"] == kind for r in result["runs"]),
            "median_wall_s": wall,
            "s_per_gb": wall / (ckpt / 1e9),
            "median_merge_call_s": statistics.median(calls) if calls else None,
            # the call's planning of the output names, and the rest of it (the copy)
            "median_layout_s": statistics.median(layouts) if layouts else None,
            "median_copy_s": statistics.median(copies) if copies else None,
            "call_s_per_gb": statistics.median(calls) / (ckpt / 1e9) if calls else None,
            "median_peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
            "max_peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "median_user_sys_s": statistics.median(r["user_s"] + r["sys_s"] for r in runs),
            "median_others_cpu_share": statistics.median(
                r["others_cpu_share"] or 0.0 for r in runs
            ),
        }
    for kind in s.copy():
        k = s[kind]
        dense_kind = "dense" + BIG if kind.endswith(BIG) else "dense"
        dense = s.get(dense_kind, {})
        if kind.startswith("dense") or not (k.get("n_ok") and dense.get("n_ok")):
            continue
        k["ratio_to_dense"] = k["s_per_gb"] / dense["s_per_gb"]
        if k["call_s_per_gb"] and dense["call_s_per_gb"]:
            k["call_ratio_to_dense"] = k["call_s_per_gb"] / dense["call_s_per_gb"]
        if k.get("median_copy_s") and dense.get("median_copy_s"):
            ckpt = result["checkpoints"][CHECKPOINT_OF[kind]]["bytes"]
            dense_ckpt = result["checkpoints"][CHECKPOINT_OF[dense_kind]]["bytes"]
            k["copy_ratio_to_dense"] = (k["median_copy_s"] / ckpt) / (
                dense["median_copy_s"] / dense_ckpt
            )
    dense = s["dense"]
    margin = _margins(s, result["checkpoints"])
    if margin:
        s["margin"] = margin
    inspect_runs = result.get("inspect_runs", [])
    inspect = {
        kind: statistics.median(
            r["wall_s"] for r in inspect_runs if r["kind"] == kind and not r["rc"]
        )
        for kind, _, _ in INSPECTS
        if any(r["kind"] == kind and not r["rc"] for r in inspect_runs)
    }
    if inspect:
        s["inspect_median_wall_s"] = inspect
    if {"dense", "moe"} <= set(inspect) and s["moe"].get("n_ok") and dense.get("n_ok"):
        planning = inspect["moe"] - inspect["dense"]
        s["planning_s"] = planning  # cold: transformers' import, meta model, trace
        # informational: the MoE merge without that fixed cost, per byte, against dense
        ckpt = result["checkpoints"]["moe"]["bytes"]
        s["ratio_without_planning"] = (
            (s["moe"]["median_wall_s"] - planning) / (ckpt / 1e9) / dense["s_per_gb"]
        )
    probes = [r for r in result.get("import_runs", []) if r["import_s"] and r["plan_s"]]
    if probes:
        s["transformers_import_s"] = statistics.median(r["import_s"] for r in probes)
        s["transformers_import_range_s"] = [
            min(r["import_s"] for r in probes),
            max(r["import_s"] for r in probes),
        ]
        s["plan_after_import_s"] = statistics.median(r["plan_s"] for r in probes)
    plans = [r["layout_s"] for r in result["runs"] if r["kind"] == "moe" and r.get("layout_s")]
    if plans:
        s["cold_layout_range_s"] = [min(plans), max(plans)]
    if {"dense", "moe_warm"} <= set(inspect):
        s["planning_warm_s"] = inspect["moe_warm"] - inspect["dense"]  # read from the cache
    # cold: the first merge of a layout on a machine (an empty layout cache); warm: every later
    # one (the plan read from the cache). Both are reported; the goal is judged on each.
    s["ratio_moe_dense"] = s["moe"].get("ratio_to_dense")
    s["ratio_moe_warm_dense"] = s.get("moe_warm", {}).get("ratio_to_dense")
    s["call_ratio_moe_dense"] = s["moe"].get("call_ratio_to_dense")
    s["call_ratio_moe_warm_dense"] = s.get("moe_warm", {}).get("call_ratio_to_dense")
    s["rss_met"] = {
        k: s[k].get("max_peak_rss_mib", 1e9) <= TARGET_RSS_MIB
        for k in TIMED + tuple(t + BIG for t in TIMED)
        if k in s
    }
    s["ratio_met"] = {
        "cold": _within(s["ratio_moe_dense"]),
        "warm": _within(s["ratio_moe_warm_dense"]),
    }
    warm_layouts = {r["layout"] for r in result["runs"] if r["kind"] == "moe_warm" and not r["rc"]}
    cold_layouts = {r["layout"] for r in result["runs"] if r["kind"] == "moe" and not r["rc"]}
    s["warm_layout_same"] = bool(warm_layouts) and warm_layouts == cold_layouts
    return s


def _margins(s: dict, checkpoints: dict) -> dict:
    """Each merge's wall time as a line through its two sizes' medians: the slope (s per GB at
    the margin) and the intercept (s of fixed cost); the MoE merges' slope against dense's,
    their fixed cost beyond dense's, and the checkpoint size from which their whole wall time
    per byte is within the goal (None: at every size, or at none)."""
    out = {}
    for kind, checkpoint in (("dense", "dense"), ("moe", "moe"), ("moe_warm", "moe")):
        small, big = s.get(kind, {}), s.get(kind + BIG, {})
        if not (small.get("n_ok") and big.get("n_ok")):
            continue
        gb = checkpoints[checkpoint]["bytes"] / 1e9
        gb_big = checkpoints[checkpoint + BIG]["bytes"] / 1e9
        slope = (big["median_wall_s"] - small["median_wall_s"]) / (gb_big - gb)
        out[kind] = {"s_per_gb": slope, "fixed_s": small["median_wall_s"] - slope * gb}
        if small.get("median_merge_call_s") and big.get("median_merge_call_s"):
            # the merge call alone: no interpreter start-up or torch import, so less noise
            call = (big["median_merge_call_s"] - small["median_merge_call_s"]) / (gb_big - gb)
            out[kind]["call_s_per_gb"] = call
    dense = out.get("dense")
    for kind in ("moe", "moe_warm"):
        if kind not in out or dense is None or dense["s_per_gb"] <= 0:
            continue
        k = out[kind]
        k["ratio_to_dense"] = k["s_per_gb"] / dense["s_per_gb"]
        k["fixed_beyond_dense_s"] = k["fixed_s"] - dense["fixed_s"]
        if k.get("call_s_per_gb") is not None and dense.get("call_s_per_gb", 0) > 0:
            k["call_ratio_to_dense"] = k["call_s_per_gb"] / dense["call_s_per_gb"]
        # (a_m + b_m x) / (a_d + b_d x) <= goal  <=>  x >= (a_m - goal a_d) / (goal b_d - b_m)
        room = TARGET_RATIO * dense["s_per_gb"] - k["s_per_gb"]
        excess = k["fixed_s"] - TARGET_RATIO * dense["fixed_s"]
        k["goal_from_gb"] = (max(excess, 0.0) / room) if room > 0 else None
    return out


def _within(ratio: float | None) -> bool | None:
    return None if ratio is None else ratio <= TARGET_RATIO


def cache_dir(work: Path, name: str) -> Path:
    """A fresh empty layout-cache directory under ``work``."""
    path = work / "layout-cache" / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def cache_files(path: Path) -> int:
    return len(list(path.glob("*.json")))


def ensure_checkpoint(kind: str, actor: Path, args: argparse.Namespace) -> float | None:
    from shardstream.testing.distributed import run

    done = actor.parent / "saved.json"  # written once every rank's file is complete
    want = {"kind": kind, "generation_config": True, **{k: getattr(args, k) for k in SHAPE}}
    if done.is_file() and json.loads(done.read_text()) == want:
        return None
    shutil.rmtree(actor, ignore_errors=True)
    log(f"saving the {kind} verl checkpoint on {args.world} ranks into {actor}")
    t = time.perf_counter()
    run(save_rank, args.world, args, kind, str(actor), timeout=3600)
    done.write_text(json.dumps(want))
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", dest="moe_inter", type=int, default=512)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--scale", type=int, default=3, help="the second size's depth, × --layers (1: none)"
    )
    parser.add_argument(
        "--no-fused", action="store_true", help="skip the MoE --keep-names runs (informational)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep checkpoints here")
    parser.add_argument("--no-reference", action="store_true", help="skip save_pretrained")
    parser.add_argument("--no-inspect", action="store_true", help="skip the inspect runs")
    parser.add_argument("--no-doc", action="store_true", help="do not re-render the doc")
    parser.add_argument(
        "--source-cache",
        choices=("warm", "evicted"),
        default="warm",
        help="the checkpoint in the page cache before each merge (warm), or read from disk",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: results/moe-merge[-evicted].json"
    )
    args = parser.parse_args()
    if args.out is None:
        evicted = "-evicted" if args.source_cache == "evicted" else ""
        args.out = RESULTS / f"moe-merge{evicted}.json"

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    t_start = time.perf_counter()
    keep = args.workdir is not None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="moe-merge-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = {k: getattr(args, k) for k in SHAPE}
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result: dict = {
        "started": started,
        "argv": ["bench/moe_merge.py", *sys.argv[1:]],
        "revision": git_revision(),
        "src_dirty": src_dirty(),
        "machine": machine_facts(work),
        "model": {**shape, "dense_intermediate": dense_intermediate(args)},
        "params": {k: param_count(args, k) for k in KINDS},
        "scale": args.scale,
        "repeats": args.repeats,
        "targets": {"peak_rss_mib": TARGET_RSS_MIB, "ratio": TARGET_RATIO},
        "options": "default 64 MiB buffer, O_DIRECT writes, files split at "
        f"{default_shard_bytes() / 10**9:g} GB (save_pretrained's default)",
        "source_cache": args.source_cache,
        "cache": EVICTED_NOTE
        if args.source_cache == "evicted"
        else (
            "warm: before each run, sync, every checkpoint of the bench evicted from the page "
            "cache (`POSIX_FADV_DONTNEED`), then the merged one's files read once, so each run "
            "reads a checkpoint cached afresh into free memory (a file cached while memory was "
            "full lies in smaller page-cache folios and took 3-4x the page faults to map, "
            "measured: that is page-cache history, not the tool, and it had favoured whichever "
            "checkpoint was cached into free memory)"
        ),
        "checkpoints": {},
        "runs": [],
        "inspect_runs": [],
        "import_runs": [],
    }
    try:
        big = argparse.Namespace(**{**vars(args), "layers": args.layers * args.scale})
        if args.scale > 1:
            result["model_big"] = {
                **{k: getattr(big, k) for k in SHAPE},
                "dense_intermediate": dense_intermediate(big),
            }
            result["params_big"] = {k: param_count(big, k) for k in KINDS}
        for kind in KINDS:
            for name, built_from in ((kind, args), (kind + BIG, big)):
                if name.endswith(BIG) and args.scale <= 1:
                    continue
                actor = work / name / "actor"
                gen = ensure_checkpoint(kind, actor, built_from)
                result["checkpoints"][name] = {
                    "bytes": tree_bytes(actor) - tree_bytes(actor / "huggingface"),
                    "rank_files": len(list(actor.glob("model_world_size_*.pt"))),
                    "generated_s": gen,
                }
        variants = [v for v in VARIANTS if v[0] != "moe_fused" or not args.no_fused]
        variants += list(BIG_VARIANTS) if args.scale > 1 else []
        for i in range(args.repeats):
            filled: dict[str, Path] = {}  # checkpoint -> the cache its cold run filled
            for kind, checkpoint, flags, cache in variants:
                log(f"repeat {i + 1}/{args.repeats}: shardstream merge of {kind}")
                target = work / checkpoint / f"merged-{kind}"
                cdir = filled[checkpoint] if cache == "warm" else cache_dir(work, f"{kind}-{i}")
                if cache == "cold" and checkpoint not in filled:
                    filled[checkpoint] = cdir
                before = cache_files(cdir)
                run_env = {**env, "SHARDSTREAM_CACHE_DIR": str(cdir)}
                rec = merge_once(
                    work / checkpoint / "actor", target, run_env, flags, work, args.source_cache
                )
                rec.update(kind=kind, repeat=i, cache=cache, cache_files_before=before)
                result["runs"].append(rec)
                log(
                    f"  {rec['wall_s']:.2f} s, peak RSS {rec['peak_rss_mib']:.0f} MiB, rc "
                    f"{rec['rc']}, {before} cached layouts before"
                )
                if kind not in ("moe", "moe_warm") or i < args.repeats - 1:
                    shutil.rmtree(target, ignore_errors=True)
            filled = {}
            for kind, checkpoint, cache in INSPECTS if not args.no_inspect else ():
                # inspect plans the output names as merge does and copies nothing: MoE minus
                # dense is what planning the save_pretrained layout costs (cold), or reading
                # it from the layout cache (warm).
                actor = work / checkpoint / "actor"
                cdir = filled[checkpoint] if cache == "warm" else cache_dir(work, f"i-{kind}-{i}")
                if cache == "cold" and checkpoint not in filled:
                    filled[checkpoint] = cdir
                before = cache_files(cdir)
                m = run_measured(
                    [sys.executable, "-m", "shardstream", "inspect", str(actor), "--json"],
                    env={**env, "SHARDSTREAM_CACHE_DIR": str(cdir)},
                    capture_stdout=True,
                )
                rule = (parse_json_stdout_any(m.stdout) or {}).get("layout", {}).get("rule")
                result["inspect_runs"].append(
                    {
                        "kind": kind,
                        "repeat": i,
                        "cache": cache,
                        "cache_files_before": before,
                        "wall_s": m.wall_s,
                        "peak_rss_mib": m.peak_rss_bytes / MiB,
                        "rc": m.returncode,
                        "layout": rule,
                    }
                )
                log(f"  inspect {kind}: {m.wall_s:.2f} s")
            shutil.rmtree(work / "layout-cache", ignore_errors=True)
            probe = import_probe(work / "moe" / "actor", env)
            result["import_runs"].append({"repeat": i, **probe})
            log(f"  cold plan alone: transformers' imports {probe['import_s']} s, then the plan "
                f"{probe['plan_s']} s")  # fmt: skip
        merged = work / "moe" / "merged-moe"
        merged_warm = work / "moe" / "merged-moe_warm"
        result["output_bytes"] = {r["kind"]: r["bytes_written"] for r in result["runs"]}
        result["layout_check"] = layout_check(merged, args) if merged.is_dir() else {"ok": False}
        if merged.is_dir() and merged_warm.is_dir():
            log("comparing the warm MoE merge (cached plan) with the cold one")
            result["warm_check"] = same_output(merged, merged_warm)
        shutil.rmtree(merged_warm, ignore_errors=True)
        if not args.no_reference and merged.is_dir():
            log("save_pretrained of the same MoE weights, held whole (the reference)")
            ref = work / "moe" / "save_pretrained"
            shutil.rmtree(ref, ignore_errors=True)
            code = SAVE_PRETRAINED.format(bench=str(BENCH), args=json.dumps(shape), target=str(ref))
            m = run_measured([sys.executable, "-c", code], env=env)
            result["save_pretrained"] = {
                "wall_s": m.wall_s,
                "peak_rss_mib": m.peak_rss_bytes / MiB,
                "rc": m.returncode,
            }
            log("comparing the MoE merge with save_pretrained, tensor by tensor")
            result["reference_check"] = same_output(merged, ref)
            shutil.rmtree(ref, ignore_errors=True)
        shutil.rmtree(merged, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for kind, checkpoint, _, _ in VARIANTS + BIG_VARIANTS:
                shutil.rmtree(work / checkpoint / f"merged-{kind}", ignore_errors=True)
            shutil.rmtree(work / "layout-cache", ignore_errors=True)
    result["summary"] = summarize(result)
    result["duration_s"] = time.perf_counter() - t_start
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("checkpoints", "summary")}, indent=2))
    if not args.no_doc:
        import report

        main_json = args.out if args.source_cache == "warm" else RESULTS / "moe-merge.json"
        if main_json.is_file():  # the evicted run is a part of the MoE section
            report.main(["--moe", str(main_json)])
    checks = [result["layout_check"]["ok"], result.get("warm_check", {}).get("identical", False)]
    if "reference_check" in result:
        checks.append(result["reference_check"]["identical"])
    return 0 if all(checks) and all(r["rc"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
