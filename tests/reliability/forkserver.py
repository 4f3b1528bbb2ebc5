"""Victim processes for the reliability trials, forked from one warm interpreter.

``python forkserver.py`` imports torch and shardstream once, then reads one JSON command per
line on stdin and answers one JSON line on stdout:

``{"op": "spawn", "job": J, "spec": {...}, "nprocs": N, "log": DIR}``
    fork N children that run job J (rank 0..N-1); answer ``{"pids": [...]}``.
``{"op": "wait", "pids": [...], "timeout": S}``
    reap those children for up to S seconds; answer ``{"exited": {pid: code}, "running": [...]}``
    (code is the exit status, or minus the signal number that killed the process).

The children are ordinary processes: the tests kill them with SIGKILL at random moments.
Forking skips the few seconds of ``import torch`` per rank, so a trial costs well under a
second of start-up and ``make test`` can afford many of them. Jobs:

``train``   an FSDP2 (``fully_shard``) training run over gloo that saves every step through
            ``CheckpointManager`` until killed. Before saving step N, rank 0 writes the full
            model and optimizer state of step N to ``side/<run>/step_N.pt`` (fsynced, renamed
            into place), so every step that can possibly be committed has its expected state on
            disk; the save's ``extra`` names the run. After ``save()`` returns, rank 0 appends N
            to ``side/<run>/saved``: a step listed there must never be lost.
``restore`` every rank restores a given checkpoint through ``CheckpointManager`` and writes
            what happened (success, or the error's type and message) to a JSON file.
``cli``     ``shardstream.cli.main(argv)``, exactly what the ``shardstream`` command runs.
``dist_cli`` the same as rank R of N gloo ranks (``merge --distributed``).
``guarded`` one entry point (a CLI command, or ``load``) under an address-space cap (fuzzing).
``hold``    open a ``CheckpointManager`` (taking its lock), say so, and sleep until killed.
``call``    run ``module:function(spec, rank)`` from this directory, optionally as another user
            (the full-disk and unprivileged-user scenarios in ``scenarios.py``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (fully_shard imports it on first use: once here, not per victim)
import torch.distributed.fsdp  # noqa: F401
from torch import nn

IN, OUT = 24, 12
HIDDEN = 40  # uneven over 2 and 3 ranks: 20/20, 14/13/13


def build_model(seed: int = 0, hidden: int = HIDDEN, depth: int = 1) -> nn.Module:
    """Linear layers: in, ``depth`` hidden ones, out (modules 0, 2, ..., 2 * depth + 2)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN, hidden), nn.Tanh()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.Tanh()]
    layers.append(nn.Linear(hidden, OUT, bias=False))
    return nn.Sequential(*layers)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, step: int) -> None:
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(8, IN, generator=generator)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _append_line(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


# --- jobs ---------------------------------------------------------------------------------------


def job_train(spec: dict, rank: int) -> int:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardstream.manager import CheckpointConfig, CheckpointManager

    world = spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['init']}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    seed = spec.get("seed", 0)
    model = build_model(seed, spec.get("hidden", HIDDEN), spec.get("depth", 1))
    for layer in model[:-1:2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model)
    async_save = spec.get("async_save", False)
    hf_source = spec.get("hf_source")  # also save hf_model, its weights shared (huggingface/)
    config = CheckpointConfig(
        directory=spec["root"],
        save_interval=1,
        keep_last=spec.get("keep_last", 2),
        async_save=async_save,
        save_contents=("model", "optimizer", "extra") + (("hf_model",) if hf_source else ()),
        share_hf_weights=bool(hf_source),
    )
    manager = CheckpointManager(config, model=model, optimizer=optimizer, hf_source_dir=hf_source)
    if spec.get("lock_at_start"):
        manager.acquire_lock()  # fail before training, not at the first save
    restored = manager.restore()
    start = restored[0] if restored else 0
    side = Path(spec["side"]) / spec["run"]
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if rank == 0:
        side.mkdir(parents=True, exist_ok=True)
        (side / "ready").write_text(json.dumps({"start": start}))
    pending: list[int] = []
    for step in range(start + 1, start + 1 + spec.get("steps", 1_000_000)):
        train_step(model, optimizer, seed, step)
        if spec.get("record", True):
            model_sd = get_model_state_dict(model, options=full)
            optim_sd = get_optimizer_state_dict(model, optimizer, options=full)
            if rank == 0:
                atomic_torch_save({"model": model_sd, "optim": optim_sd}, side / f"step_{step}.pt")
        manager.save(step, extra={"run": spec["run"], "step": step})
        pending.append(step)
        if async_save and step % 3:
            continue  # background writes pile up; they are durable once wait() returns
        manager.wait()
        if rank == 0:
            for done in pending:
                _append_line(side / "saved", str(done))
        pending.clear()
    manager.close()
    dist.destroy_process_group()
    return 0


