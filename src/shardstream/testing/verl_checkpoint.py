"""Write *real* verl-layout FSDP2 checkpoints: N gloo processes, ``fully_shard``, AdamW.

The layout follows verl 0.9 (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``)::

    root/
      latest_checkpointed_iteration.txt          "<step>"
      global_step_<step>/
        data.pt                                  dataloader state (a small dict here)
        actor/
          model_world_size_<W>_rank_<r>.pt       torch.save(model.state_dict()), DTensor values
          optim_world_size_<W>_rank_<r>.pt       torch.save(optimizer.state_dict())
          extra_state_world_size_<W>_rank_<r>.pt {"lr_scheduler": ..., "rng": {...}}
          fsdp_config.json                       {"FSDP_version": 2, "world_size": W}
          huggingface/                           config.json, generation_config.json, tokenizer
          lora_train_meta.json                   LoRA runs (verl >= 0.8)
          lora_adapter/                          LoRA runs, verl 0.4.1 - 0.7 layout (optional)
      reference/                                 NOT verl: ground truth for tests (rank 0)
        model.safetensors                        full fp32 weights, HF state_dict names
        fused.safetensors                        LoRA only: W + (alpha/r) B@A, HF names
        adapter_model.safetensors                LoRA only: PEFT adapter naming
        logits.safetensors                       input_ids, logits (fp32) [, base_logits]
        fixture.json                             the VerlFixture and derived facts

Like verl, the model is built for real on rank 0 only (meta elsewhere), wrapped with
``fully_shard`` per decoder layer (+ embed_tokens / lm_head when untied) and at the root,
then loaded with ``set_model_state_dict(broadcast_from_rank0=True)``; parameters are fp32
with a bf16 ``MixedPrecisionPolicy`` for compute. The LR scheduler is a ``LambdaLR`` over
a closure, as verl's warmup schedules are; its ``state_dict()`` then holds
``lr_lambdas=[None]`` and is plain data. The ``rng`` entry holds numpy's state (an
ndarray), so - exactly as with real verl - extra_state files need numpy globals
allow-listed to load with ``weights_only=True``.

CLI (benchmarks)::

    python -m shardstream.testing.verl_checkpoint OUT --world-size 4 [--hsdp 2x2]
        [--shard-dim 1] [--arch qwen2|llama|plain] [--tie] [--lora] [--steps N]
        [--overrides '{"hidden_size": 2048, ...}'] [--no-reference]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SRC_ROOT = Path(__file__).resolve().parents[2]

ARCHS = ("qwen2", "llama", "plain")
LORA_LAYOUTS = ("meta", "adapter", "both")


@dataclass(frozen=True)
class VerlFixture:
    """What to generate. Defaults: 2-rank FSDP2, tiny Qwen2, one AdamW step."""

    world_size: int = 2
    #: None -> (world_size,) named ("fsdp",); (R, S) -> HSDP mesh named ("ddp", "fsdp").
    mesh_shape: tuple[int, ...] | None = None
    #: 1 -> ``shard_placement_fn`` giving Shard(1) to 2-D params whose dim 1 divides the
    #: fsdp size (FSDP2 refuses uneven sharding on dims > 0), Shard(0) otherwise.
    shard_dim: int = 0
    #: "qwen2" | "llama" | "plain" (a non-transformers module, see tiny_models.PlainModule)
    arch: str = "qwen2"
    tie_word_embeddings: bool = False
    #: PEFT-style LoRA on all linear projections (not lm_head), r / alpha below.
    lora: bool = False
    lora_rank: int = 3
    lora_alpha: int = 6
    #: "meta": lora_train_meta.json (verl >= 0.8); "adapter": actor/lora_adapter/
    #: (verl 0.4.1 - 0.7); "both".
    lora_layout: str = "meta"
    #: 0 -> no training (random init as saved); otherwise AdamW steps.
    train_steps: int = 1
    seed: int = 0
    #: Extra config kwargs, e.g. to scale up for benchmarks.
    config_overrides: dict[str, Any] | None = field(default=None, hash=False)
    write_optimizer: bool = True
    #: Checkpoints older than verl 0.4.1 have no fsdp_config.json ...
    write_fsdp_config: bool = True
    #: ... and keep config/tokenizer files in actor/ itself instead of actor/huggingface/.
    hf_in_subdir: bool = True
    #: dtype named by config.json (written as both ``dtype`` and ``torch_dtype``).
    config_dtype: str = "bfloat16"
    #: bf16 MixedPrecisionPolicy for forward/backward, as verl's default.
    mixed_precision: bool = True
    lr: float = 1e-2
    #: Write root/reference/ (full fp32 weights + logits). Off for huge benchmark models.
    write_reference: bool = True

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, not {self.arch!r}")
        if self.world_size < 1:
            raise ValueError("world_size must be >= 1")
        shape = self.mesh
        if math.prod(shape) != self.world_size:
            raise ValueError(
                f"mesh_shape {shape} does not multiply to world_size {self.world_size}"
            )
        if len(shape) not in (1, 2):
            raise ValueError("mesh_shape must have 1 (FSDP) or 2 (HSDP) dims")
        if self.shard_dim not in (0, 1):
            raise ValueError("shard_dim must be 0 or 1")
        if self.arch == "plain" and (self.lora or self.tie_word_embeddings):
            raise ValueError("the plain module has no LoRA or tied-embedding variant")
        if self.lora_layout not in LORA_LAYOUTS:
            raise ValueError(f"lora_layout must be one of {LORA_LAYOUTS}")
        if self.train_steps < 0:
            raise ValueError("train_steps must be >= 0")

    @property
    def mesh(self) -> tuple[int, ...]:
        return tuple(self.mesh_shape) if self.mesh_shape else (self.world_size,)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("fsdp",) if len(self.mesh) == 1 else ("ddp", "fsdp")

    @property
    def fsdp_size(self) -> int:
        return self.mesh[-1]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mesh_shape"] = list(self.mesh_shape) if self.mesh_shape else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> VerlFixture:
        d = dict(d)
        if d.get("mesh_shape") is not None:
            d["mesh_shape"] = tuple(d["mesh_shape"])
        return cls(**d)


def actor_dir(root: str | Path, step: int = 1) -> Path:
    return Path(root) / f"global_step_{step}" / "actor"


def zip_member_data(path: str | Path, suffix: str | None = None) -> tuple[int, int]:
    """(file offset, size) of the data of the zip member of ``path`` whose name ends in
    ``suffix``, or of its largest tensor storage (``.../data/N``) without one. Found with
    ``zipfile`` and the local header, independently of shardstream's own zip reading, so tests
    can damage exact bytes of a ``.pt`` file."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
    if suffix is None:
        info = max((i for i in members if "/data/" in i.filename), key=lambda i: i.file_size)
    else:
        info = next(i for i in members if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def write_verl_checkpoint(
    root: str | Path, fx: VerlFixture, step: int = 1, *, timeout: float = 900.0
) -> Path:
    """Run ``fx.world_size`` gloo processes with real FSDP2 ``fully_shard`` on
    ``init_device_mesh("cpu", ...)``, train, and write ``root/global_step_{step}/actor`` in
    verl's layout plus ``root/reference/`` (see the module docstring). Returns the actor dir."""
    return write_verl_checkpoints([(root, fx, step)], timeout=timeout)[0]


def write_verl_checkpoints(
    jobs: Sequence[tuple[str | Path, VerlFixture, int]], *, timeout: float = 900.0
) -> list[Path]:
    """Several checkpoints from a single launcher process, which imports torch and
    transformers once and forks the ranks of each world size from there (interpreter
    start-up dominates for tiny models). Jobs sharing a root must use different steps."""
    by_ws: dict[int, list[tuple[Path, VerlFixture, int]]] = {}
    for root, fx, step in jobs:
        by_ws.setdefault(fx.world_size, []).append((Path(root).resolve(), fx, step))
    _launch(by_ws, timeout)
    return [actor_dir(Path(root).resolve(), step) for root, _, step in jobs]


# --------------------------------------------------------------------------- launcher
#
# pytest / CLI process --subprocess--> launcher (fresh interpreter: imports once)
#                                         --os.fork--> rank 0..W-1 of each world size
# The launcher is a clean interpreter, so nothing of the caller (pytest, threads) is
# forked; OMP_NUM_THREADS=1 keeps torch's thread pool fork-safe.

_LAUNCHER_CODE = "from shardstream.testing.verl_checkpoint import _launcher_main; _launcher_main()"


def _launch(by_ws: dict[int, list[tuple[Path, VerlFixture, int]]], timeout: float) -> None:
    with tempfile.TemporaryDirectory(prefix="shardstream-verl-") as tmp:
        tmp_path = Path(tmp)
        spec = {
            "tmp": str(tmp_path),
            "timeout": timeout,
            "groups": [
                {
                    "world_size": ws,
                    "jobs": [
                        {"root": str(r), "fixture": fx.to_json(), "step": s} for r, fx, s in jobs
                    ],
                }
                for ws, jobs in by_ws.items()
            ],
        }
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SRC_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env.update(
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TRANSFORMERS_VERBOSITY="error",
            PYTHONWARNINGS="ignore",
        )
        log_path = tmp_path / "launcher.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER_CODE, str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # the launcher and its forked ranks, killable as one
            )
        try:
            # the launcher enforces `timeout` per world size itself; this is the backstop
            rc = proc.wait(timeout=timeout * len(by_ws) + 120)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                _kill_session(proc)
        if os.environ.get("SHARDSTREAM_FIXTURE_VERBOSE"):
            print(_tail(log_path, 50000), file=sys.stderr)
        if rc != 0:
            what = "timed out" if rc is None else f"failed (exit {rc})"
            raise RuntimeError(f"verl fixture generation {what}:\n{_tail(log_path, 12000)}")


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        proc.kill()
    proc.wait()


