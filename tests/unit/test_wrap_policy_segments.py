"""fsdp1_shards.wrap_policy_segments: where verl's FSDP1 wrap policy puts a model's parameters
in its flat parameters, read from the model's own classes (no FSDP1 model, no process group)."""

from __future__ import annotations

import torch

from shardstream.testing.tiny_models import build_tiny_model, tiny_config
from shardstream.training.fsdp1_shards import wrap_policy_segments


def _model(tie: bool) -> torch.nn.Module:
    return build_tiny_model(tiny_config("qwen2", tie_word_embeddings=tie), seed=0)


def test_root_unit_first_then_one_unit_per_decoder_layer_offsets_packed():
    model = _model(tie=False)
    (units,) = wrap_policy_segments(model, torch.optim.AdamW(model.parameters()))
    layers = len(model.model.layers)
    assert len(units) == 1 + layers
    assert [fqn for fqn, _, _ in units[0]] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    for index, unit in enumerate(units[1:]):
        layer = dict(model.model.layers[index].named_parameters())
        assert [fqn for fqn, _, _ in unit] == [f"model.layers.{index}.{n}" for n in layer]
    params = dict(model.named_parameters())
    for unit in units:
        at = 0
        for fqn, shape, offset in unit:
            assert shape == tuple(params[fqn].shape) and offset == at
            at += params[fqn].numel()


def test_tied_weights_are_held_once():
    model = _model(tie=True)
    (units,) = wrap_policy_segments(model, torch.optim.AdamW(model.parameters()))
    assert [fqn for fqn, _, _ in units[0]] == ["model.embed_tokens.weight", "model.norm.weight"]


def test_units_split_over_optimizer_groups_or_no_unit_classes_give_no_guess():
    model = _model(tie=False)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    rest = [p for n, p in model.named_parameters() if "norm" not in n]
    split = torch.optim.AdamW([{"params": rest}, {"params": norms, "weight_decay": 0.0}])
    assert wrap_policy_segments(model, split) is None  # a layer's norms apart from its weights
    model._no_split_modules = None
    assert wrap_policy_segments(model, torch.optim.AdamW(model.parameters())) is None
    frozen = _model(tie=False)
    assert wrap_policy_segments(frozen, torch.optim.AdamW(list(frozen.parameters())[1:])) is None
