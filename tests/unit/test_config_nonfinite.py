"""A config.json holding a non-finite float, as transformers writes Mamba2's (and Bamba's,
NemotronH's, Granite 4.0's) default ``time_step_limit=(0.0, inf)``: 5.x as a ``{"__float__":
"Infinity"}`` tag, 4.x as a bare ``Infinity``. Merge read it as transformers does and writes
what save_pretrained writes; both were refused."""

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
