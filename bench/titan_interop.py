"""shardstream on checkpoints written by torchtitan 0.3.0's own ``CheckpointManager``.

The tests build torchtitan-like models and train states by hand; this script checks the real
thing, in the project venv (``make interop`` installs torchtitan 0.3.0 with ``--no-deps``, and
the few modules its imports need):

1. **save** (2 ranks over gloo, ``shardstream.testing.distributed``): torchtitan's components
   built as its ``Trainer.__init__`` builds them, on CPU: a tiny Llama 3 from
   ``Llama3Model.Config`` (fused QKV, torchtitan's default, with its
   ``ScaledDotProductAttention``), built on the meta device, FSDP2 through ``parallelize_llama``
   on a CPU mesh from ``ParallelDims``, ``init_weights``; its ``OptimizersContainer`` (AdamW),
   ``LRSchedulersContainer`` (warm-up, linear decay), ``HuggingFaceTextDataLoader`` (a local
   text dataset and a small tokenizer.json) and its train state (the ``Trainer``'s own
   ``state_dict`` / ``load_state_dict``: step and ntokens_seen). Two training steps, then
   ``CheckpointManager.save`` writes ``checkpoint/step-2``. Every rank also writes the full
   parameters, optimizer state, scheduler, train state and its dataloader state and next batch
   as the reference.
2. **CLI**: ``shardstream inspect --json`` and ``shardstream verify`` of ``step-2``.
3. **restore** at 1 and 4 processes (another world size: every tensor resharded) and at 2
   (for the dataloader, which torchtitan does not reshard): fresh, differently seeded
   components, ``shardstream.load`` / ``CheckpointManager.restore(path=...)``, then every
   parameter, optimizer entry, param-group value, scheduler field and train-state field is
   compared with the reference bit for bit.

torchtitan 0.3.0 imports ``triton`` (its fused kernels) without declaring it, and its trainer
needs CUDA. The worker processes put an inert ``triton`` stub module in ``sys.modules`` (only
there, and only when no triton is installed; torch's own checks for triton run first and see
none); no kernel of it ever runs.

Writes ``bench/results/titan_interop.json`` and its section of ``docs/interop.md``; exits
non-zero on any mismatch.

    .venv/bin/python bench/titan_interop.py            # about 2 minutes on 2 cores
    .venv/bin/python bench/titan_interop.py --render   # re-render the docs section only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from harness import REPO, RESULTS
from harness.machine import git_revision
from harness.render import generated_note, table, write_section

DOC = REPO / "docs" / "interop.md"
SECTION = "torchtitan"
OUT_JSON = RESULTS / "titan_interop.json"
SAVE_WORLD = 2
STEPS = 2
SEQ_LEN = 32
BATCH = 2
VOCAB = 256
# world size -> how shardstream restores there and what; the dataloader only where torchtitan
# takes it back (same data-parallel size: it asserts so and does not reshard its data).
RESTORES = [
    {"world": 1, "api": "shardstream.load", "states": ["train_state"]},
    {"world": 4, "api": "CheckpointManager.restore", "states": ["train_state"]},
    {"world": 2, "api": "shardstream.load", "states": ["train_state", "dataloader"]},
]


# ---------------------------------------------------------------- torchtitan on CPU


def stub_triton() -> bool:
    """An inert ``triton`` module for torchtitan's imports (its Triton kernels are never
    used here). torch's own probes for triton run first, so torch sees none."""
    import torch._functorch.partitioners  # noqa: F401  (imports torch's triton probes)
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()  # cached: False
    torch_triton.has_triton()
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return False

    def unusable(*args, **kwargs):
        raise RuntimeError("triton is an inert stub in this process (bench/titan_interop.py)")

    class Inert:
        def __call__(self, *args, **kwargs):
            return self

        def __getattr__(self, name):
            return self

    class Language(types.ModuleType):
        def __getattr__(self, name):  # tl.constexpr, tl.int64, tl.pointer_type(...), ...
            if name.startswith("__"):
                raise AttributeError(name)
            return Inert()

    triton = types.ModuleType("triton")
    triton.__version__ = "0.0.0+stub"
    triton.jit = lambda fn=None, **kwargs: unusable if fn is not None else (lambda f: unusable)
    triton.autotune = lambda *args, **kwargs: lambda f: unusable
    triton.heuristics = lambda *args, **kwargs: lambda f: unusable
    triton.Config = lambda *args, **kwargs: None
    triton.cdiv = lambda a, b: -(-a // b)
    triton.language = Language("triton.language")
    sys.modules["triton"] = triton
    sys.modules["triton.language"] = triton.language
    return True


def _model_config():
    """A tiny Llama 3: torchtitan's debug-model recipe (``_debugmodel``) at 64 wide, 2 layers,
    fused QKV (its default), with torchtitan's SDPA inner attention (0.3.0 names only flex and
    varlen for language models, both needing compiled kernels)."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, heads = 64, 4
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=2,
        dim=dim,
        n_heads=heads,
        n_kv_heads=2,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
        rope=ComplexRoPE.Config(
            dim=dim // heads, max_seq_len=SEQ_LEN * 2, theta=500000, scaling="llama"
        ),  # fmt: skip
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=VOCAB, param_init=llama3._output_linear_init(dim)
        ),
        layers=layers,
    )


def make_assets(root: Path) -> None:
    """A local text dataset (``train.json``) and a small byte-pair tokenizer (tokenizer.json,
    tokenizer_config.json) for torchtitan's ``HuggingFaceTextDataLoader``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = (REPO / "README.md").read_text().split()
    texts = [" ".join(words[i : i + 40]) for i in range(0, min(len(words), 4000), 40)]
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )


