"""Shared fixtures: small but real FSDP2 checkpoints in verl's layout, built once per session.

Each rank is a separate ``python tests/conftest.py worker ...`` process joined over gloo, so
nothing here relies on pickling test functions into ``multiprocessing`` children.

Variants written by every run (world size 2, fp32, identical values across variants):

``base``      Shard(0) on every parameter (uneven: 101 rows split 51/50)
``shard1``    Shard(1) on matrices, Shard(0) on vectors
``bigger``    the same model with a 103-row embedding (shapes disagree with ``base``)
``reference`` ``model.safetensors`` with the full tensors, written from ``full_tensor()``
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORLD_SIZE = 2
HIDDEN = 48
VOCAB = 101
INTERMEDIATE = 86
VARIANTS = ("base", "shard1", "bigger")
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "top_p": 0.8}

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "vocab_size": VOCAB,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _build_model(vocab: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Module()
    inner = nn.Module()
    inner.embed_tokens = nn.Embedding(vocab, HIDDEN)
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(HIDDEN, HIDDEN)
    layer.self_attn.k_proj = nn.Linear(HIDDEN, HIDDEN)
    layer.self_attn.v_proj = nn.Linear(HIDDEN, HIDDEN)
    layer.self_attn.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
    layer.mlp = nn.Module()
    layer.mlp.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
    layer.mlp.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
    layer.mlp.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
    layer.input_layernorm = nn.Module()
    layer.input_layernorm.weight = nn.Parameter(torch.rand(HIDDEN))
    layer.post_attention_layernorm = nn.Module()
    layer.post_attention_layernorm.weight = nn.Parameter(torch.rand(HIDDEN))
    inner.layers = nn.ModuleList([layer])
    inner.norm = nn.Module()
    inner.norm.weight = nn.Parameter(torch.rand(HIDDEN))
    model.model = inner
    model.lm_head = nn.Linear(HIDDEN, vocab, bias=False)
    return model


def _worker(rank: int, world_size: int, init_file: str, root: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for variant in VARIANTS:
        model = _build_model(VOCAB + 2 if variant == "bigger" else VOCAB)
        if variant == "shard1":
            fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1))
        else:
            fully_shard(model, mesh=mesh)
        out = Path(root) / variant
        out.mkdir(parents=True, exist_ok=True)
        state = model.state_dict()
        torch.save(state, out / f"model_world_size_{world_size}_rank_{rank}.pt")
        if variant == "base":
            full = {k: v.full_tensor() for k, v in state.items()}
            if rank == 0:
                from safetensors.torch import save_file

                ref = Path(root) / "reference"
                ref.mkdir(parents=True, exist_ok=True)
                save_file(full, str(ref / "model.safetensors"), metadata={"format": "pt"})
                (ref / "config.json").write_text(json.dumps(CONFIG))
        dist.barrier()
    dist.destroy_process_group()


def build_fsdp_checkpoints(root: Path, world_size: int = WORLD_SIZE) -> Path:
    """Write the variants above under ``root`` and return it."""
    root.mkdir(parents=True, exist_ok=True)
    init_file = root / "gloo-init"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "worker",
                str(r),
                str(world_size),
                str(init_file),
                str(root),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world_size)
    ]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("FSDP checkpoint worker failed:\n" + "\n".join(outputs))
    init_file.unlink(missing_ok=True)
    for variant in VARIANTS:
        directory = root / variant
        fsdp = {"FSDP_version": 2, "world_size": world_size}
        (directory / "fsdp_config.json").write_text(json.dumps(fsdp))
        hf = directory / "huggingface"
        hf.mkdir(exist_ok=True)
        config = dict(CONFIG, vocab_size=VOCAB + 2 if variant == "bigger" else VOCAB)
        (hf / "config.json").write_text(json.dumps(config))
        # verl copies the base model's; without it merge derives one as save_pretrained does
        (hf / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return root


def pytest_configure(config):
    """Plans of the output layout are cached on disk (``formats/hf_names_cache.py``): the test
    session, and every process it starts (they inherit the environment), uses a private
    directory of its own, never the user's ``~/.cache``."""
    import tempfile

    from shardstream.formats import hf_names_cache

    path = tempfile.mkdtemp(prefix="shardstream-test-cache-")
    config._shardstream_cache = (os.environ.get(hf_names_cache.ENV), path)
    os.environ[hf_names_cache.ENV] = path


def pytest_unconfigure(config):
    saved = getattr(config, "_shardstream_cache", None)
    if saved is None:
        return
    before, path = saved
    from shardstream.formats import hf_names_cache

    if before is None:
        os.environ.pop(hf_names_cache.ENV, None)
    else:
        os.environ[hf_names_cache.ENV] = before
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def fsdp_root(tmp_path_factory) -> Path:
    """The session's FSDP2 checkpoints (read-only: copy a variant before changing it)."""
    return build_fsdp_checkpoints(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture
def copy_variant(fsdp_root, tmp_path):
    """``copy_variant("base")`` -> a private, writable copy of that checkpoint directory."""

    def copy(variant: str, name: str | None = None) -> Path:
        dest = tmp_path / (name or variant)
        shutil.copytree(fsdp_root / variant, dest)
        return dest

    return copy


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "worker":
    from shardstream.testing.distributed import exit_finished_rank

    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    exit_finished_rank()
