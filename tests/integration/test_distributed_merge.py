"""merge --distributed under torchrun writes the same bytes as a single-process merge."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import pytest

from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoint

# ~24 MB of bf16 output: several 4 MiB chunk ranges, so ranks split single files too.
BIGGER = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "vocab_size": 20000,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-big")
    fx = VerlFixture(
        world_size=2,
        train_steps=0,
        write_optimizer=False,
        write_reference=False,
        config_overrides=BIGGER,
    )
    return write_verl_checkpoint(root, fx)


def run_merge(args: list[str], nproc: int | None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--standalone",
            "-m",
            "shardstream",
            "merge",
            *args,
            "--distributed",
        ]
    else:
        cmd = [sys.executable, "-m", "shardstream", "merge", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def same_tree(a, b) -> bool:
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


@pytest.mark.parametrize("max_shard", ["5GB", "9MB"], ids=["one-file", "split-files"])
def test_distributed_merge_is_byte_identical(actor, tmp_path, max_shard):
    single, distributed = tmp_path / "single", tmp_path / "distributed"
    common = ["--local_dir", str(actor), "--max-shard-size", max_shard, "--quiet"]
    run_merge([*common, "--target_dir", str(single)], None)
    run_merge([*common, "--target_dir", str(distributed)], 3)
    assert same_tree(single, distributed)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_distributed_without_torchrun_is_a_usage_error(actor, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardstream",
            "merge",
            "--local_dir",
            str(actor),
            "--target_dir",
            str(tmp_path / "t"),
            "--distributed_merge",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "torchrun" in done.stderr
    assert not (tmp_path / "t").exists()
