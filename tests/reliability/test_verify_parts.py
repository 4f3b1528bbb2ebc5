"""Every part of a checkpoint is checked (issue #23): the files beside the data (config,
generation config, tokenizer files of the hf_model export) are checksummed in the manifest,
checked by verify and before merge copies them; verify catches what restore catches.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import shardstream
from shardstream.commands.verify import verify
from shardstream.formats import native
from shardstream.testing.cli import run_cli

from .test_hostile_inputs import _cli

CONFIG = {"model_type": "tiny", "num_hidden_layers": 2, "torch_dtype": "float32"}
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json")


@pytest.fixture
def exported(tmp_path) -> Path:
    """A step saved with the hf_model export, its config and tokenizer files copied in."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(CONFIG))
    (source / "generation_config.json").write_text(json.dumps({"max_length": 20}))
    (source / "tokenizer.json").write_text(json.dumps({"version": "1.0", "vocab": ["a"]}))
    torch.manual_seed(0)
    step = tmp_path / "global_step_1"
    shardstream.save(
        step,
        model=torch.nn.Linear(8, 4),
        contents=("model", "hf_model"),
        hf_source_dir=source,
        step=1,
    )
    return step


def test_every_file_of_the_export_is_in_the_manifest(exported):
    files = native.read_manifest(exported)["files"]
    for name in SIDE_FILES:
        assert f"huggingface/{name}" in files, sorted(files)
        assert set(files[f"huggingface/{name}"]) == {"size", "xxh3"}
    assert verify(exported).ok


def _flip_layers(step: Path) -> Path:
    """num_hidden_layers 2 -> 3: one bit, same size."""
    config = step / "huggingface" / "config.json"
    text = config.read_text()
    assert '"num_hidden_layers": 2' in text
    config.write_text(text.replace('"num_hidden_layers": 2', '"num_hidden_layers": 3'))
    return config


@pytest.mark.parametrize("damage", ["flipped bit", "deleted"])
def test_damaged_config_is_caught(exported, tmp_path, capsys, damage):
    if damage == "flipped bit":
        config = _flip_layers(exported)
    else:
        config = exported / "huggingface" / "config.json"
        config.unlink()
    report = verify(exported)
    assert not report.ok and any(p.path == str(config) for p in report.problems), report
    target = tmp_path / "merged"
    code, lines = _cli(capsys, "merge", "--local_dir", exported, "--target_dir", target, "--quiet")
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("shardstream merge: error: ") and str(config) in lines[0]
    assert not target.exists()


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_damaged_tokenizer_or_generation_config_is_caught(exported, tmp_path, capsys, name):
    path = exported / "huggingface" / name
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify(exported)
    assert [p.path for p in report.problems] == [str(path)]
    code, lines = _cli(
        capsys, "merge", "--local_dir", exported, "--target_dir", tmp_path / "m", "--quiet"
    )
    assert code == 1 and str(path) in lines[0] and not (tmp_path / "m").exists()


def test_manifest_without_side_file_records_still_reads(exported, tmp_path, capsys):
    """A manifest written before side files were recorded: read, verified and merged as it
    was (nothing recorded, nothing to check)."""
    from .test_hostile import _reseal

    old = tmp_path / "old" / "global_step_1"
    shutil.copytree(exported, old)

    def drop(doc):
        for name in SIDE_FILES:
            doc["files"].pop(f"huggingface/{name}")
        doc.pop(native.FILES_COMPLETE)  # older writers did not say they listed every file

    _reseal(old, drop)
    assert verify(old).ok
    code, lines = _cli(
        capsys, "merge", "--local_dir", old, "--target_dir", tmp_path / "m", "--quiet"
    )
    assert (code, lines) == (0, [])
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 2


# --- every file, at any depth, hidden ones too -------------------------------------------------

NESTED = {  # what a processor's save_pretrained may write beside its top-level files
    "tokenizer.json": '{"version": "1.0", "vocab": ["a", "b"]}',
    "additional_chat_templates/tool_use.jinja": "{% for m in messages %}{{ m }}{% endfor %}",
    "processor/preprocessor_config.json": '{"do_resize": true, "size": 224}',
    ".tokenizer_state": "hidden but the processor's own",
}


class _NestedTokenizer:
    def save_pretrained(self, target) -> None:
        for name, text in NESTED.items():
            path = Path(target) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


