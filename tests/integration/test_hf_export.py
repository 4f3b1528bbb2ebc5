"""hf_model during training: every rank writes its own slices; transformers loads the result
and its logits equal the model's."""

from __future__ import annotations

import pytest
import torch

from shardstream import verify
from shardstream.formats import native
from shardstream.testing.distributed import run
from shardstream.testing.tiny_models import build_tiny_model, tiny_config

from . import workers


@pytest.mark.parametrize(
    "shared, tie, world, async_save, share_weights",
    [
        (None, False, 3, False, False),
        (False, False, 2, False, False),
        (None, True, 2, False, False),
        # async: rows read back from the rank files, or (weights shared) live under the guard;
        # both shipped to rank 0
        (False, True, 3, True, False),
        (False, False, 2, True, True),
    ],
    ids=["shared-fs-detected", "ship-to-rank0", "tied", "async-from-rank-files", "async-live"],
)
def test_hf_model_export_loads_with_transformers(
    tmp_path, shared, tie, world, async_save, share_weights
):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "run"
    args = (shared, tie, async_save, share_weights)
    full = run(workers.hf_export_run, world, str(root), *args)[0]["full"]
    export = root / "global_step_1" / "huggingface"
    assert verify(root).ok
    # The saving layout is recorded even when every weight is stored in huggingface/ only.
    manifest = native.read_manifest(root / "global_step_1")
    assert manifest["mesh"] == {"shape": [world], "dim_names": ["fsdp"]}
    placements = {entry["placement"] for entry in manifest["tensors"].values()}
    assert placements == {"fsdp:S(0)"}
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = model.state_dict()
    for name, tensor in full.items():
        if tie and name == "lm_head.weight":
            continue
        assert torch.equal(state[name], tensor), name
    reference = build_tiny_model(tiny_config("qwen2", tie_word_embeddings=tie), seed=3)
    reference.load_state_dict(full)
    ids = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("world", [1, 2])
def test_a_head_untied_by_hand_is_exported_as_save_pretrained_writes_it(tmp_path, world):
    """The config ties the head, but the model holds it apart (a Parameter of its own, other
    values): save_pretrained writes it, and so must the export, or the trained head is lost
    and the loaded model uses the embedding in its place."""
    from safetensors.torch import load_file

    root = tmp_path / "run"
    full = run(workers.hf_export_untied_by_hand_run, world, str(root))[0]["full"]
    assert not torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    export = root / "global_step_1" / "huggingface"
    written = load_file(export / "model.safetensors")
    assert written.keys() == full.keys()
    assert all(torch.equal(written[k], full[k]) for k in full)
    assert verify(root).ok


@pytest.mark.slow
def test_ranks_whose_configs_differ_are_refused_by_name(tmp_path):
    """Each rank plans the export from its own config; a rank that plans other files would
    write its rows at other offsets, so the save fails on every rank and commits nothing."""
    results = run(workers.hf_export_config_differs_run, 2, str(tmp_path / "run"))
    for result in results:
        assert result["error"] and "plans the export differently" in result["error"], results
    assert not (tmp_path / "run" / "global_step_1").exists()


def test_a_config_dtype_set_on_rank_0_alone_that_changes_no_byte_saves(tmp_path):
    """``save_pretrained`` on rank 0 alone (``if rank == 0:``) sets that rank's
    ``config.dtype`` to the weights' float32, where the other ranks' say none: every later
    hf_model save was refused ("dtype None against F32") though both plan the same files."""
    import json

    from safetensors.torch import load_file

    results = run(workers.hf_export_config_differs_run, 2, str(tmp_path / "run"), True)
    assert [r["error"] for r in results] == [None, None], results
    hf_dir = tmp_path / "run" / "global_step_1" / "huggingface"
    written = load_file(hf_dir / "model.safetensors")
    assert written.keys() == results[0]["model"].keys()
    for name, tensor in results[0]["model"].items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "float32"


def test_a_step_saved_without_hf_model_keeps_the_config_merge_needs(tmp_path):
    """hf_config= without "hf_model": the step holds huggingface/config.json (and the
    tokenizer's files), as verl's steps do, so merge writes a model transformers loads."""
    import json

    import transformers

    import shardstream
    from shardstream import CheckpointConfig, CheckpointManager

    config = tiny_config("qwen2")
    model = build_tiny_model(config, seed=0)
    cfg = CheckpointConfig(str(tmp_path / "run"), save_contents=("model",))
    with CheckpointManager(cfg, model=model, hf_config=config) as mgr:
        mgr.save(1)
    step = tmp_path / "run" / "global_step_1"
    assert json.loads((step / "huggingface" / "config.json").read_text())["model_type"] == "qwen2"
    assert not list((step / "huggingface").glob("*.safetensors"))
    assert verify(step).ok
    shardstream.merge(step, tmp_path / "merged")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", output_loading_info=True
    )
    assert not any(info.values()), info  # every weight came from the files
    want = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, want[name].to(value.dtype)), name


def test_exported_config_names_the_class_and_dtype_as_save_pretrained_does(tmp_path):
    """A model built from a config names no ``architectures`` (vLLM picks the model class by
    it; verl's merger failed without it) and, with no dtype asked for, the export wrote no
    ``dtype``: save_pretrained writes both."""
    import json

    from shardstream import CheckpointConfig, CheckpointManager

    config = tiny_config("qwen2")
    config.architectures = None
    model = build_tiny_model(config, seed=0, dtype=torch.bfloat16)
    cfg = CheckpointConfig(str(tmp_path / "run"), save_contents=("model", "hf_model"))
    with CheckpointManager(cfg, model=model, hf_config=config) as mgr:
        mgr.save(1)
    exported = tmp_path / "run" / "global_step_1" / "huggingface" / "config.json"
    model.save_pretrained(tmp_path / "reference")
    reference = json.loads((tmp_path / "reference" / "config.json").read_text())
    written = json.loads(exported.read_text())
    assert written["architectures"] == reference["architectures"] == ["Qwen2ForCausalLM"]
    assert written["dtype"] == reference["dtype"] == "bfloat16"
