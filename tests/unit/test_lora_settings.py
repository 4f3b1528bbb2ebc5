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
