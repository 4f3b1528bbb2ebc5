"""Hostile inputs: files built to run code, escape the checkpoint, or make shardstream allocate.

Every case goes through the entry points a user runs (``restore()``, ``shardstream merge``,
``shardstream verify``), not only the parsers, and must end in a clear shardstream error with
nothing executed, nothing outside the checkpoint read, and nothing big allocated. Manifests are
re-sealed with a valid checksum, as an attacker would: the checksum detects accidents, not
malice, so the checks behind it must hold on their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardstream import cli
from shardstream.commands.verify import verify
from shardstream.errors import ShardstreamError, UnsafeCheckpointError
from shardstream.formats import native
from shardstream.formats.safetensors import read_header
from shardstream.manager import CheckpointConfig, CheckpointManager

from .forkserver import build_model, build_optimizer
from .harness import record

ALLOC_LIMIT = 16 * 2**20  # bytes of Python allocations any rejection may take


class Payload:
    """Unpickling this runs ``exec`` and leaves a marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.fixture
def manager(tmp_path):
    model = build_model()
    optimizer = build_optimizer(model)
    config = CheckpointConfig(directory=str(tmp_path / "scratch-root"))
    with CheckpointManager(config, model=model, optimizer=optimizer) as mgr:
        yield mgr


def _model_and_extra_manager(tmp_path) -> CheckpointManager:
    """Restores model and extra state only (a verl directory may hold no optimizer file)."""
    model = build_model()
    config = CheckpointConfig(
        directory=str(tmp_path / "model-extra-root"),
        save_contents=("model", "extra"),
        load_contents=("model", "extra"),
    )
    return CheckpointManager(config, model=model)


def _verl_dir(directory: Path, files: dict[str, object]) -> Path:
    directory.mkdir(parents=True)
    for name, obj in files.items():
        torch.save(obj, directory / name)
    (directory / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    hf = directory / "huggingface"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "tiny", "torch_dtype": "float32"}))
    # as verl's huggingface/ has one: merge would otherwise derive it through transformers,
    # which knows no "tiny" model and says so on stderr where the soak runs without logging
    (hf / "generation_config.json").write_text("{}")
    return directory


def _plain_state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model().state_dict().items()}


def _merge(capsys, source: Path, target: Path) -> tuple[int, str]:
    code = cli.main(["merge", "--local_dir", str(source), "--target_dir", str(target), "--quiet"])
    return code, capsys.readouterr().err


# --- pickles that would run code ------------------------------------------------------------


_OPENED: list[str] | None = None  # paths opened while watched (see _opened_files)


def _audit(event: str, args) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def _opened_files():
    """Every path this process opens meanwhile (``open`` audit events: ``open()``, ``os.open``,
    what zipfile, mmap'd reads and torch's file readers start from)."""
    global _OPENED
    if not getattr(_audit, "installed", False):
        sys.addaudithook(_audit)  # for the life of the process; idle unless watching
        _audit.installed = True
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None


