"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def _qwen3_moe_config_text() -> str:
    from shardstream.testing.tiny_models import tiny_moe_config

    return json.dumps(tiny_moe_config())


@pytest.fixture
def qwen3_moe_config(_qwen3_moe_config_text) -> dict:
    """A tiny Qwen3-MoE config.json's content, as read back from the file (3 experts of width
    6, hidden 8): a fresh copy per test."""
    return json.loads(_qwen3_moe_config_text)
