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
from safetensors.torch import load_file, save_file

from shardstream import merge
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
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    text = (reference / "config.json").read_text()
    assert '{"__float__": "Infinity"}' in text.replace("\n", "").replace("  ", "")
    source = tmp_path / "state"
    source.mkdir()
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads(text)
    if spelling == "bare":
        saved["time_step_limit"] = [0.0, math.inf]  # json.dumps writes Infinity
    (source / "config.json").write_text(json.dumps(saved))
    if spelling == "bare":
        assert math.isinf(hf.read_config(source)["time_step_limit"][1])
    merge(source, tmp_path / "merged")
    got, want = (
        load_file(tmp_path / "merged" / "model.safetensors"),
        load_file(reference / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


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
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    source = tmp_path / "state"
    source.mkdir()
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((reference / "config.json").read_text())
    del saved["architectures"]
    (source / "config.json").write_text(json.dumps(saved))
    merge(source, tmp_path / "merged")
    got, want = (
        load_file(tmp_path / "merged" / "model.safetensors"),
        load_file(reference / "model.safetensors"),
    )
    assert any(k.startswith("model.language_model.") for k in state)  # in-memory names
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
