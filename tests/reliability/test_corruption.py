"""Corruption of a saved 2-rank checkpoint: every damaged byte must be caught.

Random trials flip one byte (XOR with a random non-zero value) in tensor data, in a
safetensors header, in the manifest or in an extra-state JSON file of a real FSDP2 step
directory. Each flip must be reported by ``verify`` (naming the file; for data also a tensor and
a byte range that holds the flipped byte) and must make ``restore()`` with ``verify_on_load``
fail with a shardstream error naming the file. A one-rank restore does not read rank 1's extra
state, so for those files the trial also runs what rank 1 runs in a two-rank restore; a few
trials run a real two-rank restore as well. Flips in merged HF files are checked with verify.

Then the structural damages: truncated files, a deleted rank file, two rank files swapped, a
step directory duplicated under another step's name.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from shardstream.commands.verify import verify
from shardstream.errors import ShardstreamError
from shardstream.formats import native
from shardstream.formats.safetensors import read_header, stored_checksums
from shardstream.manager import CheckpointConfig, CheckpointManager
from shardstream.training import load as loading

from .forkserver import build_model, build_optimizer
from .harness import record, trials

CATEGORIES = ("tensor data", "safetensors header", "manifest", "extra-state JSON")
RANGE = re.compile(r"bytes \[(\d+), (\d+)\)")


@pytest.fixture
def manager(tmp_path):
    model = build_model()
    optimizer = build_optimizer(model)
    config = CheckpointConfig(directory=str(tmp_path / "scratch-root"), verify_on_load=True)
    with CheckpointManager(config, model=model, optimizer=optimizer) as mgr:
        yield mgr


def _restore_error(manager, step: Path) -> ShardstreamError | None:
    try:
        manager.restore(path=step)
    except ShardstreamError as exc:
        return exc
    return None


def _rank1_error(step: Path) -> ShardstreamError | None:
    """What rank 1 reads beyond rank 0 in a 2-rank restore: its own extra state."""
    try:
        loading._read_extra(native.open_native(step), 1)
    except ShardstreamError as exc:
        return exc
    return None


def _pick(rng: random.Random, step: Path, category: str) -> tuple[Path, int, str | None]:
    """A file and a byte offset in ``category``; the tensor holding it for data bytes."""
    if category == "manifest":
        path = step / native.MANIFEST
        return path, rng.randrange(path.stat().st_size), None
    if category == "extra-state JSON":
        path = rng.choice(sorted(step.glob("extra-rank-*.json")))
        return path, rng.randrange(path.stat().st_size), None
    path = rng.choice(sorted(step.glob("*.safetensors")))
    header = read_header(path)
    if category == "safetensors header":
        return path, rng.randrange(header.data_start), None
    offset = rng.randrange(header.data_start, header.file_size)
    tensor = next(
        n
        for n, e in header.tensors.items()
        if header.data_start + e.begin <= offset < header.data_start + e.end
    )
    return path, offset, tensor


def _flip(path: Path, offset: int, xor: int) -> bytes:
    original = path.read_bytes()
    data = bytearray(original)
    data[offset] ^= xor
    path.write_bytes(bytes(data))
    return original


def _in_range(text: str, offset: int) -> bool:
    return any(int(lo) <= offset < int(hi) for lo, hi in RANGE.findall(text))


def test_random_byte_flips_are_all_detected(saved_run, tmp_path, manager):
    seed = 1_000_003
    rng = random.Random(seed)
    count = trials(50, 1000)
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    stats: Counter = Counter()
    for trial in range(count):
        category = CATEGORIES[trial % len(CATEGORIES)]
        path, offset, tensor = _pick(rng, step, category)
        xor = rng.randrange(1, 256)
        original = _flip(path, offset, xor)
        where = f"trial {trial} (seed {seed}): {category} flip at {path.name}[{offset}] ^ {xor:#x}"
        try:
            report = verify(step)
            assert not report.ok, f"{where}: verify did not notice"
            named = [p for p in report.problems if p.path in (str(path), str(step))]
            if category == "manifest":
                named = [p for p in report.problems if p.path == str(path)]
            assert named, f"{where}: verify did not name the file: {report.problems}"
            if tensor is not None:
                assert any(
                    p.tensor
                    and tensor in p.tensor
                    and p.byte_range
                    and p.byte_range[0] <= offset < p.byte_range[1]
                    for p in named
                ), f"{where}: verify did not name tensor {tensor!r} and its bytes: {named}"
            error = _restore_error(manager, step)
            reader = "restore"
            if error is None and path.name.startswith("extra-rank-00001"):
                error, reader = _rank1_error(step), "rank 1's part of a 2-rank restore"
            assert error is not None, f"{where}: restore(verify_on_load=True) succeeded"
            message = str(error)
            assert str(path) in message or path.name in message, f"{where}: {message}"
            if tensor is not None:
                assert "tensor '" in message and _in_range(message, offset), f"{where}: {message}"
        finally:
            path.write_bytes(original)
        stats[category] += 1
        stats[f"detected by {reader}"] += 1
    assert verify(step).ok
    record(
        "corruption: random byte flips in a saved checkpoint",
        seed=seed,
        trials=count,
        detected_by_verify=count,
        detected_by_restore=count,
        stats=dict(stats),
    )


def test_random_byte_flips_in_merged_hf_files(saved_run, tmp_path):
    """verify alone (no manifest anchors these headers); data, tensor table and padding."""
    seed = 1_000_033
    rng = random.Random(seed)
    count = trials(40, 600)
    hf = tmp_path / "hf"
    shutil.copytree(saved_run.hf_sharded, hf)
    files = sorted(hf.glob("*.safetensors"))
    stats: Counter = Counter()
    for trial in range(count):
        path = rng.choice(files)
        header = read_header(path)
        in_header = trial % 2 == 0
        offset = (
            rng.randrange(header.data_start)
            if in_header
            else rng.randrange(header.data_start, header.file_size)
        )
        xor = rng.randrange(1, 256)
        _assert_verify_finds_flip(hf, path, offset, xor, f"trial {trial}: flip at ")
        stats["header" if in_header else "data"] += 1
    record(
        "corruption: random byte flips in a merged HF model",
        seed=seed,
        trials=count,
        detected_by_verify=count,
        stats=dict(stats),
    )


def _assert_verify_finds_flip(hf: Path, path: Path, offset: int, xor: int, label: str = ""):
    """XOR one byte of ``path``, check ``verify`` reports that file, then put the byte back."""
    original = _flip(path, offset, xor)
    try:
        report = verify(hf)
        assert not report.ok, f"{label}{path.name}[{offset}] ^ {xor:#x} missed"
        assert any(p.path == str(path) for p in report.problems), report.problems
    finally:
        path.write_bytes(original)


def test_every_change_to_chunk_bytes_of_a_one_chunk_file(saved_run, tmp_path):
    """``shardstream.chunk_bytes`` is covered by no digest, and a file whose data fits in one
    chunk verifies alike under any larger value: every single-byte change of it is still found
    (it must be a power of two in plain decimal). Each position, every one of the 255 XORs."""
    hf = tmp_path / "hf"
    shutil.copytree(saved_run.hf, hf)
    path = hf / "model.safetensors"
    header = read_header(path)
    raw = path.read_bytes()
    key = b'"shardstream.chunk_bytes":"'
    start = raw.index(key) + len(key)
    end = raw.index(b'"', start)
    assert header.file_size - header.data_start < int(raw[start:end]), "expected one chunk"
    stats: Counter = Counter()
    for offset in range(start, end):
        for xor in range(1, 256):
            _assert_verify_finds_flip(hf, path, offset, xor)
            stats["digit changed" if chr(raw[offset] ^ xor).isdigit() else "other byte"] += 1
    assert verify(hf).ok
    record(
        "corruption: every change to chunk_bytes of a one-chunk merged file",
        trials=sum(stats.values()),
        detected_by_verify=sum(stats.values()),
        stats=dict(stats),
    )


def test_flip_that_parses_to_the_same_manifest(saved_run, tmp_path, manager):
    """'1e-08' -> '1E-08' (AdamW's eps) reads back as the same document; it is still caught."""
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    path = step / native.MANIFEST
    raw = path.read_bytes()
    at = raw.index(b"1e-08") + 1
    _flip(path, at, ord("e") ^ ord("E"))
    assert json.loads(path.read_bytes()) == json.loads(raw)
    report = verify(step)
    assert not report.ok and "checksum mismatch" in report.problems[0].message
    error = _restore_error(manager, step)
    assert error is not None and "manifest checksum mismatch" in str(error)


def _two_rank_restore(forkserver, step: Path, tmp_path: Path) -> list[dict]:
    """Restore ``step`` on 2 real ranks; each rank's outcome (ok, error type and message)."""
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "world": 2,
        "init": str(tmp_path / "gloo"),
        "scratch": str(tmp_path / "scratch"),
        "path": str(step),
        "out": str(out),
    }
    assert forkserver.run("restore", spec, nprocs=2, timeout=120) == [0, 0], forkserver.logs()
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]


