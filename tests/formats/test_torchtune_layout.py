"""Checkpoints as torchtune's checkpointers lay them out (torchtune 0.6.1,
FullModelHFCheckpointer): the epoch_N folders merge reads as Hugging Face models."""

from __future__ import annotations

import json

import pytest
import torch

from shardstream import merge

transformers = pytest.importorskip("transformers")

TEXT = dict(
    hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64, head_dim=8,
)  # fmt: skip


def test_an_adapter_config_beside_a_full_model_is_not_copied_into_the_output(tmp_path):
    """torchtune saves the merged model and the LoRA adapter's adapter_config.json into one
    epoch_N folder: merge copied that file beside the merged model, and transformers (with
    peft installed) then took the output for an adapter and failed to load it."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TEXT, tie_word_embeddings=False)
    )
    model.save_pretrained(tmp_path / "epoch_0")
    adapter = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (tmp_path / "epoch_0" / "adapter_config.json").write_text(json.dumps(adapter))
    merge(tmp_path / "epoch_0", tmp_path / "merged", dtype="float32")
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_a_runs_output_folder_names_its_newest_checkpoint_whatever_its_format(tmp_path):
    """torchtune's output_dir: DCP saves (dist_epoch_N) and Hugging Face saves (epoch_N) side
    by side. The hint counted the DCP ones alone and called dist_epoch_1 the newest, leaving
    out epoch_2, the newest and the one that merges."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from shardstream.errors import CheckpointNotFoundError

    out = tmp_path / "output"
    for epoch in (0, 1):
        dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(out / f"dist_epoch_{epoch}"))
    (out / "epoch_2").mkdir()
    save_file({"w": torch.zeros(2)}, str(out / "epoch_2" / "model.safetensors"))
    with pytest.raises(CheckpointNotFoundError) as refused:
        merge(out, tmp_path / "merged")
    said = str(refused.value)
    assert "3 folders hold checkpoints (dist_epoch_0, dist_epoch_1, epoch_2)" in said
    assert said.endswith(f"e.g. the newest, {out / 'epoch_2'}")


def test_verify_of_an_output_folder_checks_each_epoch_and_the_recipe_state(tmp_path):
    """torchtune's output_dir holds epoch_N models and recipe_state/recipe_state.pt (the
    optimizer and progress it resumes from, no model). verify said "steps []" of it without
    naming what it checked, skipped the recipe state, and failed that file alone, intact, for
    holding no model."""
    from shardstream.commands.verify import verify

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TEXT))
    out = tmp_path / "output"
    for epoch in (0, 1):
        model.save_pretrained(out / f"epoch_{epoch}")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    state = {"optimizer": optimizer.state_dict(), "seed": 0, "epochs_run": 2}
    (out / "recipe_state").mkdir()
    recipe_state = out / "recipe_state" / "recipe_state.pt"
    torch.save(state, recipe_state)
    (out / "logs").mkdir()
    (out / "logs" / "log_1.txt").write_text("step 1\n")

    report = verify(out)
    assert report.ok, report.problems
    assert report.checked == ["epoch_0", "epoch_1", "recipe_state/recipe_state.pt"]
    assert report.not_read == ["logs"]
    alone = verify(recipe_state)
    assert alone.ok and alone.bytes_checked > 0, alone.problems
    assert "no model" in alone.kind

    data = bytearray(recipe_state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a record: the moments are nearly all of the file
    recipe_state.write_bytes(bytes(data))
    damaged = verify(out)
    assert not damaged.ok
    assert [p.path for p in damaged.problems] == [str(recipe_state)], damaged.problems


def test_recipe_state_saved_with_crc32_off_counts_as_unchecked_in_the_folder(tmp_path):
    """The folder's report took the recipe state's problems and checked bytes but not its
    unchecked ones: a recipe_state.pt saved with CRC-32 off vanished from the verdict."""
    from shardstream.commands.verify import verify

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TEXT))
    out = tmp_path / "output"
    model.save_pretrained(out / "epoch_0")
    (out / "recipe_state").mkdir()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"optimizer": optimizer.state_dict()}, out / "recipe_state" / "recipe_state.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    alone = verify(out / "recipe_state" / "recipe_state.pt")
    report = verify(out)
    assert alone.ok and report.ok and alone.unchecked_bytes > 0
    assert report.unchecked_bytes == verify(out / "epoch_0").unchecked_bytes + alone.unchecked_bytes
    assert set(alone.unchecked_why) <= set(report.unchecked_why)
