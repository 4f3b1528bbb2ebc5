"""A checkpoint that is one ``torch.save`` file, as PyTorch's save/load recipes write it: the
model's ``state_dict()`` alone (``model.pt``), or a general checkpoint dict
(``{"epoch", "model_state_dict", "optimizer_state_dict", "loss"}``, and the shorter
``{"model", "optimizer"}`` other scripts use). Saved by one process, as the recipes do; each is
inspected, verified, merged, and restored at 1 process and into FSDP2 at 3 ranks, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from whole_state import (
    assert_read_by_every_command,
    flip_a_tensor_bit,
    live_objects,
    whole_state,
)

import shardstream
from shardstream.errors import ShardstreamError
from shardstream.testing.compare import assert_nested_equal
from shardstream.testing.distributed import preload, run

preload("torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict", "pytest")


def restore(rank: int, world: int, path: str, contents: tuple[str, ...]) -> dict:
    model, optimizer = live_objects(7, world)
    shardstream.load(path, model=model, optimizer=optimizer, contents=contents)
    return whole_state(model, optimizer)


# name -> (what the file holds, the contents it restores)
FILES = {
    "model.pt": ("state_dict", ("model",)),
    "checkpoint.tar": ("general", ("model", "optimizer")),
    "ckpt.pth": ("short", ("model", "optimizer")),
    # dcp_to_torch_save of DCP checkpoints whose optimizer is flattened (state.<fqn>.<key>,
    # param_groups.<fqn>.<key>): torchtitan's (the model's tensors at the top level beside
    # its containers), the optimizer beside the model at the top level, or under a key
    "titan.pt": ("torchtitan", ("model", "optimizer")),
    "flat.pt": ("flattened beside", ("model", "optimizer")),
    "flat_under_key.pt": ("flattened under a key", ("model", "optimizer")),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("torch-save-file")
    model, optimizer = live_objects(0, 1)
    for seed in range(2):
        torch.manual_seed(seed)
        model(torch.randn(6, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(model.state_dict(), root / "model.pt")
    torch.save(
        {
            "epoch": 2,
            "model_state_dict": model.state_dict(),
            "optimizer_state_dict": optimizer.state_dict(),
            "loss": 0.25,
        },
        root / "checkpoint.tar",
    )
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, root / "ckpt.pth"
    )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    flat_optimizer = get_optimizer_state_dict(model, optimizer, options=flat)
    assert any(k.startswith("param_groups.") for k in flat_optimizer)
    titan = {
        **model.state_dict(),
        "optimizer": flat_optimizer,
        "lr_scheduler": {"last_epoch": 2},
        "train_state": {"step": 2},
    }
    torch.save(titan, root / "titan.pt")
    torch.save({**model.state_dict(), **flat_optimizer}, root / "flat.pt")
    torch.save({"model": model.state_dict(), "optim": flat_optimizer}, root / "flat_under_key.pt")
    return {"root": root, "state": whole_state(model, optimizer)}


@pytest.mark.parametrize("name", list(FILES))
def test_inspect_verify_and_merge(saved, name, tmp_path):
    file = saved["root"] / name
    assert_read_by_every_command(file, "torch.save file", saved["state"]["model"], tmp_path)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("name", list(FILES))
def test_restore_into_one_process_and_fsdp2(saved, name, world):
    path, contents = str(saved["root"] / name), FILES[name][1]
    reports = [restore(0, 1, path, contents)] if world == 1 else run(restore, world, path, contents)
    for report in reports:
        assert_nested_equal(report["model"], saved["state"]["model"], "model")
        if "optimizer" in contents:
            assert_nested_equal(report["optim"], saved["state"]["optim"], "optimizer")


def test_general_checkpoint_gives_its_other_values_back(saved):
    """The general checkpoint's epoch and loss (plain numbers) come back in
    ``LoadResult.extra``; a state dict alone has nothing else."""
    model, optimizer = live_objects(7, 1)
    result = shardstream.load(saved["root"] / "checkpoint.tar", model=model, optimizer=optimizer)
    assert result.extra == {"epoch": 2, "loss": 0.25}
    result = shardstream.load(saved["root"] / "model.pt", model=model, contents=("model",))
    assert result.extra == {}


def test_model_alone_has_no_optimizer_to_restore(saved):
    model, optimizer = live_objects(7, 1)
    with pytest.raises(ShardstreamError, match="holds no optimizer state"):
        shardstream.load(saved["root"] / "model.pt", model=model, optimizer=optimizer)


def test_damaged_file_is_named_and_nothing_restored(saved, tmp_path):
    from shardstream.commands.verify import verify

    file = tmp_path / "checkpoint.tar"
    file.write_bytes((saved["root"] / "checkpoint.tar").read_bytes())
    flip_a_tensor_bit(file)
    report = verify(file)
    assert not report.ok and report.problems[0].path == str(file), report.problems
    model, optimizer = live_objects(7, 1)
    before = whole_state(model, optimizer)
    with pytest.raises(ShardstreamError, match="checkpoint.tar"):
        shardstream.load(file, model=model, optimizer=optimizer, contents=("model", "optimizer"))
    assert_nested_equal(whole_state(model, optimizer), before, "live state")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ([torch.ones(2)], "holds a list, not a state dict"),
        ({"optimizer_state_dict": {"state": {}, "param_groups": []}}, "but no model state dict"),
    ],
    ids=["a list", "an optimizer alone"],
)
def test_files_that_hold_no_model_are_named(tmp_path, content, words):
    file = tmp_path / "odd.pt"
    torch.save(content, file)
    model, _ = live_objects(7, 1)
    for attempt in (
        lambda: shardstream.load(file, model=model, contents=("model",)),
        lambda: shardstream.formats.source.open_checkpoint(file),
    ):
        with pytest.raises(ShardstreamError, match=words) as caught:
            attempt()
        assert str(file) in str(caught.value)


def _weights(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4)}


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ({**_weights(0), "model": _weights(1)}, "under 'model' and 2 tensors beside it"),
        ({"model": _weights(0), "state_dict": _weights(1)}, "under each of 'model', 'state_dict'"),
        (
            {"model_state_dict": _weights(0), "model": _weights(1)},
            "under each of 'model_state_dict', 'model'",
        ),
    ],
    ids=["tensors beside a model dict", "model and state_dict", "model_state_dict and model"],
)
def test_a_file_holding_two_models_is_refused_not_read_as_one(tmp_path, content, words):
    """Each was read as one of its models, the other left out without a word."""
    from shardstream.commands.verify import verify

    file = tmp_path / "two.pt"
    torch.save(content, file)
    with pytest.raises(ShardstreamError, match=words) as caught:
        shardstream.formats.source.open_checkpoint(file, model_only=True)
    assert str(file) in str(caught.value) and "unclear" in str(caught.value)
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(3, 4)
    with pytest.raises(ShardstreamError, match=words):
        shardstream.load(file, model=model, contents=("model",))
    problems = [p.line() for p in verify(file).problems]
    assert any(words in line for line in problems), problems


def test_a_file_holding_one_model_under_two_keys_or_beside_a_scalar_loss_is_read(tmp_path):
    """The same dict under two keys (one object in the pickle) is one model; the recipes'
    0-d ``loss`` tensor beside it is not a second one."""
    weights = _weights(0)
    for content in (
        {"model": weights, "state_dict": weights},
        {"model_state_dict": weights, "loss": torch.tensor(0.25), "epoch": 3},
    ):
        file = tmp_path / "one.pt"
        torch.save(content, file)
        source = shardstream.formats.source.open_checkpoint(file, model_only=True)
        assert sorted(t.name for t in source.tensors) == sorted(weights)


def test_an_empty_file_is_refused_by_merge_and_reported_by_verify(tmp_path):
    """``torch.save({})`` merged into a model of no tensors, exit 0; verify passed it."""
    from shardstream.cli import main
    from shardstream.commands.verify import verify

    file = tmp_path / "empty.pt"
    torch.save({}, file)
    with pytest.raises(ShardstreamError, match="holds no model tensors"):
        shardstream.formats.source.open_checkpoint(file, model_only=True)
    assert main(["merge", "--local_dir", str(file), "--target_dir", str(tmp_path / "o")]) == 1
    assert not (tmp_path / "o").exists()
    problems = [p.line() for p in verify(file).problems]
    assert any("holds no model tensors" in line for line in problems), problems


def test_a_file_of_another_kind_is_not_taken_for_one(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("not a checkpoint")
    with pytest.raises(ShardstreamError, match="expected a checkpoint directory or a torch.save"):
        shardstream.formats.source.open_checkpoint(file)
    assert Path(file).is_file()


class _RunsCode:
    """Unpickling this would run a command (it must never be)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_file_asking_for_code_is_refused_everywhere(tmp_path):
    from shardstream.cli import main

    marker = tmp_path / "ran"
    file = tmp_path / "evil.pt"
    torch.save({"model_state_dict": {"w": torch.ones(2)}, "extra": _RunsCode(marker)}, file)
    with pytest.raises(ShardstreamError, match="refused to unpickle"):
        shardstream.load(file, model=torch.nn.Linear(2, 1), contents=("model",))
    for argv in (
        ["inspect", str(file)],
        ["verify", str(file)],
        ["merge", "--local_dir", str(file), "--target_dir", str(tmp_path / "out"), "--quiet"],
    ):
        assert main(argv) == 1, argv
    assert not marker.exists() and not (tmp_path / "out").exists()


