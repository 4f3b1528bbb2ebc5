"""How long does the optimizer step right after an async ``save()`` wait?

On a GPU a training step is short next to a save, so the step after ``save()`` meets a save in
flight; on this CPU machine forward and backward take longer than the save, and
``async_bench.py`` never sees that wait. Here the step comes right after ``save()`` (no forward
or backward between), for each kind of save and staging budget:

    .venv/bin/python bench/step_stall.py            # the save bench's quick Qwen2 (0.18 GB), ws 2
    .venv/bin/python bench/step_stall.py --repeats 6

It prints, per kind, the median wait of that step (``optimizer.step()`` itself included, and
timed alone as a floor) beside the whole save's time. Nothing is written to docs: the figures
quoted in docs/design.md come from a run of this script.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from harness import RESULTS
from harness.training import MODEL_QUICK, fsdp_state

KINDS = {
    "model+optim+extra": (("model", "optimizer", "extra"), False),
    "+hf_model": (("model", "optimizer", "extra", "hf_model"), False),
    "+hf_model, share_hf_weights": (("model", "optimizer", "extra", "hf_model"), True),
}
BUDGETS = ("256MiB", "1GiB")


def worker(rank: int, world: int, root: str, repeats: int) -> dict:
    import torch

    from shardstream import CheckpointConfig, CheckpointManager

    config, model, optimizer, scheduler = fsdp_state(MODEL_QUICK)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    floor = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.step()
        floor.append(time.perf_counter() - t0)
    results = {"optimizer.step() alone": {"stall": floor, "save": []}}
    for budget in BUDGETS:
        for kind, (contents, share) in KINDS.items():
            stalls, saves = [], []
            for rep in range(repeats):
                cfg = CheckpointConfig(
                    directory=f"{root}/{budget}-{len(contents)}-{share}-{rep}",
                    save_contents=contents,
                    async_save=True,
                    staging_budget=budget,
                    share_hf_weights=share,
                )
                mgr = CheckpointManager(
                    cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, hf_config=config
                )
                t0 = time.perf_counter()
                mgr.save(1)
                t1 = time.perf_counter()
                optimizer.step()  # the pre-hook waits here
                t2 = time.perf_counter()
                mgr.close()
                saves.append(time.perf_counter() - t0)
                stalls.append(t2 - t1)
            results[f"{kind}, budget {budget}"] = {"stall": stalls, "save": saves}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    from shardstream.testing.distributed import run

    with tempfile.TemporaryDirectory(dir=RESULTS) as root:
        results = run(worker, 2, root, args.repeats, timeout=1800)
    print(f"{'save (async, ws 2, 0.18 GB Qwen2 + AdamW)':<52} {'step wait s':>12} {'save s':>8}")
    for name in results[0]:
        slowest = [max(r[name]["stall"][i] for r in results) for i in range(args.repeats)]
        saves = results[0][name]["save"]
        save = f"{statistics.median(saves):8.2f}" if saves else f"{'':>8}"
        print(f"{name:<52} {statistics.median(slowest):12.2f} {save}")


if __name__ == "__main__":
    main()