def _components(rank: int, world: int, seed: int, root: Path) -> dict:
    """torchtitan's components as ``Trainer.__init__`` builds them, on a CPU mesh."""
    stub_triton()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.trainer import Trainer

    parallel_dims_module.device_type = "cpu"  # its meshes are built for the accelerator
    torch.manual_seed(seed)
    # "partial_dtensor": DTensor on the model-parallel axes only, FSDP2 over "fsdp" (the
    # default "spmd_types" path wants every parameter distributed first, for TP)
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world, spmd_backend="partial_dtensor"
    )
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ_LEN, steps=10)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    model_config = _model_config()
    # what the Trainer does first (sets the sharding config); a non-trainer config may be
    # anything with a ParallelismConfig in .parallelism
    model_config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = model_config.build()
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=str(root / "dump"),
    )
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # torchtitan sets gradient_divide_factor=1.0, which FSDP
        if isinstance(module, FSDPModule):  # sends as PREMUL_SUM(1.0); gloo has only SUM
            module.set_force_sum_reduction_for_comms(True)  # (the same sum, divided by 1)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = default_adamw(lr=5e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=1, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=10)
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    dataloader = HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path=str(root / "data"), infinite=True
    ).build(
        dp_world_size=batch_mesh.size() if batch_mesh is not None else 1,
        dp_rank=batch_mesh.get_local_rank() if batch_mesh is not None else 0,
        tokenizer=HuggingFaceTokenizer(tokenizer_path=str(root / "tokenizer")),
        seq_len=SEQ_LEN,
        local_batch_size=BATCH,
        snapshot_every_n_steps=1,
    )
    # torchtitan's train state is the Trainer itself (its state_dict: step, ntokens_seen); a
    # Trainer cannot be built without CUDA, so this object carries the Trainer's own methods.
    train_state = types.SimpleNamespace(step=0, ntokens_seen=0)
    train_state.state_dict = types.MethodType(Trainer.state_dict, train_state)
    train_state.load_state_dict = types.MethodType(Trainer.load_state_dict, train_state)
    return {
        "model": model,
        "optimizers": optimizers,
        "lr_schedulers": lr_schedulers,
        "dataloader": dataloader,
        "train_state": train_state,
    }