@pytest.fixture
def nested(tmp_path) -> Path:
    """A step whose export holds tokenizer subfolders and a hidden file."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    step = tmp_path / "global_step_1"
    shardstream.save(
        step,
        model=torch.nn.Linear(8, 4),
        contents=("model", "hf_model"),
        hf_source_dir=source,
        tokenizer=_NestedTokenizer(),
        step=1,
    )
    return step


def test_subfolders_and_hidden_files_are_in_the_manifest(nested):
    manifest = native.read_manifest(nested)
    for name in NESTED:
        assert set(manifest["files"][f"huggingface/{name}"]) == {"size", "xxh3"}, name
    assert manifest[native.FILES_COMPLETE] is True
    report = verify(nested)
    assert report.ok, report.problems


@pytest.mark.parametrize("name", sorted(NESTED))
def test_flipped_file_in_a_tokenizer_subfolder_is_caught(nested, capsys, name):
    path = nested / "huggingface" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify(nested)
    assert [(p.path, p.message) for p in report.problems] == [(str(path), "checksum mismatch")]
    code, lines = _cli(capsys, "verify", nested)
    assert code == 1 and any(str(path) in line for line in lines), lines


@pytest.mark.parametrize(
    "name",
    [".hidden", "huggingface/.cache_note", "huggingface/processor/extra.json", "notes/a/b.txt"],
)
def test_a_file_added_after_the_save_is_reported(nested, capsys, name):
    path = nested / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("added later")
    report = verify(nested)
    assert [p.path for p in report.problems] == [str(path)], report.problems
    assert "not in the manifest" in report.problems[0].message
    code, lines = _cli(capsys, "verify", nested)
    assert code == 1 and any(str(path) in line for line in lines), lines


def test_a_deleted_file_in_a_subfolder_is_caught(nested):
    path = nested / "huggingface" / "additional_chat_templates" / "tool_use.jinja"
    path.unlink()
    report = verify(nested)
    assert [p.path for p in report.problems] == [str(path)], report.problems


def test_commit_debris_is_neither_listed_nor_reported(nested):
    (nested / "manifest.json.tmp-0123abcd").write_text("a crash's leftover")
    (nested / "huggingface" / f".probe-{'ab' * 16}").write_text("probe")
    (nested / "huggingface" / "tokenizer.json.tmp-89abcdef").mkdir()
    (nested / "huggingface" / "tokenizer.json.tmp-89abcdef" / "x").write_text("x")
    assert verify(nested).ok


def test_links_out_of_a_tokenizer_subfolder_are_refused(nested, tmp_path):
    """A listed file in a subfolder that became a link out, a linked subfolder, an unlisted
    link out: each is refused, though the bytes behind them match."""
    outside = tmp_path / "outside"
    shutil.copytree(nested / "huggingface" / "additional_chat_templates", outside)
    linked_file = nested / "huggingface" / "additional_chat_templates" / "tool_use.jinja"
    linked_file.unlink()
    os.symlink(outside / "tool_use.jinja", linked_file)
    report = verify(nested)
    assert any(
        "tool_use.jinja: symlink points outside the checkpoint" in p.line() for p in report.problems
    ), report.problems

    linked_file.unlink()
    shutil.rmtree(linked_file.parent)
    os.symlink(outside, linked_file.parent)
    report = verify(nested)
    assert not report.ok and any("outside the checkpoint" in p.line() for p in report.problems)

    os.unlink(linked_file.parent)
    shutil.copytree(outside, linked_file.parent)
    assert verify(nested).ok
    stray = nested / "huggingface" / "processor" / "passwd"
    os.symlink("/etc/passwd", stray)
    report = verify(nested)
    assert [(p.path, p.message) for p in report.problems] == [
        (str(stray), "symlink points outside the checkpoint")
    ]


@pytest.mark.parametrize("name", ["\ud800", "huggingface/\udcff.json", "a\nb", "x/./y", ""])
def test_a_manifest_name_that_names_no_file_is_refused(nested, tmp_path, capsys, name):
    """Names are wider than before (nested, hidden); one that cannot be a file name (a lone
    surrogate, a control character, a '.' part) is refused in one line, never a traceback."""
    from shardstream.errors import ShardstreamError

    from .test_hostile import _reseal

    _reseal(nested, lambda doc: doc["files"].update({name: {"size": 1, "xxh3": "0" * 16}}))
    report = verify(nested)
    assert any("not a plain file name" in p.line() for p in report.problems), report.problems
    with pytest.raises(ShardstreamError, match="not a plain file name"):
        shardstream.load(nested, model=torch.nn.Linear(8, 4))
    code, lines = _cli(capsys, "merge", "--local_dir", nested, "--target_dir", tmp_path / "m")
    assert code == 1 and len(lines) == 1 and "not a plain file name" in lines[0], lines


@pytest.mark.parametrize(
    "name", ["\ud800.safetensors", "\udcff", "a\x00.safetensors", "a\nb.safetensors"]
)
def test_an_index_file_name_that_names_no_file_is_refused(saved_run, tmp_path, name):
    """The HF index's weight_map, like the manifest: a file name with a lone surrogate raised
    UnicodeEncodeError from open() in inspect (found by the soak's structure-aware fuzzer);
    now one line naming the index, from ``python -m shardstream``."""

    model = tmp_path / "hf"
    shutil.copytree(saved_run.hf_sharded, model)
    index = model / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][sorted(doc["weight_map"])[0]] = name
    index.write_text(json.dumps(doc))  # ensure_ascii: a surrogate is written as its escape
    for argv in (
        ["inspect", model],
        ["test", "--local_dir", saved_run.step, "--test_hf_dir", model, "--quiet"],
        ["verify", "--quiet", model],
    ):
        done = run_cli(*argv)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert done.returncode == 1 and "Traceback" not in done.stderr, (argv[0], lines)
        if argv[0] == "verify":  # its problems, one a line: the name among them
            assert any(line.startswith(f"{index}: unsafe file name") for line in lines), lines
        else:
            assert len(lines) == 1, (argv[0], lines)
            assert lines[0].startswith(f"shardstream {argv[0]}: error: {index}: "), lines
            assert "not a plain file name" in lines[0], lines


def test_a_link_to_a_listed_file_is_not_an_unlisted_file(nested):
    (nested / "huggingface" / "tokenizer.json").rename(nested / "real-tokenizer.json")
    os.symlink("../real-tokenizer.json", nested / "huggingface" / "tokenizer.json")
    report = verify(nested)  # the listed name leads to the file; the file itself is covered
    assert report.ok, report.problems


# --- verify catches what restore catches: swapped verl optimizer rank files --------------------


@pytest.fixture(scope="module")
def verl_actor(tmp_path_factory) -> Path:
    from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoint

    root = tmp_path_factory.mktemp("verl-w2")
    fixture = VerlFixture(world_size=2, train_steps=1, write_reference=False)
    return write_verl_checkpoint(root, fixture, step=1)


def test_verify_catches_swapped_verl_optimizer_files(verl_actor, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(verl_actor, actor)
    assert verify(actor).ok
    a, b = actor / "optim_world_size_2_rank_0.pt", actor / "optim_world_size_2_rank_1.pt"
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    report = verify(actor)
    assert not report.ok
    assert any(
        "rank" in p.line() and "optim_world_size_2_rank_" in p.line() for p in report.problems
    )


# --- DCP: every item's byte range and zip records' CRC-32s -----------------------------------


@pytest.fixture
def dcp_train_state(tmp_path) -> Path:
    """A single-process DCP save of a model and its AdamW state (DCP's own layout)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    directory = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process: DCP warns that it runs without a group
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))
    return directory


