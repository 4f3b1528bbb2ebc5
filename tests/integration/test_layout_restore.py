"""Restore from a model that save_pretrained wrote in its checkpoint layout (the Trainer's
checkpoint-N without FSDP): Qwen2.5-VL's renamed towers, Qwen3-MoE's per-expert tensors into
the fused ones, a tied head save_pretrained leaves out; model, optimizer and scheduler bit
for bit, at 1 process and into FSDP2 at 2 ranks."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from shardstream.testing.distributed import run

from . import layout_restore_workers as lw
from .workers import assert_nested_equal


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_moe", "qwen2-tied"])
def trained(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    run(lw.save_run, 1, str(root), request.param)
    return request.param, root, torch.load(root / "reference.pt", weights_only=True)


def test_the_saved_layout_differs_from_the_model_s_names(trained):
    """The premise: the Trainer's model file holds save_pretrained's names, not the model's."""
    case, root, reference = trained
    with safe_open(root / "out" / lw.CHECKPOINT / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    held = set(reference["model"])
    assert saved != held
    if case == "qwen3_moe":
        assert any(".experts.0.gate_proj.weight" in k for k in saved)
    if case == "qwen2-tied":
        assert held - saved == {"lm_head.weight"}


@pytest.mark.parametrize("world", [1, 2], ids=["plain", "fsdp2"])
def test_restores_into_the_model_s_own_names(trained, world):
    case, root, reference = trained
    for rank, result in enumerate(run(lw.restore_run, world, str(root), case)):
        assert result["step"] == lw.STEPS
        assert_nested_equal(result["state"], reference, f"{case} rank {rank}")


def test_a_model_alone_loads_into_fsdp2_in_the_model_s_own_names(trained):
    """The directory ``save_model`` wrote (no training state): ``contents=("model",)``."""
    case, root, reference = trained
    for rank, state in enumerate(run(lw.load_model_run, 2, str(root), case)):
        assert_nested_equal(state["model"], reference["model"], f"{case} rank {rank}")


def test_a_model_alone_loads_into_a_compiled_model(tmp_path):
    """torch.compile's wrapper names every tensor ``_orig_mod.*``: the saved names are found
    without it (and without config.json, which says nothing of it)."""
    import shardstream
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    saved = build_tiny_model(tiny_config("qwen2"), seed=0)
    saved.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "config.json").unlink()
    live = torch.compile(build_tiny_model(tiny_config("qwen2"), seed=4))
    assert next(iter(live.state_dict())).startswith("_orig_mod.")
    shardstream.load(tmp_path / "model", model=live, contents=("model",))
    want = saved.state_dict()
    got = {k.removeprefix("_orig_mod."): v for k, v in live.state_dict().items()}
    assert_nested_equal(got, want, "compiled")


def test_a_model_alone_with_more_tensors_loads_and_says_what_it_left(tmp_path, caplog):
    """A model alone may hold tensors the in-memory model drops (DeepSeek's multi-token-
    prediction layers): the others load, and a warning names what was not read."""
    from safetensors.torch import load_file, save_file

    import shardstream
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    saved = build_tiny_model(tiny_config("qwen2"), seed=0)
    saved.save_pretrained(tmp_path / "model")
    weights = load_file(tmp_path / "model" / "model.safetensors")
    weights["model.layers.9.mlp.up_proj.weight"] = torch.ones(4, 4)
    save_file(weights, tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    live = build_tiny_model(tiny_config("qwen2"), seed=4)
    with caplog.at_level("WARNING", logger="shardstream"):
        shardstream.load(tmp_path / "model", model=live, contents=("model",))
    assert_nested_equal(dict(live.state_dict()), dict(saved.state_dict()), "loaded")
    assert "'model.layers.9.mlp.up_proj.weight'" in caplog.text, caplog.text
