"""merge on real verl-layout FSDP2 checkpoints: bit-equal tensors and equal logits.

Checkpoints come from ``shardstream.testing.verl_checkpoint`` (N gloo processes, fully_shard,
AdamW step), one launcher for all cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardstream.cli import main
from shardstream.engine.dtypes import itemsize
from shardstream.formats.safetensors import read_header
from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoints
from shardstream.units import DIRECT_ALIGN

CASES = {
    "ws1": VerlFixture(world_size=1),
    "ws2-tied": VerlFixture(world_size=2, tie_word_embeddings=True),
    "ws3-llama": VerlFixture(world_size=3, arch="llama"),
    "ws4": VerlFixture(world_size=4),
    "hsdp2x2": VerlFixture(world_size=4, mesh_shape=(2, 2)),
    "ws4-shard1": VerlFixture(world_size=4, shard_dim=1),
    "ws4-plain-buffers": VerlFixture(world_size=4, arch="plain"),
    "ws4-lora": VerlFixture(world_size=4, lora=True),
    "ws2-old-layout": VerlFixture(world_size=2, write_fsdp_config=False, hf_in_subdir=False),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    jobs = [(root / name, fx, 1) for name, fx in CASES.items()]
    actors = write_verl_checkpoints(jobs)
    return {name: (root / name, actor) for name, actor in zip(CASES, actors)}


def merge(actor, target, *flags) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "merge",
                "--backend",
                "fsdp",
                "--local_dir",
                str(actor),
                "--target_dir",
                str(target),
                "--json",
                *flags,
            ]
        )
    assert code == 0
    return json.loads(out.getvalue())


def merged_tensors(target) -> dict[str, torch.Tensor]:
    index = target / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        out.update(load_file(target / name))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_merge_is_bit_equal_to_unsharded_model(checkpoints, case, dtype, tmp_path):
    root, actor = checkpoints[case]
    fx = CASES[case]
    target = tmp_path / "merged"
    summary = merge(actor, target, "--dtype", dtype)
    want = load_file(root / "reference" / "model.safetensors")
    got = merged_tensors(target)
    if fx.tie_word_embeddings:
        assert "lm_head.weight" not in got and summary["skipped"] == ["lm_head.weight"]
        want.pop("lm_head.weight", None)
    assert got.keys() == want.keys()
    cast = getattr(torch, dtype)
    for name, tensor in want.items():
        expected = tensor.to(cast) if tensor.is_floating_point() else tensor
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), name
    for file in target.glob("*.safetensors"):  # laid out for direct writes
        header = read_header(file)
        assert header.data_start % DIRECT_ALIGN == 0, file
        assert all(e.begin % itemsize(e.dtype) == 0 for e in header.tensors.values()), file
    if fx.lora:
        adapter = load_file(target / "lora_adapter" / "adapter_model.safetensors")
        reference = load_file(root / "reference" / "adapter_model.safetensors")
        assert adapter.keys() == reference.keys()
        assert all(torch.equal(adapter[k], reference[k].to(cast)) for k in reference)
        config = json.loads((target / "lora_adapter" / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"]) == (fx.lora_rank, fx.lora_alpha)


@pytest.mark.parametrize("case", ["ws4", "ws2-tied", "hsdp2x2", "ws4-shard1", "ws3-llama"])
def test_transformers_loads_merge_and_logits_match(checkpoints, case, tmp_path):
    from transformers import AutoModelForCausalLM

    root, actor = checkpoints[case]
    target = tmp_path / "merged"
    merge(actor, target, "--dtype", "float32")
    model, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reference = load_file(root / "reference" / "logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)


def test_fuse_lora_matches_fused_reference(checkpoints, tmp_path):
    root, actor = checkpoints["ws4-lora"]
    target = tmp_path / "fused"
    merge(actor, target, "--fuse-lora", "--dtype", "float32")
    fused = load_file(root / "reference" / "fused.safetensors")
    got = merged_tensors(target)
    assert got.keys() == fused.keys()
    for name, tensor in fused.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)
    assert not (target / "lora_adapter").exists()


def test_default_dtype_comes_from_config_and_small_shards_split(checkpoints, tmp_path):
    root, actor = checkpoints["ws4"]
    target = tmp_path / "merged"
    summary = merge(actor, target, "--max-shard-size", "40KB", "--buffer-size", "64KiB")
    assert summary["dtype"] == "BF16"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    got = merged_tensors(target)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())
    want = load_file(root / "reference" / "model.safetensors")
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    config = json.loads((target / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert (target / "tokenizer.json").is_file() and (target / "generation_config.json").is_file()


def test_huggingface_dir_without_generation_config_gets_the_one_save_pretrained_writes(
    checkpoints, tmp_path
):
    """verl's merger ends in save_pretrained of a model built from config.json: with no
    generation_config.json beside the shards it still writes one, derived from the config."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    _, actor = checkpoints["ws2-tied"]
    copy = tmp_path / "actor"
    shutil.copytree(actor, copy)
    (copy / "huggingface" / "generation_config.json").unlink()
    merge(copy, tmp_path / "merged")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(copy / "huggingface"))
    model.generation_config.save_pretrained(tmp_path / "reference")
    got, want = (
        json.loads((d / "generation_config.json").read_text())
        for d in (tmp_path / "merged", tmp_path / "reference")
    )
    assert got == want and got.get("_from_model_config") is True


