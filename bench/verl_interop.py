"""shardstream on checkpoints written by verl 0.9.1's own ``FSDPCheckpointManager``.

The checkpoints in the tests come from shardstream's own generator of verl's layout; this
script checks the real thing. Three stages, two environments:

1. **save** (``.bench-venv``, verl installed, torchrun ranks over gloo): a tiny
   Qwen2/Llama, Qwen3-MoE or Qwen2.5-VL from a config (random weights), sharded with verl's
   ``apply_fsdp2`` and ``get_shard_placement_fn`` (so ``Shard(1)`` occurs, as in verl), two
   AdamW steps with verl's cosine schedule, then ``FSDPCheckpointManager.save_checkpoint``.
   Rank 0 also writes the full model and optimizer state (gathered with ``full_tensor``) as
   the reference.
2. **merge** (``.venv``): verl's ``python -m verl.model_merger merge`` and
   ``python -m shardstream merge`` with the same flags; the outputs must be identical bit for
   bit in bf16, equal to the reference cast to bf16, and load with transformers.
3. **restore** (``.venv``, ranks from ``shardstream.testing.distributed``):
   ``CheckpointManager.restore(path=actor)`` into the class verl trained, sharded with plain
   ``fully_shard``, at other world sizes; the gathered model, optimizer state, schedule and
   rank 0's RNG stream must equal what verl saved, bit for bit.

Writes ``bench/results/interop.json`` and ``docs/interop.md``; exits non-zero on any mismatch.

    .venv/bin/python bench/verl_interop.py            # all cases (about 3 minutes on 2 cores)
    .venv/bin/python bench/verl_interop.py --render   # re-render docs/interop.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import BENCH, REPO, RESULTS
from harness.machine import git_revision
from harness.process import torchrun
from harness.render import generated_note, keep_sections, table, write_doc

BENCH_PY = REPO / ".bench-venv" / "bin" / "python"
DOC = REPO / "docs" / "interop.md"
STEP = 2

# name: how verl trains and saves it, and the world sizes shardstream restores it at
# (None: a plain, unsharded module on one process).
CASES: dict[str, dict] = {
    "qwen2-fsdp4": {
        "arch": "qwen2",
        "tie": False,
        "mesh": [4],
        "lora": False,
        "contents": ["model", "optimizer", "extra"],
        "restore": [[2], [3], None],
    },
    "llama-tied-hsdp2x2": {
        "arch": "llama",
        "tie": True,
        "mesh": [2, 2],
        "lora": False,
        "contents": ["model", "optimizer", "extra", "hf_model"],
        "restore": [[3], [2, 2]],
    },
    "qwen2-lora-fsdp2": {
        "arch": "qwen2",
        "tie": False,
        "mesh": [2],
        "lora": True,
        "contents": ["model", "optimizer", "extra"],
        "restore": [[3], None],
    },
    "qwen2-fsdp1-ws2": {
        "arch": "qwen2",
        "tie": False,
        "mesh": [2],
        "lora": False,
        "fsdp1": True,  # FullyShardedDataParallel with a device mesh: DTensor shards
        "contents": ["model", "optimizer", "extra"],
        # FSDP1's optimizer files hold each parameter's per-rank runs of elements
        # (use_orig_params): restored at any world size from the runs' lengths.
        "restore": [[3]],
    },
    "qwen2-lora-only-fsdp4": {
        "arch": "qwen2",
        "tie": False,
        "mesh": [4],
        "lora": True,
        "lora_only": True,  # verl's save_lora_only: the model files hold the adapters only
        "contents": ["model", "optimizer", "extra"],
        "restore": [[2]],
    },
    # Models whose save_pretrained layout differs from their in-memory names (issue #22):
    # verl's merger ends in save_pretrained; shardstream must write the same files, under the
    # merger's transformers and under the project's.
    "qwen3moe-fsdp2": {
        "arch": "qwen3_moe",
        "tie": False,
        "mesh": [2],
        "lora": False,
        "layout": True,
        "contents": ["model", "optimizer", "extra"],
        "restore": [[3], None],
    },
    "qwen25vl-fsdp2": {
        "arch": "qwen2_5_vl",
        "tie": False,
        "mesh": [2],
        "lora": False,
        "layout": True,
        "contents": ["model", "optimizer", "extra"],
        "restore": [[3], None],
    },
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


# ---------------------------------------------------------------- stage 1: verl saves


def _save_main(case_name: str, root: Path) -> None:
    """One torchrun rank under .bench-venv: train and save with verl's checkpoint manager."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2, get_shard_placement_fn
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup

    from shardstream.testing import tiny_models as tm

    case = CASES[case_name]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    if case.get("layout"):
        model = tm.build_layout_model(case["arch"])
        config = model.config
    else:
        config = tm.tiny_config(case["arch"], tie_word_embeddings=case["tie"])
        model = tm.build_tiny_model(config, seed=0)
    if case["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA, task_type="CAUSAL_LM"))
    names = ("fsdp",) if len(case["mesh"]) == 1 else ("ddp", "fsdp")
    mesh = init_device_mesh("cpu", tuple(case["mesh"]), mesh_dim_names=names)
    if case.get("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer_cls = type(model.model.layers[0])
        model = FSDP(
            model,
            device_id=torch.device("cpu"),
            device_mesh=mesh,
            auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
            use_orig_params=True,
        )
    else:
        placement = get_shard_placement_fn(fsdp_size=case["mesh"][-1])
        apply_fsdp2(model, {"mesh": mesh, "shard_placement_fn": placement}, {})

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=1, num_training_steps=10
    )
    vocab = config.get_text_config().vocab_size
    for step in range(1, STEP + 1):
        generator = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, vocab, (2, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    contents = case["contents"]
    manager = FSDPCheckpointManager(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        processing_class=tm.build_tiny_tokenizer(vocab),
        checkpoint_config={
            "save_contents": contents,
            "load_contents": contents,
            "save_lora_only": case.get("lora_only", False),
        },
    )
    actor = root / f"global_step_{STEP}" / "actor"
    manager.save_checkpoint(local_path=str(actor), global_step=STEP)
    rng_next = torch.rand(2).tolist()  # continues the RNG state verl just saved

    # The reference: every tensor gathered whole, keyed by parameter name (DSD handles FSDP1
    # and FSDP2 alike), and the placements as verl wrote them to rank 0's file.
    full = StateDictOptions(full_state_dict=True)
    model_ref = {
        k: v.detach().clone() for k, v in get_model_state_dict(model, options=full).items()
    }
    optim_ref = {}
    for fqn, entries in get_optimizer_state_dict(model, optimizer, options=full)["state"].items():
        for key, value in entries.items():
            optim_ref[f"{fqn}/{key}"] = torch.as_tensor(value).detach().clone()
    placements = {}
    written = torch.load(actor / f"model_world_size_{world}_rank_0.pt", weights_only=True)
    for v in written.values():
        label = str(v.placements) if isinstance(v, DTensor) else "plain"
        placements[label] = placements.get(label, 0) + 1
    if rank == 0:
        ref = root / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(model_ref, ref / "model.safetensors")
        (ref / "optim").mkdir(exist_ok=True)  # apart: compare_dirs reads ref/*.safetensors
        save_file(optim_ref, ref / "optim" / "optim.safetensors")
        meta = {
            "lr": optimizer.param_groups[0]["lr"],
            "scheduler_last_epoch": scheduler.last_epoch,
            "rng_next_rank0": rng_next,
            "placements": placements,
            "world_size": world,
        }
        (ref / "meta.json").write_text(json.dumps(meta, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def save_case(name: str, root: Path) -> dict:
    world = math.prod(CASES[name]["mesh"])
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = ["save", "--case", name, "--root", str(root)]
    cmd = torchrun(world, __file__, *args, python=str(BENCH_PY))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(
            f"verl save of {name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
        )
    meta = json.loads((root / "reference" / "meta.json").read_text())
    return {"seconds": round(time.perf_counter() - t0, 1), **meta}


# ---------------------------------------------------------------- stage 2: merge


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)


def merge_case(name: str, root: Path) -> dict:
    from compare import compare_dirs, summarize

    actor = root / f"global_step_{STEP}" / "actor"
    out = root / "merged"
    out.mkdir(parents=True, exist_ok=True)
    verl_flags = ["merge", "--backend", "fsdp", "--local_dir", str(actor)]
    result: dict = {"checks": []}

    def check(label: str, ok: bool, detail: str = "") -> None:
        result["checks"].append({"check": label, "ok": bool(ok), "detail": detail})

    if CASES[name].get("lora_only"):
        _merge_lora_only(actor, root, out, result, check)
        return result
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    verl = _run(
        [str(BENCH_PY), "-m", "verl.model_merger", *verl_flags, "--target_dir", str(out / "verl")],
        env=env,
    )
    check("verl's merger runs", verl.returncode == 0, verl.stderr[-500:] if verl.returncode else "")
    python = sys.executable
    same_flags = _run(
        [
            python,
            "-m",
            "shardstream",
            *verl_flags,
            "--target_dir",
            str(out / "ss-verl-flags"),
            "--quiet",
        ]
    )
    check(
        "shardstream merge with verl's flags runs",
        same_flags.returncode == 0,
        same_flags.stderr[-500:],
    )
    ss = _run(
        [python, "-m", "shardstream", *verl_flags, "--target_dir", str(out / "ss-bf16"),
         "--dtype", "bfloat16", "--quiet", "--json"]
    )  # fmt: skip
    check("shardstream merge --dtype bfloat16 runs", ss.returncode == 0, ss.stderr[-500:])
    if verl.returncode or ss.returncode:
        return result
    if CASES[name].get("layout"):  # the same command under verl's merger's transformers
        alike = _run(
            [str(BENCH_PY), "-m", "shardstream", *verl_flags, "--target_dir",
             str(out / "ss-bench-venv"), "--dtype", "bfloat16", "--quiet", "--json"],
            env=env,
        )  # fmt: skip
        check(
            "shardstream merge under verl's environment (its transformers) runs",
            alike.returncode == 0,
            alike.stderr[-500:],
        )
        if alike.returncode == 0:
            result["layout"] = json.loads(alike.stdout).get("layout")
            same = compare_dirs(out / "verl", out / "ss-bench-venv")
            result["vs_verl_same_transformers"] = same["identical"]
            check(
                "shardstream (bf16, verl's transformers) == verl's merger, bit for bit, "
                "index included",
                same["identical"] and _same_index(out / "verl", out / "ss-bench-venv"),
                summarize(same),
            )
    result["shardstream_summary"] = json.loads(ss.stdout)
    config = json.loads((actor / "huggingface" / "config.json").read_text())
    result["config_dtype"] = config.get("dtype", config.get("torch_dtype"))

    report = compare_dirs(out / "verl", out / "ss-bf16")
    result["vs_verl"] = {k: report[k] for k in ("identical", "n_common", "bytes_compared_bitwise")}
    check(
        "shardstream (bf16) == verl's merger, bit for bit", report["identical"], summarize(report)
    )
    if CASES[name].get("layout"):
        check(
            "the same index (weight_map) as verl's merger",
            _same_index(out / "verl", out / "ss-bf16"),
        )
    swap = compare_dirs(out / "verl", out / "ss-verl-flags")
    result["same_command_identical"] = swap["identical"]
    check(
        "the same command with `shardstream` for `verl.model_merger` writes identical tensors",
        swap["identical"],
        summarize(swap),
    )
    adapters = [d for d in ("lora_adapter",) if (out / "verl" / d).is_dir()]
    for d in adapters:
        adapter = compare_dirs(out / "verl" / d, out / "ss-bf16" / d)
        check(f"{d}/ identical to verl's", adapter["identical"], summarize(adapter))
        result["adapter_tensors"] = adapter["n_common"]
    if not CASES[name]["lora"] and not CASES[name].get("layout"):  # layout: other names
        ref = compare_dirs(root / "reference", out / "ss-bf16")
        extra_ref = set(ref["only_in_a"]) - ({"lm_head.weight"} if CASES[name]["tie"] else set())
        ok = (
            not extra_ref
            and not ref["n_only_in_b"]
            and not ref["n_value_mismatch"]
            and ref["n_equal_after_cast"] == ref["n_common"]
        )
        check("shardstream (bf16) == verl's saved state cast to bf16", ok, summarize(ref))
    test = _run(
        [
            python,
            "-m",
            "shardstream",
            "test",
            "--backend",
            "fsdp",
            "--local_dir",
            str(actor),
            "--test_hf_dir",
            str(out / "verl"),
        ]
    )
    check(
        "shardstream test --test_hf_dir <verl's output> passes",
        test.returncode == 0,
        test.stdout[-300:] + test.stderr[-300:],
    )
    inspect = _run([python, "-m", "shardstream", "inspect", str(actor), "--json"])
    check("shardstream inspect reads it", inspect.returncode == 0, inspect.stderr[-300:])
    verify = _run([python, "-m", "shardstream", "verify", "--json", str(actor.parent.parent)])
    try:
        report = json.loads(verify.stdout)
    except ValueError:
        report = {}
    check(
        "shardstream verify of verl's run directory: every .pt record matches its CRC-32",
        verify.returncode == 0 and report.get("files_checked", 0) >= 3,
        (verify.stdout[-300:] + verify.stderr[-300:]),
    )
    for label in ("ss-bf16", "ss-verl-flags"):
        check(f"transformers loads {label}", *_loads(out / label))
    return result


def _merge_lora_only(actor: Path, root: Path, out: Path, result: dict, check) -> None:
    """A save_lora_only checkpoint merges to a PEFT adapter equal to the LoRA weights verl saved;
    verl's own merger is run for the record."""
    import torch
    from safetensors.torch import load_file

    target = out / "ss-adapter"
    flags = ["merge", "--backend", "fsdp", "--local_dir", str(actor), "--target_dir", str(target)]
    proc = _run([sys.executable, "-m", "shardstream", *flags, "--dtype", "float32", "--quiet"])
    check("shardstream merge of the LoRA-only checkpoint runs", proc.returncode == 0, proc.stderr)
    if proc.returncode:
        return
    files = sorted(p.name for p in target.iterdir())
    check("it writes a PEFT adapter directory", "adapter_model.safetensors" in files, str(files))
    adapter = load_file(target / "adapter_model.safetensors")
    saved = load_file(root / "reference" / "model.safetensors")
    lora = {k: v for k, v in saved.items() if "lora_" in k}
    same = len(adapter) == len(lora) and all(
        torch.equal(t, lora.get(n.replace(".weight", ".default.weight"), torch.empty(0)))
        for n, t in adapter.items()
    )
    check("adapter == the LoRA weights verl saved, bit for bit (fp32)", same)
    config = json.loads((target / "adapter_config.json").read_text())
    want = (LORA["r"], LORA["lora_alpha"], sorted(LORA["target_modules"]))
    got = (config["r"], config["lora_alpha"], sorted(config["target_modules"]))
    check("adapter_config.json: r, lora_alpha, target_modules as trained", got == want, str(got))
    result["adapter_tensors"] = len(adapter)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    verl = _run([str(BENCH_PY), "-m", "verl.model_merger", *flags[:-1], str(out / "verl")], env=env)
    lines = (verl.stderr.strip() or verl.stdout.strip() or "no output").splitlines()
    result["verl_merger"] = (
        "exit 0" if verl.returncode == 0 else f"exit {verl.returncode}: {lines[-1]}"
    )


def _same_index(a: Path, b: Path) -> bool:
    """Both directories hold one model.safetensors, or the same index."""
    index = "model.safetensors.index.json"
    if (a / index).is_file() or (b / index).is_file():
        try:
            return json.loads((a / index).read_text()) == json.loads((b / index).read_text())
        except OSError:
            return False
    return (a / "model.safetensors").is_file() and (b / "model.safetensors").is_file()


def _loads(path: Path) -> tuple[bool, str]:
    import transformers

    try:
        names = json.loads((path / "config.json").read_text()).get("architectures") or []
        cls = getattr(transformers, names[0], None) if names else None
        cls = cls or transformers.AutoModelForCausalLM
        _, info = cls.from_pretrained(path, output_loading_info=True)
    except Exception as exc:  # noqa: BLE001  (reported, not raised: the run lists every check)
        return False, f"{type(exc).__name__}: {exc}"
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys")}
    return not bad, json.dumps(bad, default=list)[:300]


# ---------------------------------------------------------------- stage 3: restore


def restore_run(
    rank: int,
    world: int,
    actor: str,
    mesh: list[int] | None,
    case_name: str,
    contents: list[str] | None = None,
) -> dict:
    """shardstream restores verl's checkpoint into a differently seeded model at this world size.

    The model is the class verl trained: a causal LM from the saved config.json, or for the
    layout cases the class ``tiny_models.layout_config`` names (Qwen3-MoE, Qwen2.5-VL), as the
    saving side builds it. Each module named in the model's ``_no_split_modules`` (decoder
    layers, vision blocks) is sharded, as verl's ``apply_fsdp2`` chooses them. LoRA cases use
    ``tiny_models.add_lora``, which names its tensors as peft does; after a save_lora_only
    checkpoint the base weights must keep their pre-restore values."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from transformers import AutoConfig, get_cosine_schedule_with_warmup

    from shardstream import CheckpointConfig, CheckpointManager
    from shardstream.testing import tiny_models as tm

    actor_path = Path(actor)
    root = actor_path.parent.parent
    spec = CASES[case_name]
    saved_arch = json.loads((actor_path / "huggingface" / "config.json").read_text())
    if spec.get("layout"):
        model = tm.build_layout_model(spec["arch"], seed=1234)
    else:
        model = tm.build_tiny_model(
            AutoConfig.from_pretrained(actor_path / "huggingface"), seed=1234
        )
    if [type(model).__name__] != saved_arch.get("architectures"):
        raise RuntimeError(f"built {type(model).__name__}, verl saved {saved_arch}")
    blocks = set(model._no_split_modules or ())
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if spec["lora"]:
        model = tm.add_lora(model, **LORA)
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        names = ("fsdp",) if len(mesh) == 1 else ("ddp", "fsdp")
        device_mesh = init_device_mesh("cpu", tuple(mesh), mesh_dim_names=names)
        for layer in layers:
            fully_shard(layer, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=5e-1, weight_decay=0.5)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=1, num_training_steps=10
    )
    contents = tuple(contents or spec.get("restore_contents", ("model", "optimizer", "extra")))
    cfg = CheckpointConfig(directory=str(root / f"shardstream-ws{world}"), load_contents=contents)
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    options = StateDictOptions(full_state_dict=True)
    before = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    restored = manager.restore(path=str(actor_path))
    rng_next = torch.rand(2).tolist()
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    manager.close()
    if rank != 0:
        return {}

    mismatches: list[str] = []
    model_ref = load_file(root / "reference" / "model.safetensors")
    for key, want in model_ref.items():
        if spec.get("lora_only") and "lora_" not in key:
            want = before[key]  # not in the checkpoint: restore must leave it alone
        got = model_sd.get(key)
        if got is None or got.dtype != want.dtype or not torch.equal(got, want):
            mismatches.append(f"model {key}")
    optim_ref = load_file(root / "reference" / "optim" / "optim.safetensors")
    if "optimizer" not in contents:
        optim_ref = {}
    for key, want in optim_ref.items():
        fqn, field = key.rsplit("/", 1)
        got = optim_sd["state"].get(fqn, {}).get(field)
        if got is None or not torch.equal(torch.as_tensor(got), want):
            mismatches.append(f"optimizer {key}")
    meta = json.loads((root / "reference" / "meta.json").read_text())
    if "optimizer" in contents and optimizer.param_groups[0]["lr"] != meta["lr"]:
        mismatches.append(f"lr {optimizer.param_groups[0]['lr']} != {meta['lr']}")
    if "optimizer" in contents and scheduler.last_epoch != meta["scheduler_last_epoch"]:
        mismatches.append(f"scheduler.last_epoch {scheduler.last_epoch}")
    if rng_next != meta["rng_next_rank0"]:
        mismatches.append("rank 0's torch RNG stream")
    return {
        "restored_step": restored[0] if isinstance(restored, tuple) else restored,
        "model_tensors": len(model_ref),
        "optimizer_tensors": len(optim_ref),
        "mismatches": mismatches,
    }


def restore_case(name: str, root: Path) -> list[dict]:
    from shardstream.testing.distributed import run

    actor = str(root / f"global_step_{STEP}" / "actor")
    rows = []
    for mesh in CASES[name]["restore"]:
        world = 1 if mesh is None else math.prod(mesh)
        t0 = time.perf_counter()
        try:
            result = run(restore_run, world, actor, mesh, name)[0]
        except Exception as exc:  # noqa: BLE001  (recorded: the run lists every check)
            lines = [line for line in str(exc).splitlines() if line.strip()]
            said = (lines or [repr(exc)])[-1].replace(str(root) + "/", "")
            result = {
                "restored_step": None,
                "model_tensors": 0,
                "optimizer_tensors": 0,
                "error": str(exc)[-6000:],
                "mismatches": [f"restore raised {said[-400:]}"],
            }
        result.update(mesh=mesh, world=world, seconds=round(time.perf_counter() - t0, 1))
        rows.append(result)
    if "restore_contents" in CASES[name]:  # what is left out must be refused clearly
        try:
            run(restore_run, 2, actor, [2], name, ["model", "optimizer", "extra"])
            said = "restored without an error"
        except Exception as exc:  # noqa: BLE001  (the message is the result)
            said = str(exc)
        lines = [line for line in said.splitlines() if "CheckpointFormatError" in line]
        ok = "flat-parameter shards" in said and "optim_world_size_" in said
        said = (lines or [said])[-1].replace(str(root) + "/", "")
        rows.append({"probe": "optimizer", "said": said[-400:], "ok": ok})
    return rows


# ---------------------------------------------------------------- driver and report


def _versions() -> dict:
    keys = ("torch", "transformers", "verl", "peft")
    probe = f"import {', '.join(keys)}; print({', '.join(k + '.__version__' for k in keys)})"
    out = _run([str(BENCH_PY), "-c", probe]).stdout.split()
    return (
        dict(zip(keys, out)) if len(out) == 4 else {"error": "could not read .bench-venv versions"}
    )


def run_all(names: list[str], work: Path) -> dict:
    commit = git_revision()
    results: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit,
        "bench_venv": _versions(),
        "cases": {},
    }
    for name in names:
        root = work / name
        print(f"[{name}] verl saves ...", flush=True)
        saved = save_case(name, root)
        print(f"[{name}] merge: verl's merger vs shardstream ...", flush=True)
        merged = merge_case(name, root)
        print(f"[{name}] shardstream restores at {CASES[name]['restore']} ...", flush=True)
        restores = restore_case(name, root) if CASES[name]["restore"] else []
        results["cases"][name] = {
            "case": CASES[name],
            "save": saved,
            "merge": merged,
            "restore": restores,
        }
    return results


def failures(results: dict) -> list[str]:
    out = []
    for name, case in results["cases"].items():
        out += [
            f"{name}: {c['check']}: {c['detail']}" for c in case["merge"]["checks"] if not c["ok"]
        ]
        out += [
            f"{name}: restore at {r['mesh']}: {r['mismatches'][:5]}"
            for r in case["restore"]
            if "probe" not in r and r["mismatches"]
        ]
        out += [
            f"{name}: restoring its {r['probe']} was not refused clearly: {r['said']}"
            for r in case["restore"]
            if "probe" in r and not r["ok"]
        ]
    return out


# What the tests (not this page's run) check of other trainers' checkpoints.
OTHER_TRAINERS = [
    "## Other trainers' checkpoints",
    "",
    "Checked by `make test` (`tests/integration/test_trainer_restore.py`, "
    "`tests/formats/test_trainer_layouts.py`), not by this page's run: each saved by the "
    "tool's own saving code on CPU ranks over gloo, restored at another world size, "
    "every parameter, optimizer entry and scheduler field compared bit for bit.",
    "",
    "- accelerate 1.16 `Accelerator.save_state` (FSDP2, `SHARDED_STATE_DICT`): "
    "`restore(path=<save_state directory>)` restores the model "
    "(`pytorch_model_fsdp_0/`), the optimizer (`optimizer_0/`), the scheduler "
    "(`scheduler.bin`) and each rank's RNG (`random_states_N.pkl`; a rank the run did "
    "not have takes rank 0's); the two pickles are read by shardstream's restricted "
    "unpickler, which refuses code. Only the first model and optimizer are restored. "
    "accelerate turns FSDP on only from GPU-like distributed types, so the test sets its "
    "state to FSDP after `Accelerator()`; its FSDP2 preparation and checkpoint code then "
    "run unchanged.",
    '- transformers 5.25 `Trainer` with FSDP2 (`fsdp_config={"fsdp_version": 2}`, '
    "`SHARDED_STATE_DICT` and `FULL_STATE_DICT`, tied and untied embeddings; "
    "`tests/integration/test_hf_trainer.py`): the `checkpoint-N` that `trainer.train()` "
    'writes (`save_strategy="steps"`) is inspected (`accelerate (SHARDED_STATE_DICT)` / '
    "`(FULL_STATE_DICT)`), verified (every DCP item, torch.save file and `save_pretrained` "
    "model in it; `training_args.bin` by its zip records, never unpickled; the "
    "`output_dir` verifies each `checkpoint-N`), merged (bit for bit the state at the "
    "save; no `trainer_state.json` or other run state copied beside the model), tested "
    "against `trainer.save_model`'s output with `--exact`, and restored into a plain model "
    "at 1 process and into FSDP2 prepared by the Trainer's accelerator at 3 ranks with the "
    "Trainer's own optimizer (two groups) and scheduler, each rank's RNG included. "
    "accelerate enables FSDP only from GPU-like distributed types, so on CPU the test sets "
    "the Trainer's accelerate state as accelerate sets it on GPUs; the training and "
    "saving code is the Trainer's own.",
    "- Saved without FSDP (`tests/integration/test_unsharded_saves.py`, "
    "`test_layout_restore.py`): accelerate's `save_state` at 1 process and with DDP at 2 "
    "(`model.safetensors` or `pytorch_model.bin`, `optimizer.bin` keyed by integer "
    "parameter ids), and the Trainer's `checkpoint-N` at 1 and 2 processes (`optimizer.pt`, "
    "`rng_state.pth` / `rng_state_N.pth`): restored at 1 process and into FSDP2 at 3 ranks, "
    "model, optimizer (two param groups), scheduler and each rank's RNG bit for bit; an "
    "optimizer of other param groups refused untouched. The Trainer's checkpoints of "
    "Qwen2.5-VL, Qwen3-MoE (one tensor per expert on disk) and a tied Qwen2 restore into "
    "the models' own names at 1 process and into FSDP2 at 2; the model directory "
    "`save_model` writes loads alone into FSDP2.",
    '- PyTorch\'s DCP recipe, `dcp.save({"app": AppState})` (keys `app.model.*`, '
    "`app.optim.*`): the prefix is detected from DCP's planner data and shown by "
    "`inspect`; `--prefix` / `prefix=` picks one where several containers hold a model.",
    "- Schedulers: transformers' `get_cosine_schedule_with_warmup` (`LambdaLR` over "
    "`functools.partial`, whose empty `lr_lambdas` entry DCP drops), `SequentialLR`, "
    "`OneCycleLR`: the saved state is merged into the live scheduler's own "
    "`state_dict()`.",
    "- torchtitan: torchtitan itself is not installed in the test venv. The tests build "
    "a model like its fused attention (one `wqkv` parameter that a state-dict hook "
    "presents as `wq`/`wk`/`wv`) and dataloader and `TrainState` objects as its "
    '`CheckpointManager` saves them; `restore(path=..., states={"dataloader": dl, '
    '"train_state": ts})` restores model, optimizer, scheduler, the step and each saved '
    "rank's data position. torchtitan's own `CheckpointManager`: the section below.",
    "- DCP's `HuggingFaceStorageWriter(save_distributed=True)`, with and without "
    "consolidation: merge, inspect, verify, `test --exact` and restore of the model.",
    "- Tensor parallelism with FSDP2, as torchtitan lays it out "
    "(`tests/integration/test_tensor_parallel.py`): `parallelize_module` (Colwise / Rowwise) "
    "on the tp dimension of a (dp=2, tp=2) mesh, `fully_shard` on dp, 4 ranks; saved by "
    "shardstream's manager and by `dcp.save`, merged, verified and restored into TP x FSDP, "
    "FSDP alone at 2 and 3 ranks, TP alone and a plain model, bit for bit; an FSDP-only "
    "checkpoint restores into TP x FSDP.",
    "- PyTorch's FSDP2 example (pytorch/examples `distributed/FSDP2/checkpoint.py`; "
    "`tests/formats/test_pytorch_fsdp2_example.py`): `model_state_dict.pt` and "
    "`optim_state_dict.pt` as rank 0 writes them with `torch.save` after gathering them "
    "either way it shows (the state-dict API with `full_state_dict=True`, or each DTensor's "
    "`full_tensor()` with the optimizer's integer ids), from FSDP2 at 2 ranks: inspected, "
    "verified, merged, and restored at 1 process and into FSDP2 at 3 ranks bit for bit.",
    "- One `torch.save` file as PyTorch's save/load recipes write it "
    "(`tests/formats/test_torch_save_file.py`): `torch.save(model.state_dict(), 'model.pt')`, "
    "a general checkpoint `{'epoch', 'model_state_dict', 'optimizer_state_dict', 'loss'}`, "
    "and `{'model', 'optimizer'}`: the file's path is the checkpoint; inspected, verified, "
    "merged, and restored at 1 process and into FSDP2 at 3 ranks bit for bit.",
    "- A restore that cannot finish (a scheduler or Stateful that does not take the "
    "saved state, a missing part) raises before any tensor is written, naming the part.",
    "",
]


def render(results: dict) -> str:
    v = results["bench_venv"]
    lines = [
        "# Interop with verl 0.9.1's own checkpoint manager",
        "",
        generated_note("bench/verl_interop.py", "bench/results/interop.json"),
        "",
        "The tests generate verl-layout checkpoints with shardstream's own writer. This page "
        "checks the real thing: checkpoints saved by verl's "
        "`FSDPCheckpointManager.save_checkpoint`, merged by verl's `model_merger` and by "
        "shardstream, and restored by shardstream at other world sizes.",
        "Reproduce with `make interop` (`bench/verl_interop.py`).",
        "",
        f"- **Run:** {results['started']}, shardstream @ {results['commit']}",
        f"- **verl side** (`.bench-venv`): verl {v.get('verl')}, torch {v.get('torch')}, "
        f"transformers {v.get('transformers')}, peft {v.get('peft')}",
        "- **How verl trains:** a tiny model from a config (random weights), sharded with verl's "
        "`apply_fsdp2` and `get_shard_placement_fn` (FSDP1: `FullyShardedDataParallel` per "
        "decoder layer) on a CPU mesh over gloo (torchrun), AdamW, "
        "verl's cosine schedule with warm-up, two steps on different data per rank, then "
        "`save_checkpoint(global_step=2)`.",
        "",
    ]
    rows = []
    for name, case in results["cases"].items():
        spec, merge = case["case"], case["merge"]
        placements = ", ".join(f"{n}× {p}" for p, n in sorted(case["save"]["placements"].items()))
        vs = merge.get("vs_verl", {})
        merge_cell = (
            f"identical: {vs['n_common']} tensors, "
            f"{vs['bytes_compared_bitwise'] / 2**20:.2f} MiB bit for bit"
            if vs.get("identical")
            else "**differs**"
        )
        if spec.get("lora_only"):
            merge_cell = (
                f"shardstream writes the PEFT adapter ({merge.get('adapter_tensors')} tensors, "
                f"equal to verl's saved LoRA weights); verl's merger: {merge.get('verl_merger')}"
            )
        elif merge.get("adapter_tensors"):
            merge_cell += f"; `lora_adapter/` identical ({merge['adapter_tensors']} tensors)"
        restores = []
        for r in [r for r in case["restore"] if "probe" not in r]:
            where = (
                "1 process, plain module" if r["mesh"] is None else "×".join(map(str, r["mesh"]))
            )
            verdict = "all equal" if not r["mismatches"] else f"**{len(r['mismatches'])} differ**"
            verdict = "**raised**" if r.get("error") else verdict
            restores.append(f"{where}: {verdict}")
        mesh = "×".join(map(str, spec["mesh"]))
        title = spec["arch"] + (", FSDP1" if spec.get("fsdp1") else "")
        title += ", tied" if spec["tie"] else ""
        title += ", LoRA (peft)" if spec["lora"] else ""
        title += ", save_lora_only" if spec.get("lora_only") else ""
        if merge.get("layout"):
            merge_cell += f"; layout: {merge['layout']}"
        rows.append(
            (f"{name} ({title})", mesh, ", ".join(spec["contents"]), placements, merge_cell,
             "; ".join(restores) or "not run")
        )  # fmt: skip
    lines += table(
        "case | verl mesh | saved contents | placements verl wrote "
        "| merge: shardstream vs verl's merger | restore by shardstream at",
        "llllll",
        rows,
    )
    lines += ["", "## Every check", ""]
    for name, case in results["cases"].items():
        lines.append(f"**{name}** (verl saved in {case['save']['seconds']} s; config.json dtype "
                     f"`{case['merge'].get('config_dtype')}`)")  # fmt: skip
        lines.append("")
        for c in case["merge"]["checks"]:
            lines.append(f"- {'pass' if c['ok'] else '**FAIL**'}: {c['check']}")
        for r in case["restore"]:
            if "probe" in r:
                state = "pass" if r["ok"] else "**FAIL**"
                lines.append(
                    f"- {state}: restoring its {r['probe']} state is refused, naming the file: "
                    f"`{r['said'].strip()}`"
                )
                continue
            where = "1 process (plain module)" if r["mesh"] is None else f"mesh {r['mesh']}"
            state = "pass" if not r["mismatches"] else "**FAIL**"
            if r.get("error"):
                lines.append(f"- {state}: restore at {where}: {r['mismatches'][0]}")
                continue
            optim = (
                f"{r['optimizer_tensors']} optimizer tensors, learning rate, schedule step"
                if r["optimizer_tensors"]
                else "no optimizer (not restorable, below)"
            )
            lines.append(
                f"- {state}: restore at {where}: {r['model_tensors']} model tensors and {optim} "
                f"bit for bit, and rank 0's RNG stream ({r['seconds']} s)"
                + (f"; differ: {', '.join(r['mismatches'][:5])}" if r["mismatches"] else "")
            )
        lines.append("")
    lines += [
        "## What this covers and what it does not",
        "",
        "- `Shard(1)`: verl's placement function shards each parameter on the first dimension "
        "that divides the fsdp size, so weights whose rows do not divide it (the tiny models' "
        "vocabulary of 101, MLP width of 86) are `Shard(1)`; the table counts them.",
        "- Dtype: verl's merger always writes bfloat16, and so does shardstream for a checkpoint "
        "verl's merger merges (verl's files, or the verl plug-in's), whatever config.json names, "
        "so the same command gives the same files. When the config names another dtype "
        "(float32 for verl's fp32 actor under transformers 5), shardstream says so in a note; "
        "`--dtype float32` keeps it.",
        "- The restore side shards with plain `fully_shard` (`Shard(0)`) at a different world "
        "size, so every tensor is resharded across both dimension and rank count.",
        "- LoRA: verl trains a real `peft` model. The project venv has no peft, so the restore "
        "side uses `shardstream.testing.tiny_models.add_lora`, which gives the same tensor "
        "names. After a `save_lora_only` checkpoint the base weights must keep their values.",
        "- FSDP1: verl's manager saves `FullyShardedDataParallel` (with a device mesh, "
        "`use_orig_params`) the same way; its model shards are DTensors and merge and restore "
        "them like FSDP2's. Its optimizer files hold plain per-rank runs of each parameter's "
        "elements (`use_orig_params=True`; with `False`, of each flat parameter), with no "
        "placement; each rank's run starts where the previous rank's ends, so restore places "
        "them at any world size (flat parameters: into FSDP1 wrapped as the run wrapped it). "
        "FSDP1 without a device mesh (`ShardedTensor`) is refused by merge.",
        "- Qwen3-MoE and Qwen2.5-VL (`shardstream.testing.tiny_models.layout_config`): their "
        "`save_pretrained` layout differs from the names the model holds (per-expert tensors "
        "for the fused experts; `model.*` and `visual.*` for `model.language_model.*` and "
        "`model.visual.*`), and verl's merger ends in `save_pretrained`. shardstream merges "
        "them twice: in the project's venv (its transformers) and in `.bench-venv` (the "
        "transformers verl's merger ran with), each compared with verl's merger bit for bit. "
        "The restore side builds the class verl trained (`Qwen3MoeForCausalLM`, "
        "`Qwen2_5_VLForConditionalGeneration`, from the same `layout_config`; the restore "
        "checks that config.json names it) under the project's transformers, whose in-memory "
        "names are those verl's model held (the fused experts as `experts.gate_up_proj` / "
        "`experts.down_proj`, `model.language_model.*`, `model.visual.*`), shards each "
        "decoder layer and vision block (the model's `_no_split_modules`, as verl's "
        "`apply_fsdp2` does) with `fully_shard` at 3 ranks, and also restores into a plain "
        "module on 1 process; model, optimizer state, learning rate, schedule step and RNG "
        "are compared bit for bit as for the other cases (the table gives the result). verl "
        "trains them on text only, so Qwen2.5-VL's vision tower gets no gradient and verl's "
        "optimizer files hold AdamW state for 27 of its 45 parameters (none for "
        "`model.visual.*`), which its restore has to take.",
        "",
    ]
    lines += OTHER_TRAINERS
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", nargs="?", default="all", choices=["all", "save"])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--root", type=Path, help="save stage: the case's directory")
    parser.add_argument("--work", type=Path, default=RESULTS / "interop")
    parser.add_argument("--render", action="store_true", help="re-render docs/interop.md only")
    args = parser.parse_args(argv)
    if args.stage == "save":
        _save_main(args.case[0], args.root)
        return 0
    out_json = RESULTS / "interop.json"
    if not args.render:
        setup = subprocess.run(["bash", str(BENCH / "setup_verl_venv.sh")])
        if setup.returncode:
            return setup.returncode
        shutil.rmtree(args.work, ignore_errors=True)
        results = run_all(args.case or list(CASES), args.work)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(results, indent=1))
    results = json.loads(out_json.read_text())
    write_doc(DOC, keep_sections(DOC, render(results)))  # keeps titan_interop.py's section
    bad = failures(results)
    for line in bad:
        print(f"!!! {line}")
    print(f"{DOC.relative_to(REPO)}: {'all checks pass' if not bad else f'{len(bad)} failed'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
