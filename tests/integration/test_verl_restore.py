"""restore() of a verl FSDP checkpoint at another world size: model, optimizer, scheduler, RNG."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shardstream.testing.distributed import run
from shardstream.testing.verl_checkpoint import (
    VerlFixture,
    write_verl_checkpoint,
    zip_member_data,
)

from . import workers


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-restore")
    actor = write_verl_checkpoint(root, VerlFixture(world_size=4, train_steps=2), step=2)
    return root, actor


def full_optimizer_state(actor, world: int) -> tuple[dict, list]:
    """verl's per-rank optimizer files glued back along dim 0 (test-side reference only)."""
    import torch.distributed.tensor  # noqa: F401

    parts = [
        torch.load(actor / f"optim_world_size_{world}_rank_{r}.pt", weights_only=True)
        for r in range(world)
    ]
    state = {}
    for pid, entries in parts[0]["state"].items():
        state[pid] = {}
        for key, value in entries.items():
            if hasattr(value, "_local_tensor"):
                state[pid][key] = torch.cat([p["state"][pid][key]._local_tensor for p in parts])
            else:
                state[pid][key] = value
    return state, parts[0]["param_groups"]


@pytest.mark.parametrize("world", [2, 1])
def test_verl_checkpoint_restores_at_another_world_size(verl_run, world):
    root, actor = verl_run
    results = run(workers.verl_restore_run, world, str(actor), ("model", "optimizer", "extra"))
    reference = load_file(root / "reference" / "model.safetensors")
    optim_state, groups = full_optimizer_state(actor, 4)
    ids = [pid for group in groups for pid in group["params"]]
    for result in results:
        assert result["restored"] == (2, {})
        state = result["state"]
        for name, tensor in reference.items():
            assert torch.equal(state["model"][name], tensor), name
        fqns = [fqn for group in state["optim"]["param_groups"] for fqn in group["params"]]
        for pid, fqn in zip(ids, fqns):
            for key, value in optim_state[pid].items():
                assert torch.equal(state["optim"]["state"][fqn][key], value), (fqn, key)
        assert state["optim"]["param_groups"][0]["lr"] == groups[0]["lr"]
    # the ranks share the unpickling of the rank files (each parses a share), and every rank
    # reads rank 0's optimizer file for the param groups
    model_files = sorted(f"model_world_size_4_rank_{r}.pt" for r in range(4))
    optim_files = sorted(f"optim_world_size_4_rank_{r}.pt" for r in range(4))
    parsed = [name for result in results for name in result["parsed"]]
    assert sorted(n for n in parsed if n.startswith("model_")) == model_files
    groups_file = "optim_world_size_4_rank_0.pt"
    assert sorted(n for n in parsed if n.startswith("optim_")) == sorted(
        optim_files + [groups_file] * world
    )
    assert {len(result["parsed"]) for result in results} == {(4 + 4) // world + 1}
    # rank 0 continues the RNG stream verl saved for rank 0.
    extra = torch.load(actor / "extra_state_world_size_4_rank_0.pt", weights_only=False)
    torch.set_rng_state(extra["rng"]["cpu"])
    assert torch.equal(results[0]["rng_next"], torch.rand(2))


def test_manager_in_verls_directory_resumes_by_path_and_deletes_nothing(verl_run, tmp_path):
    """Two ranks, directory = verl's run directory: restore() names verl's checkpoint instead
    of starting over, restore(path=...) resumes from it, saving its step is refused and the next
    step is saved beside it; retention never touches verl's files."""
    import shutil

    root, actor = verl_run
    shutil.copytree(actor.parent, tmp_path / "global_step_2")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    verl_files = {p: p.read_bytes() for p in (tmp_path / "global_step_2").rglob("*.pt")}
    results = run(workers.verl_directory_run, 2, str(tmp_path))
    for result in results:
        assert result["restore"].startswith("CheckpointNotFoundError: ")
        assert (
            f"{tmp_path / 'global_step_2' / 'actor'} is a checkpoint of another format"
            in (result["restore"])
        )
        assert result["resume"] == (2, {})
        assert result["save_2"].startswith(
            f"UsageError: {tmp_path / 'global_step_2'} exists and is not a shardstream checkpoint"
        )
        assert result["save_3"] is not None and result["steps"] == [3]
        assert result["resume_path"] == (2, {}) and result["disable"] is None
        reference = load_file(root / "reference" / "model.safetensors")
        resumed, untouched = result["resume_path_weights"], result["disable_weights"]
        assert all(torch.equal(resumed[name], t) for name, t in reference.items())
        assert not any(torch.equal(untouched[name], t) for name, t in reference.items() if t.dim())
    assert len(verl_files) == 13  # 4 ranks x model, optim, extra_state; data.pt
    assert {p: p.read_bytes() for p in verl_files} == verl_files


def test_model_only_restore_of_verl_checkpoint(verl_run):
    root, actor = verl_run
    results = run(workers.verl_restore_run, 3, str(actor), ("model",))
    reference = load_file(root / "reference" / "model.safetensors")
    for name, tensor in reference.items():
        assert torch.equal(results[0]["state"]["model"][name], tensor), name


def test_ranks_that_see_different_files_fail_together(verl_run, tmp_path):
    import shutil

    _, actor = verl_run
    partial = tmp_path / "actor"
    shutil.copytree(actor, partial)
    for optim in partial.glob("optim_world_size_*"):
        optim.unlink()
    messages = run(workers.verl_restore_error_run, 2, [str(actor), str(partial)])
    for message in messages:
        assert message.startswith("CheckpointFormatError: ")
        assert "rank 1 sees other files there than rank 0" in message


def test_flipped_byte_in_a_verl_optimizer_file_fails_the_restore(verl_run, tmp_path):
    """verify_on_load checks each zip record's CRC-32 in verl's .pt files as it reads them."""
    import shutil

    _, actor = verl_run
    damaged = tmp_path / "actor"
    shutil.copytree(actor, damaged)
    path = damaged / "optim_world_size_4_rank_1.pt"
    start, size = zip_member_data(path)  # the largest storage: an exp_avg(_sq) shard
    data = bytearray(path.read_bytes())
    data[start + size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    messages = run(workers.verl_restore_error_run, 2, [str(damaged), str(damaged)])
    assert "restored" not in messages
    named = [m for m in messages if "checksum mismatch" in m]
    assert named, messages
    assert str(path) in named[0] and "'optimizer.state." in named[0], named[0]


def test_restore_at_a_larger_world_size_checks_each_file_once(tmp_path):
    """At W' > W each restoring rank reads part of a saved record; the ranks then check the
    files between them before loading (each record's CRC-32 once) instead of each hashing the
    whole records it touches. Intact: restored bit for bit. Damaged: every rank fails."""
    import shutil

    actor = write_verl_checkpoint(tmp_path / "w2", VerlFixture(world_size=2, train_steps=1), step=1)
    reference = load_file(tmp_path / "w2" / "reference" / "model.safetensors")
    results = run(workers.verl_restore_run, 4, str(actor), ("model", "optimizer", "extra"))
    for result in results:
        assert result["restored"] == (1, {})
        for name, tensor in reference.items():
            assert torch.equal(result["state"]["model"][name], tensor), name

    damaged = tmp_path / "damaged"
    shutil.copytree(actor, damaged)
    path = damaged / "optim_world_size_2_rank_1.pt"
    start, _ = zip_member_data(path)
    data = bytearray(path.read_bytes())
    data[start + 1] ^= 0x01
    path.write_bytes(bytes(data))
    messages = run(workers.verl_restore_error_run, 4, [str(damaged)] * 4)
    assert all("checksum mismatch" in m and str(path) in m for m in messages), messages
