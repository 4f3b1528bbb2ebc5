"""Checkpoints laid out as PyTorch Lightning 2.x and PyTorch's DCP tutorial write them (written
here with torch alone, in the layouts Lightning 2.6's own code wrote in a probe): the model
under a training wrapper's attribute (``model.``), optimizer containers (``optimizer_0``), a
``meta.pt`` beside DCP's files, and an RNG state saved beside the model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from shardstream import merge
from shardstream.commands.inspect import describe
from shardstream.commands.verify import verify
from shardstream.errors import NamesUnderPrefixError

transformers = pytest.importorskip("transformers")

TEXT = dict(
    hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64, head_dim=8,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TEXT, tie_word_embeddings=False)
    )
    path = tmp_path_factory.mktemp("lightning") / "ref"
    model.save_pretrained(path)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _written(target) -> dict[str, torch.Tensor]:
    return load_file(target / "model.safetensors")


def _optimizer_state(state: dict) -> dict:
    return {
        "state": {i: {"exp_avg": torch.zeros_like(v)} for i, v in enumerate(state.values())},
        "param_groups": [{"lr": 0.1, "params": list(range(len(state)))}],
    }


def test_a_lightning_ckpt_file_merges_under_the_prefix_its_refusal_names(model_dir, tmp_path):
    """Lightning's single-file .ckpt holds the module's state dict, the model under the
    module's attribute (``model.model.embed_tokens.weight``). The refusal named --prefix
    'model.', which merge then refused for a file: no command merged it."""
    ref, state = model_dir
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": 2,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": {f"model.{k}": v for k, v in state.items()},
            "optimizer_states": [_optimizer_state(state)],
            "lr_schedulers": [],
        },
        ckpt,
    )
    with pytest.raises(NamesUnderPrefixError, match="with --prefix 'model.'"):
        merge(ckpt, tmp_path / "refused", hf_model_path=ref)
    merge(ckpt, tmp_path / "out", hf_model_path=ref, prefix="model.", dtype="float32")
    assert _written(tmp_path / "out").keys() == load_file(ref / "model.safetensors").keys()
    for name, tensor in _written(tmp_path / "out").items():
        assert torch.equal(tensor, state[name]), name


def test_lightnings_sharded_checkpoint_is_named_with_the_prefix_read_under_it(model_dir, tmp_path):
    """Lightning's FSDP sharded save: DCP containers ``model`` (the module's state dict, so
    ``model.model.*``) and ``optimizer_0``, and a meta.pt. The refusal advised --prefix
    'model.', the prefix already read under; optimizer_0 was called another model."""
    ref, state = model_dir
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    dcp.save(
        {
            "model": {f"model.{k}": v for k, v in state.items()},
            "optimizer_0": {f"state.{k}.exp_avg": torch.zeros_like(v) for k, v in state.items()},
        },
        checkpoint_id=str(ckpt),
        no_dist=True,
    )
    torch.save({"epoch": 0, "global_step": 2}, ckpt / "meta.pt")
    with pytest.raises(NamesUnderPrefixError, match="with --prefix 'model.model.'"):
        merge(ckpt, tmp_path / "refused", hf_model_path=ref)
    assert "--prefix 'model.model.'" in describe(ckpt, None, ref)["merge"]["layout"]["refused"]
    merge(ckpt, tmp_path / "out", hf_model_path=ref, prefix="model.model.", dtype="float32")
    for name, tensor in _written(tmp_path / "out").items():
        assert torch.equal(tensor, state[name]), name
    assert describe(ckpt, "model.model.", ref)["unread_groups"] == {}

    report = verify(ckpt)
    assert report.ok and report.files_checked == 3 and report.not_read == [], report
    (ckpt / "meta.pt").write_bytes((ckpt / "meta.pt").read_bytes()[:50])  # cut short
    damaged = verify(ckpt)
    assert [p.path for p in damaged.problems] == [str(ckpt / "meta.pt")], damaged.problems
    (ckpt / "meta.pt").unlink()
    (ckpt / "notes.txt").write_text("run 3\n")
    assert verify(ckpt).not_read == ["notes.txt"]


def test_an_rng_state_saved_beside_the_model_is_not_merged_as_a_weight(model_dir, tmp_path):
    """PyTorch's DCP tutorial saves ``"rng": torch.get_rng_state()`` beside the model: at the
    top level with the model's tensors it was written into model.safetensors (exit 0), and
    beside a general checkpoint's model_state_dict the file was refused as two models."""
    ref, state = model_dir
    rng = torch.get_rng_state()
    dcp.save({**state, "step": 2, "rng": rng}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.save({**state, "rng": rng}, tmp_path / "top.pt")
    torch.save({"model_state_dict": state, "step": 2, "rng": rng}, tmp_path / "general.pt")
    for source in ("dcp", "top.pt", "general.pt"):
        target = tmp_path / f"out-{source}"
        merge(tmp_path / source, target, hf_model_path=ref, dtype="float32")
        written = _written(target)
        assert written.keys() == state.keys(), source
        assert all(torch.equal(written[k], state[k]) for k in state), source
    assert verify(tmp_path / "general.pt").ok


def test_a_lightning_ckpt_whose_hyperparameters_hold_objects_is_refused_saying_so(
    model_dir, tmp_path
):
    """save_hyperparameters() keeps the module's arguments (an argparse.Namespace, a
    transformers config) in the .ckpt: refused, since unpickling them runs code, with only
    the class named; now it says where such objects come from and how to save without them."""
    import argparse

    from shardstream.errors import UnsafeCheckpointError

    _, state = model_dir
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    torch.save(
        {
            "epoch": 0,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": {f"model.{k}": v for k, v in state.items()},
            "hyper_parameters": {"args": argparse.Namespace(lr=0.1)},
        },
        ckpt,
    )
    with pytest.raises(UnsafeCheckpointError, match="GLOBAL argparse.Namespace") as refused:
        merge(ckpt, tmp_path / "out", prefix="model.")
    assert "a PyTorch Lightning checkpoint" in str(refused.value)
    assert "save_hyperparameters(ignore=" in str(refused.value)


def test_a_folder_of_ckpt_files_is_refused_naming_them_and_the_newest(tmp_path):
    """Lightning's ModelCheckpoint writes checkpoints/epoch=N-step=M.ckpt, one file each:
    the folder was refused as holding no model files, none named. A run's optimizer and RNG
    files are no checkpoint to pass."""
    import os

    from shardstream.errors import CheckpointNotFoundError

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for when, name in enumerate(["epoch=1-step=4.ckpt", "epoch=0-step=2.ckpt", "optimizer.pt"]):
        torch.save({"state_dict": {"w": torch.zeros(2)}}, folder / name)
        os.utime(folder / name, (1000 + when, 1000 + when))
    os.utime(folder / "epoch=1-step=4.ckpt", (2000, 2000))
    with pytest.raises(CheckpointNotFoundError) as refused:
        merge(folder, tmp_path / "out")
    said = str(refused.value)
    assert "torch.save files (epoch=0-step=2.ckpt, epoch=1-step=4.ckpt)" in said, said
    assert said.endswith(f"e.g. the newest, {folder / 'epoch=1-step=4.ckpt'}"), said
    trainer = tmp_path / "checkpoint-10"  # a Trainer's checkpoint whose model was deleted
    trainer.mkdir()
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"x": torch.zeros(1)}, trainer / name)
    with pytest.raises(CheckpointNotFoundError) as refused:
        merge(trainer, tmp_path / "out")
    assert "torch.save files" not in str(refused.value)


def test_a_lightning_ckpt_restores_into_the_model_under_its_prefix(model_dir, tmp_path):
    """shardstream.load of a Lightning .ckpt with prefix="model.": the module's model, read
    under its attribute, into a live transformers model (prefix= had been DCP's alone)."""
    import shardstream

    _, state = model_dir
    ckpt = tmp_path / "last.ckpt"
    torch.save(
        {
            "pytorch-lightning_version": "2.6.6",
            "state_dict": {f"model.{k}": v for k, v in state.items()},
        },
        ckpt,
    )
    torch.manual_seed(1)
    live = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TEXT, tie_word_embeddings=False)
    )
    shardstream.load(ckpt, model=live, contents=("model",), prefix="model.")
    for name, tensor in live.state_dict().items():
        assert torch.equal(tensor, state[name]), name
