"""``make demo``: the whole story on a tiny model, on 4 CPU processes, in about a minute.

1. verl: FSDP2 training step on 4 ranks writes a verl-layout checkpoint; shardstream merges it
   into a HF model, transformers loads it, and its logits equal the unsharded model's.
2. Training: the CheckpointManager saves every 2 steps on 4 ranks; the run stops, resumes on 2
   ranks, exports hf_model and is merged; per-rank save memory is set against a full gather.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("SHARDSTREAM_DEMO_DIR", "out/demo"))


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def cli(*args: str) -> dict:
    """Run the shardstream CLI in its own process (so its peak RSS is its own)."""
    cmd = [sys.executable, "-m", "shardstream", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout) if "--json" in args else {}


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def same_logits(hf_dir: Path, reference: dict[str, torch.Tensor], ids: torch.Tensor) -> bool:
    """Logits of the model in ``hf_dir`` against the unsharded weights cast to its dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    merged, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    odd = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    if odd:
        raise SystemExit(f"{hf_dir}: transformers loads it with {odd}")
    # The same architecture loaded the same way, holding the unsharded weights instead.
    unsharded = AutoModelForCausalLM.from_pretrained(hf_dir)
    state = {k: v.to(merged.dtype) for k, v in reference.items()}
    missing, unexpected = unsharded.load_state_dict(state, strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise SystemExit(f"reference keys differ: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        return torch.equal(merged(input_ids=ids).logits, unsharded(input_ids=ids).logits)


def part_one() -> None:
    from safetensors.torch import load_file

    from .testing.verl_checkpoint import VerlFixture, write_verl_checkpoint
    from .units import format_size

    banner("1. verl checkpoint -> Hugging Face model")
    root = OUT / "verl_run"
    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    actor = write_verl_checkpoint(root, VerlFixture(world_size=4, train_steps=1))
    print(f"FSDP2 on 4 processes wrote {actor} in {time.perf_counter() - started:.1f} s")
    checked = cli("verify", str(actor), "--json")
    print(
        f"shardstream verify {actor}: OK ({checked['files_checked']} .pt files, every zip "
        "record against the CRC-32 torch wrote and never checks)"
    )
    target = OUT / "merged_from_verl"
    summary = cli(
        "merge",
        "--backend",
        "fsdp",
        "--local_dir",
        str(actor),
        "--target_dir",
        str(target),
        "--overwrite",
        "--json",
    )
    print(
        f"checkpoint {format_size(directory_bytes(actor))} -> {target}: "
        f"{summary['tensors']} tensors ({summary['dtype']}), "
        f"{format_size(summary['bytes_written'])} in {summary['wall_s']:.2f} s, "
        f"merge peak RSS {format_size(summary['peak_rss_bytes'])}"
    )
    reference = load_file(root / "reference" / "model.safetensors")
    ids = load_file(root / "reference" / "logits.safetensors")["input_ids"]
    ok = same_logits(target, reference, ids)
    print(f"transformers loads it; logits equal the unsharded model's: {ok}")
    if not ok:
        raise SystemExit("demo failed: logits differ")


def part_two() -> None:
    from .testing.distributed import run
    from .units import format_size

    banner("2. train on 4 ranks, stop, resume on 2, export and merge")
    root = OUT / "train_run"
    shutil.rmtree(root, ignore_errors=True)
    first = run(_train, 4, str(root), 1, 6, False)
    print(f"4 ranks trained steps 1-6; committed steps {first[0]['steps']} (keep_last=2)")
    second = run(_train, 2, str(root), 7, 10, True)
    print(f"2 ranks resumed from step {second[0]['resumed']} and trained to step 10")
    for rank, result in enumerate(second):
        print(
            f"  rank {rank}: save used {format_size(result['save_extra_rss'])} above its "
            f"baseline (staging budget {format_size(result['budget'])}); a full-state gather "
            f"on rank 0 would hold {format_size(result['gather_bytes'])}"
        )
    print(
        "  (the gather grows with the model: 4 bytes x parameters, 280 GB for a 70B model; "
        "the streaming save stays within the staging budget at any size)"
    )
    cli("verify", str(root), "--quiet")
    print(f"shardstream verify {root}: OK")
    step_dir = root / "global_step_10"
    target = OUT / "merged_from_training"
    summary = cli(
        "merge", "--local_dir", str(step_dir), "--target_dir", str(target), "--overwrite", "--json"
    )
    print(
        f"merged {step_dir} -> {target} in {summary['wall_s']:.2f} s, "
        f"peak RSS {format_size(summary['peak_rss_bytes'])}"
    )
    from safetensors.torch import load_file

    exported = load_file(step_dir / "huggingface" / "model.safetensors")
    merged = load_file(target / "model.safetensors")
    same = exported.keys() == merged.keys() and all(
        torch.equal(exported[k], merged[k]) for k in exported
    )
    print(f"hf_model export written during training equals the offline merge: {same}")
    if not same:
        raise SystemExit("demo failed: export and merge differ")


def _train(rank: int, world: int, root: str, first: int, last: int, export: bool) -> dict:
    """One rank of the training run (FSDP2 over gloo)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from . import CheckpointConfig, CheckpointManager
    from .engine.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from .testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2")
    config.dtype = torch.bfloat16  # publish dtype of the hf_model export
    model = build_tiny_model(config, seed=0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    contents = ["model", "optimizer", "extra"] + (["hf_model"] if export else [])
    cfg = CheckpointConfig.from_dict(
        {
            "default_local_dir": root,
            "save_contents": contents,
            "save_freq": 2,
            "max_ckpt_to_keep": 2,
        }
    )
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, hf_config=config)
    resumed = manager.restore()
    extra_rss = 0
    for step in range(first, last + 1):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, config.vocab_size, (4, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        before = current_rss_bytes()
        reset_peak_rss()
        if manager.maybe_save(step, extra={"next_step": step + 1}):
            extra_rss = max(extra_rss, peak_rss_bytes() - before)
    steps = manager.all_steps()
    manager.close()
    params = sum(p.numel() for p in model.parameters())
    return {
        "steps": steps,
        "resumed": resumed[0] if resumed else None,
        "save_extra_rss": extra_rss,
        "budget": cfg.staging_budget_bytes,
        "gather_bytes": 4 * params,
    }


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    part_one()
    part_two()
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s; outputs in {OUT}/")


if __name__ == "__main__":
    main()