def _tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "<no log>"


def _launcher_main() -> None:
    """The launcher: import the heavy modules once, then fork each world size's ranks."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    _prewarm(spec)
    tmp = Path(spec["tmp"])
    for gi, group in enumerate(spec["groups"]):
        ws = int(group["world_size"])
        logs = [tmp / f"g{gi}_rank{r}.log" for r in range(ws)]
        init_file = tmp / f"g{gi}_pg_store"
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for r in range(ws):
            pid = os.fork()
            if pid == 0:  # rank process
                code = 1
                try:
                    fd = os.open(logs[r], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    _rank_run(group["jobs"], init_file, r, ws)
                    code = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        _wait_ranks(pids, logs, float(spec["timeout"]), ws)
        if os.environ.get("SHARDSTREAM_FIXTURE_VERBOSE"):
            for r, log in enumerate(logs):
                print(f"--- world size {ws}, rank {r}\n{_tail(log, 20000)}", flush=True)


def _prewarm(spec: dict) -> None:
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    archs = {j["fixture"]["arch"] for g in spec["groups"] for j in g["jobs"]}
    if archs - {"plain"}:
        import tokenizers  # noqa: F401
        import transformers

        from . import tiny_models as tm

        for arch in archs - {"plain"}:
            getattr(transformers, tm.ARCHITECTURES[arch])  # import the modeling module


def _wait_ranks(pids: list[int], logs: list[Path], timeout: float, ws: int) -> None:
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * len(pids)
    try:
        while True:
            for i, pid in enumerate(pids):
                if codes[i] is None:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[i] = os.waitstatus_to_exitcode(status)
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                print(f"world size {ws}: rank {r} exited with {codes[r]}:\n{_tail(logs[r])}")
                sys.exit(1)
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                for i, pid in enumerate(pids):  # ask for stacks (faulthandler), then report
                    if codes[i] is None:
                        os.kill(pid, signal.SIGUSR1)
                time.sleep(1.0)
                print(f"world size {ws}: timed out after {timeout:.0f}s")
                for r, log in enumerate(logs):
                    print(f"--- rank {r}\n{_tail(log, 3000)}")
                sys.exit(2)
            time.sleep(0.02)
    finally:
        for i, pid in enumerate(pids):
            if codes[i] is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except ProcessLookupError:
                    pass


_T0 = time.monotonic()


def _log(rank: int, msg: str) -> None:
    """Progress line in the rank's log (printed on failure, or always with
    SHARDSTREAM_FIXTURE_VERBOSE=1)."""
    print(f"[rank {rank} +{time.monotonic() - _T0:7.2f}s] {msg}", file=sys.stderr, flush=True)


def _rank_run(jobs: list[dict], init_file: Path, rank: int, world_size: int) -> None:
    """One rank: join the gloo group and run every job of this world size."""
    global _T0
    import faulthandler

    import torch.distributed as dist

    _T0 = time.monotonic()
    faulthandler.enable(all_threads=True)  # a native crash leaves its stacks in the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        for job in jobs:
            fx = VerlFixture.from_json(job["fixture"])
            _run_job(Path(job["root"]), fx, int(job["step"]), rank, world_size)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _build(fx: VerlFixture, real: bool):
    """(model, hf_config or None). Real weights when ``real``; shapes only (meta) otherwise."""
    from . import tiny_models as tm

    ctx = torch.device("cpu") if real else torch.device("meta")
    torch.manual_seed(fx.seed)
    if fx.arch == "plain":
        with ctx:
            return tm.PlainModule(), None
    config = tm.tiny_config(
        fx.arch, tie_word_embeddings=fx.tie_word_embeddings, overrides=fx.config_overrides
    )
    with ctx:
        model = tm.build_tiny_model(config, seed=None)
        if fx.lora:
            model = tm.add_lora(model, r=fx.lora_rank, lora_alpha=fx.lora_alpha)
    return model, config


def _wrap_targets(model, fx: VerlFixture) -> list:
    """Sub-modules verl's ``apply_fsdp2`` wraps before the root (``_select_fsdp2_wrap_targets``):
    decoder layers (``_no_split_modules``), and embed_tokens / lm_head unless tied."""
    from torch import nn

    if fx.arch == "plain":
        return []
    inner = model.get_base_model() if fx.lora else model
    layer_classes = set(getattr(inner, "_no_split_modules", None) or ())
    tie = fx.tie_word_embeddings
    by_name = set() if tie else {"embed_tokens", "lm_head"}
    out = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if (
            type(module).__name__ in layer_classes
            or (isinstance(module, nn.Embedding) and not tie)
            or (leaf in by_name and hasattr(module, "weight"))
        ):
            out.append(module)
    return out


def _placement_fn(fsdp_size: int):
    from torch.distributed.tensor import Shard

    def fn(param):
        if param.ndim == 2 and param.shape[1] % fsdp_size == 0:
            return Shard(1)
        return None  # FSDP2 default, Shard(0)

    return fn


def _batch(fx: VerlFixture, vocab: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(fx.seed * 7919 + step * 131 + rank)
    return torch.randint(4, vocab, (2, 16), generator=g)


def _reference_input(fx: VerlFixture, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(fx.seed + 424242)
    return torch.randint(4, vocab, (2, 9), generator=g)


def _vocab(fx: VerlFixture, config) -> int:
    from .tiny_models import PlainModule

    return PlainModule.VOCAB if config is None else config.vocab_size


def _loss(model, fx: VerlFixture, ids: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    if fx.arch == "plain":
        out = model(ids)
        g = torch.Generator().manual_seed(fx.seed * 31 + step * 7 + rank)
        target = torch.randn(out.shape, generator=g)
        return torch.nn.functional.mse_loss(out.float(), target)
    return model(input_ids=ids, labels=ids).loss


def _rng_state() -> dict[str, Any]:
    """What verl's ``BaseCheckpointManager.get_rng_state`` stores on a CPU-only run
    (on GPU it adds a "cuda" entry)."""
    import numpy as np

    return {
        "cpu": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "random": random.getstate(),
    }


def _run_job(root: Path, fx: VerlFixture, step: int, rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _log(rank, f"job {root.name} step {step}: {fx}")
    random.seed(fx.seed)
    mesh = init_device_mesh("cpu", fx.mesh, mesh_dim_names=fx.mesh_dim_names)

    # verl: real weights on rank 0, empty (meta) elsewhere, then broadcast after sharding.
    model, config = _build(fx, real=(rank == 0))
    full_state = model.state_dict() if rank == 0 else {}
    _log(rank, "built")

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
    if fx.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
        )
    if fx.shard_dim == 1:
        kwargs["shard_placement_fn"] = _placement_fn(fx.fsdp_size)
    ignored_names = tuple(getattr(model, "IGNORED_PARAMS", ()))
    ignored = {getattr(model, n) for n in ignored_names}
    for module in _wrap_targets(model, fx):
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs, ignored_params=ignored or None)

    if rank != 0:
        model.to_empty(device="cpu")  # meta -> cpu creates new Parameter objects
        ignored = {getattr(model, n) for n in ignored_names}
    set_model_state_dict(
        model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full_state
    for _, buf in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        dist.broadcast(buf, src=0)
    for p in ignored:  # not covered by FSDP: replicate explicitly
        dist.broadcast(p.data, src=0)

    _log(rank, "sharded and loaded")

    # Train (verl: AdamW over module.parameters(), LambdaLR warmup schedule).
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=fx.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    warmup = 2

    def lr_lambda(current_step: int) -> float:
        return min(1.0, (current_step + 1) / warmup)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    vocab = _vocab(fx, config)
    model.train()
    for s in range(fx.train_steps):
        loss = _loss(model, fx, _batch(fx, vocab, s, rank), s, rank)
        loss.backward()
        for p in ignored:  # FSDP does not reduce ignored params; keep them replicated
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    _log(rank, f"trained {fx.train_steps} step(s)")

    # ---- save, as FSDPCheckpointManager.save_checkpoint does
    actor = actor_dir(root, step)
    if rank == 0:
        actor.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = model.state_dict()
    save_rank_files(
        actor,
        rank,
        world_size,
        state,
        optimizer.state_dict() if fx.write_optimizer else None,
        {"lr_scheduler": scheduler.state_dict(), "rng": _rng_state()},
    )
    if rank == 0:
        _write_rank0_files(root, actor, fx, step, world_size, config)

    _log(rank, "saved shards")
    full = _gather_full(state, rank) if (fx.write_reference or _wants_adapter(fx)) else None
    if rank == 0 and full is not None:
        if _wants_adapter(fx):
            _write_lora_adapter_dir(actor / "lora_adapter", fx, full)
        if fx.write_reference:
            _write_reference(root / "reference", fx, config, full, world_size)
    _log(rank, "reference written")
    dist.barrier()


def save_rank_files(
    actor: Path,
    rank: int,
    world_size: int,
    model_state: dict,
    optim_state: dict | None = None,
    extra_state: dict | None = None,
) -> None:
    """One rank's files as ``FSDPCheckpointManager.save_checkpoint`` writes them:
    ``model_``, ``optim_`` (when given) and ``extra_state_world_size_W_rank_R.pt`` (default:
    no scheduler, no RNG)."""
    tag = f"world_size_{world_size}_rank_{rank}"
    torch.save(model_state, actor / f"model_{tag}.pt")
    if optim_state is not None:
        torch.save(optim_state, actor / f"optim_{tag}.pt")
    extra = {"lr_scheduler": None, "rng": {}} if extra_state is None else extra_state
    torch.save(extra, actor / f"extra_state_{tag}.pt")


def write_fsdp_config(actor: Path, world_size: int) -> None:
    """verl's ``fsdp_config.json`` (rank 0 writes it)."""
    with open(actor / "fsdp_config.json", "w") as f:
        json.dump({"FSDP_version": 2, "world_size": world_size}, f, indent=4)