@pytest.mark.parametrize("where", ["model", "optimizer", "extra_state"])
def test_code_running_pickle_never_runs(tmp_path, manager, capsys, where):
    """A pickle whose ``__reduce__`` runs code, in each verl file: no entry point runs it. Those
    that unpickle the file (restore, and merge/inspect/verify for the model file) refuse it with
    a shardstream error naming it; verify and inspect check the others without unpickling them
    or refuse them by name; merge never opens the optimizer or extra-state file at all (checked
    with an audit hook) and succeeds."""
    marker = tmp_path / "marker"
    state = _plain_state()
    files = {"model_world_size_1_rank_0.pt": state}
    name = f"{'optim' if where == 'optimizer' else where}_world_size_1_rank_0.pt"
    if where == "model":
        files[name] = {**state, "evil": Payload(marker)}
    else:
        files[name] = {"state": {0: {"step": Payload(marker)}}, "rng": Payload(marker)}
    source = _verl_dir(tmp_path / "actor", files)
    outcomes = {}

    if where == "extra_state":
        manager = _model_and_extra_manager(tmp_path)
    with pytest.raises(ShardstreamError) as caught:
        manager.restore(path=source)
    assert not marker.exists(), "unpickling ran code during restore"
    assert isinstance(caught.value, UnsafeCheckpointError) or "refused" in str(caught.value)
    assert name in str(caught.value)
    outcomes["restore"] = str(caught.value).splitlines()[0].replace(str(tmp_path), "TMP")

    for command in ("verify", "inspect"):
        code = cli.main([command, str(source)] + (["--quiet"] if command == "verify" else []))
        captured = capsys.readouterr()
        assert not marker.exists(), f"unpickling ran code during {command}"
        output = captured.err + captured.out
        assert "Traceback" not in output, output
        if where == "model":  # both read the model file's tensors: refused, the file named
            assert code == 1 and name in output and "refused" in output, output
        else:  # checked without unpickling (zip records), or unpickled and refused, by name
            assert code == 0 or (code == 1 and name in output and "refused" in output), output
        outcomes[command] = f"exit {code}"

    with _opened_files() as opened:
        code, err = _merge(capsys, source, tmp_path / "merged")
    assert not marker.exists(), "unpickling ran code during merge"
    if where == "model":
        assert code == 1 and "refused to unpickle" in err and name in err
        assert not (tmp_path / "merged").exists()
    else:
        assert code == 0, err
        assert not [p for p in opened if Path(p).name == name], f"merge opened {name}"
        assert any(Path(p).name == "model_world_size_1_rank_0.pt" for p in opened), opened
        assert verify(tmp_path / "merged").ok
    outcomes["merge"] = f"exit {code}" + ("" if where == "model" else f"; {name} never opened")
    record(f"hostile: code-running pickle in the {where} file", trials=1, entry_points=outcomes)


def test_code_running_pickle_next_to_the_checkpoint(tmp_path, capsys):
    """verl's data.pt and a stray .pt beside the model files are never unpickled."""
    marker = tmp_path / "marker"
    source = _verl_dir(
        tmp_path / "step" / "actor", {"model_world_size_1_rank_0.pt": _plain_state()}
    )
    torch.save({"dataloader": Payload(marker)}, source.parent / "data.pt")
    torch.save(Payload(marker), source / "notes.pt")
    code, _ = _merge(capsys, source, tmp_path / "merged")
    assert code == 0 and not marker.exists()
    with _model_and_extra_manager(tmp_path) as manager:
        manager.restore(path=source)
    assert not marker.exists()


# --- safetensors files that lie about themselves ----------------------------------------------


def _header_bytes(doc: object, pad: bool = True) -> bytes:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    if pad:
        body += b" " * (-len(body) % 8)
    return body


