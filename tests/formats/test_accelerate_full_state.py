"""accelerate's ``save_state`` with an FSDP2 ``FULL_STATE_DICT`` (``pytorch_model_fsdp.bin``,
``optimizer.bin``), written by accelerate's own code on 2 gloo ranks: inspect, verify, merge
and test read it, bit for bit; a damaged record fails naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import accelerate_full_workers as workers
import pytest
import torch
from safetensors.torch import load_file

from shardstream.cli import main
from shardstream.commands.inspect import describe
from shardstream.commands.verify import verify
from shardstream.errors import CheckpointFormatError
from shardstream.formats.source import Kind, detect, open_checkpoint
from shardstream.formats.torch_pt import zip_records
from shardstream.testing.compare import assert_bit_identical, assert_nested_equal
from shardstream.testing.distributed import run

pytestmark = pytest.mark.slow

MODEL_FILE = "pytorch_model_fsdp.bin"
FORMAT = "accelerate (FULL_STATE_DICT)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """The root holding the save_state directory, and the full state when it was saved:
    model, optimizer (by parameter name) and scheduler."""
    root = tmp_path_factory.mktemp("accelerate-full")
    return root, run(workers.save_full_state, 2, str(root))[0]


def _damaged_copy(root: Path, name: str) -> tuple[Path, str]:
    """A copy of the save_state directory with one byte flipped inside the largest tensor
    record of ``pytorch_model_fsdp.bin``; returns it and the record's name."""
    damaged = root / name
    shutil.copytree(root / workers.STATE_DIR, damaged)
    file = damaged / MODEL_FILE
    record = max(zip_records(str(file)), key=lambda r: r.end - r.start)
    data = bytearray(file.read_bytes())
    data[(record.start + record.end) // 2] ^= 0x40
    file.write_bytes(bytes(data))
    return damaged, record.name


def test_accelerate_writes_the_full_state_layout(saved):
    root, full = saved[0], saved[1]["model"]
    state = root / workers.STATE_DIR
    files = {p.name for p in state.iterdir()}
    assert {MODEL_FILE, "optimizer.bin", "scheduler.bin"} <= files, files
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= files, files
    assert not any(p.is_dir() for p in state.iterdir()), files  # no DCP directory
    assert detect(state) is Kind.ACCELERATE
    assert all(t.dtype == torch.float32 for t in full.values())


def test_inspect_and_verify_describe_it(saved, capsys):
    root, full = saved[0], saved[1]["model"]
    state = root / workers.STATE_DIR
    info = describe(state)
    assert info["format"] == FORMAT and info["world_size"] == 2
    assert info["files"] == [str(state / MODEL_FILE)]
    assert {t["name"] for t in info["tensors"]} == set(full)
    assert {t["dtype"] for t in info["tensors"]} == {"float32"}
    assert info["merge"]["output_dtype"] == "as stored"
    assert main(["inspect", str(state)]) == 0
    assert FORMAT in capsys.readouterr().out

    report = verify(state)
    assert report.ok, [p.line() for p in report.problems]
    assert report.kind == "accelerate"
    # pytorch_model_fsdp.bin, optimizer.bin, scheduler.bin, 2 RNG files
    assert report.files_checked == 5, report
    assert report.bytes_checked >= (state / MODEL_FILE).stat().st_size // 2
    assert main(["verify", str(state)]) == 0


def test_merge_is_bit_identical_in_the_stored_dtype(saved, tmp_path):
    root, full = saved[0], saved[1]["model"]
    state = root / workers.STATE_DIR
    target = tmp_path / "weights_only"  # no config anywhere: the weights alone, as stored
    assert main(["merge", "--local_dir", str(state), "--target_dir", str(target), "--quiet"]) == 0
    assert_bit_identical(load_file(target / "model.safetensors"), full)
    assert not (target / "config.json").exists()

    with_config = tmp_path / "with_config"
    argv = ["merge", "--local_dir", str(state), "--target_dir", str(with_config), "--quiet"]
    assert main([*argv, "--hf_model_path", str(root / workers.CONFIG_DIR)]) == 0
    assert_bit_identical(load_file(with_config / "model.safetensors"), full)
    assert (with_config / "config.json").is_file()

    argv = ["test", "--local_dir", str(state), "--test_hf_dir", str(root / workers.REFERENCE_DIR)]
    assert main([*argv, "--exact"]) == 0


def test_a_flipped_byte_fails_verify_and_merge_naming_the_file(saved, tmp_path, capsys):
    root, _ = saved
    damaged, record = _damaged_copy(root, "damaged")
    report = verify(damaged)
    assert not report.ok
    (problem,) = report.problems
    assert problem.path == str(damaged / MODEL_FILE) and record in problem.message
    assert problem.tensor  # the tensor the record holds

    capsys.readouterr()
    target = tmp_path / "merged"
    assert main(["merge", "--local_dir", str(damaged), "--target_dir", str(target)]) != 0
    assert MODEL_FILE in capsys.readouterr().err
    assert not (target / "model.safetensors").exists()


def test_both_layouts_of_one_model_are_refused_naming_both(saved):
    root, _ = saved
    both = root / "both"
    shutil.copytree(root / workers.STATE_DIR, both)
    (both / "pytorch_model_fsdp_0").mkdir()
    (both / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"")
    assert detect(both) is Kind.ACCELERATE
    with pytest.raises(CheckpointFormatError, match=r"pytorch_model_fsdp_0/.*pytorch_model_fsdp"):
        open_checkpoint(both)
    report = verify(both)
    assert not report.ok and "pytorch_model_fsdp.bin" in report.problems[0].line()


def test_restore_at_another_world_size(saved):
    """CheckpointManager.restore(path=<save_state dir>) at 3 FSDP2 ranks: model, optimizer
    and scheduler bit for bit."""
    root, state = saved
    restored = run(workers.restore_full_state, 3, str(root))[0]
    for part in ("model", "optimizer", "scheduler"):
        assert_nested_equal(restored[part], state[part], part)


def test_restore_of_dtypes_without_a_typed_storage(tmp_path):
    """float8 and uint16 tensors of a whole saved state dict (their storages pickle as
    UntypedStorage) restore into a live module bit for bit."""
    import shardstream

    def module(fill) -> torch.nn.Module:
        m = torch.nn.Module()
        m.scale = torch.nn.Parameter(fill(4, 4).to(torch.float8_e4m3fn), requires_grad=False)
        m.register_buffer("codes", fill(2, 3).mul(100).abs().to(torch.uint16))
        m.weight = torch.nn.Parameter(fill(3, 3))
        return m

    torch.manual_seed(0)
    saved = module(torch.randn)
    (tmp_path / "ckpt").mkdir()
    torch.save(saved.state_dict(), tmp_path / "ckpt" / MODEL_FILE)
    live = module(torch.zeros)
    shardstream.load(tmp_path / "ckpt", model=live, contents=["model"])
    assert_bit_identical(live.state_dict(), saved.state_dict())
