"""Bad inputs to ``shardstream merge``: one clear line naming the culprit, a non-zero exit, no
traceback, and nothing written (no target directory, no ``*.tmp-*`` leftovers)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardstream.cli import main
from shardstream.testing.verl_checkpoint import zip_member_data

RANK0 = "model_world_size_2_rank_0.pt"
RANK1 = "model_world_size_2_rank_1.pt"
NORM_KEY = "model.norm.weight"


@pytest.fixture
def out(tmp_path) -> Path:
    """An empty directory to hold the target; after a failure it must still be empty."""
    path = tmp_path / "out"
    path.mkdir()
    return path


def merge(capsys, local, target, *extra) -> tuple[int, str]:
    argv = ["merge", "--local_dir", str(local), "--target_dir", str(target), "--quiet", *extra]
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.err


def assert_clean_failure(rc: int, err: str, *fragments: str, code: int = 1) -> str:
    assert rc == code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("shardstream merge: error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def assert_nothing_written(directory: Path, expected: set[str] | None = None) -> None:
    names = set(os.listdir(directory))
    assert names == (expected or set()), names
    assert not any(".tmp-" in n for n in names)


def merge_fails(capsys, local, out, *fragments, code=1, extra=()) -> str:
    rc, err = merge(capsys, local, out / "merged", *extra)
    line = assert_clean_failure(rc, err, *fragments, code=code)
    assert_nothing_written(out)
    return line


def flip(path: Path, offset: int, count: int = 4) -> None:
    data = bytearray(path.read_bytes())
    for k in range(offset, offset + count):
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))


def record_offset(path: Path, suffix: str) -> int:
    """File offset of the data of the zip member ending in ``suffix`` (local header skipped)."""
    return zip_member_data(path, suffix)[0]


class CodeOnLoad:
    """Unpickling this would create ``marker`` (a directory): code execution, made visible."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


# ---------------------------------------------------------------------------- missing input


def test_missing_directory(capsys, tmp_path, out):
    merge_fails(capsys, tmp_path / "nope", out, str(tmp_path / "nope"), "no such directory")


def test_local_dir_is_a_file(capsys, tmp_path, out):
    f = tmp_path / "file.txt"
    f.write_bytes(b"x")
    merge_fails(capsys, f, out, str(f), "is a regular file")
    f = tmp_path / "file.pt"  # read as one torch.save file, which it is not
    f.write_bytes(b"x")
    merge_fails(capsys, f, out, str(f), "corrupt or truncated torch checkpoint")


def test_no_model_files(capsys, tmp_path, out):
    empty = tmp_path / "ckpt"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    merge_fails(capsys, empty, out, str(empty), "no model files", "model_world_size_W_rank_R.pt")


def test_run_or_step_directory_names_the_checkpoint_inside(capsys, tmp_path, copy_variant, out):
    """A user who passes a run or step directory is told which directory to pass."""
    run = tmp_path / "run"
    for step in (1, 2):
        for role in ("actor", "critic"):
            (run / f"global_step_{step}").mkdir(parents=True, exist_ok=True)
            shutil.copytree(
                copy_variant("base", f"{step}{role}"), run / f"global_step_{step}" / role
            )
    step1 = run / "global_step_1"
    both = "2 folders hold checkpoints (actor, critic); pass one of them "
    both += f"({step1 / 'actor'}, ...)"
    merge_fails(capsys, step1, out, f"{step1}: no model files here", both)
    (run / "latest_checkpointed_iteration.txt").write_text("1\n")  # the pointer wins
    merge_fails(capsys, run, out, both)
    (run / "latest_checkpointed_iteration.txt").unlink()  # else the highest step
    merge_fails(capsys, run, out, str(run / "global_step_2" / "actor"))
    native_run = tmp_path / "native_run"  # shardstream's: the step directory is the checkpoint
    (native_run / "global_step_3").mkdir(parents=True)
    (native_run / "global_step_3" / "manifest.json").write_text("{}")
    merge_fails(capsys, native_run, out, f"{native_run / 'global_step_3'} holds a checkpoint")


def test_missing_rank_file_is_named(capsys, copy_variant, out):
    ckpt = copy_variant("base")
    (ckpt / RANK1).unlink()
    merge_fails(capsys, ckpt, out, "missing rank file(s)", RANK1)