def job_restore(spec: dict, rank: int) -> int:
    """Restore ``spec["path"]`` on every rank; write each rank's outcome to ``out/rank-R.json``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardstream.manager import CheckpointConfig, CheckpointManager

    world = spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['init']}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = build_model(0, spec.get("hidden", HIDDEN), spec.get("depth", 1))
    for layer in model[:-1:2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model)
    outcome: dict = {"rank": rank}
    try:
        manager = CheckpointManager(
            CheckpointConfig(directory=spec["scratch"]), model=model, optimizer=optimizer
        )
        manager.restore(path=spec["path"])
        outcome["ok"] = True
    except BaseException as exc:  # noqa: BLE001
        outcome.update(ok=False, error=type(exc).__name__, message=str(exc))
        from shardstream.errors import ShardstreamError

        outcome["shardstream_error"] = isinstance(exc, ShardstreamError)
    Path(spec["out"], f"rank-{rank}.json").write_text(json.dumps(outcome))
    return 0


def job_cli(spec: dict, rank: int) -> int:
    from shardstream import cli

    return cli.main(spec["argv"])


def job_dist_cli(spec: dict, rank: int) -> int:
    """``shardstream.cli.main(argv)`` as rank ``rank`` of ``spec["world"]`` gloo ranks (the
    group torchrun would give ``merge --distributed``, joined through a file)."""
    import torch.distributed as dist

    from shardstream import cli

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(spec["world"]))
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['init']}", rank=rank, world_size=spec["world"]
    )
    return cli.main(spec["argv"])


def job_guarded(spec: dict, rank: int) -> int:
    """One entry point on possibly hostile files, with the address space capped at what the
    process maps now plus ``spec["extra"]`` bytes: ``spec["argv"]`` through
    ``shardstream.cli.main``, or with ``spec["load"]`` ``shardstream.load`` of that directory
    into the test model (a ``ShardstreamError`` printed as the CLI prints one, exit 1). Anything
    else ends in a traceback (``_child``), which the fuzz tests look for."""
    import resource

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + spec["extra"], vm + spec["extra"]))
    if spec.get("load"):
        from shardstream.errors import ShardstreamError
        from shardstream.training.load import load

        model = build_model()
        optimizer = build_optimizer(model) if spec.get("optimizer") else None
        try:
            load(spec["load"], model=model, optimizer=optimizer)
        except ShardstreamError as exc:
            print(f"shardstream load: error: {exc}", file=sys.stderr)
            return 1
        return 0
    from shardstream import cli

    return cli.main(spec["argv"])


def job_hold(spec: dict, rank: int) -> int:
    from shardstream.manager import CheckpointConfig, CheckpointManager

    manager = CheckpointManager(CheckpointConfig(directory=spec["root"]))
    manager.acquire_lock()  # what a saving run holds from its first save on
    Path(spec["ready"]).write_text(str(os.getpid()))
    while True:
        time.sleep(3600)
    manager.close()  # unreachable: the test kills this process


def job_call(spec: dict, rank: int) -> int:
    """``module:function(spec, rank)``, as user ``spec["uid"]`` if given (imported before)."""
    module, _, name = spec["target"].partition(":")
    function = getattr(importlib.import_module(module), name)
    if spec.get("uid") is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    return function(spec, rank) or 0


JOBS = {
    "train": job_train,
    "restore": job_restore,
    "cli": job_cli,
    "dist_cli": job_dist_cli,
    "guarded": job_guarded,
    "hold": job_hold,
    "call": job_call,
}


# --- the server ---------------------------------------------------------------------------------


def _child(command: dict, rank: int) -> None:
    code = 1
    try:
        # The spawn's number too: a later process given a dead one's pid gets a log of its own.
        log = Path(command["log"]) / f"{command['job']}-{rank}-{os.getpid()}-{command['seq']}.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        torch.set_num_threads(1)
        code = JOBS[command["job"]](command.get("spec", {}), rank)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def serve() -> None:
    # Everything a job needs, imported before the first fork (torch._dynamo: what
    # get_model_state_dict imports on first use, two seconds in every child otherwise).
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import shardstream.cli  # noqa: F401
    import shardstream.commands.inspect  # noqa: F401
    import shardstream.commands.merge  # noqa: F401
    import shardstream.commands.test  # noqa: F401
    import shardstream.commands.verify  # noqa: F401
    import shardstream.formats.dcp  # noqa: F401
    import shardstream.formats.hf_names  # noqa: F401
    import shardstream.formats.verl  # noqa: F401
    import shardstream.manager  # noqa: F401
    import shardstream.training.load  # noqa: F401

    try:  # what naming a merge's outputs imports on first use (seconds, in every child)
        import transformers
        import transformers.conversion_mapping  # noqa: F401
        import transformers.core_model_loading  # noqa: F401
        from transformers import CONFIG_MAPPING, AutoModel, AutoModelForCausalLM  # noqa: F401
    except ImportError:
        pass

    def reply(doc: dict) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    reply({"ready": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "spawn":
            pids = []
            for rank in range(command.get("nprocs", 1)):
                pid = os.fork()
                if pid == 0:
                    _child(command, rank)
                pids.append(pid)
            reply({"pids": pids})
        elif command["op"] == "wait":
            deadline = time.monotonic() + command.get("timeout", 0)
            pending = set(command["pids"])
            exited = {}
            while True:
                for pid in sorted(pending):
                    try:
                        done, status = os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        exited[pid] = None
                        pending.discard(pid)
                        continue
                    if done:
                        exited[pid] = os.waitstatus_to_exitcode(status)
                        pending.discard(pid)
                if not pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            reply({"exited": {str(k): v for k, v in exited.items()}, "running": sorted(pending)})
        elif command["op"] == "quit":
            break


if __name__ == "__main__":
    serve()
