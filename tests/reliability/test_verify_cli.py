"""``shardstream verify DIR`` on a step directory, a manager root and merged HF directories.

Exit 0 when everything checks out; otherwise exit 1 and one line per problem on stderr, naming
the file, the tensor and the byte range; ``--json`` gives the same as a document.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardstream import cli
from shardstream.formats.safetensors import read_header
from shardstream.testing.verl_checkpoint import zip_member_data

from .harness import record

LINE = re.compile(
    r"^(?P<path>\S+)(?: tensor (?P<tensor>.+?))?(?: bytes \[(?P<lo>\d+), (?P<hi>\d+)\))?: "
)


def _verify(capsys, *args) -> tuple[int, list[str], str]:
    """Exit code, stderr lines and stdout of ``shardstream verify --quiet`` (no progress bar)."""
    code = cli.main(["verify", "--quiet", *map(str, args)])
    out, err = capsys.readouterr()
    return code, [line for line in err.splitlines() if line.strip()], out


def flip_data_byte(path: Path, fraction: float = 0.5) -> tuple[int, str]:
    """Flip a byte inside the data section; return its file offset and the tensor it is in."""
    header = read_header(path)
    offset = header.data_start + int((header.file_size - header.data_start) * fraction)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    name = next(
        n
        for n, e in header.tensors.items()
        if header.data_start + e.begin <= offset < header.data_start + e.end
    )
    return offset, name


@pytest.mark.parametrize(
    "which,kind",
    [("step", "step"), ("root", "root"), ("hf", "huggingface"), ("hf_sharded", "huggingface")],
)
def test_verify_passes_on_good_checkpoints(saved_run, capsys, which, kind):
    path = getattr(saved_run, which)
    code, problems, out = _verify(capsys, path)
    assert (code, problems, out) == (0, [], "")
    code, problems, out = _verify(capsys, path, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["kind"] == kind and doc["problems"] == []
    assert doc["files_checked"] >= 1 and doc["bytes_checked"] > 0
    if kind == "root":
        assert doc["steps"] == [2, 3]


def test_verify_of_a_run_names_the_leftovers_of_a_save_cut_short(saved_run, tmp_path, capsys):
    """inspect listed a killed save's staging folder; verify, the command run to check a
    run before resuming it, passed without naming it (a whole step's worth of disk)."""
    root = tmp_path / "root"
    shutil.copytree(saved_run.root, root)
    (root / "global_step_4.tmp-0badf00d").mkdir()
    code = cli.main(["verify", str(root)])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("OK: root"), (out, err)
    note = [line for line in err.splitlines() if line.startswith("note: uncommitted leftovers")]
    assert len(note) == 1 and note[0].endswith(": global_step_4.tmp-0badf00d"), err
    code, problems, out = _verify(capsys, root, "--json")
    assert code == 0 and not problems
    assert json.loads(out)["uncommitted"] == ["global_step_4.tmp-0badf00d"]


def test_verify_names_a_role_cut_short_in_verls_layout_as_leftovers(saved_run, tmp_path, capsys):
    """The verl plug-in stages a role as ``global_step_N/actor.tmp-*``: killed mid-save, the
    step directory holds that alone, and verify called the run FAILED (exit 1) where the
    tracker and the next save treat it as the leftover it is."""
    root = tmp_path / "root"
    shutil.copytree(saved_run.root, root)
    (root / "global_step_4" / "actor.tmp-0badf00d").mkdir(parents=True)
    code, problems, out = _verify(capsys, root, "--json")
    assert code == 0 and not problems, problems
    assert json.loads(out)["uncommitted"] == ["global_step_4/actor.tmp-0badf00d"]
    (root / "global_step_4" / "stray.bin").write_bytes(b"x")  # not a leftover alone
    code, problems, _ = _verify(capsys, root)
    assert code == 1 and any("global_step_4: step directory has no manifest" in p for p in problems)


def test_verify_root_reports_one_line_per_problem(saved_run, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(saved_run.root, root)
    offset, tensor = flip_data_byte(root / "global_step_3" / "rank-00001.safetensors")
    extra = root / "global_step_2" / "extra-rank-00000.json"
    extra.write_bytes(extra.read_bytes()[:-7])  # truncated
    (root / "latest_checkpointed_iteration.txt").write_text("9\n")

    code, lines, out = _verify(capsys, root)
    assert code == 1
    assert len(lines) == 3, lines
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    by_file = {Path(m["path"]).name: (m, line) for m, line in zip(parsed, lines)}
    data, line = by_file["rank-00001.safetensors"]
    assert tensor in data["tensor"] and "checksum mismatch" in line
    assert int(data["lo"]) <= offset < int(data["hi"])
    assert "size" in by_file["extra-rank-00000.json"][1]
    assert "names step 9, which is not committed" in by_file["latest_checkpointed_iteration.txt"][1]

    code, _, out = _verify(capsys, root, "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and len(doc["problems"]) == 3
    problem = next(p for p in doc["problems"] if p["path"].endswith("rank-00001.safetensors"))
    assert tensor in problem["tensor"]
    assert problem["byte_range"][0] <= offset < problem["byte_range"][1]
    assert problem["line"] in lines
    record(
        "verify: manager root with three problems",
        trials=1,
        lines=lines,
    )


def test_verify_step_dir_names_file_tensor_and_bytes(saved_run, tmp_path, capsys):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    offset, tensor = flip_data_byte(step / "rank-00000.safetensors", 0.9)
    code, lines, _ = _verify(capsys, step)
    assert code == 1 and len(lines) == 1
    match = LINE.match(lines[0])
    assert match["path"] == str(step / "rank-00000.safetensors")
    assert tensor in match["tensor"]
    assert int(match["lo"]) <= offset < int(match["hi"])


def test_verify_directory_of_other_tools_checkpoints(saved_run, tmp_path, capsys):
    """A directory holding checkpoints side by side (the Trainer's output_dir, checkpoint-N):
    each is verified, a damaged one named; steps in the order of the names' numbers."""
    out = tmp_path / "out"
    for step in (10, 2):  # (directories of shardstream's or verl's checkpoints are verl roles)
        shutil.copytree(saved_run.hf, out / f"checkpoint-{step}")
    code, lines, text = _verify(capsys, out, "--json")
    assert code == 0 and not lines
    report = json.loads(text)
    assert (report["kind"], report["steps"]) == ("checkpoints", [2, 10]), report
    _, _, alone = _verify(capsys, out / "checkpoint-2", "--json")
    assert report["files_checked"] == 2 * json.loads(alone)["files_checked"] > 0
    offset, tensor = flip_data_byte(out / "checkpoint-10" / "model.safetensors", 0.9)
    code, lines, _ = _verify(capsys, out)
    assert code == 1 and len(lines) == 1, lines
    match = LINE.match(lines[0])
    assert match["path"] == str(out / "checkpoint-10" / "model.safetensors")
    assert tensor in match["tensor"] and int(match["lo"]) <= offset < int(match["hi"])


def test_verify_hf_dirs(saved_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(saved_run.hf, hf)
    offset, tensor = flip_data_byte(hf / "model.safetensors", 0.3)
    code, lines, _ = _verify(capsys, hf)
    assert code == 1 and len(lines) == 1
    match = LINE.match(lines[0])
    assert match["path"] == str(hf / "model.safetensors") and tensor in match["tensor"]
    assert int(match["lo"]) <= offset < int(match["hi"])

    sharded = tmp_path / "sharded"
    shutil.copytree(saved_run.hf_sharded, sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[0].unlink()
    code, lines, _ = _verify(capsys, sharded)
    assert code == 1 and lines
    assert any(str(shards[0]) in line and "missing" in line for line in lines), lines


def test_verify_of_a_model_another_tool_wrote_says_its_data_went_unchecked(tmp_path, capsys):
    """A flipped data byte in a file without shardstream's checksums (save_pretrained's,
    verl's merger's) passed as "OK ... 2.70 KiB checked", the header's size alone."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "foreign"
    model.mkdir()
    save_file({"w": torch.arange(1024, dtype=torch.float32)}, str(model / "model.safetensors"))
    header = read_header(model / "model.safetensors")
    data = header.file_size - header.data_start
    flip_data_byte(model / "model.safetensors")
    code = cli.main(["verify", str(model)])  # not --quiet: the verdict line
    out = capsys.readouterr().out
    assert code == 0, out  # nothing it can check is wrong
    assert "4.00 KiB of tensor data not checked" in out and "carry no checksums" in out, out
    code = cli.main(["verify", "--json", str(model)])
    doc = json.loads(capsys.readouterr().out)
    assert doc["unchecked_bytes"] == data == 4096 and doc["bytes_checked"] == header.data_start


def test_verify_hf_shard_names_that_merely_start_with_dots(saved_run, tmp_path, capsys):
    """A shard named ``..model-00001-of-00002.safetensors`` is a file of the model directory,
    as merge and ``test`` read it: verify checks it like any other; ``..`` itself is refused.
    (The edited index is not the one merge wrote, whose digest the first shard keeps: that
    is the one problem said.)"""
    sharded = tmp_path / "sharded"
    shutil.copytree(saved_run.hf_sharded, sharded)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (sharded / first).rename(sharded / f"..{first}")
    index["weight_map"] = {t: f"..{f}" if f == first else f for t, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    code, lines, _ = _verify(capsys, sharded)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"{index_path}: differs from what merge wrote"), lines
    renamed = index["weight_map"].items()
    index["weight_map"] = {t: ".." if f == f"..{first}" else f for t, f in renamed}
    index_path.write_text(json.dumps(index))
    code, lines, _ = _verify(capsys, sharded)
    assert code == 1 and any("unsafe file name '..'" in line for line in lines), lines


def test_verify_missing_or_foreign_directory(tmp_path, capsys):
    code, lines, _ = _verify(capsys, tmp_path / "nope")
    assert code == 1 and len(lines) == 1 and "no such directory" in lines[0]
    (tmp_path / "empty").mkdir()
    code, lines, _ = _verify(capsys, tmp_path / "empty")
    assert code == 1 and "not a checkpoint" in lines[0]


def test_verify_exit_codes_of_the_installed_command(saved_run, tmp_path):
    """The real ``python -m shardstream verify`` process: 0 when fine, 1 with problem lines."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "shardstream", "verify", "--quiet"]
    ok = subprocess.run([*command, str(saved_run.root)], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    offset, tensor = flip_data_byte(step / "rank-00001.safetensors")
    bad = subprocess.run([*command, str(step)], capture_output=True, text=True, env=env)
    assert bad.returncode == 1
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and tensor in lines[0] and "rank-00001.safetensors" in lines[0]


def test_verify_verl_checkpoint_step_and_run(copy_variant, tmp_path, capsys):
    """verl's .pt files: every zip record against the CRC-32 torch wrote (and never checks),
    every rank's optimizer and extra files present, the layout consistent."""

    import torch

    run = tmp_path / "run"
    actor = run / "global_step_7" / "actor"
    actor.parent.mkdir(parents=True)
    shutil.copytree(copy_variant("base"), actor)
    for rank in range(2):
        torch.save({"state": {}, "param_groups": []}, actor / f"optim_world_size_2_rank_{rank}.pt")
    (run / "latest_checkpointed_iteration.txt").write_text("7")

    for path, kind in ((actor, "verl"), (actor.parent, "verl"), (run, "root")):
        code, problems, out = _verify(capsys, path, "--json")
        doc = json.loads(out)
        assert (code, doc["ok"], doc["kind"]) == (0, True, kind), doc
        assert doc["files_checked"] == 4 and doc["bytes_checked"] > 0
    assert doc["steps"] == [7]

    victim = actor / "model_world_size_2_rank_1.pt"
    start, size = zip_member_data(victim)
    offset = start + size // 3
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x01
    victim.write_bytes(bytes(data))
    (actor / "optim_world_size_2_rank_0.pt").unlink()

    code, lines, _ = _verify(capsys, run)
    assert code == 1 and len(lines) == 2, lines
    crc = LINE.match(next(line for line in lines if "CRC-32" in line))
    assert crc["path"] == str(victim) and crc["tensor"].startswith("'model.")
    assert int(crc["lo"]) <= offset < int(crc["hi"])
    assert any(line == f"{actor / 'optim_world_size_2_rank_0.pt'}: missing" for line in lines), (
        lines
    )


def test_verify_dcp_checks_structure_and_crcs(tmp_path, capsys):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(ckpt))
    code = cli.main(["verify", str(ckpt)])
    out, err = capsys.readouterr()
    assert code == 0 and "CRC-32" in out, (out, err)
    data = next(ckpt.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and len(lines) == 1 and "truncated" in lines[0] and data.name in lines[0]


def test_verify_dcp_names_a_data_file_its_metadata_does_not(tmp_path, capsys):
    """A stray ``__2_0.distcp`` (an earlier save's at more ranks, or junk) was counted among
    the files checked, which it never was: it is said apart, and not counted."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(ckpt))
    assert cli.main(["verify", str(ckpt)]) == 0
    counted = capsys.readouterr().out
    (ckpt / "__2_0.distcp").write_bytes(bytes(range(256)) * 20)
    assert cli.main(["verify", str(ckpt)]) == 0
    out, err = capsys.readouterr()
    assert out == counted, (out, counted)
    assert "files no part of the checkpoint (its .metadata, index" in err, err
    assert "__2_0.distcp" in err, err


def test_verify_hf_names_a_weights_file_its_index_does_not(tmp_path, capsys):
    """A shard beside a sharded model that its index does not name (an earlier save's, with
    another lm_head.weight) went unmentioned: merge follows the index and never reads it."""
    import json

    import torch
    from safetensors.torch import save_file

    model = tmp_path / "hf"
    model.mkdir()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file({"a": torch.ones(4)}, str(model / names[0]), metadata={"format": "pt"})
    save_file({"lm_head.weight": torch.ones(4)}, str(model / names[1]), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": 32},
        "weight_map": {"a": names[0], "lm_head.weight": names[1]},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert cli.main(["verify", str(model)]) == 0
    counted = capsys.readouterr().out
    save_file({"lm_head.weight": torch.zeros(4)}, str(model / "model-00002-of-00003.safetensors"))
    assert cli.main(["verify", str(model), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unnamed"] == ["model-00002-of-00003.safetensors"]
    assert cli.main(["verify", str(model)]) == 0
    out, err = capsys.readouterr()
    assert out == counted, (out, counted)
    assert "no part of the checkpoint" in err and "model-00002-of-00003.safetensors" in err, err


def test_verify_dcp_checks_the_config_files_merge_copies(tmp_path, capsys):
    """A FIFO as the tokenizer file beside a DCP checkpoint: merge refuses it, verify said
    OK (it checked the DCP files only)."""
    import os
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(ckpt))
    (ckpt / "config.json").write_text('{"model_type": "tiny"}')
    assert _verify(capsys, ckpt)[0] == 0
    os.mkfifo(ckpt / "tokenizer.json")
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and lines == [f"{ckpt / 'tokenizer.json'}: is a FIFO, expected a regular file"]


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        ({"num_hidden_layers": 5}, "num_hidden_layers is 5"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "q_proj.bias"),
        ({"hidden_size": 7}, "hidden_size 7"),
    ],
)
def test_verify_of_a_verl_role_checks_its_config_describes_the_weights(
    copy_variant, capsys, change, shown
):
    """A config.json of another model beside verl's weights: verify said OK, then merge
    refused it. verify now applies merge's checks of config.json against the weights."""
    actor = copy_variant("base")
    code, _, _ = _verify(capsys, actor)
    assert code == 0
    path = actor / "huggingface" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    code, lines, _ = _verify(capsys, actor)
    assert code == 1 and len(lines) == 1, lines
    assert str(path) in lines[0] and shown in lines[0], lines


def test_verify_of_a_hf_model_names_a_tensor_name_merge_refuses(tmp_path, capsys):
    """A tensor named with U+202E (text direction reversed when printed): verify said OK,
    merge refused it."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "hf"
    model.mkdir()
    save_file(
        {"a.weight": torch.zeros(2), "b\u202e.weight": torch.ones(2)}, model / "model.safetensors"
    )
    code, lines, _ = _verify(capsys, model)
    assert code == 1 and len(lines) == 1 and "U+202E" in lines[0], lines
    assert cli.main(["merge", "--local_dir", str(model), "--target_dir", str(tmp_path / "o")]) == 1
    assert "U+202E" in capsys.readouterr().err


def test_verify_names_an_update_in_place_that_was_cut_short(saved_run, tmp_path):
    """A merge killed while it moved its files into an existing output leaves the files it
    replaced in .shardstream-old.tmp-*: verify said "not a checkpoint" (or named a missing
    shard) without naming that folder or saying that rerunning the merge completes it."""
    from shardstream.commands.verify import verify

    target = tmp_path / "merged"
    shutil.copytree(saved_run.hf, target)
    old = target / ".shardstream-old.tmp-0123abcd"
    old.mkdir()
    assert verify(target).ok and verify(target).uncommitted == [old.name]
    for entry in target.iterdir():  # killed after moving every old file out, none in
        if entry != old:
            shutil.move(entry, old / entry.name)
    report = verify(target)
    assert not report.ok
    said = [p.message for p in report.problems]
    assert any(f"cut short: the files it replaced are in {old}" in m for m in said), said
    assert any("rerun the merge" in m for m in said), said
