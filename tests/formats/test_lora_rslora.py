"""Rank-stabilised LoRA (PEFT's ``use_rslora``): merge scales ``B @ A`` by ``alpha / sqrt(r)``
when fusing, and writes ``use_rslora`` into the adapter it exports, so PEFT itself (loading
that adapter onto the merged base model and merging it) gives the fused weights merge wrote.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardstream.cli import main
from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoint

R, ALPHA = 3, 6


@pytest.fixture(scope="module")
def rslora_actor(tmp_path_factory) -> Path:
    """A verl LoRA checkpoint (lora_train_meta.json and lora_adapter/) whose adapter config
    says use_rslora, as a run with ``LoraConfig(use_rslora=True)`` saves it."""
    root = tmp_path_factory.mktemp("rslora")
    fixture = VerlFixture(
        world_size=2, lora=True, lora_layout="both", lora_rank=R, lora_alpha=ALPHA
    )
    actor = Path(write_verl_checkpoint(root, fixture))
    config = actor / "lora_adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_rslora": True}))
    return actor


def _merge(actor: Path, target: Path, *flags: str) -> None:
    argv = ["merge", "--local_dir", str(actor), "--target_dir", str(target), "--quiet"]
    assert main([*argv, "--dtype", "float32", *flags]) == 0


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_fused_weights_are_what_peft_merges_with_rslora(rslora_actor, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    _merge(rslora_actor, tmp_path / "split")
    adapter = json.loads((tmp_path / "split" / "lora_adapter" / "adapter_config.json").read_text())
    assert adapter["use_rslora"] is True and adapter["r"] == R
    _merge(rslora_actor, tmp_path / "fused", "--fuse-lora")
    fused = _tensors(tmp_path / "fused")

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "split", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "split" / "lora_adapter")
    from peft.tuners.lora import LoraLayer

    scales = {m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)}
    assert scales and all(s == pytest.approx(ALPHA / math.sqrt(R)) for s in scales)
    expected = model.merge_and_unload().state_dict()

    base_weights = _tensors(tmp_path / "split")
    changed = 0
    for name, tensor in fused.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
        changed += not torch.equal(tensor, base_weights[name])
    assert changed  # the adapter changed some weights, so the scale was tested


def test_adapter_files_that_disagree_on_rslora_are_refused(rslora_actor, tmp_path, capsys):
    copy = tmp_path / "actor"
    shutil.copytree(rslora_actor, copy)
    meta = copy / "lora_train_meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "use_rslora": False}))
    argv = ["merge", "--local_dir", str(copy), "--target_dir", str(tmp_path / "out"), "--quiet"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "use_rslora=False" in err and "use_rslora=True" in err and str(meta) in err
    assert not (tmp_path / "out").exists()


def test_settings_are_read_where_peft_and_the_trainer_keep_adapter_config(tmp_path):
    """A Trainer's LoRA checkpoint holds no verl file: PEFT's adapter_config.json sits beside
    the weights (FULL_STATE_DICT), or only in the output_dir above checkpoint-N, whose model
    folder is accelerate's pytorch_model_fsdp_0 (SHARDED_STATE_DICT)."""
    import json

    from shardstream.errors import CheckpointFormatError
    from shardstream.formats import lora

    peft_config = {"r": 4, "lora_alpha": 8, "use_rslora": False, "peft_type": "LORA"}
    beside = tmp_path / "full" / "checkpoint-2"
    beside.mkdir(parents=True)
    (beside / "adapter_config.json").write_text(json.dumps(peft_config))
    assert lora.lora_settings(beside) == lora.LoraSettings(4, 8.0, False)

    sharded = tmp_path / "out" / "checkpoint-2" / "pytorch_model_fsdp_0"
    sharded.mkdir(parents=True)
    (tmp_path / "out" / "adapter_config.json").write_text(json.dumps({**peft_config, "r": 2}))
    assert lora.lora_settings(sharded).r == 2

    elsewhere = tmp_path / "mine" / "pytorch_model_fsdp_0"  # no checkpoint-N: not looked above
    elsewhere.mkdir(parents=True)
    (tmp_path / "adapter_config.json").write_text(json.dumps(peft_config))
    with pytest.raises(CheckpointFormatError, match="nothing says their r and lora_alpha"):
        lora.lora_settings(elsewhere)


def test_a_peft_adapter_saved_through_dcp_without_its_name_restores(tmp_path):
    """accelerate's sharded save of a PeftModel holds PEFT's names (``lora_A.weight``, no
    adapter name); the live model's are ``lora_A.default.weight``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    import shardstream
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    def peft_model(seed):
        model = build_tiny_model(tiny_config("qwen2"), seed=0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
        model = get_peft_model(model, config)
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p)
        return model

    saved = peft_model(1)
    adapter = get_peft_model_state_dict(saved)
    assert any(k.endswith("lora_A.weight") for k in adapter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": adapter}, checkpoint_id=str(tmp_path / "ckpt"))
    live = peft_model(2)
    shardstream.load(tmp_path / "ckpt", model=live)
    want = saved.state_dict()
    for name, value in live.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_inspect_says_merge_refuses_lora_weights_without_their_settings(tmp_path, capsys):
    """accelerate's sharded save of a PeftModel without adapter_config.json: merge refuses it
    (no file says r and lora_alpha), inspect printed a merge estimate as if it would write."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from shardstream.commands.inspect import describe

    state = {
        "base_model.model.q.base_layer.weight": torch.ones(4, 4),
        "base_model.model.q.lora_A.weight": torch.ones(2, 4),
        "base_model.model.q.lora_B.weight": torch.zeros(4, 2),
    }
    ckpt = tmp_path / "pytorch_model_fsdp_0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save({"model": state}, checkpoint_id=str(ckpt))
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o")]) == 1
    assert "nothing says their r and lora_alpha" in capsys.readouterr().err
    refused = describe(ckpt)["merge"]["layout"]["refused"]
    assert refused is not None and "nothing says their r and lora_alpha" in refused