def test_missing_rank_file_via_subprocess(copy_variant, out):
    """The real entry point: exit status and stderr as a user sees them."""
    ckpt = copy_variant("base")
    (ckpt / RANK0).unlink()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardstream",
            "merge",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(out / "merged"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 1
    assert_clean_failure(proc.returncode, proc.stderr, RANK0)
    assert proc.stdout == ""
    assert_nothing_written(out)


# ---------------------------------------------------------------------------- names and config


def test_fsdp_config_world_size_disagrees_with_file_names(capsys, copy_variant, out):
    ckpt = copy_variant("base")
    (ckpt / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 4}')
    merge_fails(capsys, ckpt, out, "fsdp_config.json", "world_size 4", "world size 2")


def test_fsdp_config_world_size_of_another_type_is_named_so(capsys, copy_variant, out):
    """A string "2" was said to disagree with world size 2."""
    ckpt = copy_variant("base")
    (ckpt / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": "2"}')
    merge_fails(capsys, ckpt, out, "fsdp_config.json", "world_size is '2' (str), not a whole")


def test_files_renamed_to_another_world_size(capsys, copy_variant, out):
    ckpt = copy_variant("base")
    for r in (0, 1):
        os.rename(
            ckpt / f"model_world_size_2_rank_{r}.pt", ckpt / f"model_world_size_3_rank_{r}.pt"
        )
    (ckpt / "fsdp_config.json").unlink()
    merge_fails(capsys, ckpt, out, "missing rank file(s)", "model_world_size_3_rank_2.pt")


def test_fsdp_config_not_json(capsys, copy_variant, out):
    ckpt = copy_variant("base")
    (ckpt / "fsdp_config.json").write_text("{world_size: 2")
    merge_fails(capsys, ckpt, out, "fsdp_config.json", "not valid JSON")


def test_files_from_two_world_sizes(capsys, copy_variant, out):
    ckpt = copy_variant("base")
    shutil.copy(ckpt / RANK0, ckpt / "model_world_size_4_rank_0.pt")
    (ckpt / "fsdp_config.json").unlink()
    merge_fails(capsys, ckpt, out, str(ckpt), "several world sizes (2, 4), and no fsdp_config")


def test_a_step_saved_again_at_another_world_size_reads_the_set_its_config_names(
    capsys, caplog, copy_variant, fsdp_root, out
):
    """verl saving a step again at another world size leaves the earlier set beside the new
    one; its fsdp_config.json names the new one, which verl's merger reads: merge refused."""
    ckpt = copy_variant("base")
    assert json.loads((ckpt / "fsdp_config.json").read_text())["world_size"] == 2
    for rank in range(3):  # an earlier save's set, complete
        shutil.copy(ckpt / RANK0, ckpt / f"model_world_size_3_rank_{rank}.pt")
    with caplog.at_level(logging.WARNING, logger="shardstream.formats.verl"):
        rc, err = merge(capsys, ckpt, out / "merged", "--dtype", "float32")
    assert rc == 0, err
    said = err + "".join(r.getMessage() for r in caplog.records)
    assert "holds model files of world sizes 2, 3; reading those of world size 2" in said, said
    assert (
        main(
            [
                "test",
                "--local_dir",
                str(out / "merged"),
                "--test_hf_dir",
                str(fsdp_root / "reference"),
                "--exact",
            ]
        )
        == 0
    )


def test_verify_says_the_other_world_sizes_files_are_not_read(copy_variant):
    """verify counted an earlier save's complete set among the files checked (10 of which
    6 are read): they are named apart, not counted."""
    from shardstream.commands.verify import verify

    ckpt = copy_variant("base")
    counted = verify(ckpt).files_checked
    stale = [f"model_world_size_3_rank_{rank}.pt" for rank in range(3)]
    for name in stale:
        shutil.copy(ckpt / RANK0, ckpt / name)
    report = verify(ckpt)
    assert report.ok and report.files_checked == counted and report.unnamed == stale


def test_verify_names_pt_files_no_rank_file_is_named_as_not_read(copy_variant):
    """``model_world_size_2_rank_01.pt`` (verl opens rank_1.pt) and other stray .pt files were
    counted among the files checked though nothing reads them: damaged, verify still passed."""
    from shardstream.commands.verify import verify

    ckpt = copy_variant("base")
    counted = verify(ckpt).files_checked
    strays = ["model_world_size_2_rank_01.pt", "notes.pt"]
    for name in strays:
        shutil.copy(ckpt / RANK1, ckpt / name)
    report = verify(ckpt)
    assert report.ok and report.files_checked == counted and report.unnamed == sorted(strays)


def test_rank_beyond_world_size(capsys, copy_variant, out):
    ckpt = copy_variant("base")
    shutil.copy(ckpt / RANK1, ckpt / "model_world_size_2_rank_2.pt")
    merge_fails(capsys, ckpt, out, "rank 2 file exists but world size is 2")


def test_swapped_rank_files(capsys, copy_variant, out):
    ckpt = copy_variant("base")
    os.rename(ckpt / RANK0, ckpt / "tmp")
    os.rename(ckpt / RANK1, ckpt / RANK0)
    os.rename(ckpt / "tmp", ckpt / RANK1)
    merge_fails(capsys, ckpt, out, RANK0, "named for rank 0 but was saved by rank 1")


def test_a_rank_file_name_with_a_trailing_newline_is_not_that_ranks(
    capsys, copy_variant, fsdp_root, out
):
    """``model_world_size_2_rank_1.pt`` and a newline: Python's ``$`` matches before a final
    newline, so the stray file was read as rank 1 in place of the real one (whichever the
    listing gave last), verify passed and the output held its values. verl opens the exact
    name; so does merge now."""
    ckpt = copy_variant("base")
    state = torch.load(ckpt / RANK1, weights_only=False)  # rank 1 of another run: other values
    for tensor in state.values():
        tensor.to_local().add_(1.0)
    torch.save(state, ckpt / (RANK1 + "\n"))
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out)]) == 0
    capsys.readouterr()
    reference = fsdp_root / "base"
    assert main(["merge", "--local_dir", str(reference), "--target_dir", str(out) + "-ref"]) == 0
    got = (out / "model.safetensors").read_bytes()
    assert got == (Path(str(out) + "-ref") / "model.safetensors").read_bytes()
    (ckpt / RANK1).unlink()  # the stray file alone is no rank file either
    capsys.readouterr()
    alone = Path(str(out) + "-alone")
    alone.mkdir()
    merge_fails(capsys, ckpt, alone, f"missing rank file(s): {RANK1}")