def _wants_adapter(fx: VerlFixture) -> bool:
    return fx.lora and fx.lora_layout in ("adapter", "both")


def _gather_full(state: dict, rank: int) -> dict[str, torch.Tensor] | None:
    """Unsharded copy of ``state`` on rank 0 (every rank joins each collective)."""
    from torch.distributed.tensor import DTensor

    full: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        t = value.full_tensor() if isinstance(value, DTensor) else value
        if rank == 0:
            full[key] = t.detach().clone()
        del t
    return full if rank == 0 else None


def _write_rank0_files(
    root: Path, actor: Path, fx: VerlFixture, step: int, world_size: int, config
) -> None:
    from . import tiny_models as tm

    if config is not None:
        hf_dir = actor / "huggingface" if fx.hf_in_subdir else actor
        tm.write_hf_files(hf_dir, config, config_dtype=fx.config_dtype)
    if fx.write_fsdp_config:
        write_fsdp_config(actor, world_size)
    if fx.lora and fx.lora_layout in ("meta", "both"):
        meta = {"r": fx.lora_rank, "lora_alpha": fx.lora_alpha, "task_type": "CAUSAL_LM"}
        with open(actor / "lora_train_meta.json", "w", encoding="utf-8") as f:
            json.dump(meta, f, ensure_ascii=False, indent=4)
    step_dir = actor.parent
    torch.save(
        {"_num_yielded": fx.train_steps, "_sampler_iter_yielded": fx.train_steps},
        step_dir / "data.pt",
    )
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def _write_lora_adapter_dir(out: Path, fx: VerlFixture, full: dict[str, torch.Tensor]) -> None:
    """verl 0.4.1-0.7 (``ActorRolloutRefWorker.save_checkpoint``): PEFT's saved-adapter
    naming, full (gathered) tensors, adapter_config.json from ``asdict(LoraConfig)``."""
    from safetensors.torch import save_file

    from . import tiny_models as tm

    out.mkdir(parents=True, exist_ok=True)
    adapter = {k: v.contiguous() for k, v in tm.peft_adapter_state_dict(full).items()}
    save_file(adapter, out / "adapter_model.safetensors")
    cfg = tm.adapter_config(fx.lora_rank, fx.lora_alpha, sorted(tm.LORA_TARGETS))
    with open(out / "adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=4)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    # clone: tied entries share storage, which safetensors refuses
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, path)