def _snapshot(parts: dict) -> dict:
    """Everything the checkpoint should carry, gathered to full tensors (a collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    def full(value):
        if isinstance(value, DTensor):
            return value.full_tensor().clone()  # at one rank it may share the storage
        return value.clone() if isinstance(value, torch.Tensor) else value

    model = parts["model"]
    params = {name: full(p.detach()) for name, p in model.named_parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    optim_state, groups = {}, []
    for optimizer in parts["optimizers"].optimizers:
        for param, state in optimizer.state.items():
            optim_state[names[id(param)]] = {k: full(v) for k, v in sorted(state.items())}
        for group in optimizer.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
    return {
        "params": params,
        "optimizer": optim_state,
        "param_groups": groups,
        "lr_scheduler": {
            "container": parts["lr_schedulers"].state_dict(),
            "schedulers": [
                {k: v for k, v in s.state_dict().items() if k != "lr_lambdas"}
                for s in parts["lr_schedulers"].schedulers
            ],
        },
        "train_state": dict(parts["train_state"].state_dict()),
    }


def _dataloader_snapshot(dataloader) -> dict:
    """The dataloader's state and the batch it yields next (iterating a copy of its state)."""
    state = dataloader.state_dict()
    batch, labels = next(iter(dataloader))
    dataloader.load_state_dict(state)
    return {"state": state, "next_input": batch["input"], "next_labels": labels}


def _train(parts: dict, steps: int) -> None:
    import torch.nn.functional as F

    model, optimizers = parts["model"], parts["optimizers"]
    data = iter(parts["dataloader"])
    for _ in range(steps):
        input_dict, labels = next(data)
        logits = model(input_dict["input"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizers.step()
        parts["lr_schedulers"].step()
        optimizers.zero_grad()
        parts["train_state"].step += 1
        parts["train_state"].ntokens_seen += labels.numel()


def save_run(rank: int, world: int, root: str) -> dict:
    """torchtitan trains two steps and its CheckpointManager saves step-2; the reference."""
    import torch
    from torchtitan.components.checkpoint import CheckpointManager

    root = Path(root)
    parts = _components(rank, world, 0, root)
    _train(parts, STEPS)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1,
                                      keep_latest_k=0, async_mode="disabled")  # fmt: skip
    checkpointer = CheckpointManager(
        config,
        dataloader=parts["dataloader"],
        model_parts=[parts["model"]],
        optimizers=parts["optimizers"],
        lr_schedulers=parts["lr_schedulers"],
        states={"train_state": parts["train_state"]},
        sd_adapter=None,
        base_folder=str(root),
    )
    t0 = time.perf_counter()
    saved = checkpointer.save(curr_step=parts["train_state"].step)
    seconds = time.perf_counter() - t0
    checkpointer.close()
    snapshot = _snapshot(parts)
    reference = root / "reference"
    reference.mkdir(exist_ok=True)
    torch.save(_dataloader_snapshot(parts["dataloader"]), reference / f"dataloader-{rank}.pt")
    model_keys = sorted(parts["model"].state_dict())  # the fused-QKV hook splits DTensors:
    if rank != 0:  # every rank takes part
        return {}
    torch.save(snapshot, reference / "state.pt")
    placements: dict[str, int] = {}
    for param in parts["model"].parameters():
        key = str(tuple(param.placements))
        placements[key] = placements.get(key, 0) + 1
    return {
        "saved": bool(saved),
        "seconds": round(seconds, 2),
        "placements": placements,
        "model_keys": model_keys,
        "params": {n: list(p.shape) for n, p in snapshot["params"].items()},
        "train_state": snapshot["train_state"],
        "lr_scheduler": snapshot["lr_scheduler"]["container"],
    }


# ---------------------------------------------------------------- restore


def _diff(got, want, where: str, out: list[str]) -> int:
    """Compare nested values bit for bit (tensors: dtype, shape, bytes); count the leaves."""
    import torch

    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            out.append(f"{where}: keys {sorted(map(str, got)) if isinstance(got, dict) else got}")
            return 0
        return sum(_diff(got[k], want[k], f"{where}.{k}", out) for k in want)
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            out.append(f"{where}: {got!r} != {want!r}")
            return 0
        return sum(_diff(g, w, f"{where}[{i}]", out) for i, (g, w) in enumerate(zip(got, want)))
    if isinstance(want, torch.Tensor):
        same = (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got.view(torch.uint8) if got.dim() else got, want.view(torch.uint8)
                            if want.dim() else want)
        )  # fmt: skip
        if not same:
            out.append(f"{where}: tensor differs")
        return 1
    if type(got) is not type(want) or got != want:
        out.append(f"{where}: {got!r} != {want!r}")
    return 1