# ---------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0])
def test_truncated_pt(capsys, copy_variant, out, keep):
    ckpt = copy_variant("base")
    path = ckpt / RANK1
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    merge_fails(capsys, ckpt, out, str(path), "truncated")


def test_pt_with_a_byte_prepended(capsys, copy_variant, out):
    """Every record shifts by one, so torch's unpickler reads a garbled stream and fails with
    an IndexError deep inside it (found by the soak fuzzer); merge names the file instead."""
    ckpt = copy_variant("base")
    path = ckpt / RANK1
    path.write_bytes(b"a" + path.read_bytes())
    merge_fails(capsys, ckpt, out, str(path), "corrupt")


@pytest.mark.parametrize("where", ["pickle-start", "pickle-middle", "central-directory"])
def test_corrupt_pt(capsys, copy_variant, out, where):
    ckpt = copy_variant("base")
    path = ckpt / RANK1
    if where == "central-directory":
        flip(path, path.stat().st_size - 60, 10)
    else:
        start = record_offset(path, "data.pkl")
        flip(path, start + (40 if where == "pickle-start" else 1500))
    line = merge_fails(capsys, ckpt, out, str(path), "corrupt")
    if where != "central-directory":
        assert "Bad CRC-32" in line and "data.pkl" in line


@pytest.mark.parametrize("record", ["data/0", "data/3"])
def test_flipped_byte_in_tensor_data(capsys, copy_variant, fsdp_root, out, record):
    """torch checks no CRC when it loads a file; merge and test check each record's CRC-32 as
    they read it, and name the file, the record and the tensor."""
    ckpt = copy_variant("base")
    path = ckpt / RANK1
    flip(path, record_offset(path, record) + 2, 1)
    expected = (
        rf"{path}: checksum mismatch in bytes \[\d+, \d+\) \(zip record \S+/{record}: '[\w.]+'\)"
    )
    line = merge_fails(capsys, ckpt, out, str(path))
    assert re.search(expected, line), line
    rc = main(["test", "--local_dir", str(ckpt), "--test_hf_dir", str(fsdp_root / "reference")])
    err = capsys.readouterr().err
    assert rc == 1 and re.search(expected, err) and "Traceback" not in err, err


def test_pickle_with_code_is_refused_and_never_run(capsys, copy_variant, out, tmp_path):
    marker = tmp_path / "PWNED"
    ckpt = copy_variant("base")
    state = {"model.norm.weight": torch.ones(3), "payload": CodeOnLoad(str(marker))}
    torch.save(state, ckpt / RANK1)
    merge_fails(capsys, ckpt, out, str(ckpt / RANK1), "refused to unpickle", "os.makedirs")
    assert not marker.exists()
    # The payload is live: an unrestricted load does run it.
    witness = tmp_path / "witness"
    torch.save({"payload": CodeOnLoad(str(witness))}, tmp_path / "live.pt")
    torch.load(tmp_path / "live.pt", weights_only=False)
    assert witness.is_dir()


def test_pickle_with_code_via_subprocess(copy_variant, out, tmp_path):
    marker = tmp_path / "PWNED"
    ckpt = copy_variant("base")
    torch.save({"payload": CodeOnLoad(str(marker))}, ckpt / RANK0)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardstream",
            "merge",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(out / "merged"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert_clean_failure(proc.returncode, proc.stderr, str(ckpt / RANK0), "refused to unpickle")
    assert not marker.exists()
    assert_nothing_written(out)


# ---------------------------------------------------------------------------- ranks disagree


def test_shapes_disagree_across_ranks(capsys, copy_variant, fsdp_root, out):
    ckpt = copy_variant("base")
    shutil.copy(fsdp_root / "bigger" / RANK1, ckpt / RANK1)
    merge_fails(
        capsys,
        ckpt,
        out,
        str(ckpt / RANK1),
        "'model.embed_tokens.weight'",
        "[103, 48]",
        "[101, 48]",
        "disagree across ranks",
    )


def test_placements_disagree_across_ranks(capsys, copy_variant, fsdp_root, out):
    ckpt = copy_variant("base")
    shutil.copy(fsdp_root / "shard1" / RANK1, ckpt / RANK1)
    merge_fails(
        capsys,
        ckpt,
        out,
        "'model.embed_tokens.weight'",
        "Shard(dim=1)",
        "Shard(dim=0)",
        "disagree across ranks",
    )


def plain_checkpoint(directory: Path, states: list[dict]) -> Path:
    directory.mkdir()
    for rank, state in enumerate(states):
        torch.save(state, directory / f"model_world_size_{len(states)}_rank_{rank}.pt")
    return directory


def test_plain_replicas_that_differ(capsys, tmp_path, out):
    a = {"a.weight": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5)}
    b = {k: v.clone() for k, v in a.items()}
    b["a.weight"][1, 2] = 7.0
    ckpt = plain_checkpoint(tmp_path / "plain", [a, b])
    merge_fails(capsys, ckpt, out, RANK1, "replica of tensor 'a.weight' differs", RANK0)
    from shardstream.commands.verify import verify

    report = verify(ckpt)  # every record sound, but not a checkpoint merge takes: not OK
    assert not report.ok
    (problem,) = report.problems
    assert problem.path == str(ckpt / RANK1) and "'a.weight' differs" in problem.line()