def _file(header: bytes, data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HOSTILE_FILES: dict[str, Callable[[], bytes]] = {
    "header length beyond the file": lambda: _file(_header_bytes({"w": F32}), b"\0" * 8, 4096),
    "header length over 100 MB": lambda: _file(b"{}", b"", 100_000_001),
    "header length 2**64-1": lambda: _file(b"{}", b"", 2**64 - 1),
    "overlapping offsets": lambda: _file(
        _header_bytes({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}), b"\0" * 12
    ),
    "offsets out of range": lambda: _file(
        _header_bytes({"a": {**F32, "data_offsets": [8, 16]}}), b"\0" * 8
    ),
    "offsets past the end of the file": lambda: _file(
        _header_bytes({"a": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}),
        b"\0" * 8,
    ),
    "a hole between tensors": lambda: _file(
        _header_bytes({"a": F32, "b": {**F32, "data_offsets": [12, 20]}}), b"\0" * 20
    ),
    "unknown dtype": lambda: _file(_header_bytes({"a": {**F32, "dtype": "F33"}}), b"\0" * 8),
    "shape and byte size disagree": lambda: _file(
        _header_bytes({"a": {**F32, "shape": [3]}}), b"\0" * 8
    ),
    "absurd shape": lambda: _file(
        _header_bytes({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}}),
        b"\0" * 8,
    ),
    "negative shape": lambda: _file(_header_bytes({"a": {**F32, "shape": [-2]}}), b"\0" * 8),
    # no bytes, but a dimension no torch size holds: written out, no reader could load it
    "empty with a dimension of 2**63": lambda: _file(
        _header_bytes({"a": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}), b""
    ),
    "empty with a dimension of 2**64": lambda: _file(
        _header_bytes({"a": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}}), b""
    ),
    "duplicate tensor names": lambda: _file(
        _header_bytes(
            b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
        ),
        b"\0" * 8,
    ),
    "not JSON": lambda: _file(_header_bytes(b"\xff\xfe{not json"), b""),
    "JSON nested 100000 deep": lambda: _file(_header_bytes(b"[" * 100_000 + b"]" * 100_000), b""),
    "not an object": lambda: _file(_header_bytes([1, 2, 3]), b""),
    "metadata not strings": lambda: _file(
        _header_bytes({"__metadata__": {"format": 7}, "a": F32}), b"\0" * 8
    ),
    "empty file": lambda: b"",
    "shorter than the length prefix": lambda: b"\x08\0\0",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_hostile_safetensors_file(tmp_path, saved_run, manager, case):
    raw = HOSTILE_FILES[case]()
    loose = tmp_path / "loose.safetensors"
    loose.write_bytes(raw)

    # 1. The parser, with its allocations measured.
    tracemalloc.start()
    try:
        with pytest.raises(ShardstreamError) as parsed:
            read_header(loose)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(loose) in str(parsed.value)
    assert peak < ALLOC_LIMIT, f"rejecting {case!r} allocated {peak} bytes"

    # 2. As the weights of a HF model directory: verify reports it, naming the file.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(raw)
    report = verify(hf)
    assert not report.ok and report.problems[0].path == str(hf / "model.safetensors")

    # 3. As rank 0's file of a step directory, with a manifest re-sealed to match it.
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    (step / "rank-00000.safetensors").write_bytes(raw)
    _reseal(step, lambda doc: doc["files"]["rank-00000.safetensors"].update(size=len(raw)))
    with pytest.raises(ShardstreamError) as restored:
        manager.restore(path=step)
    assert "rank-00000.safetensors" in str(restored.value)
    report = verify(step)
    assert not report.ok
    assert any("rank-00000.safetensors" in p.line() for p in report.problems)
    record(
        f"hostile safetensors: {case}",
        trials=1,
        error=str(parsed.value).replace(str(loose), "FILE"),
        python_alloc_peak=peak,
    )


# --- manifests that point outside, or ask for too much -----------------------------------------


def _reseal(step: Path, mutate: Callable[[dict], None]) -> None:
    doc = json.loads((step / native.MANIFEST).read_bytes())
    doc.pop("checksum")
    for fqn, tensor in doc["tensors"].items():  # spell grid entries out, so cases can edit them
        if "grid" in tensor:
            tensor["chunks"] = list(native.grid_chunks(fqn, tensor["shape"], tensor.pop("grid")))
    mutate(doc)
    native.write_manifest(step, doc)


def _grid(doc: dict, world) -> None:
    tensor = doc["tensors"]["model.0.weight"]
    tensor.pop("chunks")
    tensor["grid"] = world


def _rename_file(doc: dict, old: str, new: str) -> None:
    doc["files"][new] = doc["files"].pop(old)
    for tensor in doc["tensors"].values():
        for chunk in tensor["chunks"]:
            if chunk["file"] == old:
                chunk["file"] = new


