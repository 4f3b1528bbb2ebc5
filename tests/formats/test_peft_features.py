"""PEFT features merge does not apply: DoRA, LoRA on an embedding, ``modules_to_save`` (a LoRA
critic's score head), several adapters in one model. Each wrote a model or adapter other than
the trained one with exit 0 (the extra tensors under the base model's names, or one adapter's
factors silently taking the other's place); merge and test now refuse them, naming the tensor,
and verify, which judges the files, passes them. Real PEFT models, saved with DCP as verl's
layout would hold them (PEFT's in-memory names, ``lora_train_meta.json`` beside them), the
model's config.json passed as ``--hf_model_path``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from shardstream import cli
from shardstream.testing.tiny_models import build_tiny_model, tiny_config

peft = pytest.importorskip("peft")

R, ALPHA = 4, 8


def _save(directory: Path, model: torch.nn.Module, config) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(dict(model.state_dict()), checkpoint_id=directory)
    config.save_pretrained(directory.parent / "hf")
    meta = {"r": R, "lora_alpha": ALPHA, "task_type": "CAUSAL_LM"}
    (directory / "lora_train_meta.json").write_text(json.dumps(meta))
    return directory


def _hf(ck: Path) -> list[str]:
    return ["--hf_model_path", str(ck.parent / "hf")]


def _peft_model(case: str, config):
    from peft import LoraConfig, get_peft_model

    lora = {"r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"]}
    base = build_tiny_model(config)
    if case == "dora":
        return get_peft_model(base, LoraConfig(**lora, use_dora=True))
    if case == "embedding":
        targets = ["q_proj", "v_proj", "embed_tokens"]
        return get_peft_model(base, LoraConfig(**{**lora, "target_modules": targets}))
    if case == "critic":  # verl's LoRA critic: PEFT keeps the score head in modules_to_save
        from transformers import Qwen2ForTokenClassification

        config.num_labels = 1
        return get_peft_model(
            Qwen2ForTokenClassification(config), LoraConfig(**lora, task_type="TOKEN_CLS")
        )
    if case == "lora_bias":
        return get_peft_model(base, LoraConfig(**lora, lora_bias=True))
    if case == "kasa":
        return get_peft_model(base, LoraConfig(**lora, kasa_config={}))
    if case == "two adapters":
        model = get_peft_model(base, LoraConfig(**lora))
        model.add_adapter("second", LoraConfig(**lora))
        return model
    return get_peft_model(base, LoraConfig(**lora))


@pytest.mark.parametrize(
    ("case", "shown"),
    [
        ("dora", "DoRA (lora_magnitude_vector)"),
        ("embedding", "LoRA on an embedding"),
        ("critic", "modules_to_save"),
        ("two adapters", "several PEFT adapters ('default', 'second')"),
        # tensors besides the factors, which were written into the base model as they were
        ("lora_bias", "q_proj.lora_B.default.bias'"),
        ("kasa", "q_proj.lora_diag.default'"),
    ],
)
def test_a_peft_feature_merge_does_not_apply_is_refused(tmp_path, capsys, case, shown):
    config = tiny_config("qwen2")
    ck = _save(tmp_path / "ck", _peft_model(case, config), config)
    for fuse in ([], ["--fuse-lora"]):
        target = tmp_path / f"out{len(fuse)}"
        argv = ["merge", "--local_dir", str(ck), "--target_dir", str(target), *fuse, *_hf(ck)]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert shown in err and "merge does not apply it" in err, err
        assert not target.exists()
    ref = tmp_path / "ref"
    build_tiny_model(config).save_pretrained(ref)
    assert cli.main(["test", "--local_dir", str(ck), "--test_hf_dir", str(ref)]) == 1
    assert shown in capsys.readouterr().err
    assert cli.main(["verify", str(ck)]) == 0, capsys.readouterr()


def test_plain_lora_merges_and_says_which_scale_it_assumed(tmp_path, capsys):
    """verl's lora_train_meta.json does not record use_rslora: the fused weights and the
    adapter take lora_alpha / r, and merge says so."""
    config = tiny_config("qwen2")
    model = _peft_model("plain", config)
    ck = _save(tmp_path / "ck", model, config)
    argv = ["merge", "--local_dir", str(ck), "--target_dir", str(tmp_path / "o"), "--fuse-lora"]
    argv += _hf(ck)
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert f"LoRA scale taken as lora_alpha / r ({ALPHA / R:g})" in err, err
    assert "if it did, the fused weights are wrong" in err, err


def test_fusing_a_lora_on_a_tied_head_is_refused(tmp_path, capsys):
    """save_pretrained writes no tied head, so the head's fused LoRA update was dropped
    silently; the adapter keeps it, so merging without --fuse-lora works."""
    from peft import LoraConfig, get_peft_model

    config = tiny_config("qwen2", tie_word_embeddings=True)
    lora = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT: a tied target "can lead to complications"
        model = get_peft_model(build_tiny_model(config), lora)
    ck = _save(tmp_path / "ck", model, config)
    argv = ["merge", *_hf(ck), "--local_dir", str(ck), "--target_dir"]
    assert cli.main([*argv, str(tmp_path / "fused"), "--fuse-lora"]) == 2
    err = capsys.readouterr().err
    assert "LoRA on 'lm_head'" in err and "ties to the input embedding" in err, err
    assert not (tmp_path / "fused").exists()
    assert cli.main([*argv, str(tmp_path / "split")]) == 0, capsys.readouterr().err
    adapter = json.loads((tmp_path / "split" / "lora_adapter" / "adapter_config.json").read_text())
    assert "lm_head" in adapter["target_modules"]


def test_hf_model_of_a_peft_model_is_refused_when_the_manager_is_built(tmp_path):
    """The export wrote PEFT's names (``base_model.model.*.base_layer.weight``), which
    transformers loaded as a model of random weights, and verify passed it."""
    from shardstream import CheckpointConfig, CheckpointManager
    from shardstream.errors import UsageError

    config = tiny_config("qwen2")
    model = _peft_model("plain", config)
    contents = ("model", "hf_model")
    with pytest.raises(UsageError, match="PEFT .LoRA. model .* merge the checkpoint"):
        CheckpointManager(
            CheckpointConfig(tmp_path / "run", save_contents=contents), model, hf_config=config
        )
    manager = CheckpointManager(  # without hf_model: saved, and merged as base + adapter
        CheckpointConfig(tmp_path / "run", save_contents=("model",)), model, hf_config=config
    )
    manager.save(1)
    manager.close()


def test_an_adapter_alone_merges_without_the_no_config_note(tmp_path, capsys):
    """An adapter-only checkpoint (save_lora_only, or ignore_frozen_params=True of a PEFT
    model) merged to a correct adapter, with a note that transformers could not load the
    weights as a model for want of config.json: an adapter is loaded onto its base."""
    import torch.distributed.checkpoint as dcp

    model = _peft_model("plain", tiny_config("qwen2"))
    adapter = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(adapter, checkpoint_id=tmp_path / "ck")
    meta = {"r": R, "lora_alpha": ALPHA, "task_type": "CAUSAL_LM"}
    (tmp_path / "ck" / "lora_train_meta.json").write_text(json.dumps(meta))
    argv = ["merge", "--local_dir", str(tmp_path / "ck"), "--target_dir", str(tmp_path / "o")]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "found no config.json" not in err, err
    assert (tmp_path / "o" / "adapter_model.safetensors").is_file()


def _with_peft_config(tmp_path: Path, **settings) -> Path:
    """A plain LoRA checkpoint with PEFT's own adapter_config.json beside it, saved by PEFT
    and then given ``settings``."""
    config = tiny_config("qwen2")
    model = _peft_model("plain", config)
    ck = _save(tmp_path / "ck", model, config)
    model.peft_config["default"].save_pretrained(str(tmp_path / "adapter"))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (ck / "adapter_config.json").write_text(json.dumps({**written, **settings}))
    return ck


def test_peft_own_adapter_config_of_a_plain_lora_merges(tmp_path, capsys):
    """Every key PEFT writes for plain LoRA (its defaults included) is one merge knows."""
    ck = _with_peft_config(tmp_path)
    argv = ["merge", "--local_dir", str(ck), "--target_dir", str(tmp_path / "o"), "--fuse-lora"]
    assert cli.main([*argv, *_hf(ck)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("settings", "shown"),
    [
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens is set (activated LoRA"),
        ({"use_bdlora": {"nblocks": 2}}, "use_bdlora is set (block-diagonal"),
        ({"kasa_config": {}}, "kasa_config is set (KaSA"),
        ({"a_future_variant": {"on": True}}, "a_future_variant is set (a PEFT setting merge"),
        ({"peft_type": "LOHA"}, "peft_type is LOHA; merge reads LoRA adapters only"),
    ],
)
def test_an_adapter_setting_merge_does_not_apply_is_refused(tmp_path, capsys, settings, shown):
    """The adapter's tensors are plain lora_A/lora_B, but adapter_config.json says they mean
    more (or something merge does not know): the adapter was written as plain LoRA and the
    fused weights as W + scale * B @ A, exit 0. Refused, naming the file and the key."""
    ck = _with_peft_config(tmp_path, **settings)
    for fuse in ([], ["--fuse-lora"]):
        target = tmp_path / f"out{len(fuse)}"
        argv = ["merge", "--local_dir", str(ck), "--target_dir", str(target), *fuse, *_hf(ck)]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert shown in err and str(ck / "adapter_config.json") in err, err
        assert not target.exists()
