"""Run a function on N real processes over gloo, for tests, the demo and benchmarks.

``run(fn, world_size, *args)`` starts the ranks from a fork server that has imported torch,
transformers and shardstream once (so a rank starts in well under a second instead of paying
``import torch`` each time), initialises a gloo process group through a file store (no ports
to collide), calls ``fn(rank, world_size, *args)`` and returns the per-rank return values.
A failing rank raises in the caller with its traceback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, store: str, out: str, args: tuple) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # A native crash (SIGSEGV, abort), or SIGUSR1 from run() at its timeout, leaves every
    # thread's Python stack here for run() to show.
    crash_log = open(Path(out, f"{rank}.crash"), "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(crash_log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, crash_log, all_threads=True)
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        dist.barrier()  # every pair is connected before anyone can finish and leave
        result = fn(rank, world_size, *args)
        dist.barrier()
        _write_result(out, rank, ("ok", result))
    except BaseException:
        _write_result(out, rank, ("error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Interpreter teardown beside gloo's threads has crashed finished ranks (SIGSEGV, abort)
    # on a busy machine; the work and its result are complete here, so skip it.
    exit_finished_rank()


def _write_result(out: str, rank: int, record: tuple) -> None:
    """``rank``'s result, whole or not at all: run() stops a failed run's other ranks at any
    point, a result file's write included."""
    path = Path(out, f"{rank}.pkl")
    part = path.with_suffix(".part")
    part.write_bytes(pickle.dumps(record))
    os.replace(part, path)


def _read_result(out: str, rank: int) -> tuple | None:
    """What ``rank`` returned, ``("ok", value)`` or ``("error", traceback)``; None if it wrote
    nothing, ``("error", why)`` if its record cannot be read back."""
    path = Path(out, f"{rank}.pkl")
    if not path.exists():
        return None
    try:
        return pickle.loads(path.read_bytes())
    except Exception as exc:  # noqa: BLE001  (a record cut short, or a result pickle cannot rebuild)
        return ("error", f"its result record {path.name} cannot be read back: {exc!r}")


# What ranks would otherwise import each time: torch._dynamo (fully_shard imports it on
# first use, ~0.6 s of CPU per rank), transformers' model code (~1.5 s) for the tiny models
# of testing.tiny_models. One not installed is skipped.
PRELOADED = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "shardstream",
]


def preload(*modules: str) -> None:
    """Have the fork server also import ``modules`` (those the ranks' functions import), if
    called before its first start; a module that is not installed is skipped."""
    PRELOADED.extend(m for m in modules if m not in PRELOADED)


def _preload() -> None:
    """Have the fork server import the heavy modules once (it starts on first use)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(list(PRELOADED))


def exit_finished_rank() -> NoReturn:
    """Exit 0 from a rank process whose work is done and whose group is destroyed, skipping
    interpreter teardown, where gloo's threads have aborted finished ranks ("terminate called
    without an active exception") on a busy machine. Call it only after success: a failure
    should raise and exit non-zero with its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _dump_stacks(processes: list, wait_s: float = 2.0) -> None:
    """Ask each live rank for its threads' stacks (faulthandler, SIGUSR1) before a kill."""
    for process in processes:
        if process.is_alive():
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGUSR1)
    time.sleep(wait_s)


def _signal_deaths(processes: list) -> list[str]:
    """A line "process R terminated with signal NAME" for each rank a signal ended, other than
    the SIGTERM and SIGKILL that stop the remaining ranks after a failure."""
    out = []
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code is not None and code < 0 and -code not in (signal.SIGTERM, signal.SIGKILL):
            out.append(f"process {rank} terminated with signal {signal.Signals(-code).name}")
    return out


def _crash_stacks(tmp: str, world_size: int) -> list[str]:
    """What faulthandler wrote for each rank that crashed natively or hung (its threads'
    stacks)."""
    out = []
    for rank in range(world_size):
        path = Path(tmp, f"{rank}.crash")
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        if text:
            out.append(f"--- rank {rank}: its threads' stacks ---\n{text[-6000:]}")
    return out


def run(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results."""
    with tempfile.TemporaryDirectory(prefix="shardstream-dist-") as tmp:
        store = os.path.join(tmp, "store")
        _preload()
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, store, tmp, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    _dump_stacks(context.processes)
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"{world_size} ranks did not finish in {timeout:.0f} s")
        except Exception as exc:
            records = [_read_result(tmp, rank) for rank in range(world_size)]
            details = [
                f"--- rank {rank} ---\n{record[1]}"
                for rank, record in enumerate(records)
                if record is not None and record[0] == "error"
            ]
            if not details:  # say how far the ranks got: a crash in fn, or after it
                done = [r for r, record in enumerate(records) if record is not None]
                details.append(f"{exc} (ranks that had returned their result: {done})")
            # A rank that died of a signal, though another's error (its peer gone) came first
            details += [d for d in _signal_deaths(context.processes) if d not in details[-1]]
            # What stopped the run (a rank's exit code or signal, or the timeout), if not said
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            if first and not any(first in d for d in details):
                details.append(f"the run stopped at: {first}")
            details += _crash_stacks(tmp, world_size)
            raise RuntimeError("\n".join(details)) from None
        records = [_read_result(tmp, rank) for rank in range(world_size)]
        unread = [
            f"rank {r}: {rec and rec[1]}"
            for r, rec in enumerate(records)
            if not rec or rec[0] != "ok"
        ]
        if unread:
            raise RuntimeError("\n".join(unread))
        return [record[1] for record in records]


def shard_units(model: Any, units: list, mesh: Any, wrap: str = "fsdp2") -> Any:
    """``model`` sharded over ``mesh``, each of ``units`` (disjoint submodules) a unit of its
    own and the root the rest: FSDP2 (``"fsdp2"``, ``fully_shard``), or FSDP1 on CPU with
    ``use_orig_params`` (``"fsdp1-orig"``) or without (any other ``"fsdp1..."``). Returns the
    root: the model itself under FSDP2, its FSDP1 wrapper otherwise."""
    import torch

    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    def fsdp1(module: Any) -> Any:
        return FullyShardedDataParallel(
            module,
            device_mesh=mesh,
            device_id=torch.device("cpu"),
            use_orig_params=wrap == "fsdp1-orig",
        )

    for unit in units:
        name = next(n for n, m in model.named_modules() if m is unit)
        head, _, attr = name.rpartition(".")
        setattr(model.get_submodule(head), attr, fsdp1(unit))
    return fsdp1(model)
