"""Checkpoints saved WITHOUT FSDP, the common DDP or single-process run: accelerate's
``save_state`` and transformers' Trainer ``checkpoint-N``, each written by the tool itself on
real processes (1, or 2 over gloo with DDP), then read by the shardstream command as a user runs
it and restored at 1 process into a plain model and at 3 ranks into FSDP2, bit for bit against
the state the run had when it saved.

What the tools write (checked by ``test_what_the_tool_wrote``): the whole model in one file
(``model.safetensors``, or ``pytorch_model.bin`` with ``safe_serialization=False``), the
optimizer's own ``state_dict()`` (parameters as integer ids, group after group), the
scheduler's, one RNG file per rank, and for the Trainer its config and arguments too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shardstream.testing.cli import main_stdout
from shardstream.testing.compare import assert_bit_identical
from shardstream.testing.distributed import run

from . import unsharded_save_workers as uw
from .workers import assert_nested_equal as _assert_same


class Case(NamedTuple):
    tool: str  # "accelerate" or "trainer"
    world: int  # processes of the saving run (2: DDP)
    tie: bool  # tie_word_embeddings
    safe: bool = True  # accelerate's safe_serialization


CASES = {
    "accelerate-1": Case("accelerate", 1, tie=False),
    "accelerate-ddp-2-tied": Case("accelerate", 2, tie=True),
    "accelerate-bin-1-tied": Case("accelerate", 1, tie=True, safe=False),
    "trainer-1-tied": Case("trainer", 1, tie=True),
    "trainer-ddp-2": Case("trainer", 2, tie=False),
}
ACCELERATE_CASES = [name for name, case in CASES.items() if case.tool == "accelerate"]
# Files of the training state a merge must not copy into a model directory.
TRAINING_STATE = ("optimizer", "scheduler", "random_states", "rng_state", "training_args")


def _model_file(case: Case) -> str:
    return "model.safetensors" if case.safe else "pytorch_model.bin"


def _expected_files(case: Case) -> set[str]:
    """What the tool writes for ``case``, as read from its source (accelerate's
    ``save_accelerator_state``, the Trainer's ``_save_checkpoint``)."""
    if case.tool == "accelerate":
        rng = {f"random_states_{r}.pkl" for r in range(case.world)}
        return {_model_file(case), "optimizer.bin", "scheduler.bin"} | rng
    # The Trainer names its RNG file after the rank only when there are several.
    rng = {"rng_state.pth"} if case.world == 1 else {f"rng_state_{r}.pth" for r in range(2)}
    beside = {"config.json", "generation_config.json", "trainer_state.json", "training_args.bin"}
    return {"model.safetensors", "optimizer.pt", "scheduler.pt"} | rng | beside


def _read_model_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """One save per case by the tool itself: the checkpoint, its file list, each rank's RNG at
    the save, the live optimizer's parameter ids and names, and the state at the save (model,
    optimizer by FQN, scheduler) as the saving process gathered it."""
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    if case.tool == "accelerate":
        ranks = run(uw.accelerate_save_run, case.world, str(root), case.tie, case.safe)
    else:
        ranks = run(uw.trainer_save_run, case.world, str(root), case.tie)
    ckpt = Path(uw.checkpoint_dir(str(root), case.tool))
    return {
        "case": case,
        "root": root,
        "ckpt": ckpt,
        "files": ranks[0]["files"],
        "rng": [rank["rng"] for rank in ranks],
        "ids": ranks[0]["ids"],
        "names": ranks[0]["names"],
        "model_file": _read_model_file(ckpt / _model_file(case)),
        "reference": torch.load(root / "reference.pt", weights_only=True),
    }


def _assert_rng(got, want, where: str) -> None:
    """torch's, Python's and numpy's generators (numpy's whole state, position included)."""
    assert torch.equal(got[0], want[0]), f"{where}: torch"
    assert got[1] == want[1], f"{where}: random"
    assert got[2][0] == want[2][0] and np.array_equal(got[2][1], want[2][1]), f"{where}: numpy"
    assert tuple(got[2][2:]) == tuple(want[2][2:]), f"{where}: numpy position"


def _saved_rng(saved, rank: int):
    """The RNG a restoring rank must end with: the one its rank saved; a rank the run did not
    have takes rank 0's."""
    return saved["rng"][rank if rank < len(saved["rng"]) else 0]


def test_what_the_tool_wrote(saved):
    """The saving side itself, so that a restore failure below is shardstream's: the files
    the tool wrote; the model file holding the model's tensors as they were at the save
    (without FSDP: whole, under the model's own names, never DDP's ``module.``; a tied
    ``lm_head.weight`` left out by safetensors, kept by torch.save); the optimizer file's
    parameters as integer ids 0..N-1 group after group, so that id ``i`` is not the ``i``-th
    named parameter; and each rank's RNG its own."""
    case, ckpt, reference = saved["case"], saved["ckpt"], saved["reference"]
    assert set(saved["files"]) == _expected_files(case), saved["files"]

    expected = dict(reference["model"])
    if case.tie and case.safe:
        del expected["lm_head.weight"]
    assert_bit_identical(saved["model_file"], expected)

    optimizer_file = ckpt / ("optimizer.bin" if case.tool == "accelerate" else "optimizer.pt")
    raw = torch.load(optimizer_file, map_location="cpu", weights_only=True)
    ids = [list(g["params"]) for g in raw["param_groups"]]
    assert ids == saved["ids"] and len(ids) == 2, ids
    count = len(saved["names"])
    assert [i for group in ids for i in group] == list(range(count)), ids
    assert sorted(raw["state"]) == list(range(count))
    assert [g["weight_decay"] for g in raw["param_groups"]] == [0.1, 0.0]
    # The first group (decay) is not the first parameters by name: the mapping matters.
    by_position = saved["names"][: len(ids[0])]
    assert by_position != reference["optim"]["param_groups"][0]["params"]
    # The optimizer state by FQN holds every parameter the run trained.
    assert set(reference["optim"]["state"]) == set(saved["names"])

    if case.world > 1:
        assert not torch.equal(saved["rng"][0][0], saved["rng"][1][0])  # ranks differ


def test_restore_one_process_plain(saved):
    """Restored at 1 process into a plain model and an optimizer and scheduler built as the
    run built them (two param groups, same order), by ``shardstream.load(path, model=,
    optimizer=, lr_scheduler=)``: every model tensor, every optimizer state tensor and param
    group hyperparameter, the scheduler's state_dict and rank 0's RNG, as saved."""
    case = saved["case"]
    (result,) = run(uw.restore_plain_run, 1, case.tool, str(saved["root"]), case.tie)
    if case.tool == "trainer":
        assert result["step"] == uw.STEPS
    _assert_same(result["state"], saved["reference"], "state")
    _assert_rng(result["rng"], saved["rng"][0], "rng")


def test_restore_three_ranks_fsdp2(saved, tmp_path):
    """Restored at 3 ranks into FSDP2 (each decoder layer and the root on an explicit CPU
    mesh) by ``CheckpointManager(directory=<fresh>).restore(path=<the checkpoint>)``: the
    whole state as saved, gathered, and each rank's RNG as that rank saved it (rank 0's on a
    rank the run did not have)."""
    case = saved["case"]
    args = (case.tool, str(saved["root"]), case.tie, str(tmp_path / "run"))
    for rank, result in enumerate(run(uw.restore_fsdp_run, 3, *args)):
        if case.tool == "trainer":
            assert result["step"] == uw.STEPS
        _assert_same(result["state"], saved["reference"], f"rank {rank}")
        _assert_rng(result["rng"], _saved_rng(saved, rank), f"rank {rank} rng")


def test_inspect_and_verify(saved):
    """``shardstream inspect --json`` and ``verify --json`` as a user runs them: recognised as
    a training checkpoint (not a plain Hugging Face model), every tensor of the model file
    counted, and every file of the training state checked: the model, the optimizer, the
    scheduler, each rank's RNG, and the Trainer's training_args.bin."""
    case, ckpt = saved["case"], saved["ckpt"]
    info = json.loads(main_stdout("inspect", "--json", str(ckpt)))
    assert info["format"] != "huggingface", info["format"]
    assert info["num_tensors"] == len(saved["model_file"]), info["num_tensors"]

    verified = json.loads(main_stdout("verify", "--json", str(ckpt)))
    files = 3 + case.world + (1 if case.tool == "trainer" else 0)
    assert verified["ok"] and verified["files_checked"] == files, verified


def test_merge_writes_the_model(saved, tmp_path):
    """``shardstream merge`` writes the model's tensors bit for bit under the model's names
    (a tied ``lm_head.weight`` may be left out), and none of the training state; the
    Trainer's config files go with it (accelerate's save has none)."""
    case, model = saved["case"], saved["reference"]["model"]
    merged = tmp_path / "merged"
    main_stdout("merge", "--local_dir", str(saved["ckpt"]), "--target_dir", str(merged), "--quiet")
    got = load_file(merged / "model.safetensors")
    expected = dict(model)
    if case.tie and "lm_head.weight" not in got:
        del expected["lm_head.weight"]
    assert_bit_identical(got, expected)

    written = {p.name for p in merged.iterdir()}
    assert not [n for n in written if n.startswith(TRAINING_STATE)], written
    beside = {"config.json", "generation_config.json"} if case.tool == "trainer" else set()
    assert written == {"model.safetensors"} | beside, written


@pytest.mark.parametrize("saved", ACCELERATE_CASES, indirect=True)
def test_other_param_groups_refused(saved):
    """accelerate's checkpoint restored into an optimizer with one param group where the run
    had two: shardstream's CheckpointFormatError naming the param groups, and the live model,
    optimizer and scheduler untouched."""
    case = saved["case"]
    (result,) = run(uw.refused_groups_run, 1, str(saved["root"]), case.tie)
    assert result["format_error"], result["error"]
    assert "param group" in result["error"], result["error"]
    _assert_same(result["after"], result["before"], "untouched")