ESCAPES = {
    "../ in a file name": "../outside.safetensors",
    "absolute path": None,  # filled in with the outside file's absolute path
    "huggingface/../ in a file name": "huggingface/../../outside.safetensors",
    "a bare ..": "..",
    "NUL byte": "rank-00000.safetensors\x00.x",
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_manifest_paths_that_escape(tmp_path, saved_run, manager, capsys, case):
    step = tmp_path / "ckpt" / "global_step_3"
    shutil.copytree(saved_run.step, step)
    outside = tmp_path / "outside.safetensors"  # a valid file an escape would reach
    shutil.copyfile(step / "rank-00000.safetensors", outside)
    shutil.copyfile(step / "rank-00000.safetensors", step.parent / "outside.safetensors")
    name = ESCAPES[case] or str(outside)
    _reseal(step, lambda doc: _rename_file(doc, "rank-00000.safetensors", name))
    (step / "rank-00000.safetensors").unlink()
    with pytest.raises(UnsafeCheckpointError, match="not a plain file name inside"):
        manager.restore(path=step)
    code, err = _merge(capsys, step, tmp_path / "merged")
    assert code == 1 and "not a plain file name inside" in err
    assert not verify(step).ok


def test_a_huggingface_record_two_entries_name_is_refused(tmp_path, capsys):
    """With share_hf_weights, model tensors point into huggingface/ under save_pretrained's
    names, which the reader cannot derive: an entry (resealed) pointing at another tensor's
    record merged and restored that tensor's bytes, verify passing."""
    import shardstream
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2")
    step = tmp_path / "run" / "global_step_1"
    model = build_tiny_model(config)
    contents = ("model", "hf_model")
    shardstream.save(step, model=model, contents=contents, hf_config=config, share_hf_weights=True)
    assert cli.main(["verify", str(step)]) == 0
    capsys.readouterr()

    def point_head_at_embedding(doc: dict) -> None:
        (chunk,) = doc["tensors"]["model.lm_head.weight"]["chunks"]
        assert chunk["file"].startswith("huggingface/")
        chunk["key"] = "model.embed_tokens.weight"

    _reseal(step, point_head_at_embedding)
    said = "which tensor 'model.lm_head.weight' names too"
    report = verify(step)
    assert not report.ok and any(said in p.line() for p in report.problems), report.problems
    code, err = _merge(capsys, step, tmp_path / "merged")
    assert code == 1 and said in err and not (tmp_path / "merged").exists()
    with pytest.raises(ShardstreamError, match=said):
        shardstream.load(step, model=build_tiny_model(config), contents=("model",))


def test_manifest_chunk_with_more_sizes_than_dims(tmp_path, saved_run, capsys):
    """A chunk of a 1-D tensor with two sizes passed verify and inspect; merge then failed
    naming neither the manifest nor the file."""
    step = tmp_path / "ckpt" / "global_step_3"
    shutil.copytree(saved_run.step, step)

    def alias(doc: dict) -> None:
        fqn, tensor = next(
            (k, v)
            for k, v in doc["tensors"].items()
            if k.startswith("model.") and len(v["shape"]) == 2
        )
        chunk = dict(tensor["chunks"][0], offsets=[0])
        rows, cols = chunk["sizes"]
        doc["tensors"]["model.alias"] = {**tensor, "shape": [rows * cols], "chunks": [chunk]}

    _reseal(step, alias)
    report = verify(step)
    assert not report.ok
    assert any(
        "manifest.json" in p.line() and "2 sizes for 1 dims" in p.line() for p in report.problems
    )
    code, err = _merge(capsys, step, tmp_path / "merged")
    assert code == 1 and "manifest.json" in err and "2 sizes for 1 dims" in err


@pytest.mark.parametrize("what", ["file", "directory", "manifest"])
def test_symlinks_pointing_outside(tmp_path, saved_run, manager, capsys, what):
    step = tmp_path / "ckpt" / "global_step_3"
    shutil.copytree(saved_run.step, step)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if what == "manifest":  # the manifest itself (verify and merge read it as it was)
        shutil.move(step / "manifest.json", elsewhere / "manifest.json")
        os.symlink(elsewhere / "manifest.json", step / "manifest.json")
    elif what == "file":
        shutil.move(step / "rank-00001.safetensors", elsewhere / "rank-00001.safetensors")
        os.symlink(elsewhere / "rank-00001.safetensors", step / "rank-00001.safetensors")
    else:  # the huggingface/ directory itself is a link out; names inside it look plain
        shutil.move(step / "rank-00001.safetensors", elsewhere / "rank-00001.safetensors")
        os.symlink(elsewhere, step / "huggingface")
        _reseal(
            step,
            lambda doc: _rename_file(
                doc, "rank-00001.safetensors", "huggingface/rank-00001.safetensors"
            ),
        )
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint"):
        manager.restore(path=step)
    code, err = _merge(capsys, step, tmp_path / "merged")
    assert code == 1 and "outside the checkpoint" in err
    report = verify(step)
    assert not report.ok and any("outside the checkpoint" in p.line() for p in report.problems)


def test_symlink_inside_the_checkpoint_is_fine(tmp_path, saved_run, manager):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    (step / "rank-00001.safetensors").rename(step / "real-rank-1")
    os.symlink("real-rank-1", step / "rank-00001.safetensors")
    manager.restore(path=step)
    assert verify(step).ok


ABSURD = {
    "tensor shape 2**40 x 2**40": lambda doc: doc["tensors"]["model.0.weight"].update(
        shape=[2**40, 2**40]
    ),
    "negative tensor shape": lambda doc: doc["tensors"]["model.0.weight"].update(shape=[-40, 24]),
    "chunk outside its tensor": lambda doc: doc["tensors"]["model.0.weight"]["chunks"][0].update(
        offsets=[2**62, 0]
    ),
    "10000 chunks": lambda doc: doc["tensors"]["model.0.weight"].update(
        chunks=[doc["tensors"]["model.0.weight"]["chunks"][0]] * 10_000
    ),
    "file size 2**63": lambda doc: doc["files"]["rank-00000.safetensors"].update(size=2**63),
    "20000 missing files": lambda doc: doc["files"].update(
        {f"f{i}.safetensors": {"size": 8, "header_xxh3": "0" * 16} for i in range(20_000)}
    ),
    "dtype that does not exist": lambda doc: doc["tensors"]["model.0.weight"].update(dtype="F33"),
    "tensors section is a list": lambda doc: doc.update(tensors=[1, 2]),
    "chunk with no file": lambda doc: doc["tensors"]["model.0.weight"]["chunks"][0].pop("file"),
    "grid over 2**40 ranks": lambda doc: _grid(doc, 2**40),
    "grid that is not a number": lambda doc: _grid(doc, "2"),
    "grid with a 2**40-row shape": lambda doc: (
        _grid(doc, 2),
        doc["tensors"]["model.0.weight"].update(shape=[2**40, 24]),
    ),
}


@pytest.mark.parametrize("case", sorted(ABSURD))
def test_absurd_manifest(tmp_path, saved_run, manager, case):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    _reseal(step, ABSURD[case])
    tracemalloc.start()
    try:
        with pytest.raises(ShardstreamError) as caught:
            native.open_native(step)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    manifest_bytes = (step / native.MANIFEST).stat().st_size
    # Parsing the manifest itself is the allowed cost; nothing may be sized by its claims.
    assert peak < ALLOC_LIMIT + 20 * manifest_bytes, f"{case}: {peak} bytes"
    with pytest.raises(ShardstreamError):
        manager.restore(path=step)
    assert not verify(step).ok
    record(
        f"hostile manifest: {case}",
        trials=1,
        error=str(caught.value).replace(str(step), "STEP")[:300],
    )


def test_manifest_over_the_size_limit_is_not_read(tmp_path, saved_run, manager):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    with open(step / native.MANIFEST, "r+b") as f:  # sparse: claims 1 GiB + 1 byte
        f.truncate(native.MAX_MANIFEST_BYTES + 1)
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeCheckpointError, match="size limit"):
            manager.restore(path=step)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOC_LIMIT
    assert not verify(step).ok


