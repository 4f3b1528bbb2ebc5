"""detect(): one order for every kind of directory, and readers that all keep one contract."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import shardstream
from shardstream.commands.inspect import describe
from shardstream.formats.source import (
    CheckpointSource,
    Kind,
    checkpoints_below,
    detect,
    looks_like_checkpoint,
    open_checkpoint,
)


def native_step(directory: Path) -> Path:
    shardstream.save(directory, model=torch.nn.Linear(8, 4), contents=("model",))
    return directory


def verl_checkpoint(directory: Path) -> Path:
    """One rank's ``model.state_dict()`` of plain tensors: verl's layout at world size 1."""
    directory.mkdir(parents=True)
    torch.save({"w": torch.ones(2, 3)}, directory / "model_world_size_1_rank_0.pt")
    return directory


def dcp_checkpoint(directory: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(2, 3)}, checkpoint_id=directory)
    return directory


def hf_model(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file({"w": torch.ones(2, 3)}, str(directory / "model.safetensors"))
    return directory


def test_each_kind(tmp_path):
    assert detect(native_step(tmp_path / "native")) is Kind.NATIVE
    assert detect(verl_checkpoint(tmp_path / "verl")) is Kind.VERL
    assert detect(dcp_checkpoint(tmp_path / "dcp")) is Kind.DCP
    assert detect(hf_model(tmp_path / "hf")) is Kind.HF_MODEL
    verl_checkpoint(tmp_path / "verl_step" / "actor")
    verl_checkpoint(tmp_path / "verl_step" / "critic")
    assert detect(tmp_path / "verl_step") is Kind.VERL_ROLES
    (tmp_path / "empty").mkdir()
    assert detect(tmp_path / "empty") is Kind.NONE
    assert detect(tmp_path / "missing") is Kind.NONE
    (tmp_path / "file").write_text("")
    assert detect(tmp_path / "file") is Kind.NONE


def test_dcp_layouts(tmp_path):
    """accelerate's pytorch_model_fsdp_N is a DCP directory; so is one whose save stopped
    before the .metadata (open_checkpoint then says so)."""
    assert detect(dcp_checkpoint(tmp_path / "ckpt" / "pytorch_model_fsdp_0")) is Kind.DCP
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "__0_0.distcp").write_bytes(b"")
    assert detect(tmp_path / "partial") is Kind.DCP
    with pytest.raises(shardstream.CheckpointNotFoundError, match="did not finish"):
        open_checkpoint(tmp_path / "partial")


def test_run_directories(tmp_path):
    native_step(tmp_path / "run" / "global_step_3")
    assert detect(tmp_path / "run") is Kind.RUN
    verl_checkpoint(tmp_path / "verl_run" / "global_step_1" / "actor")
    assert detect(tmp_path / "verl_run") is Kind.RUN
    assert detect(tmp_path / "verl_run" / "global_step_1") is Kind.VERL_ROLES
    (tmp_path / "pointer_only").mkdir()
    (tmp_path / "pointer_only" / "latest_checkpointed_iteration.txt").write_text("7")
    assert detect(tmp_path / "pointer_only") is Kind.RUN
    (tmp_path / "uncommitted" / "global_step_2").mkdir(parents=True)
    assert detect(tmp_path / "uncommitted") is Kind.RUN


def test_order_what_a_directory_holds_comes_first(tmp_path):
    """native, verl, DCP, HF model, verl roles, run: the first that matches names it."""
    both = native_step(tmp_path / "native_and_verl")
    torch.save({}, both / "model_world_size_1_rank_0.pt")
    assert detect(both) is Kind.NATIVE
    verl_and_dcp = verl_checkpoint(tmp_path / "verl_and_dcp")
    (verl_and_dcp / ".metadata").write_bytes(b"")
    assert detect(verl_and_dcp) is Kind.VERL
    dcp_and_hf = dcp_checkpoint(tmp_path / "dcp_and_hf")
    (dcp_and_hf / "model.safetensors").write_bytes(b"")
    assert detect(dcp_and_hf) is Kind.DCP
    hf_and_run = hf_model(tmp_path / "hf_and_run")
    native_step(hf_and_run / "global_step_1")
    assert detect(hf_and_run) is Kind.HF_MODEL
    roles_and_run = tmp_path / "roles_and_run"
    verl_checkpoint(roles_and_run / "actor")
    (roles_and_run / "latest_checkpointed_iteration.txt").write_text("1")
    assert detect(roles_and_run) is Kind.VERL_ROLES


def test_verl_checkpoint_with_its_hf_config_is_verl(tmp_path):
    actor = verl_checkpoint(tmp_path / "actor")
    hf_model(actor / "huggingface")
    assert detect(actor) is Kind.VERL


@pytest.mark.parametrize(
    "build, stray",
    [
        (dcp_checkpoint, "model.safetensors"),
        (verl_checkpoint, "pytorch_model.bin"),
        (native_step, "model.safetensors.index.json"),
        (verl_checkpoint, ".metadata"),  # and a DCP checkpoint's
        (dcp_checkpoint, "model_state_dict.pt"),  # and PyTorch's FSDP2 example's
        (native_step, "model_world_size_1_rank_0.pt"),  # and verl's
    ],
)
def test_a_second_model_beside_a_checkpoint_is_refused_not_left_unread(
    tmp_path, capsys, build, stray
):
    """Which of the two a user means is unknown: merge refuses, naming both, verify reports
    it, and nothing is written; a verl checkpoint's huggingface/ is its own, not a stray."""
    from shardstream.cli import main

    directory = build(tmp_path / "both")
    hf_model(tmp_path / "hf")
    shutil.copyfile(tmp_path / "hf" / "model.safetensors", directory / stray)
    with pytest.raises(shardstream.CheckpointFormatError, match="checkpoint and, beside it, "):
        open_checkpoint(directory)
    assert main(["merge", "--local_dir", str(directory), "--target_dir", str(tmp_path / "o")]) == 1
    assert "which one to read" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert main(["verify", str(directory)]) == 1
    assert "which one to read" in "".join(capsys.readouterr())
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(shardstream.CheckpointFormatError, match="which one to read"):
        shardstream.load(directory, model=model, contents=("model",))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_checkpoint_kinds_are_the_readable_ones(tmp_path):
    assert looks_like_checkpoint(native_step(tmp_path / "native"))
    assert looks_like_checkpoint(verl_checkpoint(tmp_path / "verl"))
    assert looks_like_checkpoint(dcp_checkpoint(tmp_path / "dcp"))
    assert not looks_like_checkpoint(hf_model(tmp_path / "hf"))
    native_step(tmp_path / "run" / "global_step_2")
    assert not looks_like_checkpoint(tmp_path / "run")
    assert checkpoints_below(tmp_path / "run") == [tmp_path / "run" / "global_step_2"]