def test_plain_replicas_with_different_shapes(capsys, tmp_path, out):
    a = {"a.weight": torch.zeros(3, 4)}
    ckpt = plain_checkpoint(tmp_path / "plain", [a, {"a.weight": torch.zeros(4, 3)}])
    merge_fails(capsys, ckpt, out, RANK1, "'a.weight'", "[4, 3]", "[3, 4]")


def test_plain_replicas_that_agree_merge(capsys, tmp_path, out):
    a = {"a.weight": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5)}
    ckpt = plain_checkpoint(tmp_path / "plain", [a, {k: v.clone() for k, v in a.items()}])
    rc, err = merge(capsys, ckpt, out / "merged")
    assert rc == 0, err
    from safetensors.torch import load_file

    loaded = load_file(str(out / "merged" / "model.safetensors"))
    assert torch.equal(loaded["a.weight"], a["a.weight"]) and torch.equal(loaded["b"], a["b"])


def test_tensor_names_differ_across_ranks(capsys, tmp_path, out):
    ckpt = plain_checkpoint(tmp_path / "plain", [{"a": torch.zeros(2)}, {"b": torch.zeros(2)}])
    merge_fails(capsys, ckpt, out, RANK1, "tensor names differ from rank 0's")


def test_non_tensor_entry(capsys, tmp_path, out):
    ckpt = plain_checkpoint(tmp_path / "plain", [{"a": torch.zeros(2), "step": 5}] * 2)
    merge_fails(capsys, ckpt, out, RANK0, "entry 'step' is a int, not a tensor")


# ---------------------------------------------------------------------------- the target


def test_target_is_a_file(capsys, fsdp_root, out):
    target = out / "merged"
    target.write_text("keep me")
    rc, err = merge(capsys, fsdp_root / "base", target)
    assert_clean_failure(rc, err, str(target), "not a directory", code=2)
    assert target.read_text() == "keep me"
    assert_nothing_written(out, {"merged"})


