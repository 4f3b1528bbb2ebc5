"""verl's ``save_lora_only``: a LoRA run saves its adapters only and restores them in place."""

from __future__ import annotations

import json

import torch

from shardstream import CheckpointConfig
from shardstream.formats.source import open_checkpoint
from shardstream.testing.distributed import run

from . import workers


def test_lora_only_save_and_restore_at_another_world_size(tmp_path):
    root = str(tmp_path / "run")
    saved = run(workers.lora_only_run, 2, root, "save", 0)[0]
    lora = {k for k in saved if ".lora_A." in k or ".lora_B." in k}
    assert lora and len(lora) < len(saved)

    checkpoint = open_checkpoint(f"{root}/global_step_1")
    model_names = {t.name for t in checkpoint.tensors}
    assert model_names == lora  # no base weight was written

    fresh = run(workers.lora_only_run, 1, root, "fresh", 7)[0]
    restored = run(workers.lora_only_run, 3, root, "restore", 7)[0]
    for name, tensor in restored.items():
        want = saved[name] if name in lora else fresh[name]  # base weights keep their values
        assert torch.equal(tensor, want), name
    assert any(not torch.equal(saved[n], fresh[n]) for n in lora)  # the restore did something


def test_merge_of_lora_only_checkpoint_writes_the_adapter(tmp_path):
    from safetensors.torch import load_file

    from shardstream.cli import main
    from shardstream.commands.test import compare_with_reference

    root = str(tmp_path / "run")
    saved = run(workers.lora_only_run, 2, root, "save", 0)[0]
    target = tmp_path / "adapter"
    args = ["merge", "--local_dir", f"{root}/global_step_1", "--target_dir", str(target)]
    assert main([*args, "--quiet"]) == 0
    assert sorted(p.name for p in target.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((target / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (3, 6.0)  # from the manifest, as saved
    adapter = load_file(target / "adapter_model.safetensors")
    assert len(adapter) == sum(".lora_" in k for k in saved)
    for name, tensor in adapter.items():  # PEFT's saved names drop the adapter name
        assert torch.equal(tensor, saved[name.replace(".weight", ".default.weight")]), name
    # shardstream test against the adapter directory compares the factors
    report = compare_with_reference(f"{root}/global_step_1", target)
    assert report.ok and report.compared == len(adapter), report.problems
    assert main([*args[:-1], str(tmp_path / "fused"), "--fuse-lora", "--quiet"]) == 2
    assert not (tmp_path / "fused").exists()


def test_verl_checkpoint_keys_are_accepted():
    cfg = CheckpointConfig.from_dict(
        {
            "save_contents": ["model"],
            "load_contents": ["model"],
            "async_save": False,
            "strict": True,
            "save_lora_only": True,
            "default_local_dir": "ckpts",
        }
    )
    assert cfg.save_lora_only and cfg.directory == "ckpts"