def _write_reference(out: Path, fx: VerlFixture, config, full: dict, world_size: int) -> None:
    from . import tiny_models as tm

    out.mkdir(parents=True, exist_ok=True)
    full = {k: (v.float() if v.is_floating_point() else v) for k, v in full.items()}
    vocab = _vocab(fx, config)
    ids = _reference_input(fx, vocab)
    logits: dict[str, torch.Tensor] = {"input_ids": ids}
    info: dict[str, Any] = {"fixture": fx.to_json(), "world_size": world_size}

    def run(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        if fx.arch == "plain":
            m = tm.PlainModule()
        else:
            m = tm.build_tiny_model(config, seed=None)
        m.load_state_dict(weights, strict=True)
        m.eval()
        with torch.no_grad():
            out = m(ids) if fx.arch == "plain" else m(input_ids=ids).logits
        return out.float()

    if fx.lora:
        base = tm.base_state_dict(full)
        fused = tm.fuse_lora_state_dict(full, fx.lora_rank, fx.lora_alpha)
        _save_tensors(out / "model.safetensors", base)
        _save_tensors(out / "fused.safetensors", fused)
        _save_tensors(out / "adapter_model.safetensors", tm.peft_adapter_state_dict(full))
        logits["logits"] = run(fused)
        logits["base_logits"] = run(base)
        info["lora_scaling"] = fx.lora_alpha / fx.lora_rank
        info["lora_keys"] = sorted(k for k in full if tm.is_lora_key(k))
    else:
        _save_tensors(out / "model.safetensors", full)
        logits["logits"] = run(full)
    _save_tensors(out / "logits.safetensors", logits)
    info["checkpoint_keys"] = sorted(full)
    info["shapes"] = {k: list(v.shape) for k, v in full.items()}
    (out / "fixture.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- CLI


def _parse_mesh(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.lower().split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected RxS, e.g. 2x2, got {text!r}") from e
    return a, b


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shardstream.testing.verl_checkpoint",
        description="Write a real verl-layout FSDP2 checkpoint (gloo, CPU) for tests/benchmarks.",
    )
    p.add_argument("out", type=Path, help="checkpoint root (global_step_N/actor is created in it)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--hsdp",
        type=_parse_mesh,
        default=None,
        metavar="RxS",
        help="HSDP mesh (replicas x shards), e.g. 2x2; product must equal --world-size",
    )
    p.add_argument("--shard-dim", type=int, choices=(0, 1), default=0)
    p.add_argument("--arch", choices=ARCHS, default="qwen2")
    p.add_argument("--tie", action="store_true", help="tie_word_embeddings")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--lora-rank", type=int, default=3)
    p.add_argument("--lora-alpha", type=int, default=6)
    p.add_argument("--lora-layout", choices=LORA_LAYOUTS, default="meta")
    p.add_argument("--steps", type=int, default=1, help="AdamW steps (0: save the random init)")
    p.add_argument("--step", type=int, default=1, help="N in global_step_N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--overrides",
        type=json.loads,
        default=None,
        help='config overrides as JSON, e.g. \'{"hidden_size": 2048, '
        '"intermediate_size": 5632, "num_hidden_layers": 16, '
        '"num_attention_heads": 16, "num_key_value_heads": 8, '
        '"vocab_size": 32000}\' (~1B params)',
    )
    p.add_argument("--config-dtype", default="bfloat16")
    p.add_argument("--no-optimizer", action="store_true")
    p.add_argument("--no-fsdp-config", action="store_true")
    p.add_argument(
        "--old-layout",
        action="store_true",
        help="config/tokenizer in actor/ itself and no fsdp_config.json (verl < 0.4.1)",
    )
    p.add_argument("--no-mixed-precision", action="store_true")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0)
    a = p.parse_args(argv)
    fx = VerlFixture(
        world_size=a.world_size,
        mesh_shape=a.hsdp,
        shard_dim=a.shard_dim,
        arch=a.arch,
        tie_word_embeddings=a.tie,
        lora=a.lora,
        lora_rank=a.lora_rank,
        lora_alpha=a.lora_alpha,
        lora_layout=a.lora_layout,
        train_steps=a.steps,
        seed=a.seed,
        config_overrides=a.overrides,
        write_optimizer=not a.no_optimizer,
        write_fsdp_config=not (a.no_fsdp_config or a.old_layout),
        hf_in_subdir=not a.old_layout,
        config_dtype=a.config_dtype,
        mixed_precision=not a.no_mixed_precision,
        write_reference=not a.no_reference,
    )
    t0 = time.monotonic()
    out = write_verl_checkpoint(a.out, fx, step=a.step, timeout=a.timeout)
    print(f"{out}  ({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
