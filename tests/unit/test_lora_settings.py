"""verl's LoRA metadata is read with the strict JSON rules every checkpoint JSON file gets."""

from __future__ import annotations

import pytest

from shardstream.errors import CheckpointFormatError
from shardstream.formats.lora import META_FILE, lora_settings


def test_r_and_alpha_come_from_verls_meta_file(tmp_path):
    (tmp_path / META_FILE).write_text('{"r": 8, "lora_alpha": 16}')
    assert lora_settings(tmp_path) == (8, 16.0)


@pytest.mark.parametrize(
    "text", ['{"r": 8, "lora_alpha": Infinity}', '{"r": 8, "lora_alpha": 1e999}', "[8, 16]"]
)
def test_a_meta_file_with_odd_json_is_refused_by_name(tmp_path, text):
    (tmp_path / META_FILE).write_text(text)
    with pytest.raises(CheckpointFormatError, match=META_FILE):
        lora_settings(tmp_path)
