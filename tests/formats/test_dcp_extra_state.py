"""A module's ``get_extra_state`` in a DCP checkpoint: DCP pickles it as a bytes entry. merge
writes the tensors, leaves the entry out (safetensors holds tensors only) and says which;
inspect lists it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from shardstream import cli


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.amax = 2.5

    def get_extra_state(self) -> dict:
        return {"amax": self.amax}

    def set_extra_state(self, state: dict) -> None:
        self.amax = state["amax"]


class Tagged(torch.nn.Module):
    def get_extra_state(self) -> str:
        return "fp8-recipe-1"

    def set_extra_state(self, state: str) -> None:
        pass


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.block = Scaled()
        self.tag = Tagged()


@pytest.mark.parametrize("nested", [True, False], ids=["under_model", "top_level"])
def test_extra_state_is_named_and_left_out(tmp_path, capsys, nested):
    torch.manual_seed(0)
    state = Tiny().state_dict()
    assert "block._extra_state" in state  # the module's own non-tensor entry
    saved = {"model": state, "step": 3} if nested else state
    source = tmp_path / "ckpt"
    dcp.save(saved, checkpoint_id=str(source), no_dist=True)
    # DCP flattens the dict get_extra_state returns, and pickles each value
    entries = [
        ("model." if nested else "") + k for k in ("block._extra_state.amax", "tag._extra_state")
    ]

    assert cli.main(["inspect", str(source)]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if "non-tensor" in line]
    assert len(listed) == 1 and all(e in listed[0] for e in entries)

    target = tmp_path / "out"
    assert cli.main(["merge", "--local_dir", str(source), "--target_dir", str(target)]) == 0
    err = capsys.readouterr().err
    assert "left out 2 non-tensor entries of the model's state ('" in err
    assert all(repr(e) in err for e in entries)
    merged = load_file(target / "model.safetensors")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert set(merged) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(merged[name], tensor), name

    assert (
        cli.main(
            ["merge", "--local_dir", str(source), "--target_dir", str(tmp_path / "j"), "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["not_tensors"] == entries


def test_restore_says_which_extra_state_it_leaves_as_the_live_model_has_it(tmp_path, caplog):
    """Restored tensors only, and left a dict of extra state (older TransformerEngine's FP8
    metadata) at its live value without a word."""
    import logging

    import shardstream

    torch.manual_seed(0)
    saved = Tiny()
    saved.block.amax = 7.0
    dcp.save({"model": saved.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    torch.manual_seed(1)
    live = Tiny()
    with caplog.at_level(logging.WARNING, logger="shardstream.training.load"):
        shardstream.load(tmp_path / "ck", model=live, contents=("model",))
    assert torch.equal(live.embed.weight, saved.embed.weight)
    assert live.block.amax == 2.5  # not restored, and now said
    said = [r.getMessage() for r in caplog.records]
    assert any("block (dict)" in m and "tag (str)" in m and "not restored" in m for m in said)