def test_missing_parents_of_the_target_are_made_as_verls_merger_makes_them(capsys, fsdp_root, out):
    target = out / "run1" / "hf" / "merged"
    rc, err = merge(capsys, fsdp_root / "base", target)
    assert rc == 0, err
    assert sorted(os.listdir(target)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert_nothing_written(target.parent, {"merged"})


def test_a_file_in_the_way_of_the_targets_parents_is_named(capsys, fsdp_root, out):
    (out / "run1").write_text("keep me")
    rc, err = merge(capsys, fsdp_root / "base", out / "run1" / "hf" / "merged")
    assert_clean_failure(rc, err, str(out / "run1"), "Not a directory", code=2)
    assert (out / "run1").read_text() == "keep me"
    assert_nothing_written(out, {"run1"})


def test_non_empty_target_is_written_into_as_verl_does_or_replaced_with_overwrite(
    capsys, fsdp_root, out
):
    """verl's merger writes into an existing target: the merge replaces the files of its
    names and another set of weights there (shards and their index), and keeps the rest.
    --overwrite replaces the target whole."""
    from safetensors.torch import load_file

    target = out / "merged"
    target.mkdir()
    (target / "notes").mkdir()
    (target / "notes" / "eval.txt").write_text("kept")
    (target / "README.md").write_text("kept")
    (target / "config.json").write_text("{}")
    stale = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in [*stale, "model.safetensors.index.json", "pytorch_model.bin"]:
        (target / name).write_text("an older model's")
    rc, err = merge(capsys, fsdp_root / "base", target)
    assert rc == 0, err
    assert sorted(os.listdir(target)) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes",
    ]
    assert (target / "README.md").read_text() == "kept"
    assert (target / "notes" / "eval.txt").read_text() == "kept"
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen2"
    assert_nothing_written(out, {"merged"})
    merged = load_file(str(target / "model.safetensors"))
    reference = load_file(str(fsdp_root / "reference" / "model.safetensors"))
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k].bfloat16()) for k in merged)

    rc, err = merge(capsys, fsdp_root / "base", target, "--max-shard-size", "20KB")
    assert rc == 0, err
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and "model.safetensors" not in os.listdir(target)
    assert sorted(os.listdir(target)) == sorted(
        ["README.md", "config.json", "generation_config.json", "notes", *shards]
        + ["model.safetensors.index.json"]
    )

    rc, err = merge(capsys, fsdp_root / "base", target, "--overwrite")
    assert rc == 0, err
    assert sorted(os.listdir(target)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert_nothing_written(out, {"merged"})


def test_an_update_in_place_that_fails_midway_puts_the_target_back(
    capsys, fsdp_root, out, monkeypatch
):
    """A rename that fails once the old weights had left (an immutable file, say) lost both
    the old model and the new one; the old files now wait in a folder inside the target and
    go back, and the message says the target is as it was."""
    from shardstream.storage import commit

    target = out / "merged"
    target.mkdir()
    old = {"README.md": b"kept", "config.json": b"{}", "model.safetensors": b"old weights"}
    for name, data in old.items():
        (target / name).write_bytes(data)
    (target / "model-00001-of-00002.safetensors").write_bytes(b"another old set")
    old["model-00001-of-00002.safetensors"] = b"another old set"
    rename = os.rename

    def refused_for_the_new_weights(src, dst, *args, **kwargs):
        if Path(dst) == target / "model.safetensors" and Path(src).parent.parent == out:
            raise PermissionError(1, "Operation not permitted", str(dst))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(commit.os, "rename", refused_for_the_new_weights)
    rc, err = merge(capsys, fsdp_root / "base", target)
    line = assert_clean_failure(rc, err, f"could not update target {target}", code=2)
    assert line.endswith("it is as it was")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == old
    assert_nothing_written(out, {"merged"})


def _old_model_with_a_readme(capsys, fsdp_root, target: Path) -> dict[str, bytes]:
    """``target``: an earlier merge (float32) and the user's README; its files' bytes."""
    assert merge(capsys, fsdp_root / "base", target, "--dtype", "float32")[0] == 0
    (target / "README.md").write_text("mine")
    return {p.name: p.read_bytes() for p in target.iterdir()}


def test_ctrl_c_during_an_update_in_place_waits_for_it_and_says_so(
    capsys, fsdp_root, out, monkeypatch
):
    """A SIGINT once the first new file had moved in was raised there: the target was left
    with the new config.json and neither model's weights, and the message said "nothing was
    committed". The moves now finish first, and the message says the output is in place."""
    from shardstream.storage import commit

    target = out / "merged"
    old = _old_model_with_a_readme(capsys, fsdp_root, target)
    rename = os.rename

    def interrupted_after_the_first_move_in(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if Path(dst).parent == target and Path(src).parent.parent == out:
            monkeypatch.setattr(commit.os, "rename", rename)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(commit.os, "rename", interrupted_after_the_first_move_in)
    rc, err = merge(capsys, fsdp_root / "base", target, "--dtype", "bfloat16")
    assert rc == 128 + signal.SIGINT, err
    assert f"interrupted after {target} was put in place" in err, err
    now = {p.name: p.read_bytes() for p in target.iterdir() if not p.name.startswith(".")}
    assert set(now) == set(old) and now["README.md"] == b"mine"
    assert now["model.safetensors"] != old["model.safetensors"]  # the new, bfloat16 weights
    assert main(["verify", str(target)]) == 0, capsys.readouterr()


def test_an_update_in_place_moves_the_weights_in_last(capsys, copy_variant, out, monkeypatch):
    """A crash midway (kill -9) must leave the target without weights, not a model that
    verify passes with its tokenizer gone: only a sharded model's index came last, and
    tokenizer files sort after model.safetensors."""
    from shardstream.storage import commit
    from shardstream.testing.tiny_models import save_tiny_tokenizer

    actor = copy_variant("base")
    save_tiny_tokenizer(actor / "huggingface")
    target = out / "merged"
    assert merge(capsys, actor, target, "--dtype", "float32")[0] == 0
    assert "tokenizer.json" in os.listdir(target)
    rename, arrived = os.rename, []

    def recorded(src, dst, *args, **kwargs):
        if Path(dst).parent == target and Path(src).parent.parent == out:
            arrived.append(Path(dst).name)
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(commit.os, "rename", recorded)
    assert merge(capsys, actor, target, "--dtype", "bfloat16")[0] == 0
    assert len(arrived) > 1 and arrived[-1] == "model.safetensors", arrived


def test_ctrl_c_right_after_the_overwrite_swap_says_the_output_is_in_place(
    capsys, fsdp_root, out, monkeypatch
):
    """A SIGINT just after the swap said "nothing was committed" and removed the staging
    path, which held the old output by then: the new one was in place."""
    from shardstream.storage import commit

    target = out / "merged"
    _old_model_with_a_readme(capsys, fsdp_root, target)
    swap_in = commit.swap_in

    def interrupted_after(staged, where):
        aside = swap_in(staged, where)
        signal.raise_signal(signal.SIGINT)
        return aside

    monkeypatch.setattr(commit, "swap_in", interrupted_after)
    rc, err = merge(capsys, fsdp_root / "base", target, "--dtype", "bfloat16", "--overwrite")
    assert rc == 128 + signal.SIGINT, err
    assert f"interrupted after {target} was put in place" in err, err
    assert not (target / "README.md").exists()  # replaced whole, as --overwrite does
    assert main(["verify", str(target)]) == 0, capsys.readouterr()


def test_one_ranks_file_is_refused_naming_its_directory(capsys, fsdp_root, out):
    """Read as a whole torch.save file, one rank's shards said "shapes or placements disagree
    across ranks", which reads as damage."""
    rank_file = fsdp_root / "base" / "model_world_size_2_rank_0.pt"
    rc, err = merge(capsys, rank_file, out / "merged")
    assert_clean_failure(
        rc, err, "one rank's file of a verl checkpoint", str(fsdp_root / "base"), code=2
    )
    assert_nothing_written(out)


def test_the_next_update_deletes_what_a_crashed_update_left_in_the_target(capsys, fsdp_root, out):
    """An update killed between its renames leaves the replaced files in a
    ``.shardstream-old.tmp-<hex>`` folder inside the target (a whole model's worth); the next
    update, having replaced them itself, deletes it. Other folders stay."""
    target = out / "merged"
    crashed = target / ".shardstream-old.tmp-0123abcd"
    crashed.mkdir(parents=True)
    (crashed / "model.safetensors").write_bytes(b"weights a killed update replaced")
    (target / "config.json").write_text("{}")
    look_alike = target / ".shardstream-old.tmp-keep"  # not a name an update gives its folder
    look_alike.mkdir()
    (target / "evals").mkdir()
    rc, err = merge(capsys, fsdp_root / "base", target)
    assert rc == 0, err
    assert sorted(os.listdir(target)) == [
        ".shardstream-old.tmp-keep",
        "config.json",
        "evals",
        "generation_config.json",
        "model.safetensors",
    ]
    assert_nothing_written(out, {"merged"})


def test_a_target_with_a_folder_where_the_merge_writes_a_file_is_refused_untouched(
    capsys, fsdp_root, out, monkeypatch
):
    """Refused before the model is written (it was refused only once all of it was)."""
    from shardstream.commands import merge as merge_command

    def not_staged(*args, **kwargs):
        raise AssertionError("the merge staged its output before refusing the target")

    monkeypatch.setattr(merge_command, "staged_directory", not_staged)
    target = out / "merged"
    (target / "model.safetensors").mkdir(parents=True)
    (target / "README.md").write_text("kept")
    rc, err = merge(capsys, fsdp_root / "base", target)
    assert_clean_failure(rc, err, f"target {target / 'model.safetensors'} is a folder", code=2)
    assert sorted(os.listdir(target)) == ["README.md", "model.safetensors"]
    assert_nothing_written(out, {"merged"})


def test_an_empty_target_is_refused_not_read_as_the_working_directory(
    capsys, fsdp_root, tmp_path, monkeypatch
):
    """``--target_dir "$OUT"`` with OUT unset: ``Path("")`` is the working directory, which
    --overwrite replaced whole."""
    cwd = tmp_path / "project"
    cwd.mkdir()
    (cwd / "train.py").write_text("kept")
    monkeypatch.chdir(cwd)
    for extra in ((), ("--overwrite",)):
        rc, err = merge(capsys, fsdp_root / "base", "", *extra)
        assert_clean_failure(rc, err, "--target_dir is empty", code=2)
        assert os.listdir(cwd) == ["train.py"] and os.listdir(tmp_path) == ["project"]


def test_a_target_name_too_long_to_stage_beside_is_refused_before_writing(capsys, fsdp_root, out):
    """A legal name of 237-255 bytes failed with "File name too long" once the output was
    written, on the staged name beside it; the longest name that can be staged works."""
    rc, err = merge(capsys, fsdp_root / "base", out / ("m" * 237))
    assert_clean_failure(rc, err, "too long to stage beside it", "at most 236 bytes", code=2)
    assert_nothing_written(out)
    rc, err = merge(capsys, fsdp_root / "base", out / ("m" * 236))
    assert rc == 0, err


def tree_state(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_target_that_is_or_holds_an_input_is_refused_even_with_overwrite(
    capsys, copy_variant, tmp_path
):
    """--overwrite replaces the target: a target that is the checkpoint, a directory above it,
    a link to it, or its config directory would delete what is being merged. Written into
    (the default), the checkpoint's own directory or one above would hold a model beside it;
    its config directory takes the model, as verl's docs merge into actor/huggingface."""
    ckpt = copy_variant("base", "run/global_step_1/actor")
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    before = tree_state(tmp_path / "run")
    cases = [
        (ckpt, "is the checkpoint"),
        (ckpt.parent, "contains the checkpoint"),
        (tmp_path / "run", "contains the checkpoint"),
        (link, "is the checkpoint"),
        (ckpt / "huggingface", "is the checkpoint's config directory"),
    ]
    for target, relation in cases:
        for extra in ((), ("--overwrite",)):
            if not extra and relation.endswith("config directory"):
                continue
            rc, err = merge(capsys, ckpt, target, *extra)
            assert_clean_failure(rc, err, f"target {target} {relation}", code=2)
            assert tree_state(tmp_path / "run") == before
    hf_source = copy_variant("base", "hf_source") / "huggingface"
    rc, err = merge(capsys, ckpt, tmp_path, "--overwrite", "--hf_model_path", str(hf_source))
    assert_clean_failure(rc, err, f"target {tmp_path} contains the checkpoint", code=2)
    rc, err = merge(capsys, ckpt, hf_source, "--overwrite", "--hf_model_path", str(hf_source))
    assert_clean_failure(rc, err, f"target {hf_source} is --hf_model_path", code=2)
    assert tree_state(tmp_path / "run") == before and (hf_source / "config.json").is_file()

    rc, err = merge(capsys, ckpt, ckpt / "merged")  # inside the checkpoint: reads nothing there
    assert rc == 0, err
    assert (ckpt / "merged" / "model.safetensors").is_file()
    config = json.loads((ckpt / "huggingface" / "config.json").read_text())
    rc, err = merge(capsys, ckpt, ckpt / "huggingface")
    assert rc == 0, err
    written = json.loads((ckpt / "huggingface" / "config.json").read_text())
    assert written == {**config, "torch_dtype": "bfloat16"}  # the dtype merge wrote, as verl
    assert (ckpt / "huggingface" / "model.safetensors").is_file()


def test_target_inside_a_shardstream_step_is_refused(capsys, tmp_path):
    """A step's manifest names every file in it: merged files written inside would make the
    step fail verify (files added after the save), so the target must lie outside it."""
    import shardstream

    model = torch.nn.Linear(4, 3)
    step = tmp_path / "run" / "global_step_1"
    shardstream.save(step, model=model, contents=("model",))
    before = tree_state(step)
    rc, err = merge(capsys, step, step / "merged")
    assert_clean_failure(rc, err, f"target {step / 'merged'} is inside the checkpoint", code=2)
    assert tree_state(step) == before
    rc, err = merge(capsys, step, tmp_path / "merged")
    assert rc == 0, err


@pytest.mark.parametrize("extra", [(), ("--overwrite",)], ids=["update", "overwrite"])
def test_a_failed_merge_leaves_a_non_empty_target_as_it_was(capsys, copy_variant, out, extra):
    ckpt = copy_variant("base")
    flip(ckpt / RANK1, record_offset(ckpt / RANK1, "data.pkl") + 40)
    target = out / "merged"
    target.mkdir()
    (target / "model.safetensors").write_text("old")
    rc, err = merge(capsys, ckpt, target, *extra)
    assert_clean_failure(rc, err, "Bad CRC-32")
    assert os.listdir(target) == ["model.safetensors"]
    assert (target / "model.safetensors").read_text() == "old"
    assert_nothing_written(out, {"merged"})


def test_empty_existing_target_is_fine(capsys, fsdp_root, out):
    (out / "merged").mkdir()
    rc, err = merge(capsys, fsdp_root / "base", out / "merged")
    assert rc == 0, err


def test_backend_megatron(capsys, fsdp_root, out):
    merge_fails(
        capsys,
        fsdp_root / "base",
        out,
        "--backend 'megatron' is not supported",
        code=2,
        extra=("--backend", "megatron"),
    )


# ---------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """Mount a tiny tmpfs (needs root); yields a function taking the size, e.g. "64k"."""
    mounts = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounts)}"
        point.mkdir()
        try:
            proc = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                capture_output=True,
                text=True,
            )
        except FileNotFoundError:
            pytest.skip("no mount command: cannot create a small filesystem to fill")
        if proc.returncode:
            pytest.skip(
                f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {proc.stderr.strip()}"
            )
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", str(point)], check=False)