def test_two_rank_restore_catches_rank1_extra_state(forkserver, saved_run, tmp_path):
    """A real 2-rank restore: rank 1 reads its own extra state and must refuse a damaged one;
    rank 0 must learn of it (not wait in a barrier for a process that may never exit)."""
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    victim = step / "extra-rank-00001.safetensors"
    header = read_header(victim)
    _flip(victim, (header.data_start + header.file_size) // 2, 0x10)
    results = _two_rank_restore(forkserver, step, tmp_path)
    rank1 = results[1]
    assert rank1["ok"] is False and rank1["shardstream_error"], rank1
    assert "extra-rank-00001.safetensors" in rank1["message"]
    assert "checksum mismatch" in rank1["message"]
    rank0 = results[0]
    # Rank 0 read nothing wrong, but must fail too, told why, rather than wait for rank 1.
    assert rank0["ok"] is False and rank0["shardstream_error"], rank0
    assert "rank 1" in rank0["message"] and "extra-rank-00001.safetensors" in rank0["message"]
    record(
        "corruption: rank 1's extra state in a real 2-rank restore",
        trials=1,
        rank1=rank1["message"],
        rank0=rank0.get("message", "ok"),
    )


# --- structural damage ---------------------------------------------------------------------


def _problems(path: Path) -> list[str]:
    report = verify(path)
    assert not report.ok
    return [p.line() for p in report.problems]


@pytest.mark.parametrize(
    "name", ["rank-00000.safetensors", "extra-rank-00001.json", "manifest.json"]
)
def test_truncated_file(saved_run, tmp_path, manager, name):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    victim = step / name
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    lines = _problems(step)
    assert any(name in line for line in lines), lines
    error = _restore_error(manager, step) or (
        _rank1_error(step) if name.startswith("extra-rank-00001") else None
    )
    assert error is not None and name in str(error)
    record(f"corruption: truncated {name}", trials=1, verify=lines, restore=str(error))


def test_deleted_rank_file(saved_run, tmp_path, manager):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    (step / "rank-00001.safetensors").unlink()
    lines = _problems(step)
    assert any("rank-00001.safetensors" in line and "missing" in line for line in lines), lines
    error = _restore_error(manager, step)
    assert error is not None and "rank-00001.safetensors" in str(error) and "missing" in str(error)
    record("corruption: deleted rank file", trials=1, verify=lines, restore=str(error))


def test_swapped_rank_files(saved_run, tmp_path, manager):
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    a, b = step / "rank-00000.safetensors", step / "rank-00001.safetensors"
    a.rename(step / "swap")
    b.rename(a)
    (step / "swap").rename(b)
    lines = _problems(step)
    assert any("rank-0000" in line for line in lines), lines
    error = _restore_error(manager, step)
    assert error is not None and "rank-0000" in str(error)
    record(
        "corruption: two rank files swapped",
        trials=1,
        verify=lines,
        restore=str(error),
    )


def test_swapped_same_size_files(saved_run, tmp_path, manager):
    """Files of equal size swapped (extra tensors of rank 0 and 1): the header digest tells."""
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    a, b = step / "extra-rank-00000.safetensors", step / "extra-rank-00001.safetensors"
    assert a.stat().st_size == b.stat().st_size
    data_a, data_b = a.read_bytes(), b.read_bytes()
    if data_a == data_b:
        pytest.skip("both ranks' extra tensors are identical; a swap changes nothing")
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    lines = _problems(step)
    assert any("extra-rank-0000" in line for line in lines), lines
    assert _restore_error(manager, step) is not None


def test_step_directory_duplicated_under_another_name(saved_run, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved_run.root, root)
    shutil.copytree(root / "global_step_3", root / "global_step_7")
    (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    lines = _problems(root)
    assert any(
        "global_step_7" in line and "named for step 7" in line and "step 3" in line
        for line in lines
    ), lines
    model = build_model()
    optimizer = build_optimizer(model)
    config = CheckpointConfig(directory=str(root))
    with CheckpointManager(config, model=model, optimizer=optimizer) as manager:
        with pytest.raises(ShardstreamError, match="global_step_7.*step 3"):
            manager.restore()
        with pytest.raises(ShardstreamError, match="global_step_7.*step 3"):
            manager.restore(step=7)
        assert manager.restore(step=3)[0] == 3
    record(
        "corruption: step directory copied under another step's name",
        trials=1,
        verify=lines,
    )


def test_two_rank_restore_fails_on_every_rank_when_one_rank_file_is_damaged(
    forkserver, saved_run, tmp_path
):
    """Each rank opens only the files it reads: the damaged header of a rank file no list
    entry points into is seen by its own rank alone; the other rank must fail with it named
    instead of entering the collective load alone."""
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    doc = json.loads((step / native.MANIFEST).read_bytes())
    shared = {c["file"] for t in doc["tensors"].values() for c in t.get("chunks", [])}
    owner = next(r for r in (0, 1) if native.rank_file(r) not in shared)
    victim = step / native.rank_file(owner)
    _flip(victim, read_header(victim).data_start // 2, 0x01)
    results = _two_rank_restore(forkserver, step, tmp_path)
    mine = results[owner]
    assert mine["ok"] is False and victim.name in mine["message"], mine
    other = results[1 - owner]
    assert other["ok"] is False and other["shardstream_error"], other
    assert f"rank {owner}" in other["message"] and victim.name in other["message"], other


def test_random_byte_flips_in_rank_files_fail_a_merge(saved_run, tmp_path):
    """A merge reads the model's bytes only, but every chunk it touches is checked whole:
    a flip anywhere in such a chunk (optimizer state beside the model included) fails the
    merge, names the file, and leaves no output."""
    from shardstream.commands.merge import merge

    seed = 2_000_003
    rng = random.Random(seed)
    count = trials(12, 200)
    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    for trial in range(count):
        path = rng.choice(sorted(step.glob("rank-*.safetensors")))
        header = read_header(path)
        stored = stored_checksums(header)
        model_end = max(e.end for n, e in header.tensors.items() if n.startswith("model."))
        last_model_chunk = (model_end - 1) // stored.chunk_bytes
        hi = min(header.file_size, header.data_start + (last_model_chunk + 1) * stored.chunk_bytes)
        offset = rng.randrange(header.data_start, hi)
        original = _flip(path, offset, rng.randrange(1, 256))
        where = f"trial {trial} (seed {seed}): flip at {path.name}[{offset}]"
        target = tmp_path / f"merged-{trial}"
        try:
            with pytest.raises(ShardstreamError) as caught:
                merge(step, target)
            assert path.name in str(caught.value) and _in_range(str(caught.value), offset), (
                f"{where}: {caught.value}"
            )
            assert not target.exists() and not list(tmp_path.glob(f"merged-{trial}*")), where
        finally:
            path.write_bytes(original)
    merge(step, tmp_path / "merged-intact")  # the restored files merge fine
    record("corruption: byte flips in rank files fail a merge", seed=seed, trials=count)


def test_random_byte_flips_in_verl_storages(fsdp_root, tmp_path):
    """verl's .pt files: torch stores a CRC-32 per zip record and checks none on load. A flip in
    any storage record is reported by verify, naming the file and a byte range holding it; a
    merge that reads the record fails the same way and leaves no output. A storage no model
    tensor uses (the saved DeviceMesh's) is not read by a merge, whose output is then unchanged."""
    from shardstream.commands.merge import merge
    from shardstream.formats.torch_pt import zip_records

    seed = 3_000_017
    rng = random.Random(seed)
    count = trials(16, 300)
    actor = tmp_path / "actor"
    shutil.copytree(fsdp_root / "base", actor)
    merge(actor, tmp_path / "merged-intact")
    intact = (tmp_path / "merged-intact" / "model.safetensors").read_bytes()
    files = sorted(actor.glob("model_world_size_*_rank_*.pt"))
    storages = {f: [r for r in zip_records(str(f)) if "/data/" in r.name] for f in files}
    outcomes: Counter = Counter()
    for trial in range(count):
        path = rng.choice(files)
        record_ = rng.choice([r for r in storages[path] if r.end > r.start])
        offset = rng.randrange(record_.start, record_.end)
        original = _flip(path, offset, rng.randrange(1, 256))
        where = f"trial {trial} (seed {seed}): flip at {path.name}[{offset}]"
        target = tmp_path / f"merged-{trial}"
        try:
            report = verify(actor)
            assert [p.path for p in report.problems] == [str(path)], (where, report.problems)
            lo, hi = report.problems[0].byte_range
            assert lo <= offset < hi, where
            try:
                merge(actor, target)
            except ShardstreamError as exc:
                assert path.name in str(exc) and _in_range(str(exc), offset), f"{where}: {exc}"
                assert not target.exists() and not list(tmp_path.glob(f"merged-{trial}*")), where
                outcomes["merge failed, naming file and bytes"] += 1
            else:
                assert (target / "model.safetensors").read_bytes() == intact, where
                outcomes["record no model tensor uses: merge output unchanged"] += 1
        finally:
            path.write_bytes(original)
    assert outcomes["merge failed, naming file and bytes"] >= count // 2, outcomes
    record(
        "corruption: byte flips in verl storages (verify and merge)",
        seed=seed,
        trials=count,
        outcomes=dict(outcomes),
    )


def test_shardstream_test_verifies_what_it_reads(saved_run, tmp_path, capsys):
    """``shardstream test`` compares a checkpoint of shardstream's format with a reference;
    the checkpoint's bytes are checked against their digests on the way, so a damaged rank
    file is reported as damage (file and bytes named, exit 1), not as different values."""
    from shardstream.cli import main

    step = tmp_path / "global_step_3"
    shutil.copytree(saved_run.step, step)
    argv = ["test", "--local_dir", str(step), "--test_hf_dir", str(saved_run.hf)]
    assert main(argv) == 0, capsys.readouterr()
    capsys.readouterr()
    victim = step / native.rank_file(1)
    header = read_header(victim)
    entry = next(e for n, e in header.tensors.items() if n.startswith("model."))
    offset = header.data_start + entry.begin
    _flip(victim, offset, 0x40)
    assert main(argv) == 1
    _, err = capsys.readouterr()
    assert "checksum mismatch" in err and victim.name in err and _in_range(err, offset), err