def _config_link_out(directory: Path, tmp_path: Path, whole_dir: bool) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (secret / "id_rsa").write_text("PRIVATE KEY")
    hf = directory / "huggingface"
    if hf.exists():
        shutil.rmtree(hf)
    if whole_dir:
        os.symlink(secret, hf)
    else:
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps({"model_type": "tiny"}))
        os.symlink(secret / "id_rsa", hf / "tokenizer.json")


@pytest.mark.parametrize("whole_dir", [True, False], ids=["dir-link", "file-link"])
def test_merge_does_not_copy_config_files_from_outside(saved_run, tmp_path, capsys, whole_dir):
    """A linked huggingface/ (or tokenizer file) must not smuggle local files into the output."""
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    _config_link_out(step, tmp_path, whole_dir)
    code, err = _merge(capsys, step, tmp_path / "merged")
    assert code == 1 and "outside the checkpoint" in err
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("whole_dir", [True, False], ids=["dir-link", "file-link"])
def test_verl_merge_does_not_copy_config_files_from_outside(tmp_path, capsys, whole_dir):
    source = _verl_dir(tmp_path / "actor", {"model_world_size_1_rank_0.pt": _plain_state()})
    _config_link_out(source, tmp_path, whole_dir)
    code, _ = _merge(capsys, source, tmp_path / "merged")
    assert not (tmp_path / "merged" / "id_rsa").exists()
    assert not (tmp_path / "merged" / "tokenizer.json").exists()
    assert code == 1