@pytest.mark.parametrize("stage", ["weights", "config"])
def test_no_space_left(capsys, fsdp_root, small_disk, tmp_path, stage):
    """``weights``: fallocate of the weights file fails before any data is streamed.
    ``config``: the weights fit exactly (tmpfs counts whole pages), config.json does not."""
    if stage == "weights":
        size = "32k"  # under the bfloat16 weights (47 KiB)
    else:
        probe = tmp_path / "probe"
        assert merge(capsys, fsdp_root / "base", probe)[0] == 0
        pages = -(-(probe / "model.safetensors").stat().st_size // 4096)
        size = f"{pages * 4}k"
    disk = small_disk(size)
    rc, err = merge(capsys, fsdp_root / "base", disk / "merged")
    assert_clean_failure(rc, err, "no space left on device")
    assert_nothing_written(disk)


def test_a_source_file_removed_while_merging(tmp_path, out):
    """A step deleted (by the saving run's retention) after merge opened it: a
    CheckpointNotFoundError naming the file, not a traceback, and no target left. Found by
    make soak, merging while a run saves."""
    import shardstream
    from shardstream.commands.merge import merge
    from shardstream.errors import CheckpointNotFoundError

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    shardstream.save(tmp_path / "step", model=model, contents=["model"])
    (rank_file,) = (tmp_path / "step").glob("*.safetensors")

    def retention(_nbytes: int) -> None:  # after the plan, before the first byte is read
        rank_file.unlink()

    with pytest.raises(CheckpointNotFoundError, match=re.escape(str(rank_file))):
        merge(tmp_path / "step", out / "merged", on_plan=retention)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    "files, words",
    [
        (["model.fp16.safetensors", "config.json"], "save_pretrained's variant 'fp16'"),
        (
            ["model.ema-00001-of-00002.safetensors", "model.safetensors.index.ema.json"],
            "save_pretrained's variant 'ema'",
        ),
        (["adapter_model.safetensors", "adapter_config.json"], "a PEFT adapter alone"),
    ],
)
def test_a_directory_of_what_no_reader_opens_says_what_it_holds(
    capsys, tmp_path, out, files, words
):
    from shardstream import load
    from shardstream.errors import CheckpointNotFoundError

    source = tmp_path / "source"
    source.mkdir()
    for name in files:
        (source / name).write_text("{}")
    line = merge_fails(capsys, source, out, str(source), "no model files found", words)
    assert "a Hugging Face model.safetensors" in line
    with pytest.raises(CheckpointNotFoundError, match=words):
        load(source, model=torch.nn.Linear(2, 2))
    assert main(["verify", str(source), "--quiet"]) == 1
    assert words in capsys.readouterr().err


