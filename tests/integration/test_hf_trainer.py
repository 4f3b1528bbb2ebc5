"""transformers' Trainer with FSDP2 (2 CPU ranks over gloo): its own checkpoint-N, written by
``trainer.train()``, read by the shardstream command as a user runs it, and restored at other
world sizes bit for bit against the state the Trainer had when it saved."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shardstream.testing.cli import main_stdout, run_cli
from shardstream.testing.distributed import run

from . import hf_trainer_workers as hw
from .workers import assert_nested_equal as _assert_same

# What the Trainer writes in checkpoint-N (directories end in /): with a sharded state dict
# the model and optimizer as DCP directories and no weights of its own (save_model saves
# none); with a full one the whole state dicts by rank 0, and save_pretrained's output too.
COMMON = {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"}
FILES = {
    "SHARDED_STATE_DICT": COMMON | {"optimizer_0/", "pytorch_model_fsdp_0/"},
    "FULL_STATE_DICT": COMMON
    | {"optimizer.bin", "pytorch_model_fsdp.bin", "training_args.bin"}
    | {"config.json", "generation_config.json", "model.safetensors"},
}
CASES = {
    "sharded": ("SHARDED_STATE_DICT", False),
    "full": ("FULL_STATE_DICT", False),
    "full-tied": ("FULL_STATE_DICT", True),
}


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tmp_path_factory):
    """One Trainer run per case: its output dir, save_model's reference and the state at the
    save (model, optimizer, scheduler in full; each rank's RNG)."""
    state_dict_type, tie = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    saved = run(hw.save_run, 2, str(root), state_dict_type, tie)
    return {
        "root": root,
        "type": state_dict_type,
        "tie": tie,
        "ckpt": root / "out" / hw.CHECKPOINT,
        "files": saved[0]["files"],
        "rng": [rank["rng"] for rank in saved],
        "reference": torch.load(root / "reference.pt", weights_only=True),
    }


def _assert_rng(got, want, where: str) -> None:
    assert torch.equal(got[0], want[0]), f"{where}: torch"
    assert got[1] == want[1], f"{where}: random"
    assert np.array_equal(got[2], want[2]), f"{where}: numpy"


def test_checkpoint_files_and_cli(trained, tmp_path):
    """inspect, verify, merge (against the state at the save) and test --exact (against
    ``trainer.save_model``'s output) of checkpoint-2."""
    assert set(trained["files"]) == FILES[trained["type"]], trained["files"]
    ckpt, model = trained["ckpt"], trained["reference"]["model"]

    info = json.loads(main_stdout("inspect", "--json", str(ckpt)))
    assert (info["world_size"], info["step"], info["num_tensors"]) == (2, hw.STEPS, len(model))
    assert info["format"] == f"accelerate ({trained['type']})", info["format"]
    verified = json.loads(main_stdout("verify", "--json", str(ckpt)))
    assert verified["kind"] == "accelerate", verified
    # model and optimizer (2 rank files and .metadata each, or one file each), scheduler, RNG;
    # FULL_STATE_DICT: also training_args.bin (records) and save_pretrained's model.safetensors
    sharded = trained["type"] == "SHARDED_STATE_DICT"
    files = 3 + (2 * 3 if sharded else 2 * 1 + 2)
    assert verified["ok"] and verified["files_checked"] == files, verified

    merged = tmp_path / "merged"
    main_stdout("merge", "--local_dir", str(ckpt), "--target_dir", str(merged), "--quiet")
    # config.json (FULL_STATE_DICT only) says the embeddings are tied: lm_head left out
    expected = {k: v for k, v in model.items() if not (trained["tie"] and k == "lm_head.weight")}
    _assert_same(load_file(merged / "model.safetensors"), expected, "merged")
    written = {p.name for p in merged.iterdir()}
    beside = {"config.json", "generation_config.json"}  # the model's; no training state
    assert written == {"model.safetensors"} | (
        beside if trained["type"] == "FULL_STATE_DICT" else set()
    )

    ref = trained["root"] / "ref"
    out = main_stdout("test", "--local_dir", str(ckpt), "--test_hf_dir", str(ref), "--exact")
    assert f"compared {len(model)} tensors" in out and "max abs diff 0" in out, out


def test_restore_one_process_plain(trained):
    """Saved at 2 ranks, restored at 1 process into a plain model and the Trainer's own
    optimizer and scheduler for it, by ``shardstream.load``."""
    (result,) = run(hw.restore_plain_run, 1, str(trained["root"]), trained["tie"])
    assert result["step"] == hw.STEPS
    _assert_same(result["state"], trained["reference"], "state")
    _assert_rng(result["rng"], trained["rng"][0], "rng")


def test_restore_three_ranks_fsdp2(trained):
    """Saved at 2 ranks, restored at 3 into FSDP2 prepared by the Trainer's accelerator, by
    ``CheckpointManager.restore(path=...)``; each rank's RNG as that rank saved it, rank 0's
    on a rank the run did not have."""
    assert not torch.equal(trained["rng"][0][0], trained["rng"][1][0])  # ranks differ
    args = (str(trained["root"]), trained["type"], trained["tie"])
    for rank, result in enumerate(run(hw.restore_fsdp_run, 3, *args)):
        assert result["step"] == hw.STEPS
        _assert_same(result["state"], trained["reference"], f"rank {rank}")
        _assert_rng(result["rng"], trained["rng"][rank if rank < 2 else 0], f"rank {rank} rng")


def test_verify_trainer_output_dir(trained):
    """The Trainer's output_dir: every checkpoint-N in it verified."""
    out = trained["root"] / "out"
    verified = json.loads(main_stdout("verify", "--json", str(out)))
    assert verified["ok"] and verified["kind"] == "checkpoints", verified
    assert verified["steps"] == [hw.STEPS], verified
    alone = json.loads(main_stdout("verify", "--json", str(trained["ckpt"])))
    assert verified["files_checked"] == alone["files_checked"] > 0, (verified, alone)


@pytest.mark.parametrize("damaged", ["model.safetensors", "training_args.bin"])
def test_verify_names_a_damaged_file_of_a_full_checkpoint(trained, tmp_path, damaged):
    """FULL_STATE_DICT: save_pretrained's model and the pickled TrainingArguments are checked
    too: the model's header against its size (it holds no checksums: truncated here), the
    arguments by their zip records' CRC-32s (a byte flipped; never unpickled)."""
    if trained["type"] != "FULL_STATE_DICT":
        pytest.skip("only FULL_STATE_DICT checkpoints hold them")
    ckpt = tmp_path / hw.CHECKPOINT
    shutil.copytree(trained["ckpt"], ckpt)
    data = bytearray((ckpt / damaged).read_bytes())
    if damaged == "model.safetensors":
        del data[-64:]
    else:
        data[len(data) * 3 // 4] ^= 0x5A
    (ckpt / damaged).write_bytes(bytes(data))
    done = run_cli("verify", "--quiet", ckpt)
    assert done.returncode == 1, done.stdout + done.stderr
    assert str(ckpt / damaged) in done.stderr, done.stderr


def test_restore_names_an_optimizer_save_that_did_not_finish(trained, tmp_path):
    """SHARDED_STATE_DICT: a checkpoint-N whose optimizer_0/ lacks its .metadata (the save was
    cut short after the model's: its data files written, or none yet) is refused naming that
    directory, not as a checkpoint that holds no optimizer state."""
    if trained["type"] != "SHARDED_STATE_DICT":
        pytest.skip("only SHARDED_STATE_DICT checkpoints hold optimizer_0/")
    ckpt = tmp_path / "out" / hw.CHECKPOINT
    shutil.copytree(trained["ckpt"], ckpt)
    optimizer = ckpt / "optimizer_0"
    for written in ("DCP data files", "no DCP data files"):
        for path in optimizer.iterdir():
            if path.name == ".metadata" or written.startswith("no"):
                path.unlink()
        with pytest.raises(RuntimeError) as failed:
            run(hw.restore_plain_run, 1, str(tmp_path), trained["tie"])
        message = str(failed.value)
        assert f"{optimizer}: {written} and no .metadata" in message, message
        assert "the save did not finish" in message, message