def test_open_checkpoint_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(shardstream.CheckpointNotFoundError, match="no model files found"):
        open_checkpoint(tmp_path)
    hf = open_checkpoint(hf_model(tmp_path / "hf"))  # no training checkpoint, but merge reads it
    assert hf.format == "huggingface" and hf.tensors
    actor = verl_checkpoint(tmp_path / "step" / "actor")
    with pytest.raises(shardstream.CheckpointNotFoundError, match=f"but {actor} holds"):
        open_checkpoint(tmp_path / "step")


def trainer_checkpoint(directory: Path, finished: str = "all") -> Path:
    """A Trainer's SHARDED_STATE_DICT checkpoint-N: its model as DCP (real), training_args.bin,
    trainer_state.json written last; ``finished``: "all", "model" (no trainer_state.json) or
    "none" (the model's DCP save cut short before its .metadata)."""
    dcp_checkpoint(directory / "pytorch_model_fsdp_0")
    (directory / "training_args.bin").write_bytes(b"")
    if finished == "all":
        (directory / "trainer_state.json").write_text("{}")
    if finished == "none":
        (directory / "pytorch_model_fsdp_0" / ".metadata").unlink()
    return directory


def test_a_trainer_output_dir_names_its_finished_checkpoints_in_step_order(tmp_path):
    out = tmp_path / "out"
    done = [trainer_checkpoint(out / f"checkpoint-{n}") for n in (9, 10)]
    cut = [trainer_checkpoint(out / "checkpoint-11", "model")]
    cut.append(trainer_checkpoint(out / "checkpoint-12", "none"))
    assert checkpoints_below(out) == done  # numerically: 9 before 10
    with pytest.raises(shardstream.CheckpointNotFoundError) as refused:
        open_checkpoint(out)
    message = str(refused.value)
    listed = "2 folders hold checkpoints (checkpoint-9, checkpoint-10)"
    assert f"but {listed}; pass one of them, e.g. the newest, {done[1]}" in message
    assert f"; {cut[0]} and {cut[1]} are checkpoints whose saves did not finish" in message
    for finished in done:
        shutil.rmtree(finished)
    with pytest.raises(shardstream.CheckpointNotFoundError) as refused:
        open_checkpoint(out)
    assert "no model files found" in str(refused.value)
    assert f"; {cut[0]} and {cut[1]} are checkpoints" in str(refused.value)