def _central_entry(data: bytes, name_end: bytes = b"data.pkl") -> int:
    """Offset of the central-directory entry of the record whose name ends in ``name_end``."""
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_len = int.from_bytes(data[at + 28 : at + 30], "little")
        if data[at + 46 : at + 46 + name_len].endswith(name_end):
            return at
        at = data.find(b"PK\x01\x02", at + 4)
    raise AssertionError("no such record")


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        (10, 8, "decompressing"),  # compression method: stored -> deflate (zlib.error)
        (6, 0x80 | 20, "zip file version"),  # version needed to extract (NotImplementedError)
    ],
    ids=["compression method", "version needed"],
)
def test_one_flipped_zip_field_is_a_one_line_error_everywhere(
    tmp_path, capsys, field, value, words
):
    """One flipped bit of data.pkl's central-directory entry ended merge, inspect and verify
    in a traceback (zlib.error, NotImplementedError), and restore raised zlib's error."""
    from shardstream.cli import main

    file = tmp_path / "model.pt"
    torch.save(_weights(3), file)
    data = bytearray(file.read_bytes())
    data[_central_entry(bytes(data)) + field] = value
    file.write_bytes(bytes(data))
    for argv in (
        ["merge", "--local_dir", str(file), "--target_dir", str(tmp_path / "o")],
        ["inspect", str(file)],
        ["verify", str(file)],
    ):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert "Traceback" not in err and words in out + err, (argv, out, err)
    assert not (tmp_path / "o").exists()
    model, _ = live_objects(7, 1)
    with pytest.raises(ShardstreamError, match="model.pt"):
        shardstream.load(file, model=model, contents=("model",))


def test_a_file_saved_without_crc32s_is_read(tmp_path, capsys):
    """torch.serialization.set_crc32_options(False) writes 0 for every record's CRC-32, a
    valid archive torch.load reads: it was refused as corrupt ("Bad CRC-32 for data.pkl")."""
    from shardstream.cli import main

    weights = _weights(4)
    file = tmp_path / "model.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(weights, file)
    finally:
        torch.serialization.set_crc32_options(True)
    assert main(["verify", str(file)]) == 0, capsys.readouterr()
    target = tmp_path / "o"
    assert main(["merge", "--local_dir", str(file), "--target_dir", str(target)]) == 0
    from safetensors.torch import load_file

    merged = load_file(target / "model.safetensors")
    assert sorted(merged) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(merged[name], tensor), name
