"""``shardstream test`` (compare with a reference HF model) and ``shardstream inspect``."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardstream.cli import main
from shardstream.commands.inspect import TENSOR_RSS_BYTES, describe, render
from shardstream.commands.merge import merge
from shardstream.commands.test import DEFAULT_ATOL, DEFAULT_RTOL, compare_with_reference
from shardstream.errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"


def reference_tensors(fsdp_root) -> dict[str, torch.Tensor]:
    return load_file(str(fsdp_root / "reference" / "model.safetensors"))


def write_reference(directory: Path, tensors: dict, config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("variant", ["base", "shard1"])
@pytest.mark.parametrize("buffer", ["64MiB", "64KiB"])
def test_checkpoint_matches_its_reference(fsdp_root, variant, buffer):
    report = compare_with_reference(
        fsdp_root / variant, fsdp_root / "reference", buffer_size=buffer
    )
    assert report.ok, report.problems
    assert report.compared == len(reference_tensors(fsdp_root))
    assert report.elements == sum(t.numel() for t in reference_tensors(fsdp_root).values())
    assert report.max_abs_diff == 0.0
    assert (report.atol, report.rtol) == (DEFAULT_ATOL, DEFAULT_RTOL) == (1e-6, 1e-6)


def test_sharded_bf16_reference_from_merge(fsdp_root, tmp_path):
    target = tmp_path / "merged"
    merge(fsdp_root / "shard1", target, dtype="bfloat16", max_shard_size="30KB")
    assert (target / "model.safetensors.index.json").is_file()
    report = compare_with_reference(fsdp_root / "base", target)  # cast to the reference's BF16
    assert report.ok, report.problems
    assert report.compared == len(reference_tensors(fsdp_root))
    # Against the fp32 reference, a bf16 comparison passes too (both sides rounded alike)...
    assert compare_with_reference(fsdp_root / "base", fsdp_root / "reference", dtype="bf16").ok
    # ...but the fp32 checkpoint is not the bf16 model at fp32 precision.
    fp32 = compare_with_reference(fsdp_root / "base", target, dtype="float32")
    assert not fp32.ok and 0 < fp32.max_abs_diff < 0.01


def test_a_damaged_reference_merge_wrote_is_named_not_compared(fsdp_root, tmp_path):
    """A reference shardstream wrote carries checksums, which test did not check: one
    flipped bit passed (or, with --exact, was blamed on the checkpoint)."""
    from shardstream.errors import ChecksumMismatchError

    target = tmp_path / "merged"
    merge(fsdp_root / "base", target)
    file = target / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x01  # the last tensor's data
    file.write_bytes(bytes(data))
    for local in (fsdp_root / "base", target):  # the damaged directory on both sides, too
        with pytest.raises(ChecksumMismatchError, match=str(file)) as raised:
            compare_with_reference(local, target)
        # the tensors of the damaged chunk are named (this small model's lie in one chunk)
        assert re.search(
            r"\(tensor '[^']+', '[^']+', '[^']+' and "
            + str(len(reference_tensors(fsdp_root)) - 3)
            + r" more\)$",
            str(raised.value),
        )
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch .* \\(tensor "):
        merge(target, tmp_path / "again")


def test_single_safetensors_file_as_reference(fsdp_root):
    report = compare_with_reference(
        fsdp_root / "base", fsdp_root / "reference" / "model.safetensors"
    )
    assert report.ok, report.problems


# ---------------------------------------------------------------------------- disagreement


def test_value_mismatch_names_tensor_and_element(fsdp_root, tmp_path):
    tensors = reference_tensors(fsdp_root)
    tensors[EMBED][57, 3] += 0.5
    ref = write_reference(tmp_path / "ref", tensors)
    report = compare_with_reference(fsdp_root / "shard1", ref, buffer_size="64KiB")
    assert not report.ok
    (line,) = report.problems
    assert line.startswith(f"tensor {EMBED!r}: 1 of {101 * 48} elements differ")
    assert "at [57, 3]" in line and "atol=1e-06, rtol=1e-06" in line
    assert report.max_abs_diff == pytest.approx(0.5, abs=1e-6)


def test_tolerances(fsdp_root, tmp_path):
    tensors = reference_tensors(fsdp_root)
    tensors[NORM][0] += 5e-7  # within verl's atol=1e-6
    tensors[NORM][1] += 1e-3
    ref = write_reference(tmp_path / "ref", tensors)
    report = compare_with_reference(fsdp_root / "base", ref)
    assert [p.split(":")[0] for p in report.problems] == [f"tensor {NORM!r}"]
    assert "1 of 48 elements differ" in report.problems[0]
    assert compare_with_reference(fsdp_root / "base", ref, atol=2e-3).ok
    assert compare_with_reference(fsdp_root / "base", ref, rtol=0.5).ok
    # Only one given: the other keeps its default, as the help says.
    no_atol = compare_with_reference(fsdp_root / "base", ref, atol=0.0)
    assert (no_atol.atol, no_atol.rtol) == (0.0, DEFAULT_RTOL)
    assert "rtol=1e-06" in no_atol.problems[0]
    assert compare_with_reference(fsdp_root / "base", ref, rtol=0.0).atol == DEFAULT_ATOL
    # Both zero: an exact comparison fails on the 5e-7 change too.
    exact = compare_with_reference(fsdp_root / "base", ref, atol=0.0, rtol=0.0)
    assert "2 of 48 elements differ" in exact.problems[0]


def test_missing_unexpected_shape_and_dtype(fsdp_root, tmp_path):
    tensors = reference_tensors(fsdp_root)
    tensors["model.extra.weight"] = torch.zeros(2)
    del tensors["lm_head.weight"]
    tensors[NORM] = torch.zeros(49)
    tensors["model.layers.0.input_layernorm.weight"] = torch.zeros(48, dtype=torch.int32)
    ref = write_reference(tmp_path / "ref", tensors)
    report = compare_with_reference(fsdp_root / "base", ref)
    problems = sorted(report.problems)
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "tensor 'model.extra.weight': missing from the checkpoint" in text
    assert "tensor 'lm_head.weight': unexpected" in text
    assert f"tensor {NORM!r}: shape mismatch: reference [49], checkpoint [48]" in text
    assert (
        "'model.layers.0.input_layernorm.weight': dtype mismatch: reference I32, checkpoint F32"
        in text
    )
    assert report.compared == len(tensors) - 3  # all but the four, one added


def test_tied_lm_head_is_skipped_like_merge(fsdp_root, tmp_path, copy_variant):
    tensors = reference_tensors(fsdp_root)
    del tensors["lm_head.weight"]
    ref = write_reference(tmp_path / "ref", tensors)
    assert not compare_with_reference(fsdp_root / "base", ref).ok
    # --tie-word-embedding does not drop a head the checkpoint's config unties (as merge)
    report = compare_with_reference(fsdp_root / "base", ref, tie_word_embedding=True)
    assert not report.ok and report.skipped == []
    # tie_word_embeddings in the checkpoint's config: its head, trained apart, is not the
    # embedding the reference's model uses in its place (merge refuses to leave it out)
    ckpt = copy_variant("base")
    config_path = ckpt / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tie_word_embeddings": True}))
    report = compare_with_reference(ckpt, ref)
    apart = (
        "tensor 'lm_head.weight': differs from 'model.embed_tokens.weight', but the reference "
        "ties the output head to the input embedding (it holds no head), so its model's head is "
        "not the checkpoint's"
    )
    assert not report.ok and report.problems == [apart]
    # or in the reference's
    write_reference(ref, tensors, {**config, "tie_word_embeddings": True})
    assert compare_with_reference(fsdp_root / "base", ref).problems == [apart]
    # a checkpoint whose head holds its embedding's values: skipped, as merge leaves it out
    same = reference_tensors(fsdp_root)
    same["lm_head.weight"] = same["model.embed_tokens.weight"].clone()
    report = compare_with_reference(plain_checkpoint(tmp_path / "tied", same), ref)
    assert (
        report.ok
        and report.skipped == ["lm_head.weight"]
        and report.compared == len(reference_tensors(fsdp_root)) - 1
    )
    # A reference that does keep lm_head.weight is still compared against it.
    full = write_reference(tmp_path / "full", reference_tensors(fsdp_root))
    report = compare_with_reference(fsdp_root / "base", full, tie_word_embedding=True)
    assert (
        report.ok and report.compared == len(reference_tensors(fsdp_root)) and report.skipped == []
    )


def plain_checkpoint(directory: Path, state: dict, world_size: int = 2) -> Path:
    directory.mkdir()
    for rank in range(world_size):
        torch.save(state, directory / f"model_world_size_{world_size}_rank_{rank}.pt")
    return directory


def test_nan_inf_and_integers(tmp_path):
    values = torch.tensor([1.0, math.nan, math.inf, -math.inf, -0.0, 2.5])
    ids = torch.arange(-3, 3, dtype=torch.int64)
    ckpt = plain_checkpoint(
        tmp_path / "ckpt", {"v": values, "ids": ids, "flag": torch.tensor(True)}
    )
    same = write_reference(
        tmp_path / "same", {"v": values.clone(), "ids": ids.clone(), "flag": torch.tensor(True)}
    )
    report = compare_with_reference(ckpt, same)
    assert report.ok, report.problems  # NaN == NaN at the same place; infs match
    changed_ids = ids.clone()
    changed_ids[4] = 1 << 40
    other = values.clone()
    other[2] = 1e30  # inf vs a finite value
    diff = write_reference(
        tmp_path / "diff", {"v": other, "ids": changed_ids, "flag": torch.tensor(False)}
    )
    report = compare_with_reference(ckpt, diff, atol=1.0, rtol=1.0)
    text = "\n".join(sorted(report.problems))
    assert "tensor 'flag': 1 of 1 elements differ (exact, as BOOL)" in text
    assert "tensor 'ids': 1 of 6 elements differ (exact, as I64)" in text and "at [4]" in text
    assert "tensor 'v': 1 of 6 elements differ" in text and "at [2]" in text
    assert report.max_abs_diff == math.inf
    assert report.to_json()["max_abs_diff"] is None
    json.dumps(report.to_json(), allow_nan=False)


def test_empty_and_scalar_tensors(tmp_path):
    state = {"empty": torch.zeros(0, 4), "scalar": torch.tensor(3.25)}
    ckpt = plain_checkpoint(tmp_path / "ckpt", state)
    ref = write_reference(tmp_path / "ref", {k: v.clone() for k, v in state.items()})
    report = compare_with_reference(ckpt, ref)
    assert report.ok and report.compared == 2 and report.elements == 1


# ---------------------------------------------------------------------------- bad references


def test_reference_errors(fsdp_root, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope: no such model directory"):
        compare_with_reference(fsdp_root / "base", tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"empty: no model\.safetensors or model\.safetensors\.index\.json",
    ):
        compare_with_reference(fsdp_root / "base", empty)
    (empty / "pytorch_model.bin").write_bytes(b"x")  # read as a torch.save model since: named
    with pytest.raises(CheckpointFormatError, match=r"empty/pytorch_model\.bin: corrupt"):
        compare_with_reference(fsdp_root / "base", empty)


def sharded_reference(fsdp_root, tmp_path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    target = tmp_path / "sharded"
    merge(fsdp_root / "base", target, max_shard_size="30KB")
    return target


def edit_index(directory: Path, edit) -> None:
    path = directory / "model.safetensors.index.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_index_errors(fsdp_root, tmp_path):
    ref = sharded_reference(fsdp_root, tmp_path)
    index = ref / "model.safetensors.index.json"
    for file in ("../../etc/passwd", "sub/model.safetensors", "..", ".", ""):
        edit_index(ref, lambda d, file=file: d["weight_map"].update({EMBED: file}))
        with pytest.raises(UnsafeCheckpointError) as caught:
            compare_with_reference(fsdp_root / "base", ref)
        # one check, one message: the index, the tensor and the name it points at
        assert str(caught.value) == (
            f"{index}: tensor {EMBED!r} points at {file!r}, which is not a plain file name in "
            "the model directory"
        )
    ref = sharded_reference(fsdp_root, tmp_path / "2")
    first = sorted(p.name for p in ref.glob("model-*.safetensors"))[0]
    edit_index(ref, lambda d: d["weight_map"].update({"ghost": first}))
    with pytest.raises(CheckpointFormatError, match=f"lists tensor 'ghost' in {first}, but"):
        compare_with_reference(fsdp_root / "base", ref)
    edit_index(ref, lambda d: d.pop("weight_map"))
    with pytest.raises(CheckpointFormatError, match="not a valid safetensors index"):
        compare_with_reference(fsdp_root / "base", ref)


def test_bad_arguments(fsdp_root):
    from shardstream.errors import UsageError

    with pytest.raises(UsageError, match="buffer-size"):
        compare_with_reference(fsdp_root / "base", fsdp_root / "reference", buffer_size="1KiB")
    with pytest.raises(UsageError, match="non-negative"):
        compare_with_reference(fsdp_root / "base", fsdp_root / "reference", atol=-1)
    with pytest.raises(UsageError, match="unknown dtype"):
        compare_with_reference(fsdp_root / "base", fsdp_root / "reference", dtype="float8")


# ---------------------------------------------------------------------------- the CLI


def test_cli_test_ok_and_mismatch(fsdp_root, tmp_path, capsys):
    argv = ["test", "--local_dir", str(fsdp_root / "base"), "--test_hf_dir"]
    assert main([*argv, str(fsdp_root / "reference")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"OK: compared {len(reference_tensors(fsdp_root))} tensors") and err == ""

    tensors = reference_tensors(fsdp_root)
    tensors[NORM][5] = 9.0
    ref = write_reference(tmp_path / "ref", tensors)
    assert main([*argv, str(ref)]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("MISMATCH (1 problem above)") and err.count("\n") == 1 and NORM in err

    assert main([*argv, str(ref), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["compared"] == len(tensors) and len(doc["problems"]) == 1

    assert main([*argv, str(tmp_path / "missing")]) == 1
    _, err = capsys.readouterr()
    assert err.startswith("shardstream test: error: ") and err.count("\n") == 1


# ---------------------------------------------------------------------------- inspect


def test_describe(fsdp_root):
    info = describe(fsdp_root / "shard1")
    assert info["format"] == "verl" and info["world_size"] == 2 and info["fsdp_version"] == 2
    assert info["num_files"] == 2 and info["num_tensors"] == len(reference_tensors(fsdp_root))
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name[EMBED] == {
        "name": EMBED,
        "shape": [101, 48],
        "dtype": "float32",
        "placement": "fsdp:S(1)",
        "bytes": 101 * 48 * 4,
        "blocks": 2,
        "replicas": 0,
    }
    assert by_name[NORM]["placement"] == "fsdp:S(0)"
    assert info["total_bytes"] == sum(t["bytes"] for t in info["tensors"])
    m = info["merge"]
    assert m["bytes_read"] == info["total_bytes"]  # float32 read, bfloat16 written as by verl
    assert m["bytes_written"] == info["total_bytes"] // 2
    assert m["tensors_rss_bytes"] == TENSOR_RSS_BYTES * len(info["tensors"])
    assert m["estimated_peak_rss_bytes"] == (
        64 * 2**20 + m["baseline_rss_bytes"] + m["tensors_rss_bytes"]
    )
    assert m["estimated_seconds"] == pytest.approx(
        1.5 * info["total_bytes"] / m["assumed_disk_bytes_per_s"]
    )
    json.dumps(info)


def test_describe_reads_no_tensor_data(fsdp_root, monkeypatch):
    from shardstream.engine import endpoints

    def forbidden(*args, **kwargs):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(endpoints.FileEndpoint, "read_into", forbidden)
    monkeypatch.setattr(endpoints.FileEndpoint, "__init__", forbidden)
    assert describe(fsdp_root / "base")["num_tensors"] == len(reference_tensors(fsdp_root))


def test_describe_output_dtype_and_tied_head(copy_variant):
    ckpt = copy_variant("base")
    config_path = ckpt / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(
        json.dumps({**config, "torch_dtype": "bfloat16", "tie_word_embeddings": True})
    )
    m = describe(ckpt)["merge"]
    assert m["output_dtype"] == "bfloat16" and m["dropped_tied"] == ["lm_head.weight"]
    assert m["bytes_written"] == (describe(ckpt)["total_bytes"] - 101 * 48 * 4) // 2


def test_render_and_cli(fsdp_root, capsys):
    text = render(describe(fsdp_root / "base"))
    assert "verl checkpoint, world size 2" in text and EMBED in text and "101x48" in text
    assert "assumed" in text and "fsdp:S(0)" in text
    assert main(["inspect", str(fsdp_root / "base")]) == 0
    assert capsys.readouterr().out.strip() == text
    assert main(["inspect", str(fsdp_root / "base"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 2
    assert main(["inspect", str(fsdp_root / "nope")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_inspect_plain_checkpoint(tmp_path):
    ckpt = plain_checkpoint(tmp_path / "plain", {"w": torch.zeros(3, 2), "s": torch.tensor(1.0)})
    info = describe(ckpt)
    assert info["mesh"] == "none (plain tensors)"
    assert [t["replicas"] for t in info["tensors"]] == [1, 1]
    assert info["merge"]["bytes_read"] == 2 * info["total_bytes"]
    assert "scalar" in render(info)
    shutil.rmtree(ckpt)


def test_inspect_run_directory_describes_the_newest_committed_step(tmp_path, capsys):
    from shardstream import CheckpointConfig, CheckpointManager

    model = torch.nn.Linear(8, 4)
    cfg = CheckpointConfig(directory=tmp_path / "run", save_contents=("model",), keep_last=None)
    manager = CheckpointManager(cfg, model=model)
    for step in (1, 2):
        manager.save(step)
    manager.close()
    (tmp_path / "run" / "global_step_3.tmp-0123abcd").mkdir()  # a crashed save's leftover
    info = describe(tmp_path / "run")
    assert info["run"] == {
        "directory": str(tmp_path / "run"),
        "steps": [1, 2],
        "latest_pointer": 2,
        "newest": 2,
        "uncommitted": ["global_step_3.tmp-0123abcd"],
    }
    assert info["path"] == str(tmp_path / "run" / "global_step_2") and info["step"] == 2
    assert info["contents"] == ["model"] and info["mesh"] == ""
    assert {t["placement"] for t in info["tensors"]} == {"plain; 1 chunk(s) in 1 file(s)"}
    text = render(info)
    assert "committed steps 1, 2; latest_checkpointed_iteration.txt: 2" in text
    assert "uncommitted (ignored): global_step_3.tmp-0123abcd" in text
    assert "\nmesh:" not in text and "step 2, contents: model" in text
    assert main(["inspect", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.strip() == text


def test_inspect_of_a_verl_run_describes_the_newest_steps_actor(fsdp_root, tmp_path, capsys):
    """verl's run directory (global_step_N/actor, critic): verify read it; inspect said
    'pass that directory'."""
    run = tmp_path / "run"
    for step, roles in ((3, ("actor",)), (5, ("actor", "critic")), (8, ())):
        for role in roles:
            shutil.copytree(fsdp_root / "base", run / f"global_step_{step}" / role)
    (run / "global_step_8").mkdir()  # a step verl has not written yet
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    info = describe(run)
    assert {k: info["run"][k] for k in ("steps", "newest", "role", "roles")} == {
        "steps": [3, 5],
        "newest": 5,
        "role": "actor",
        "roles": ["actor", "critic"],
    }
    assert info["path"] == str(run / "global_step_5" / "actor") and info["format"] == "verl"
    assert main(["inspect", str(run)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{run}: run of global_step_N/actor, steps 3, 5; ")
    assert "the newest committed step, 5 (roles actor, critic; this is actor):" in text


def test_inspect_of_a_merged_model_reads_its_headers_without_torch(fsdp_root, tmp_path, capsys):
    """inspect of merge's output (a HF model directory): its files and tensors, as written,
    and what merging it again would write."""
    import subprocess
    import sys

    target = tmp_path / "merged"
    merge(fsdp_root / "base", target, dtype="bfloat16", max_shard_size="8KB")
    index = json.loads((target / "model.safetensors.index.json").read_text())
    info = describe(target)
    assert info["format"] == "huggingface"
    m = info["merge"]
    assert m["output_dtype"] == "bfloat16" and m["bytes_read"] == m["bytes_written"]
    assert m["layout"]["rule"].endswith("(nothing renamed or split)")
    assert info["num_files"] == len(set(index["weight_map"].values())) > 1
    assert info["total_bytes"] == index["metadata"]["total_size"]
    written = {}
    for file in sorted(set(index["weight_map"].values())):
        written.update(load_file(target / file))
    assert {t["name"]: (tuple(t["shape"]), t["dtype"], t["file"]) for t in info["tensors"]} == {
        name: (tuple(v.shape), "bfloat16", index["weight_map"][name]) for name, v in written.items()
    }
    text = render(info)
    assert text.startswith(f"{target}: huggingface model") and EMBED in text
    assert main(["inspect", str(target)]) == 0
    assert capsys.readouterr().out.strip() == text
    fresh = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nfrom shardstream.cli import main\n"
            f"main(['inspect', {str(target)!r}, '--json'])\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout) == json.loads(json.dumps(info))


def test_inspect_into_a_closed_pipe_exits_quietly(fsdp_root):
    """``shardstream inspect D | head -1``: no traceback when the reader goes away."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-m", "shardstream", "inspect", str(fsdp_root / "base")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    child.stdout.close()  # before it writes anything
    err = child.stderr.read().decode()
    assert child.wait() == 1 and err == ""


