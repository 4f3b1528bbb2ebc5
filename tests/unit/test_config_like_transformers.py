"""config.json read as transformers reads it. A non-finite float, as transformers writes
Mamba2's (and Bamba's, NemotronH's, Granite 4.0's) default ``time_step_limit=(0.0, inf)``:
5.x as a ``{"__float__": "Infinity"}`` tag, 4.x as a bare ``Infinity`` (both were refused). A
vision-language config without ``architectures``: its image-text class, as verl loads it (the
causal-LM class was tried and failed to build)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pretrained_pair import assert_merges_as_saved, state_and_reference

from shardstream.formats import hf

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("spelling", ["tag", "bare"])
def test_a_mamba2_config_with_infinity_merges_as_save_pretrained(tmp_path, spelling):
    config = transformers.Mamba2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=8, num_heads=4,
        head_dim=16, expand=2, n_groups=1, chunk_size=16,
    )  # fmt: skip
    assert math.isinf(config.time_step_limit[1])
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(config)
    text = json.dumps(json.loads(config.to_json_string()))  # as save_pretrained spells it
    assert '{"__float__": "Infinity"}' in text

    def spelled(saved: dict) -> None:
        if spelling == "bare":
            saved["time_step_limit"] = [0.0, math.inf]  # json.dumps writes Infinity

    source, reference, _ = state_and_reference(tmp_path, model, spelled)
    if spelling == "bare":
        assert math.isinf(hf.read_config(source)["time_step_limit"][1])
    assert_merges_as_saved(source, reference, tmp_path / "merged")


def test_a_vlm_config_without_architectures_merges_as_save_pretrained(tmp_path):
    """Qwen3.5's composite config maps to Qwen3_5ForCausalLM too, which cannot be built from
    it; its image-text class is what verl builds."""
    text = dict(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, head_dim=8, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
        patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
    )  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    source, reference, state = state_and_reference(
        tmp_path, model, lambda saved: saved.pop("architectures")
    )
    assert any(k.startswith("model.language_model.") for k in state)  # in-memory names
    assert_merges_as_saved(source, reference, tmp_path / "merged")