def restore_run(rank: int, world: int, root: str, api: str, states: list[str]) -> dict:
    """Fresh components (another seed, another world size); shardstream restores step-2."""
    import torch

    import shardstream
    from shardstream import CheckpointConfig, CheckpointManager

    root = Path(root)
    parts = _components(rank, world, 1234 + world, root)
    path = root / "checkpoint" / f"step-{STEPS}"
    stateful = {name: parts[name] for name in states}
    before = _snapshot(parts)
    t0 = time.perf_counter()
    optimizer = parts["optimizers"].optimizers[0]
    if api == "CheckpointManager.restore":
        cfg = CheckpointConfig(directory=str(root / f"shardstream-ws{world}"))
        manager = CheckpointManager(cfg, model=parts["model"], optimizer=optimizer,
                                    lr_scheduler=parts["lr_schedulers"])  # fmt: skip
        restored = manager.restore(path=str(path), states=stateful)  # (step, extra)
        restored = restored[0] if isinstance(restored, tuple) else restored
        manager.close()
    else:
        result = shardstream.load(path, model=parts["model"], optimizer=optimizer,
                                  lr_scheduler=parts["lr_schedulers"], states=stateful)  # fmt: skip
        restored = result.step
    seconds = time.perf_counter() - t0
    after = _snapshot(parts)
    mismatches: list[str] = []
    counts = {}
    if "dataloader" in states:
        want = torch.load(root / "reference" / f"dataloader-{rank}.pt", weights_only=True)
        got = _dataloader_snapshot(parts["dataloader"])
        counts["dataloader"] = _diff(got, want, f"rank {rank} dataloader", mismatches)
    if rank != 0:
        return {"mismatches": mismatches}
    want = torch.load(root / "reference" / "state.pt", weights_only=True)
    for part in ("params", "optimizer", "param_groups", "lr_scheduler", "train_state"):
        counts[part] = _diff(after[part], want[part], part, mismatches)
    changed = sum(
        not torch.equal(before["params"][n], after["params"][n]) for n in before["params"]
    )
    return {
        "restored_step": restored,
        "counts": counts,
        "params_changed": changed,
        "train_state": after["train_state"],
        "lr_scheduler": after["lr_scheduler"]["container"],
        "mismatches": mismatches,
        "seconds": round(seconds, 2),
    }


def refused_run(rank: int, world: int, root: str) -> dict:
    """The dataloader at another data-parallel size: torchtitan asserts the size, so the
    restore must be refused, naming it, before any tensor is written."""
    import torch

    import shardstream

    root = Path(root)
    parts = _components(rank, world, 99, root)
    before = _snapshot(parts)
    try:
        shardstream.load(
            root / "checkpoint" / f"step-{STEPS}",
            model=parts["model"],
            optimizer=parts["optimizers"].optimizers[0],
            lr_scheduler=parts["lr_schedulers"],
            states={"train_state": parts["train_state"], "dataloader": parts["dataloader"]},
        )
        said = "restored without an error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        said = f"{type(exc).__name__}: {exc}"
    after = _snapshot(parts)
    untouched = all(torch.equal(before["params"][n], after["params"][n]) for n in before["params"])
    untouched = untouched and before["train_state"] == after["train_state"]
    untouched = untouched and before["lr_scheduler"] == after["lr_scheduler"]
    return {"said": said.replace(str(root) + "/", ""), "untouched": untouched}