def test_inspect_tolerates_odd_informational_manifest_fields(tmp_path):
    """mesh and placement are informational: odd values never break inspect. contents is
    read by load, so a list holding anything but names is a format error naming the field."""
    from shardstream import save
    from shardstream.errors import CheckpointFormatError
    from shardstream.formats import native

    save(tmp_path / "step", model=torch.nn.Linear(8, 4), contents=("model",))
    doc = native.read_manifest(tmp_path / "step")
    doc["mesh"] = {"shape": 4, "dim_names": None}
    for entry in doc["tensors"].values():
        entry["placement"] = ["not", "a", "string"]
    native.write_manifest(tmp_path / "step", doc)
    info = describe(tmp_path / "step")
    assert info["mesh"] == "" and info["contents"] == ["model"]
    assert {t["placement"] for t in info["tensors"]} == {"1 chunk(s) in 1 file(s)"}
    assert "step 0, contents: model" in render(info)
    doc["contents"] = ["model", 7]
    native.write_manifest(tmp_path / "step", doc)
    with pytest.raises(CheckpointFormatError, match="'contents' is not a list of names"):
        describe(tmp_path / "step")


@pytest.mark.parametrize(("total", "ok"), [(None, True), (16, True), (-5, False), (17, False)])
def test_verify_checks_the_index_total_size_it_is_given(tmp_path, total, ok):
    """A negative total_size passed (-1 stood for "not said"), where a too-large one failed."""
    from shardstream.commands.verify import verify

    directory = tmp_path / "model"
    directory.mkdir()
    save_file({"w": torch.ones(4)}, str(directory / "model-00001-of-00001.safetensors"))
    metadata = {} if total is None else {"total_size": total}
    index = {"metadata": metadata, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    report = verify(directory)
    assert report.ok == ok, report.problems
    if not ok:
        assert any(f"total_size {total} but" in p.line() for p in report.problems)


def test_verify_prints_a_bounded_number_of_problem_lines(tmp_path, capsys, monkeypatch):
    """An index of 1.4 M entries naming tensors its file does not hold printed 1.4 M lines."""
    from shardstream import cli

    directory = tmp_path / "model"
    directory.mkdir()
    save_file({"w": torch.ones(4)}, str(directory / "model-00001-of-00001.safetensors"))
    weight_map = {"w": "model-00001-of-00001.safetensors"}
    weight_map |= {f"gone.{i}": "model-00001-of-00001.safetensors" for i in range(5)}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    monkeypatch.setattr(cli, "PROBLEMS_SHOWN", 2)
    assert main(["verify", "--quiet", str(directory)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("... and "), lines
    assert main(["verify", "--json", str(directory)]) == 1
    listed = json.loads(capsys.readouterr().out)["problems"]
    assert len(listed) == 2 + int(lines[-1].split()[2].replace(",", ""))


def test_a_training_checkpoint_given_as_the_reference_is_said_to_be_one(
    fsdp_root, tmp_path, capsys
):
    """--test_hf_dir of a verl actor directory (or its global_step_N) called its
    extra_state_*.pt a model and said only safetensors models are read."""
    step = tmp_path / "global_step_1"
    step.mkdir()
    shutil.copytree(fsdp_root / "base", step / "actor")
    torch.save({"epoch": 0}, step / "data.pt")
    for ref in (step / "actor", step):
        argv = ["test", "--local_dir", str(fsdp_root / "base"), "--test_hf_dir", str(ref)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--test_hf_dir {ref}: a verl" in err and "pass it as --local_dir" in err, err