def _with_placements(rank_file: Path, name: str, placements: list) -> None:
    """Rewrite ``name``'s DTensor in ``rank_file`` with other ``placements`` (same shard)."""
    import copy

    from torch.distributed.tensor import DTensor

    state = torch.load(rank_file, weights_only=False)  # the test's own file
    tensor = state[name]
    spec = copy.copy(tensor._spec)
    object.__setattr__(spec, "placements", tuple(placements))
    state[name] = DTensor(tensor._local_tensor, spec, requires_grad=False)
    torch.save(state, rank_file)


@pytest.mark.parametrize(
    ("placements", "words"),
    [
        ("two", "has 2 placement(s) (S(0), S(0)) for a 1-D device mesh"),
        ("none", "has 0 placement(s) (none) for a 1-D device mesh"),
        ("dim 2", "is sharded along dimension 2, which its 1-D global shape"),
    ],
)
def test_placements_that_do_not_fit_the_mesh_or_shape_are_named(
    capsys, copy_variant, out, placements, words
):
    """Two placements on a 1-D mesh were read by the first alone (exit 0); a Shard of a
    dimension the tensor lacks was said to be "not Shard"."""
    from torch.distributed.tensor import Shard

    chosen = {"two": [Shard(0), Shard(0)], "none": [], "dim 2": [Shard(2)]}[placements]
    ckpt = copy_variant("base")
    for rank in range(2):
        _with_placements(ckpt / f"model_world_size_2_rank_{rank}.pt", NORM_KEY, chosen)
    line = merge_fails(capsys, ckpt, out, NORM_KEY)
    assert words in line, line