# ---------------------------------------------------------------- CLI checks


def cli_checks(path: Path) -> list[dict]:
    checks = []
    inspect = subprocess.run(
        [sys.executable, "-m", "shardstream", "inspect", "--json", str(path)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    step = None
    try:
        step = json.loads(inspect.stdout).get("step")
    except (json.JSONDecodeError, AttributeError):
        pass
    checks.append({
        "check": "shardstream inspect --json reads it",
        "ok": inspect.returncode == 0 and step == STEPS,
        "detail": f"exit {inspect.returncode}, step {step}" + (
            f": {inspect.stderr.strip().splitlines()[-1]}" if inspect.returncode else ""),
    })  # fmt: skip
    verify = subprocess.run(
        [sys.executable, "-m", "shardstream", "verify", str(path)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    last = (verify.stdout.strip() or verify.stderr.strip()).splitlines()
    checks.append({
        "check": "shardstream verify checks it",
        "ok": verify.returncode == 0,
        "detail": f"exit {verify.returncode}: {last[-1] if last else ''}".replace(
            str(path.parent.parent) + "/", ""),
    })  # fmt: skip
    return checks


# ---------------------------------------------------------------- driver and report


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torchtitan", "torch", "torchdata", "datasets", "tokenizers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_all(work: Path) -> dict:
    import shutil

    from shardstream.testing.distributed import run

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    make_assets(work)
    results: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_revision(),
        "versions": _versions(),
        "save_world": SAVE_WORLD,
    }
    print(f"torchtitan saves at {SAVE_WORLD} ranks ...", flush=True)
    t0 = time.perf_counter()
    results["save"] = run(save_run, SAVE_WORLD, str(work), timeout=900)[0]
    results["save"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    ckpt = work / "checkpoint" / f"step-{STEPS}"
    results["files"] = sorted(p.name for p in ckpt.iterdir())
    print("shardstream inspect / verify ...", flush=True)
    results["cli"] = cli_checks(ckpt)
    results["restores"] = []
    for spec in RESTORES:
        print(f"shardstream restores at {spec['world']} ({spec['api']}) ...", flush=True)
        try:
            out = run(restore_run, spec["world"], str(work), spec["api"], spec["states"],
                      timeout=900)[0]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            out = {"mismatches": [f"{type(exc).__name__}: {str(exc)[-600:]}"]}
        results["restores"].append({**spec, **out})
    print("dataloader at another data-parallel size (must be refused) ...", flush=True)
    results["refused"] = run(refused_run, 4, str(work), timeout=900)[0]
    return results


def failures(results: dict) -> list[str]:
    bad = [f"{c['check']}: {c['detail']}" for c in results["cli"] if not c["ok"]]
    if not results["save"].get("saved"):
        bad.append("torchtitan's CheckpointManager did not save")
    for r in results["restores"]:
        if r.get("mismatches") or r.get("restored_step") != STEPS:
            bad.append(f"restore at {r['world']}: step {r.get('restored_step')}, "
                       f"{r.get('mismatches', [])[:5]}")  # fmt: skip
    refused = results["refused"]
    if not (refused["untouched"] and "dataloader" in refused["said"]
            and "nothing was restored" in refused["said"]):  # fmt: skip
        bad.append(f"dataloader at 4 ranks: {refused}")
    return bad


def _count_text(counts: dict) -> str:
    names = {
        "params": "parameters",
        "optimizer": "optimizer entries",
        "param_groups": "param-group values",
        "lr_scheduler": "scheduler fields",
        "train_state": "train-state fields",
        "dataloader": "dataloader values (state and next batch, this rank)",
    }
    return ", ".join(f"{n} {names[k]}" for k, n in counts.items())


def render(results: dict) -> str:
    v, save = results["versions"], results["save"]
    lines = [
        "## Interop with torchtitan 0.3.0's own checkpoint manager",
        "",
        generated_note("bench/titan_interop.py", "bench/results/titan_interop.json"),
        "",
        "Checkpoints saved by torchtitan's `CheckpointManager.save` (the DCP train state its "
        "trainer writes), restored by shardstream into torchtitan's own objects at other world "
        "sizes. Reproduce with `make interop` (`bench/titan_interop.py`).",
        "",
        f"- **Run:** {results['started']}, shardstream @ {results['commit']}; torchtitan "
        f"{v.get('torchtitan')}, torch {v.get('torch')}, torchdata {v.get('torchdata')}, "
        f"datasets {v.get('datasets')}",
        "- **How torchtitan trains:** its components built as `Trainer.__init__` builds them, "
        f"on {results['save_world']} CPU ranks over gloo: a tiny Llama 3 "
        "(`Llama3Model.Config`, fused QKV as in its default models, torchtitan's "
        "`ScaledDotProductAttention`) on the meta device, FSDP2 through `parallelize_llama` "
        "with a CPU mesh from `ParallelDims`, `init_weights`; `OptimizersContainer` (AdamW, "
        "`default_adamw`), `LRSchedulersContainer` (warm-up, linear decay), "
        "`HuggingFaceTextDataLoader` over a local text file and a small BPE tokenizer.json, "
        "the train state through the `Trainer`'s own `state_dict`/`load_state_dict` (step, "
        f"ntokens_seen). {STEPS} steps, then `CheckpointManager.save` writes "
        f"`checkpoint/step-{STEPS}` ({save.get('seconds')} s).",
        "- **Placements torchtitan wrote:** "
        + ", ".join(f"{n}× {p}" for p, n in sorted(save.get("placements", {}).items())),
        f"- **Saved train state:** `train_state` {save.get('train_state')}, `lr_scheduler` "
        f"{save.get('lr_scheduler')}; the model's keys are the hook-presented ones "
        "(`attention.qkv_linear.wq/wk/wv.weight`), its parameter is the fused `wqkv`.",
        "",
    ]
    rows = []
    for r in results["restores"]:
        verdict = (
            "all equal: " + _count_text(r.get("counts", {}))
            if not r.get("mismatches") and r.get("restored_step") == STEPS
            else f"**{len(r.get('mismatches', []))} differ**"
        )
        rows.append((r["world"], f"`{r['api']}`", ", ".join(r["states"]) + " (states=)",
                     r.get("restored_step"), verdict, r.get("seconds", "–")))  # fmt: skip
    lines += table(
        "restore at | API | also restored | step returned | compared bit for bit | s",
        "rllrlr",
        rows,
    )
    lines += ["", "**Every check**", ""]
    lines.append(f"- {'pass' if save.get('saved') else '**FAIL**'}: torchtitan's "
                 f"`CheckpointManager.save` writes `step-{STEPS}` "
                 f"({', '.join(results.get('files', []))})")  # fmt: skip
    for c in results["cli"]:
        lines.append(f"- {'pass' if c['ok'] else '**FAIL**'}: {c['check']} ({c['detail']})")
    for r in results["restores"]:
        ok = not r.get("mismatches") and r.get("restored_step") == STEPS
        lines.append(
            f"- {'pass' if ok else '**FAIL**'}: restore at {r['world']} process"
            f"{'es' if r['world'] > 1 else ''} with `{r['api']}`: "
            f"{_count_text(r.get('counts', {}))} bit for bit; train state "
            f"{r.get('train_state')}, scheduler {r.get('lr_scheduler')}; the restore changed "
            f"{r.get('params_changed')} of the fresh model's parameters ({r.get('seconds')} s)"
            + (f"; differ: {', '.join(r['mismatches'][:5])}" if r.get("mismatches") else "")
        )
    refused = results["refused"]
    ok = refused["untouched"] and "dataloader" in refused["said"]
    lines.append(
        f"- {'pass' if ok else '**FAIL**'}: the dataloader at 4 processes is refused before "
        f"anything is touched (parameters, scheduler and train state unchanged: "
        f"{refused['untouched']}): `{refused['said'].strip()[-400:]}`"
    )
    lines += [
        "",
        "**What this covers and what it does not**",
        "",
        "- torchtitan 0.3.0 imports `triton` (for its fused kernels) without declaring it; the "
        "script's worker processes put an inert `triton` stub module in `sys.modules` (after "
        "torch's own probes found none), which no code path here calls. Its trainer needs "
        "CUDA, so the components are built as `Trainer.__init__` builds them, not by "
        "`Trainer` itself. 0.3.0 no longer lets language models use SDPA "
        "(`get_attention_config` names flex and varlen only), so the layers' inner attention "
        "is set to its `ScaledDotProductAttention` config; the parameters are the same.",
        "- The fused QKV: torchtitan 0.3.0's `FusedQKVLinear` state-dict hook gathers `wqkv` "
        "to `Replicate`, reshapes it to (kv heads, q heads per kv + 2, head dim, dim) and "
        "copies out `wq`, `wk` and `wv`, so with grouped-query attention each presented "
        "tensor is every few rows of `wqkv`, not one slice. shardstream runs such a hook once "
        "on index tensors of the parameter's global shape (one module at a time) and describes "
        "the saved `wq`/`wk`/`wv` blocks as runs of rows of `wqkv`, which DCP's planner fills "
        "in the sharded parameter directly; no state dict is built.",
        "- On CPU ranks over gloo: the model is sharded with torchtitan's `partial_dtensor` "
        "SPMD backend (its default, `spmd_types`, wants every parameter distributed for tensor "
        "parallelism first), and each FSDP module gets `set_force_sum_reduction_for_comms` "
        "(torchtitan sets a gradient divide factor of 1, which FSDP sends as `PREMUL_SUM`, an "
        "op gloo lacks; a plain sum divided by 1 is the same).",
        "- The optimizer passed to shardstream is the AdamW inside torchtitan's "
        "`OptimizersContainer` (`optimizers.optimizers[0]`, the only one with one model part); "
        "the scheduler is the `LRSchedulersContainer` itself, whose state is `last_epoch`.",
        "- The dataloader: torchtitan's `ParallelAwareDataloader.load_state_dict` asserts that "
        'the data-parallel size is the one saved ("dataloader resharding is not supported '
        'yet"), so it is restored at the saving world size only; at another size shardstream '
        "refuses the restore, naming the dataloader, before any tensor is written. Its state is "
        "a `pickle.dumps` of the loader's state per rank, which torchtitan's own "
        "`load_state_dict` unpickles.",
        "- torchtitan 0.3.0's train state is `{step, ntokens_seen}`. Earlier torchtitan "
        "`TrainState`s kept the step as a tensor and loss histories as `torch.save`d "
        "`BytesIO`; shardstream restores those too (`tests/integration/"
        "test_titan_train_state.py`): each BytesIO's bytes are read from the `.distcp` file "
        "and checked by the restricted loader (weights-only types; code is refused, naming "
        "the file and key) before an `io.BytesIO` of them goes to `load_state_dict`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=RESULTS / "titan_interop")
    parser.add_argument("--render", action="store_true", help="re-render the docs section only")
    args = parser.parse_args(argv)
    if not args.render:
        results = run_all(args.work)
        OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
        OUT_JSON.write_text(json.dumps(results, indent=1, default=str))
    results = json.loads(OUT_JSON.read_text())
    write_section(DOC, SECTION, render(results))
    bad = failures(results)
    for line in bad:
        print(f"!!! {line}")
    print(f"{DOC.relative_to(REPO)}: torchtitan section: "
          f"{'all checks pass' if not bad else f'{len(bad)} failed'}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
