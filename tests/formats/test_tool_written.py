"""Checkpoints written by PyTorch's own DCP code on 2 gloo ranks (``tool_writers.py``), read by
inspect, verify, merge and restore, compared bit for bit with what was saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import tool_writers
import torch
from safetensors.torch import load_file

import shardstream
from shardstream.cli import main
from shardstream.commands.inspect import describe
from shardstream.commands.verify import verify
from shardstream.errors import CheckpointNotFoundError
from shardstream.formats.source import open_checkpoint
from shardstream.testing.compare import assert_bit_identical
from shardstream.testing.distributed import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tool-written")
    run(tool_writers.write_all, 2, str(root))
    return root


def _merged(source: Path, target: Path) -> dict[str, torch.Tensor]:
    assert main(["merge", "--local_dir", str(source), "--target_dir", str(target), "--quiet"]) == 0
    out: dict[str, torch.Tensor] = {}
    for path in sorted(target.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_float8_tensors_merge_and_restore_bit_for_bit(written, tmp_path):
    """float8 storages pickle as torch.storage.UntypedStorage (no typed storage class)."""
    path = written / "float8"
    want = load_file(written / "float8.reference.safetensors")
    dtypes = {row["name"]: row["dtype"] for row in describe(path)["tensors"]}
    assert dtypes["sharded.e4m3"] == "float8_e4m3fn" and dtypes["e5m2"] == "float8_e5m2"
    assert verify(path).ok
    assert_bit_identical(_merged(path, tmp_path / "merged"), want)

    # restore into a module holding buffers at the saved names
    holder = torch.nn.Module()
    holder.sharded = torch.nn.Module()
    for name, tensor in want.items():
        owner, leaf = (holder.sharded, name.split(".")[1]) if "." in name else (holder, name)
        owner.register_buffer(leaf, torch.zeros(tensor.shape).to(tensor.dtype))
    shardstream.load(path, model=holder)
    assert_bit_identical(dict(holder.state_dict()), want)


def test_hf_writer_with_index_mapping_names_the_saving_ranks(written, tmp_path):
    """torchtitan's HF export: each of 2 ranks wrote one shard file per output file."""
    path = written / "hf_mapped"
    assert len(list((path / "sharded").glob("shard-*.safetensors"))) == 4
    for where in (path, path / "sharded"):
        assert open_checkpoint(where).world_size == 2, where
        report = verify(where)
        assert report.ok
        assert describe(where)["format"] == report.kind == "dcp_hf", where  # one name
        want = load_file(written / "hf_mapped.reference.safetensors")
        assert_bit_identical(_merged(where, tmp_path / where.name), want)


class _Extra:
    state = None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.state = state


def _restored(path: Path) -> tuple[dict, dict]:
    """The model (at one process) and the ``extra`` Stateful's state restored from ``path``."""
    torch.manual_seed(5)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(7, 4)
    model.norm = torch.nn.LayerNorm(4, bias=False)
    model.head = torch.nn.Linear(4, 7, bias=False)
    extra = _Extra()
    shardstream.load(path, model=model, states={"extra": extra})
    return dict(model.state_dict()), extra.state


def _assert_extra(state: dict) -> None:
    want = tool_writers.EXTRA
    assert state.keys() == want.keys()
    assert torch.equal(state["seen"], want["seen"])
    assert {k: v for k, v in state.items() if k != "seen"} == {
        k: v for k, v in want.items() if k != "seen"
    }


def test_tensors_of_another_stateful_are_restored(written):
    """``dcp.save({"model": ..., "extra": {...}})``: restore(states={"extra": obj}) gives the
    object its saved values, its tensor included."""
    model, extra = _restored(written / "extras")
    assert_bit_identical(model, load_file(written / "extras.reference.safetensors"))
    _assert_extra(extra)


def test_save_without_collectives_is_read_from_every_ranks_metadata(written, tmp_path):
    path = written / "uncoordinated"
    assert not (path / ".metadata").exists() and (path / "__1.metadata").is_file()
    want = load_file(written / "extras.reference.safetensors")
    assert describe(path)["num_tensors"] == len(want)
    report = verify(path)  # every item's zip records, from the per-rank metadata
    assert report.ok and report.bytes_checked >= sum(t.nbytes for t in want.values())
    assert_bit_identical(_merged(path, tmp_path / "merged"), want)
    model, extra = _restored(path)
    assert_bit_identical(model, want)
    _assert_extra(extra)


def test_containers_pickled_whole_are_refused_clearly(written):
    with pytest.raises(CheckpointNotFoundError, match="flatten_state_dict=False"):
        open_checkpoint(written / "not_flattened")
