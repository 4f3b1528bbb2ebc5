"""Benchmark checkpoints: size a Qwen2 model to a target fp32 byte count, write it once as a
real verl FSDP checkpoint with ``shardstream.testing.verl_checkpoint`` and cache it under
``bench/results/ckpt/``.

Generation runs in a child process (``python bench/checkpoints.py --write ...``) so its
torch.distributed workers and their memory never live inside the benchmark driver.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.process import run_measured
from harness.training import QWEN2_WIDTHS, param_count

# Two model families, picked by target size; the layer count is then solved for the target.
# Shapes are Qwen2-like (GQA with 4 KV heads, head_dim 64 / 128, untied lm_head).
_SMALL = QWEN2_WIDTHS
_LARGE = dict(QWEN2_WIDTHS, hidden_size=2048, intermediate_size=5632)


def qwen2_overrides_for(target_gb: float) -> dict:
    """Config overrides whose fp32 weights come closest to ``target_gb`` * 1e9 bytes."""
    base = dict(_SMALL if target_gb < 1.5 else _LARGE, tie_word_embeddings=False)
    target_params = target_gb * 1e9 / 4
    best = None
    for layers in range(1, 200):
        c = dict(base, num_hidden_layers=layers)
        err = abs(param_count(c) - target_params)
        if best is None or err < best[0]:
            best = (err, c)
    return best[1]


@dataclass(frozen=True)
class CkptSpec:
    target_gb: float
    world_size: int

    @property
    def name(self) -> str:
        return f"qwen2-{self.target_gb:g}gb-ws{self.world_size}"

    @property
    def overrides(self) -> dict:
        return qwen2_overrides_for(self.target_gb)

    @property
    def fp32_bytes(self) -> int:
        return param_count(self.overrides) * 4

    def meta(self) -> dict:
        return {
            "generator": "shardstream.testing.verl_checkpoint.write_verl_checkpoint",
            "arch": "qwen2",
            "world_size": self.world_size,
            "train_steps": 0,
            "write_optimizer": False,
            "write_reference": False,
            "seed": 0,
            "config_overrides": self.overrides,
        }


def actor_dir(root: Path) -> Path:
    return root / "global_step_1" / "actor"


def ensure_checkpoint(spec: CkptSpec, cache_root: Path, python: str, log=print) -> dict:
    """Return {"root", "actor_dir", "generated_s" (None if cached), ...}; generate if needed."""
    cache_root = cache_root.resolve()
    root = cache_root / spec.name
    meta_path = root / "bench-meta.json"
    if meta_path.exists() and actor_dir(root).is_dir():
        meta = json.loads(meta_path.read_text())
        if meta.get("spec") == spec.meta():
            log(f"[ckpt] reusing {root}")
            return {**meta, "root": str(root), "actor_dir": str(actor_dir(root)), "cached": True}
        log(f"[ckpt] {root} was made with other parameters; regenerating")
    if root.exists():
        shutil.rmtree(root)
    tmp = cache_root / (spec.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    log(
        f"[ckpt] generating {spec.name}: ~{spec.fp32_bytes / 1e9:.2f} GB fp32, "
        f"world_size={spec.world_size}, overrides={json.dumps(spec.overrides)}"
    )
    t0 = time.perf_counter()
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--write",
        str(tmp),
        "--world-size",
        str(spec.world_size),
        "--overrides",
        json.dumps(spec.overrides),
    ]
    m = run_measured(cmd)
    if m.returncode != 0:
        raise RuntimeError(
            f"checkpoint generation failed (rc={m.returncode}) for {spec.name}:\n{m.stderr_tail}"
        )
    elapsed = time.perf_counter() - t0
    meta = {
        "spec": spec.meta(),
        "generated_s": round(elapsed, 1),
        "generation_peak_rss_mib": round(m.tree_peak_rss_bytes / 2**20),
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / "bench-meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    tmp.rename(root)
    log(
        f"[ckpt] wrote {root} in {elapsed:.0f}s "
        f"(generator tree peak RSS {meta['generation_peak_rss_mib']} MiB)"
    )
    return {**meta, "root": str(root), "actor_dir": str(actor_dir(root)), "cached": False}


def _write(out: Path, world_size: int, overrides: dict) -> None:
    from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoint

    fx = VerlFixture(
        world_size=world_size,
        arch="qwen2",
        tie_word_embeddings=False,
        train_steps=0,
        seed=0,
        config_overrides=overrides,
        write_optimizer=False,
        write_reference=False,  # the fixture's fp32 ground-truth copy: not needed here
    )
    actor = write_verl_checkpoint(out, fx, step=1)
    print(f"wrote {actor}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--write", type=Path, help="(child mode) write a checkpoint under this root")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--overrides", type=json.loads, default=None)
    p.add_argument("--show", type=float, nargs="*", help="print the config for these GB targets")
    a = p.parse_args(argv)
    if a.write:
        _write(a.write, a.world_size, a.overrides)
        return 0
    for gb in a.show or [0.5, 4.0]:
        c = qwen2_overrides_for(gb)
        print(f"{gb:g} GB -> {param_count(c) / 1e6:.1f} M params, {json.dumps(c)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
