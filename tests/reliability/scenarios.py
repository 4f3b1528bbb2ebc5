"""Scenarios the fork server runs in a child (``job: call``): several ranks on a full disk, and
an unprivileged user (uid 65534) facing directories it may not write.

Each writes what happened to ``spec["out"]/<name>-<rank>.json`` for the test to judge; the
tests, not these functions, decide what is right.
"""

from __future__ import annotations

# The unprivileged scenarios cannot import anything new once they dropped to uid 65534 (the
# interpreter's standard library lives under /root), so everything is imported up front.
import getpass  # noqa: F401  (torch._dynamo imports it when an optimizer is built)
import json
import os
import stat
import uuid  # noqa: F401
from pathlib import Path

import torch._dynamo  # noqa: F401
from forkserver import build_model, build_optimizer, train_step

import shardstream.cli  # noqa: F401
import shardstream.commands.merge  # noqa: F401
import shardstream.commands.verify  # noqa: F401
import shardstream.training.load  # noqa: F401
import shardstream.training.save  # noqa: F401
from shardstream.errors import OutOfSpaceError, ShardstreamError
from shardstream.manager import CheckpointConfig, CheckpointManager, read_latest


def _outcome(call) -> dict:
    try:
        value = call()
    except BaseException as exc:  # noqa: BLE001
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc).splitlines()[0] if str(exc) else "",
            "shardstream": isinstance(exc, ShardstreamError),
            "out_of_space": isinstance(exc, OutOfSpaceError),
        }
    try:
        json.dumps(value)
    except TypeError:
        value = None
    return {"ok": True, "value": value}


def _write(spec: dict, name: str, rank: int, doc: dict) -> None:
    Path(spec["out"], f"{name}-{rank}.json").write_text(json.dumps(doc))


def disk_full_ranks(spec: dict, rank: int) -> int:
    """2 FSDP2 ranks save step 1, rank 0 fills the disk to ``leave`` free bytes, all save step 2.

    With ``hf``, saves include ``hf_model`` and ``leave`` counts beyond what step 1's sharded
    files took, so the space runs out in the export, which rank 0 creates alone."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['init']}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = build_model()
    for layer in model[:-1:2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model)
    contents = ("model", "optimizer", "extra") + (("hf_model",) if spec.get("hf") else ())
    config = CheckpointConfig(
        directory=spec["root"],
        keep_last=2,
        save_contents=contents,
        share_hf_weights=spec.get("share", False),
    )
    source = spec.get("hf_source")
    manager = CheckpointManager(config, model=model, optimizer=optimizer, hf_source_dir=source)
    train_step(model, optimizer, 0, 1)
    manager.save(1)
    dist.barrier()
    if rank == 0:
        leave = spec["leave"]
        if spec.get("hf"):
            step = Path(spec["root"], "global_step_1")
            leave += sum(p.stat().st_size for p in step.iterdir() if p.is_file())
        free = os.statvfs(spec["root"]).f_bavail * os.statvfs(spec["root"]).f_frsize
        with open(Path(spec["ballast"]), "wb") as f:
            if free > leave:
                os.posix_fallocate(f.fileno(), 0, free - leave)
    dist.barrier()
    train_step(model, optimizer, 0, 2)
    result = _outcome(lambda: manager.save(2))
    _write(spec, "save", rank, result)
    manager.close()
    dist.destroy_process_group()
    return 0


def unprivileged_denied(spec: dict, rank: int) -> int:
    """As nobody, in a directory owned by root (mode 0755): save, start a manager, merge into it;
    and read a root-owned checkpoint, which is allowed."""
    from shardstream import cli
    from shardstream.commands.verify import verify
    from shardstream.training import load as loading
    from shardstream.training import save as saving

    denied = Path(spec["denied"])
    model = build_model()
    optimizer = build_optimizer(model)
    results = {
        "uid": os.getuid(),
        "manager": _outcome(
            lambda: CheckpointManager(
                CheckpointConfig(str(denied / "run")), model=model, optimizer=optimizer
            ).save(1)
        ),
        "save": _outcome(
            lambda: saving.save(denied / "step", model=model, optimizer=optimizer, step=1) and None
        ),
        "merge": _outcome(
            lambda: cli.main(
                ["merge", "--local_dir", spec["readable"], "--target_dir", str(denied / "out")]
                + ["--quiet"]
            )
        ),
        "restore_readable": _outcome(
            lambda: loading.load(spec["readable"], model=model, optimizer=optimizer).step
        ),
        "verify_readable": _outcome(lambda: str(verify(spec["readable"]).ok)),
    }
    _write(spec, "denied", rank, results)
    return 0


def unprivileged_mid_run(spec: dict, rank: int) -> int:
    """As nobody, in its own run directory: save step 1, lose write permission, try step 2,
    regain it, save step 3; then make a data file unreadable and restore."""
    from shardstream.commands.verify import verify
    from shardstream.training import load as loading

    root = Path(spec["root"])
    model = build_model()
    optimizer = build_optimizer(model)
    results: dict = {"uid": os.getuid()}
    manager = CheckpointManager(
        CheckpointConfig(directory=str(root), keep_last=3), model=model, optimizer=optimizer
    )
    train_step(model, optimizer, 0, 1)
    manager.save(1)
    root.chmod(0o555)
    train_step(model, optimizer, 0, 2)
    results["save_read_only_dir"] = _outcome(lambda: manager.save(2) and None)
    results["entries_while_read_only"] = sorted(p.name for p in root.iterdir())
    root.chmod(0o755)
    results["latest_after"] = read_latest(root)
    results["verify_after"] = str(verify(root).ok)
    train_step(model, optimizer, 0, 3)
    results["save_after_regaining"] = _outcome(lambda: manager.save(3) and None)
    manager.close()
    rank_file = root / "global_step_3" / "rank-00000.safetensors"
    rank_file.chmod(0)
    results["restore_unreadable_file"] = _outcome(
        lambda: loading.load(root / "global_step_3", model=model, optimizer=optimizer).step
    )
    results["verify_unreadable_file"] = _outcome(
        lambda: [p.line() for p in verify(root / "global_step_3").problems]
    )
    rank_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
    extra = root / "global_step_3" / "extra-rank-00000.json"
    extra.chmod(0)
    results["restore_unreadable_extra"] = _outcome(
        lambda: loading.load(root / "global_step_3", model=model, optimizer=optimizer).step
    )
    results["verify_unreadable_extra"] = _outcome(
        lambda: [p.line() for p in verify(root / "global_step_3").problems]
    )
    extra.chmod(stat.S_IRUSR | stat.S_IWUSR)
    _write(spec, "mid-run", rank, results)
    return 0
