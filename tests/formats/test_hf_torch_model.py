"""A Hugging Face model saved with ``torch.save``, written by accelerate's own code:
``save_state(safe_serialization=False)`` (``pytorch_model.bin`` beside the optimizer, scheduler
and RNG files) and ``save_model(safe_serialization=False)`` sharded (``pytorch_model-*.bin``
and their index). merge writes ``save_pretrained``'s files bit for bit; verify checks every
record's CRC-32; damage is refused naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardstream.cli import main
from shardstream.commands.inspect import describe
from shardstream.commands.verify import verify
from shardstream.formats.source import ACCELERATE_PLAIN_FORMAT, Kind, detect

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

FORMAT = "huggingface (pytorch_model.bin)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_torch")
    config = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    accelerator.save_state(str(root / "state"), safe_serialization=False)
    accelerator.save_model(
        model, str(root / "sharded"), max_shard_size="20KB", safe_serialization=False
    )
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(root / "reference")
    unwrapped.config.save_pretrained(root / "config")
    return {name: root / name for name in ("state", "sharded", "reference", "config")}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _merge(source: Path, target: Path, saved: dict[str, Path]) -> int:
    argv = ["merge", "--local_dir", str(source), "--target_dir", str(target), "--quiet"]
    return main([*argv, "--hf_model_path", str(saved["config"]), "--dtype", "float32"])


@pytest.mark.parametrize("which", ["state", "sharded"])
def test_merge_writes_what_save_pretrained_writes(saved, tmp_path, which):
    source = saved[which]
    # save_state's directory holds the run's state beside the model: a training checkpoint
    kind, label = (
        (Kind.ACCELERATE, ACCELERATE_PLAIN_FORMAT) if which == "state" else (Kind.HF_TORCH, FORMAT)
    )
    assert detect(source) is kind
    if which == "sharded":
        assert (source / "pytorch_model.bin.index.json").is_file()
        assert len(list(source.glob("pytorch_model-*.bin"))) > 1
    info = describe(source)
    weights = list(source.glob("pytorch_model*.bin"))  # not save_state's optimizer.bin
    assert info["format"] == label and info["num_files"] == len(weights)
    assert _merge(source, tmp_path / "merged", saved) == 0
    got, want = _tensors(tmp_path / "merged"), _tensors(saved["reference"])
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert verify(source).ok


def test_a_flipped_byte_is_refused_naming_the_file(saved, tmp_path, capsys):
    source = tmp_path / "sharded"
    shutil.copytree(saved["sharded"], source)
    file = sorted(source.glob("pytorch_model-*.bin"))[-1]
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    file.write_bytes(bytes(raw))
    report = verify(source)
    assert not report.ok and any(p.path == str(file) for p in report.problems)
    capsys.readouterr()
    assert _merge(source, tmp_path / "merged", saved) == 1
    assert str(file) in capsys.readouterr().err and not (tmp_path / "merged").exists()


def test_an_index_that_misplaces_a_tensor_is_refused(saved, tmp_path, capsys):
    source = tmp_path / "sharded"
    shutil.copytree(saved["sharded"], source)
    index_file = source / "pytorch_model.bin.index.json"
    index = json.loads(index_file.read_text())
    files = sorted(set(index["weight_map"].values()))
    moved = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][moved] = files[1]  # listed in the wrong shard
    index_file.write_text(json.dumps(index))
    assert _merge(source, tmp_path / "merged", saved) == 1
    err = capsys.readouterr().err
    assert repr(moved) in err and "Traceback" not in err
    assert not verify(source).ok


def test_both_a_single_file_and_an_index_are_refused(saved, tmp_path, capsys):
    source = tmp_path / "sharded"
    shutil.copytree(saved["sharded"], source)
    shutil.copy(saved["state"] / "pytorch_model.bin", source / "pytorch_model.bin")
    assert _merge(source, tmp_path / "merged", saved) == 1
    assert (
        "holds both pytorch_model.bin and pytorch_model.bin.index.json" in capsys.readouterr().err
    )


def test_shardstream_test_takes_a_pytorch_model_bin_reference(saved, tmp_path, capsys):
    """verl's --test_hf_dir may be an older model saved as pytorch_model.bin: compared tensor by
    tensor, each reference record checked against its CRC-32 as it is read."""
    assert _merge(saved["sharded"], tmp_path / "merged", saved) == 0
    argv = ["test", "--local_dir", str(tmp_path / "merged"), "--exact", "--test_hf_dir"]
    assert main([*argv, str(saved["sharded"])]) == 0
    assert "OK: compared" in capsys.readouterr().out

    reference = tmp_path / "reference"
    shutil.copytree(saved["sharded"], reference)
    file = sorted(reference.glob("pytorch_model-*.bin"))[0]
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    file.write_bytes(bytes(raw))
    assert main([*argv, str(reference)]) != 0
    assert str(file) in capsys.readouterr().err
