"""Trainers' checkpoints restored whole at another world size, bit for bit (issue #24)."""

from __future__ import annotations

import shutil

import pytest
import torch

from shardstream.testing.cli import run_cli
from shardstream.testing.distributed import run

from . import trainer_workers
from .workers import assert_nested_equal as _assert_same


def test_pytorch_recipe_app_state_with_transformers_schedule(tmp_path):
    """``dcp.save({"app": AppState})``: keys app.model.*, app.optim.*, app.scheduler.*, the
    scheduler a LambdaLR over functools.partial (its empty lr_lambdas entry lost by DCP)."""
    saved = run(trainer_workers.recipe_run, 2, str(tmp_path), "save")[0]
    for result in run(trainer_workers.recipe_run, 3, str(tmp_path), "restore"):
        assert result["step"][0] == 2
        _assert_same(saved["state"], result["state"], "state")

    # A scheduler that cannot take the saved state: refused before anything is written.
    (refused,) = run(trainer_workers.refused_run, 1, str(tmp_path))
    assert "lr_scheduler" in refused["error"] and "nothing was restored" in refused["error"]
    _assert_same(refused["before"], refused["after"], "untouched")


def test_accelerate_save_state_restores_whole(tmp_path):
    saved = run(trainer_workers.accelerate_run, 2, str(tmp_path), "save")
    files = saved[0]["files"]
    assert {"pytorch_model_fsdp_0", "optimizer_0", "scheduler.bin"} <= set(files), files
    restored = run(trainer_workers.accelerate_run, 3, str(tmp_path), "restore")
    for rank, result in enumerate(restored):
        _assert_same(saved[0]["state"], result["state"], "state")
        # Each rank's RNG as that rank saved it; a rank beyond the saved ones takes rank 0's.
        torch_rng, python_rng = saved[rank if rank < 2 else 0]["rng"]
        assert torch.equal(result["rng"][0], torch_rng)
        assert result["rng"][1] == python_rng


def test_fused_qkv_hooks_restore_into_the_real_parameter(tmp_path):
    """Saved keys wq/wk/wv (model and optimizer), live parameter wqkv: 2 -> 3 ranks."""
    saved = run(trainer_workers.fused_run, 2, str(tmp_path), "save")[0]
    assert any(".wqkv." in name for name in saved["state"]["model"])
    for rank, result in enumerate(run(trainer_workers.fused_run, 3, str(tmp_path), "restore")):
        assert result["step"][0] == 2
        _assert_same(saved["state"], result["state"], "state")
        # torchtitan-like Statefuls: the step; each saved rank's data position (a rank the
        # run did not have keeps its own, as torchtitan's dataloader does)
        assert result["train_step"] == 2
        assert result["position"] == (10 + rank if rank < 2 else 0)


@pytest.mark.parametrize("consolidate", [False, True], ids=["sharded", "consolidated"])
def test_hf_storage_writer_output_is_an_input(tmp_path, consolidate):
    from shardstream.cli import main
    from shardstream.commands.inspect import describe
    from shardstream.commands.verify import verify
    from shardstream.formats.source import Kind, detect

    saved = run(trainer_workers.hf_writer_run, 2, str(tmp_path), "save", consolidate)[0]
    path = tmp_path / "hf"
    assert detect(path) is Kind.DCP_HF
    assert verify(path).ok
    assert describe(path)["num_tensors"] == len(saved)
    merged = tmp_path / "merged"
    assert main(["merge", "--local_dir", str(path), "--target_dir", str(merged), "--quiet"]) == 0
    assert main(["test", "--local_dir", str(path), "--test_hf_dir", str(merged), "--exact"]) == 0
    for state in run(trainer_workers.hf_writer_run, 3, str(tmp_path), "restore", consolidate):
        _assert_same(saved, state, "model")


def test_hf_storage_writer_without_save_distributed_is_refused(tmp_path):
    """Without save_distributed, every rank writes the same file names: a shared directory
    keeps the files of the rank that wrote last. Rank 0's (its chunks start at 0, but the
    index counts every rank's bytes) and rank 1's (chunks away from the start) are each
    refused by merge, naming the file and the writer's option, not merged as a model of
    partial tensors."""
    run(trainer_workers.hf_writer_run, 2, str(tmp_path), "save-undistributed", False)
    shared = tmp_path / "hf-rank0"
    (name,) = [p.name for p in shared.glob("*.safetensors")]
    for last in (0, 1):
        if last:
            shutil.copyfile(tmp_path / "hf-rank1" / name, shared / name)
        done = run_cli("merge", "--local_dir", shared, "--target_dir", tmp_path / f"m{last}")
        assert done.returncode == 1, done.stdout + done.stderr
        assert "save_distributed=True" in done.stderr, done.stderr
        assert not (tmp_path / f"m{last}").exists()
    assert "is the chunk at [" in done.stderr and str(shared / name) in done.stderr
