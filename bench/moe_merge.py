"""Merge of a fused-expert Qwen3-MoE verl checkpoint (transformers 5) into save_pretrained's
per-expert layout, against ``save_pretrained`` itself.

    python bench/moe_merge.py [--experts 32] [--layers 4] [--hidden 1024] [--moe-inter 512]

1. One process per rank (``--world``, FSDP2 over gloo) saves the model as verl does
   (``model_world_size_W_rank_R.pt``, fp32).
2. ``shardstream merge`` (bf16, 5 GB files) runs under ``harness.process.run_measured``.
3. The same weights, built in one process and cast to bf16, go through ``save_pretrained``
   (what verl's merger ends in, without its gather): the floor a merger that holds the
   whole model pays, measured the same way.

Both outputs are compared tensor by tensor (names, dtypes, bytes) and by index. Writes
``results/moe-merge.json``; prints the numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from harness import BENCH, REPO, RESULTS, MiB, log
from harness.machine import git_revision
from harness.process import run_measured

sys.path.insert(0, str(REPO / "src"))


def config(args: argparse.Namespace):
    import transformers

    c = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        vocab_size=8192,
        moe_intermediate_size=args.moe_inter,
        num_experts=args.experts,
        num_experts_per_tok=2,
    )
    c.architectures = ["Qwen3MoeForCausalLM"]
    c.dtype = "bfloat16"
    return c


def build(args: argparse.Namespace):
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config(args))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.float()


def save_rank(rank: int, world: int, args: argparse.Namespace, actor: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = build(args)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = Path(actor)
    if rank == 0:
        (out / "huggingface").mkdir(parents=True)
        model.config.save_pretrained(out / "huggingface")
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    dist.barrier()
    torch.save(model.state_dict(), out / f"model_world_size_{world}_rank_{rank}.pt")


SAVE_PRETRAINED = """
import sys, json, argparse, torch
sys.path.insert(0, {bench!r})
import moe_merge
args = argparse.Namespace(**json.loads({args!r}))
moe_merge.build(args).to(torch.bfloat16).save_pretrained({target!r})
"""


def same_output(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    index = "model.safetensors.index.json"
    if (a / index).is_file() != (b / index).is_file():
        return False
    if (a / index).is_file() and (a / index).read_bytes() != (b / index).read_bytes():
        return False
    tensors: list[dict] = [{}, {}]
    for side, directory in enumerate((a, b)):
        for path in directory.glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    tensors[side][key] = f.get_tensor(key)
    if sorted(tensors[0]) != sorted(tensors[1]):
        return False
    return all(
        t.dtype == tensors[1][k].dtype
        and t.view(torch.uint8).equal(tensors[1][k].view(torch.uint8))
        for k, t in tensors[0].items()
    )


def _numbers(m) -> dict:
    return {"wall_s": m.wall_s, "peak_rss_mib": m.peak_rss_bytes / MiB, "rc": m.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", dest="moe_inter", type=int, default=512)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    from shardstream.testing.distributed import run

    work = Path(args.workdir or tempfile.mkdtemp(prefix="moe-merge-"))
    actor = work / "actor"
    shape = {k: v for k, v in vars(args).items() if k != "workdir"}
    if not actor.exists():
        log(f"saving the verl checkpoint on {args.world} ranks into {actor}")
        run(save_rank, args.world, args, str(actor), timeout=1800)
    stored = sum(p.stat().st_size for p in actor.glob("model_world_size_*.pt"))
    for name in ("merged", "save_pretrained"):
        shutil.rmtree(work / name, ignore_errors=True)
    log("shardstream merge")
    argv = ["merge", "--local_dir", str(actor), "--target_dir", str(work / "merged"), "--json"]
    merge = run_measured(
        [sys.executable, "-m", "shardstream", *argv],
        env={"PYTHONPATH": str(REPO / "src")},
        capture_stdout=True,
    )
    log("save_pretrained of the same weights, held whole")
    code = SAVE_PRETRAINED.format(
        bench=str(BENCH), args=json.dumps(shape), target=str(work / "save_pretrained")
    )
    floor = run_measured([sys.executable, "-c", code], env={"PYTHONPATH": str(REPO / "src")})
    equal = same_output(work / "merged", work / "save_pretrained")
    result = {
        "revision": git_revision(),
        "model": shape,
        "checkpoint_bytes": stored,
        "output_bytes": sum(p.stat().st_size for p in (work / "merged").glob("*.safetensors")),
        "merge": _numbers(merge),
        "save_pretrained": _numbers(floor),
        "identical_output": equal,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe-merge.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if equal and merge.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
