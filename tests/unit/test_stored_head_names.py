"""A head stored under a name that is not the model's (one flipped bit, a stray prefix, a
trailing space): merge wrote it as it was, exit 0, and transformers started the model's head
at random. Any name below ``lm_head.`` counted as the head, and the missing head was excused
whenever a name did not start with ``model.``; now only a PEFT wrapper's weight counts, and
only a critic's head (``score``, ``classifier``) excuses it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardstream import merge
from shardstream.errors import CheckpointFormatError
from shardstream.testing.tiny_models import build_layout_model, write_tiny_hf_model


def _renamed_head(directory, new: str) -> None:
    path = directory / "model.safetensors"
    state = load_file(path)
    state[new] = state.pop("lm_head.weight")
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "new", ["Lm_head.weight", "lm_head.weighT", "lm_head.weight ", "module.lm_head.weight"]
)
def test_an_untied_head_under_another_name_is_refused(tmp_path, new):
    model = write_tiny_hf_model(tmp_path / "hf", tie_word_embeddings=False)
    _renamed_head(model, new)
    with pytest.raises(CheckpointFormatError, match="holds no lm_head.weight"):
        merge(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_head_of_a_model_transformers_plans_under_another_name_is_refused(tmp_path):
    """The same where transformers builds the model (Qwen3-MoE): the missing head was
    excused by the stray name."""
    model = build_layout_model("qwen3_moe")
    model.config.tie_word_embeddings = False
    model.save_pretrained(tmp_path / "hf")
    _renamed_head(tmp_path / "hf", "Lm_head.weight")
    with pytest.raises(CheckpointFormatError, match="lm_head"):
        merge(tmp_path / "hf", tmp_path / "out")


def test_a_critics_score_beside_a_causal_lm_config_still_merges(tmp_path):
    """verl saves its critic's ``score`` head with the actor's CausalLM config.json."""
    model = write_tiny_hf_model(tmp_path / "hf", tie_word_embeddings=False)
    path = model / "model.safetensors"
    state = load_file(path)
    state["score.weight"] = torch.zeros(1, state.pop("lm_head.weight").shape[1])
    save_file(state, path, metadata={"format": "pt"})
    summary = merge(model, tmp_path / "out")
    assert "score.weight" in load_file(tmp_path / "out" / "model.safetensors")
    assert summary.tensors == len(state)