def test_command_in_a_fresh_process_prints_everything_and_exits_with_its_code(
    checkpoints, tmp_path
):
    """``python -m shardstream`` ends without interpreter teardown (``console_main``): its
    output through a pipe is still whole, the merge is complete, and errors still exit 1."""
    import subprocess
    import sys

    root, actor = checkpoints["ws2-tied"]
    target = tmp_path / "merged"
    command = [sys.executable, "-m", "shardstream", "merge", "--local_dir", str(actor)]
    done = subprocess.run(
        [*command, "--target_dir", str(target), "--json", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    got = merged_tensors(target)
    assert summary["tensors"] == len(got) and summary["target"] == str(target)
    want = load_file(root / "reference" / "model.safetensors")
    assert got.keys() == want.keys() - {"lm_head.weight"}
    assert all(torch.equal(got[k], want[k]) for k in got)

    missing = tmp_path / "no_such_checkpoint"
    refused = subprocess.run(
        [*command[:-1], str(missing), "--target_dir", str(tmp_path / "other")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("shardstream merge: error: ") and str(missing) in (
        refused.stderr
    )


def _fsdp1_rank(rank: int, world: int, root: str, with_mesh: bool) -> dict:
    """FSDP1 (device_id=cpu) SHARDED_STATE_DICT in verl's file naming."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 30), torch.nn.Linear(30, 5))
    kwargs = {"device_id": torch.device("cpu")}
    if with_mesh:
        kwargs["device_mesh"] = init_device_mesh("cpu", (world,))
    wrapped = FSDP(model, use_orig_params=True, **kwargs)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    wrapped(torch.ones(3, 6)).sum().backward()
    optimizer.step()
    with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        torch.save(wrapped.state_dict(), f"{root}/model_world_size_{world}_rank_{rank}.pt")
        # As verl saves it: the optimizer's own state dict, flat-parameter fragments.
        torch.save(optimizer.state_dict(), f"{root}/optim_world_size_{world}_rank_{rank}.pt")
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT):
        full = {k: v.clone() for k, v in wrapped.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(
        wrapped, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return full, {fqn: {k: v.clone() for k, v in e.items()} for fqn, e in optim["state"].items()}


@pytest.mark.filterwarnings("ignore")
def test_fsdp1_with_device_mesh_merges_and_sharded_tensors_are_refused(tmp_path):
    from shardstream.testing.distributed import run

    for with_mesh in (True, False):
        root = tmp_path / f"fsdp1-{with_mesh}"
        root.mkdir()
        full, optim = run(_fsdp1_rank, 2, str(root), with_mesh)[0]
        target = tmp_path / f"out-{with_mesh}"
        code = main(["merge", "--local_dir", str(root), "--target_dir", str(target), "--quiet"])
        if with_mesh:
            assert code == 0
            got = load_file(target / "model.safetensors")
            assert got.keys() == full.keys()
            # No config.json names a dtype: bfloat16, as verl's merger writes.
            assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in full.items())
        else:
            assert code == 1 and not target.exists()
    _fsdp1_optimizer_restores(tmp_path / "fsdp1-True", full, optim)


def _fsdp1_optimizer_restores(actor, full: dict, optim: dict) -> None:
    """FSDP1's optimizer files (``use_orig_params``: each rank's run of each parameter's
    elements, no placement) restore at another world size, here into a plain module on one
    process, bit for bit."""
    import shardstream

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 30), torch.nn.Linear(30, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shardstream.load(actor, model=model, optimizer=optimizer, contents=("model", "optimizer"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in full.items())
    for name, param in model.named_parameters():
        for key, value in optim[name].items():
            assert torch.equal(optimizer.state[param][key], value), (name, key)


# What load_layout says about every tensor of a .pt file, as JSON; run in a fresh process
# (stand-ins for torch's DTensor classes) and in this one (torch's own classes).
_DESCRIBE = r"""
import json, sys, torch
from shardstream.formats.torch_pt import DistributedTensor, load_layout

def local(t):
    return [str(t.dtype), list(t.shape), list(t.stride()), t.storage_offset(),
            t.untyped_storage()._checkpoint_offset]

def describe(value):
    if isinstance(value, DistributedTensor):
        m = value.mesh
        return {"dtensor": [list(value.shape), [repr(p) for p in value.placements],
                            [list(m.shape), m.dim_names, m.coordinate, m.rank, m.rank_map],
                            local(value.local)]}
    if isinstance(value, torch.Tensor):
        return {"tensor": local(value)}
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    return repr(value)

def describe_files(paths):
    return json.dumps({p: describe(load_layout(p)) for p in paths}, sort_keys=True, default=str)
"""


def test_dtensor_stand_ins_read_what_torchs_classes_read(checkpoints):
    """A fresh process (no torch.distributed.tensor) reads every rank file, model and optimizer,
    exactly as torch's own DTensor classes do, and never imports that module."""
    import subprocess
    import sys

    paths = sorted(
        str(p)
        for _, actor in checkpoints.values()
        for p in actor.iterdir()
        if p.name.startswith(("model_world_size", "optim_world_size"))
    )
    assert len(paths) > 20
    script = (
        _DESCRIBE + "paths = json.loads(sys.stdin.read())\n"
        "out = describe_files(paths)\n"
        "assert 'torch.distributed.tensor' not in sys.modules\n"
        "print(out)\n"
    )
    fresh = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(paths),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    import torch.distributed.tensor  # noqa: F401  (this process: torch's classes)

    scope: dict = {}
    exec(_DESCRIBE, scope)
    here = scope["describe_files"](paths)
    assert json.loads(fresh) == json.loads(here)
    assert '"dtensor"' in here and "Shard(dim=1)" in here and "Replicate()" in here


def test_compare_lora_checkpoint_with_its_merge(checkpoints, tmp_path):
    """``shardstream test`` on a LoRA run compares what merge writes: base weights under HF
    names, and the factors against ``lora_adapter/`` when the reference has one."""
    import shutil

    from safetensors.torch import save_file

    from shardstream.commands.test import compare_with_reference

    root, actor = checkpoints["ws4-lora"]
    target = tmp_path / "merged"
    merge(actor, target, "--dtype", "float32")
    adapter_file = target / "lora_adapter" / "adapter_model.safetensors"
    n_base = len(load_file(target / "model.safetensors"))
    adapter = load_file(adapter_file)
    report = compare_with_reference(actor, target)
    assert report.ok, report.problems
    assert report.compared == n_base + len(adapter) and report.max_abs_diff == 0.0

    name = sorted(adapter)[0]
    adapter[name] = adapter[name] + 1
    save_file(adapter, str(adapter_file), metadata={"format": "pt"})
    report = compare_with_reference(actor, target)
    assert not report.ok and any(name in line for line in report.problems)

    shutil.rmtree(target / "lora_adapter")
    report = compare_with_reference(actor, target)
    assert report.ok and report.compared == n_base
    assert sorted(report.skipped) == sorted(adapter)


def test_float32_config_is_written_as_bfloat16_as_verls_merger_does_and_said(
    checkpoints, tmp_path, capsys
):
    """verl's actor config names float32 (transformers 5 rewrites it for an fp32 actor), and
    verl's merger writes bfloat16 anyway: so does merge by default, saying what config.json
    names and how to keep it; --dtype float32 keeps it."""
    import shutil

    root, actor = checkpoints["ws4"]
    copy = tmp_path / "actor"
    shutil.copytree(actor, copy)
    config_path = copy / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config))
    target = tmp_path / "merged"
    args = ["merge", "--backend", "fsdp", "--local_dir", str(copy), "--target_dir", str(target)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "note: wrote bfloat16, as verl's merger does" in err and "--dtype float32" in err
    assert all(t.dtype == torch.bfloat16 for t in merged_tensors(target).values())
    assert json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"
    kept = tmp_path / "fp32"
    assert main([*args[:-1], str(kept), "--dtype", "float32"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert all(t.dtype == torch.float32 for t in merged_tensors(kept).values())


def test_no_direct_io_writes_the_same_files_through_the_page_cache(
    checkpoints, tmp_path, monkeypatch
):
    """``--no-direct-io`` is the escape hatch for file systems where O_DIRECT misbehaves: no
    write goes through an O_DIRECT descriptor, and the files are byte-identical."""
    import fcntl
    import os

    _, actor = checkpoints["ws4-shard1"]
    real, direct_writes = os.pwrite, []

    def spy(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            direct_writes.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    merge(actor, tmp_path / "direct", "--dtype", "bfloat16", "--buffer-size", "64KiB")
    used_direct = bool(direct_writes)
    direct_writes.clear()
    merge(
        actor, tmp_path / "paged", "--dtype", "bfloat16", "--buffer-size", "64KiB", "--no-direct-io"
    )
    assert direct_writes == []
    names = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "paged").iterdir())
    for name in names:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "paged" / name).read_bytes()
    from shardstream.formats.writer import open_direct

    probe = open_direct(str(tmp_path / "direct" / "config.json"))
    if probe is not None:
        os.close(probe)
        assert used_direct, "the default merge wrote nothing with O_DIRECT"


def test_sharded_tensors_keep_one_offset_per_rank(checkpoints, monkeypatch):
    """A DTensor split along one dimension is held as one byte offset per rank (GridBlocks);
    the blocks it hands out are the ones a Block-per-rank reading builds, in every case
    (Shard(0) and Shard(1), uneven rows, HSDP replicas, plain buffers, LoRA)."""
    from shardstream.engine.plan import GridBlocks
    from shardstream.formats import verl

    opened = {name: verl.open_verl(actor) for name, (_, actor) in checkpoints.items()}
    monkeypatch.setattr(verl, "_grid_part", lambda *args: None)
    for name, (_, actor) in checkpoints.items():
        eager = {t.name: t for t in verl.open_verl(actor).tensors}
        grids = [t for t in opened[name].tensors if isinstance(t.blocks, GridBlocks)]
        assert grids or name == "ws4-plain-buffers", name
        for tensor in opened[name].tensors:
            nonempty = tuple(b for b in eager[tensor.name].blocks if b.numel)
            assert tuple(b for b in tensor.blocks if b.numel) == nonempty, tensor.name
        for tensor in grids:
            assert not isinstance(eager[tensor.name].blocks, GridBlocks)
            assert tensor.blocks.offsets.itemsize == 8
            assert len({b.location for b in tensor.blocks}) == len(tensor.blocks)
    dims = {
        t.blocks.dim for o in opened.values() for t in o.tensors if isinstance(t.blocks, GridBlocks)
    }
    assert dims == {0, 1}  # Shard(1) checkpoints keep grids too


def _replica_diverged(path, offset: int) -> None:
    """The float32 at ``offset`` of the rank file ``path`` changed and its zip record's CRC-32
    made to match: replicas that drifted apart in training, not a corrupt file."""
    import struct
    import zipfile
    import zlib

    from shardstream.formats.torch_pt import zip_records

    raw = bytearray(path.read_bytes())
    (record,) = [r for r in zip_records(str(path)) if r.start <= offset < r.end]
    struct.pack_into("<f", raw, offset, struct.unpack_from("<f", raw, offset)[0] + 1.0)
    crc = zlib.crc32(bytes(raw[record.start : record.end]))
    with zipfile.ZipFile(path) as archive:
        struct.pack_into("<I", raw, archive.getinfo(record.name).header_offset + 14, crc)
    at = raw.find(b"PK\x01\x02")
    while at >= 0:  # the central directory's entry of the record
        length = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + length].decode() == record.name:
            struct.pack_into("<I", raw, at + 16, crc)
        at = raw.find(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(raw))


def test_verify_compares_hsdp_replicas(checkpoints, tmp_path):
    """The pieces an HSDP checkpoint's second data-parallel row stores again were checked
    against their CRC-32s only: rows that drifted apart verified OK (merge reads the first)."""
    import shutil

    from shardstream.commands.verify import verify
    from shardstream.formats.verl import open_verl

    _, actor = checkpoints["hsdp2x2"]
    copy = tmp_path / "actor"
    shutil.copytree(actor, copy)
    assert verify(copy).ok
    pairs = open_verl(copy, keep_shard_replicas=True).shard_replicas
    name = "model.layers.0.mlp.up_proj.weight"
    assert len(pairs[name]) == 2  # ddp row 1's two pieces, each beside row 0's
    replica, first = pairs[name][1]
    assert replica.dtype == "F32" and replica.start == first.start
    _replica_diverged(Path(replica.location), replica.offset + 4)
    report = verify(copy)
    assert not report.ok
    (problem,) = report.problems
    assert problem.path == replica.location
    assert f"tensor {name!r}" in problem.line() and "HSDP" in problem.line()