@pytest.mark.parametrize("shards", ["1", "3"])
def test_verify_checks_the_files_merge_wrote_beside_the_weights(capsys, copy_variant, out, shards):
    """A flipped byte in the merged config.json (rms_norm_eps 1e-06 read as 1e-07), tokenizer
    or index passed verify: only the weights carried checksums. The first weight file's
    header now lists the digest of every other file merge wrote; files added later (a
    README) are not merge's and not checked."""
    from shardstream.formats.safetensors import FILES_KEY, read_header
    from shardstream.testing.tiny_models import save_tiny_tokenizer

    actor = copy_variant("base")
    save_tiny_tokenizer(actor / "huggingface")
    target = out / "merged"
    extra = ("--max-shard-size", "20KB") if shards == "3" else ()
    assert merge(capsys, actor, target, *extra)[0] == 0
    first = sorted(p for p in target.iterdir() if p.suffix == ".safetensors")[0]
    listed = read_header(first).metadata[FILES_KEY]
    beside = sorted(p.name for p in target.iterdir() if p.suffix != ".safetensors")
    assert [pair.split("=")[0] for pair in listed.split(";")] == beside
    assert ("model.safetensors.index.json" in beside) == (shards == "3")
    (target / "README.md").write_text("added by hand")
    assert main(["verify", "--quiet", str(target)]) == 0, capsys.readouterr()
    for name in [n for n in beside if n != "README.md"]:
        data = (target / name).read_bytes()
        (target / name).write_bytes(data[:-2] + bytes([data[-2] ^ 0x01]) + data[-1:])
        assert main(["verify", "--quiet", str(target)]) == 1
        err = capsys.readouterr().err
        assert f"{target / name}: " in err, err
        (target / name).write_bytes(data)
    (target / "config.json").unlink()
    assert main(["verify", "--quiet", str(target)]) == 1
    assert "config.json: missing (listed in the header of" in capsys.readouterr().err


def test_a_verl_step_saved_with_hf_model_alone_points_at_its_export(capsys, copy_variant, out):
    """verl's save_contents=['hf_model'] leaves no rank files, only huggingface/ with the
    model: merge said "no model files" without pointing there."""
    ckpt = copy_variant("base")
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out / "x"), "--quiet"]) == 0
    shutil.copyfile(out / "x" / "model.safetensors", ckpt / "huggingface" / "model.safetensors")
    for rank in range(2):
        (ckpt / f"model_world_size_2_rank_{rank}.pt").unlink()
    shutil.rmtree(out / "x")
    capsys.readouterr()
    line = merge_fails(capsys, ckpt, out, "no model files here", code=1)
    assert f"{ckpt / 'huggingface'} holds the model saved with hf_model" in line, line