@pytest.mark.parametrize("build", [native_step, verl_checkpoint, dcp_checkpoint])
def test_every_reader_keeps_the_contract(tmp_path, build):
    checkpoint = open_checkpoint(build(tmp_path / "ckpt"))
    assert isinstance(checkpoint, CheckpointSource)
    assert checkpoint.format in ("shardstream", "verl", "dcp")
    assert checkpoint.directory == tmp_path / "ckpt"
    assert checkpoint.tensors and isinstance(checkpoint.world_size, int)
    assert isinstance(checkpoint.manifest, dict) and isinstance(checkpoint.replicas, dict)
    assert isinstance(checkpoint.placements, dict) and isinstance(checkpoint.mesh, str)
    block = checkpoint.tensors[0].blocks[0]
    assert checkpoint.endpoint(block.location) is not None
    checkpoint.check_split_records(checkpoint.tensors)  # one process: nothing shared to check
    info = describe(tmp_path / "ckpt")
    assert info["format"] == checkpoint.format and info["num_tensors"] == len(checkpoint.tensors)


def test_a_verl_step_of_shardstream_roles_is_verified_role_by_role(tmp_path):
    """The verl plug-in writes shardstream checkpoints into verl's global_step_N/actor layout:
    verify of the run and of the step checks them; a flipped byte in one is found."""
    run = tmp_path / "run"
    for step in (1, 2):
        native_step(run / f"global_step_{step}" / "actor")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    assert detect(run / "global_step_1") is Kind.VERL_ROLES
    assert detect(run) is Kind.RUN
    for path in (run, run / "global_step_1"):
        report = shardstream.verify(path)
        assert report.ok, [p.line() for p in report.problems]
    assert shardstream.verify(run).steps == [1, 2]
    data = next((run / "global_step_2" / "actor").glob("rank-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    report = shardstream.verify(run)
    assert not report.ok and any(str(data) in p.line() for p in report.problems)


def test_step_and_temporary_directories_are_not_roles(tmp_path):
    run = tmp_path / "run"
    native_step(run / "global_step_1")
    native_step(run / "global_step_2.tmp-0123abcd")
    assert detect(run) is Kind.RUN


@pytest.mark.parametrize("copy", ["best", "global_step_1.bak", "global_step_01"])
def test_a_run_holding_a_step_copied_aside_is_still_a_run(tmp_path, copy):
    """A run root with a step copied aside (``cp -r global_step_1 best``) was read as a verl
    step whose one role is the copy: verify checked the copy alone and said OK of a run
    whose step 2 is damaged."""
    run = tmp_path / "run"
    for step in (1, 2):
        native_step(run / f"global_step_{step}")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    shutil.copytree(run / "global_step_1", run / copy)
    assert detect(run) is Kind.RUN
    data = next((run / "global_step_2").glob("rank-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    report = shardstream.verify(run)
    assert not report.ok and any(str(data) in p.line() for p in report.problems)
    assert report.steps == [1, 2]


def test_shards_without_their_index_are_named_with_what_is_missing(tmp_path):
    """save_pretrained's shards whose index was lost: "no model files found" said nothing of
    the shards or the index; merge and verify name both."""
    from safetensors.torch import save_file

    from shardstream.commands.verify import verify

    for i in (1, 2):
        save_file({f"t{i}": torch.zeros(2)}, str(tmp_path / f"model-0000{i}-of-00002.safetensors"))
    with pytest.raises(shardstream.CheckpointNotFoundError) as refused:
        open_checkpoint(tmp_path)
    said = "holds save_pretrained's shards (model-00001-of-00002.safetensors, ...) but not "
    assert said + "model.safetensors.index.json" in str(refused.value)
    (problem,) = verify(tmp_path).problems
    assert said in problem.message