def _item(directory: Path, key: str) -> tuple[Path, int, int]:
    from shardstream.formats.dcp import item_ranges

    ((path, start, length),) = [(p, s, n) for k, p, s, n in item_ranges(directory) if k == key]
    return path, start, length


def _flip_in_data_record(directory: Path, key: str) -> Path:
    """Flip one bit inside the tensor data record of item ``key``."""
    from shardstream.formats.torch_pt import zip_records_in

    path, start, length = _item(directory, key)
    (record,) = [r for r in zip_records_in(str(path), start, length) if "/data/" in r.name]
    data = bytearray(path.read_bytes())
    data[(record.start + record.end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return path


def test_verify_passes_a_good_dcp_train_state(dcp_train_state, capsys):
    report = verify(dcp_train_state)
    assert report.ok, report.problems
    assert report.bytes_checked > 64 * 32 * 4 * 3  # weight, exp_avg, exp_avg_sq at least


@pytest.mark.parametrize("key", ["optimizer.state.weight.exp_avg", "model.weight"])
def test_verify_catches_a_flipped_bit_in_any_dcp_item(dcp_train_state, key):
    path = _flip_in_data_record(dcp_train_state, key)
    report = verify(dcp_train_state)
    assert not report.ok
    assert any(
        p.path == str(path) and p.tensor == key and "CRC-32" in p.message for p in report.problems
    ), report.problems


def test_merge_catches_a_flipped_bit_in_a_dcp_model_item(dcp_train_state, tmp_path, capsys):
    path = _flip_in_data_record(dcp_train_state, "model.weight")
    target = tmp_path / "merged"
    code, lines = _cli(
        capsys, "merge", "--local_dir", dcp_train_state, "--target_dir", target, "--quiet"
    )
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("shardstream merge: error: ") and str(path) in lines[0]
    assert not target.exists()


def test_verify_catches_a_truncated_dcp_optimizer_item(dcp_train_state):
    from shardstream.formats.dcp import item_ranges

    last_key, path, start, length = item_ranges(dcp_train_state)[-1]
    assert not last_key.startswith("model.")  # the optimizer's state is written after the model
    with open(path, "r+b") as f:
        f.truncate(start + length - 16)
    report = verify(dcp_train_state)
    assert not report.ok and any(str(path) in p.line() for p in report.problems)


def _fresh_train_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize(
    "key", ["optimizer.state.weight.exp_avg", "optimizer.state.bias.exp_avg_sq", "model.weight"]
)
def test_restore_checks_every_dcp_item_before_touching_anything(dcp_train_state, key):
    """restore() of a DCP train state checks the CRC-32s of every item it reads, optimizer
    items as well as the model's, before anything is written into the live objects."""
    path = _flip_in_data_record(dcp_train_state, key)
    model, optimizer = _fresh_train_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {
        k: v.clone() for k, v in optimizer.state_dict()["state"][0].items() if torch.is_tensor(v)
    }
    with pytest.raises(shardstream.ShardstreamError) as caught:
        shardstream.load(dcp_train_state, model=model, optimizer=optimizer)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and str(path) in message and key in message, message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    state_after = optimizer.state_dict()["state"][0]
    assert all(torch.equal(v, state_after[k]) for k, v in state_before.items())


def test_model_only_restore_does_not_read_a_damaged_optimizer_item(dcp_train_state):
    _flip_in_data_record(dcp_train_state, "optimizer.state.weight.exp_avg")
    model, _ = _fresh_train_state()
    shardstream.load(dcp_train_state, model=model)  # reads no optimizer tensor
    with pytest.raises(shardstream.ShardstreamError, match="exp_avg"):
        shardstream.load(
            dcp_train_state, model=model, optimizer=torch.optim.AdamW(model.parameters())
        )


@pytest.mark.parametrize(
    "damage", ["weights linked out", "config of another depth", "config of another vocabulary"]
)
def test_verify_of_a_hf_model_reports_what_merge_refuses(tmp_path, damage):
    """A save_pretrained-layout model whose weights file is a link out of its folder, or whose
    config.json counts other layers than the weights hold, or another vocabulary than its
    embedding's rows, is refused by merge: verify, which passed them, reports it too, naming
    the file."""
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    model = build_tiny_model(tiny_config("qwen2"), seed=0)
    source = tmp_path / "hf"
    model.save_pretrained(source)
    if damage == "weights linked out":
        faulty = source / "model.safetensors"
        faulty.rename(tmp_path / "elsewhere.safetensors")
        os.symlink(tmp_path / "elsewhere.safetensors", faulty)
    else:
        faulty = source / "config.json"
        config = json.loads(faulty.read_text())
        config["num_hidden_layers" if "depth" in damage else "vocab_size"] += 5
        faulty.write_text(json.dumps(config))
    merged = run_cli("merge", "--local_dir", source, "--target_dir", tmp_path / "m")
    assert merged.returncode == 1 and str(faulty) in merged.stderr, merged.stderr
    report = verify(source)
    assert not report.ok and [p.path for p in report.problems] == [str(faulty)], report
