"""verl's LoRA metadata is read with the strict JSON rules every checkpoint JSON file gets."""

from __future__ import annotations

import pytest

from shardstream.errors import CheckpointFormatError
from shardstream.formats.lora import ADAPTER_CONFIG, ADAPTER_DIR, META_FILE, lora_settings


def test_r_and_alpha_come_from_verls_meta_file(tmp_path):
    (tmp_path / META_FILE).write_text('{"r": 8, "lora_alpha": 16}')
    settings = lora_settings(tmp_path)
    assert (settings.r, settings.alpha, settings.rslora) == (8, 16.0, False)
    assert settings.scale == 2.0


def test_rslora_stated_by_the_adapter_config_alone_is_applied(tmp_path):
    """verl's meta file never states use_rslora; the adapter config PEFT wrote does."""
    (tmp_path / META_FILE).write_text('{"r": 4, "lora_alpha": 16}')
    (tmp_path / ADAPTER_DIR).mkdir()
    (tmp_path / ADAPTER_DIR / ADAPTER_CONFIG).write_text(
        '{"r": 4, "lora_alpha": 16, "use_rslora": true}'
    )
    settings = lora_settings(tmp_path)
    assert settings.rslora and settings.scale == 8.0  # 16 / sqrt(4), not 16 / 4
    assert lora_settings(tmp_path, {"r": 4, "lora_alpha": 16, "use_rslora": True}).scale == 8.0


def test_files_that_disagree_on_rslora_are_refused(tmp_path):
    (tmp_path / META_FILE).write_text('{"r": 4, "lora_alpha": 16, "use_rslora": false}')
    (tmp_path / ADAPTER_DIR).mkdir()
    (tmp_path / ADAPTER_DIR / ADAPTER_CONFIG).write_text(
        '{"r": 4, "lora_alpha": 16, "use_rslora": true}'
    )
    with pytest.raises(CheckpointFormatError, match="use_rslora=False but .* use_rslora=True"):
        lora_settings(tmp_path)


@pytest.mark.parametrize(
    "text", ['{"r": 8, "lora_alpha": Infinity}', '{"r": 8, "lora_alpha": 1e999}', "[8, 16]"]
)
def test_a_meta_file_with_odd_json_is_refused_by_name(tmp_path, text):
    (tmp_path / META_FILE).write_text(text)
    with pytest.raises(CheckpointFormatError, match=META_FILE):
        lora_settings(tmp_path)


def test_target_modules_match_only_the_adapted_modules():
    """An ``all-linear`` adapter on a VLM adapts ``visual.merger.mlp.0``: its last name, "0",
    also matches every ``layers.0``, and PEFT refused to load the adapter merge wrote."""
    from shardstream.engine.plan import GlobalTensor
    from shardstream.formats.lora import LoraSplit

    stored = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.2.mlp.0.weight",
        "visual.blocks.0.attn.proj.weight",
        "visual.merger.mlp.0.weight",
        "visual.merger.mlp.2.weight",
    ]
    adapted = [
        "model.layers.0.self_attn.q_proj",
        "visual.blocks.0.attn.proj",
        "visual.merger.mlp.0",
        "visual.merger.mlp.2",
    ]
    base = [GlobalTensor(name, "F32", (1,), ()) for name in stored]
    split = LoraSplit(base=base, factors={module: {} for module in adapted})
    chosen = split.target_modules
    assert chosen == ["merger.mlp.0", "mlp.2", "proj", "q_proj"]
    modules = {name.rsplit(".", 1)[0] for name in stored}
    modules |= {m.rsplit(".", k)[0] for m in list(modules) for k in range(1, m.count(".") + 1)}
    matched = {m for m in modules for s in chosen if m == s or m.endswith("." + s)}
    assert matched == set(adapted)  # as PEFT matches them: every adapted module, no other
    alone = LoraSplit(base=[], factors={module: {} for module in adapted})
    assert alone.target_modules == ["0", "2", "proj", "q_proj"]  # no other modules to tell
