"""GPU check for async save and device-to-host transfers (one command, a few minutes).

Run on a machine with CUDA:  python bench/gpu_check.py [--gb 1.0] [--out bench/results/gpu.json]
It measures, on one GPU: HostTransfer (pinned ring on a side stream) against a plain
``tensor.cpu()``; a sync save; an async save's stall at the next optimizer step; and checks that
the checkpoint restores bit for bit. Without CUDA it says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def transfer_rates(tensor: torch.Tensor) -> dict:
    from shardstream.engine.endpoints import TensorEndpoint
    from shardstream.engine.transfer import HostTransfer

    out = np.empty(tensor.numel() * tensor.element_size(), dtype=np.uint8)
    endpoint = TensorEndpoint("x", tensor, transfer=HostTransfer(slot_bytes=8 << 20, slots=3))
    torch.cuda.synchronize()
    started = time.perf_counter()
    endpoint.read_into(0, out)
    ring = time.perf_counter() - started
    started = time.perf_counter()
    plain = tensor.cpu()
    torch.cuda.synchronize()
    direct = time.perf_counter() - started
    assert out.tobytes() == plain.view(torch.uint8).numpy().tobytes()
    gb = out.nbytes / 1e9
    return {"ring_gb_s": gb / ring, "tensor_cpu_gb_s": gb / direct}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0, help="fp32 model size")
    parser.add_argument("--out", default="bench/results/gpu.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing measured (see docs/benchmarks.md)")
        return 0
    from shardstream import CheckpointConfig, CheckpointManager

    torch.manual_seed(0)
    width = 4096
    layers = max(1, int(args.gb * 1e9 / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device="cuda")

    def step():
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    results = {"device": torch.cuda.get_device_name(), "params_gb": 4 * layers * width**2 / 1e9}
    results["transfer"] = transfer_rates(next(model.parameters()).detach())
    root = Path(tempfile.mkdtemp(prefix="shardstream-gpu-"))
    snapshots = {}
    try:
        for mode in ("sync", "async"):
            snapshots[mode] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            cfg = CheckpointConfig(
                str(root / mode), async_save=mode == "async", save_contents=("model", "optimizer")
            )
            manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
            torch.cuda.synchronize()
            started = time.perf_counter()
            manager.save(1)
            returned = time.perf_counter() - started
            step_started = time.perf_counter()
            step()  # the optimizer pre-hook waits here for what is neither written nor staged
            torch.cuda.synchronize()
            step_time = time.perf_counter() - step_started
            manager.wait()
            results[mode] = {
                "save_returned_s": returned,
                "next_step_s": step_time,
                "stalls_s": list(getattr(manager._async, "stalls", []) or []),
            }
            manager.close()
        # Each checkpoint must hold the weights of the moment its save was requested, even
        # though training went on (async) while it was written.
        for mode, expected in snapshots.items():
            check = CheckpointManager(
                CheckpointConfig(str(root / mode), load_contents=("model",)), model=model
            )
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            check.restore(step=1)
            check.close()
            results[f"{mode}_restore_bit_equal"] = all(
                torch.equal(v.cpu(), expected[k]) for k, v in model.state_dict().items()
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
