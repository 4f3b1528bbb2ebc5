"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def _qwen3_moe_config_text() -> str:
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=8,
        intermediate_size=16,
        moe_intermediate_size=6,
        num_experts=3,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=20,
    ).to_dict()
    return json.dumps({**config, "architectures": ["Qwen3MoeForCausalLM"]})


@pytest.fixture
def qwen3_moe_config(_qwen3_moe_config_text) -> dict:
    """A tiny Qwen3-MoE config.json's content, as read back from the file (3 experts of width
    6, hidden 8): a fresh copy per test."""
    return json.loads(_qwen3_moe_config_text)
