"""The HF output policy and writer that merge and the training export share."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from shardstream.engine.copy import Buffers, Streamer
from shardstream.engine.dtypes import is_floating
from shardstream.engine.endpoints import TensorEndpoint, live_block
from shardstream.engine.plan import GlobalTensor
from shardstream.formats import hf
from shardstream.formats.hf_writer import HfModelFiles, output_tensors
from shardstream.formats.writer import fill_range, plan_file, read_chunk_digest
from shardstream.training.hf_export import _plan_files
from shardstream.units import parse_size


def test_floating_tensors_take_the_output_dtype_and_others_keep_theirs():
    assert [is_floating(c) for c in ("F64", "F32", "F16", "BF16")] == [True] * 4
    assert not any(is_floating(c) for c in ("I64", "U8", "BOOL", "F8_E4M3", "C64"))
    assert hf.cast_dtype("F32", "BF16") == "BF16"
    assert hf.cast_dtype("I64", "BF16") == "I64"
    assert hf.cast_dtype("F32", None) == "F32"


def test_default_max_shard_size_is_the_installed_save_pretrained_s():
    import inspect

    from transformers import PreTrainedModel

    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"]
    assert hf.default_shard_bytes() == parse_size(default.default)


@pytest.mark.parametrize(
    "version, size", [("4.57.1", "5GB"), ("5.0.0", "50GB"), ("5.25.0", "50GB"), (None, "50GB")]
)
def test_default_max_shard_size_follows_the_transformers_version(monkeypatch, version, size):
    from shardstream.formats import hf_names_cache

    monkeypatch.setattr(hf_names_cache, "transformers_version", lambda: version)
    assert hf.default_shard_bytes() == parse_size(size)


def _global(name: str, dtype: str, shape: tuple[int, ...]) -> GlobalTensor:
    return GlobalTensor(name, dtype, shape, ())


def test_output_tensors_apply_drop_dtype_and_names():
    tensors = [
        _global("model.embed_tokens.weight", "F32", (4, 2)),
        _global("lm_head.weight", "F32", (4, 2)),
        _global("steps", "I64", (3,)),
    ]
    config = {"tie_word_embeddings": True}
    drop = hf.tied_duplicates(tensors, config, False)
    assert drop == {"lm_head.weight"}
    outputs = output_tensors(tensors, "BF16", drop, config)
    assert [(t.name, t.dtype) for t in outputs] == [
        ("model.embed_tokens.weight", "BF16"),
        ("steps", "I64"),
    ]
    # The output is named as save_pretrained names it (here: torch.compile's prefix
    # stripped); the source keeps the stored name.
    compiled = [_global("_orig_mod." + t.name, t.dtype, t.shape) for t in tensors]
    renamed = output_tensors(compiled, None, hf.tied_duplicates(compiled, config, False), config)
    assert [(t.name, t.source.name) for t in renamed][0] == (
        "model.embed_tokens.weight",
        "_orig_mod.model.embed_tokens.weight",
    )
    assert [t.name for t in renamed] == ["model.embed_tokens.weight", "steps"]


def test_no_tie_without_an_input_embedding():
    tensors = [_global("wte.weight", "F32", (4, 2)), _global("lm_head.weight", "F32", (4, 2))]
    assert hf.tied_duplicates(tensors, {"tie_word_embeddings": True}, False) == set()


def test_export_plans_with_the_same_policy(tmp_path):
    """dtype and tied head from the transformers config, or from the source's config.json."""
    from transformers import Qwen2Config

    live = {
        "model.embed_tokens.weight": torch.zeros(4, 2),
        "lm_head.weight": torch.zeros(4, 2),
        "model.norm.steps": torch.zeros(3, dtype=torch.int64),
    }
    config = Qwen2Config(
        vocab_size=4, hidden_size=2, num_attention_heads=1, num_key_value_heads=1,
        tie_word_embeddings=True, dtype=torch.bfloat16,
    )  # fmt: skip
    out_dtype, files, _ = _plan_files(live, config, None, None)
    names = {t.name: t.dtype for _, group in files for t in group}
    assert out_dtype == "BF16" and names == {
        "model.embed_tokens.weight": "BF16",
        "model.norm.steps": "I64",
    }

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    out_dtype, files, _ = _plan_files(live, None, tmp_path, None)
    assert out_dtype == "F16" and len(files[0][1]) == 3
    assert _plan_files(live, None, tmp_path, "float32")[0] == "F32"


def _model(tmp_path, max_bytes: int):
    values = {
        "a": torch.arange(3000, dtype=torch.float32).reshape(100, 30),
        "b": torch.arange(2000, dtype=torch.float32),
        "steps": torch.arange(5, dtype=torch.int64),
    }
    sources = []
    for name, value in values.items():
        block = live_block(name, value, (0,) * value.dim())
        sources.append(GlobalTensor(name, block.dtype, block.shape, (block,)))
    outputs = output_tensors(sources, "BF16", set(), {})
    files = hf.plan_hf_files(outputs, max_bytes)
    directory = tmp_path / "out"
    jobs = [plan_file(str(directory / n), group, chunk_bytes=1024) for n, group in files]
    model = HfModelFiles(directory, files, jobs)
    endpoints = {n: TensorEndpoint(n, v) for n, v in values.items()}
    return values, model, Streamer(endpoints.__getitem__, Buffers.sized(1 << 16, 2.0))


def test_files_sealed_from_the_writers_parts_load_with_safetensors(tmp_path):
    values, model, streamer = _model(tmp_path, 8_000)
    assert len(model.files) > 1
    model.create()
    parts = []
    for index, job in enumerate(model.jobs):
        # Two writers per file: one fills and hashes, the other's chunk is read back.
        digests = fill_range(job, streamer)
        parts.append({(index, 0): digests[:-1]})
        parts.append({(index, job.chunk_count - 1): [read_chunk_digest(job, job.chunk_count - 1)]})
    written = model.seal(parts)
    assert [f.path for f in written] == [job.path for job in model.jobs]
    loaded = {}
    for job in model.jobs:
        loaded.update(load_file(job.path))
    for name, value in values.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(loaded[name], expected), name
    index = (model.directory / hf.INDEX_FILE).read_text()
    assert index.endswith("}\n") and set(json.loads(index)["weight_map"]) == set(values)


def test_a_chunk_no_writer_hashed_is_refused(tmp_path):
    _, model, streamer = _model(tmp_path, hf.default_shard_bytes())
    model.create()
    job = model.jobs[0]
    digests = fill_range(job, streamer)
    with pytest.raises(AssertionError, match="has no digest"):
        model.seal([{(0, 1): digests[1:]}])
    with pytest.raises(AssertionError, match="digests"):
        model.seal([{(0, 0): digests[:-1]}])


def test_config_names_the_output_dtype_under_its_own_key(tmp_path):
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    (source / "config.json").write_text(json.dumps({"torch_dtype": "float32", "x": 1}))
    (source / "tokenizer.json").write_text("{}")
    hf.write_configs(target, "BF16", source)
    assert json.loads((target / "config.json").read_text()) == {"torch_dtype": "bfloat16", "x": 1}
    assert (target / "tokenizer.json").read_text() == "{}"
    hf.write_configs(target, None, source)
    assert (target / "config.json").read_bytes() == (source / "config.json").read_bytes()
