"""A ``.pt`` whose zip directory reads one way to Python's ``zipfile`` and another to torch's
own reader (the one ``torch.load`` uses): a harmless checkpoint to the first, a TorchScript
archive (which ``torch.load`` hands to ``torch.jit.load``, running its code) or another
checkpoint to the second. Refused before ``torch.load``, naming the file; no code runs."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zipfile
from typing import Tuple  # noqa: UP035 (TorchScript)

import pytest
import torch

MARK = "TORCHSCRIPT-RAN"


class _Loud(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.ones(2000)

    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, bool]:  # noqa: UP006 (TorchScript's typing)
        return (self.x, self.training)

    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:  # noqa: UP006
        print("TORCHSCRIPT-RAN")  # MARK (TorchScript reads no globals)
        self.x = state[0]
        self.training = state[1]

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a + self.x


def _split(raw: bytes) -> tuple[bytes, bytes, int]:
    """(local records, central directory, entries) of a zip without a comment."""
    end = raw.rfind(b"PK\x05\x06")
    entries, size, offset = struct.unpack_from("<HII", raw, end + 10)
    return raw[:offset], raw[offset : offset + size], entries


def _moved(directory: bytes, delta: int) -> bytes:
    """A central directory whose local-header offsets are moved by ``delta``."""
    out, at = bytearray(directory), 0
    while out[at : at + 4] == b"PK\x01\x02":
        name, extra, comment = struct.unpack_from("<HHH", out, at + 28)
        struct.pack_into("<I", out, at + 42, struct.unpack_from("<I", out, at + 42)[0] + delta)
        at += 46 + name + extra + comment
    return bytes(out)


def _two_faced(for_torch: bytes, state: dict) -> bytes:
    """One file: torch's reader (the end record's offset) finds ``for_torch``'s directory;
    Python's zipfile (which corrects the offset for data it assumes prepended) finds a
    checkpoint of ``state`` whose folder name is long enough to line the two up."""
    saved = io.BytesIO()
    torch.save(state, saved)
    plain = zipfile.ZipFile(io.BytesIO(saved.getvalue()))
    padded = io.BytesIO()
    with zipfile.ZipFile(padded, "w") as out:
        for name in plain.namelist():
            out.writestr(zipfile.ZipInfo("c" * 400 + "/" + name.split("/", 1)[1]), plain.read(name))
    t_local, t_dir, t_entries = _split(for_torch)
    c_local, c_dir, _ = _split(padded.getvalue())
    assert len(t_local) >= len(c_local) and len(c_dir) >= len(t_dir)
    end = struct.pack(
        "<4sHHHHIIH", b"PK\x05\x06", 0, 0, t_entries, t_entries, len(c_dir), len(t_local), 0
    )
    return t_local + t_dir + c_local + _moved(c_dir, len(t_local) - len(c_local)) + end


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardstream", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def torchscript(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("ts") / "ts.pt"
    torch.jit.save(torch.jit.script(_Loud()), str(path))
    return path.read_bytes()


@pytest.mark.parametrize("layout", ["torch file", "verl"])
def test_a_torchscript_archive_behind_a_checkpoint_is_refused_unrun(tmp_path, torchscript, layout):
    blob = _two_faced(torchscript, {"w": torch.arange(4.0)})
    names = zipfile.ZipFile(io.BytesIO(blob)).namelist()
    assert not any(n.endswith("constants.pkl") for n in names)  # zipfile sees a checkpoint
    file = tmp_path / (
        "model.pt" if layout == "torch file" else "ckpt/model_world_size_1_rank_0.pt"
    )
    file.parent.mkdir(exist_ok=True)
    file.write_bytes(blob)
    source = str(file if layout == "torch file" else file.parent)
    for args in (["inspect", source], ["verify", source], ["merge", "--local_dir", source,
                 "--target_dir", str(tmp_path / "out")]):  # fmt: skip
        done = _run(*args)
        assert done.returncode != 0, (args, done.stdout)
        assert MARK not in done.stdout + done.stderr, args
        assert f"{file}: refused to unpickle: a TorchScript archive" in done.stdout + done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_two_checkpoints_in_one_file_are_refused(tmp_path):
    """torch would load one checkpoint, the checks would read another: refused."""
    other = io.BytesIO()
    torch.save({"w": torch.zeros(2000)}, other)
    file = tmp_path / "model.pt"
    file.write_bytes(_two_faced(other.getvalue(), {"w": torch.arange(4.0)}))
    done = _run("inspect", str(file))
    assert done.returncode != 0
    assert f"{file}: refused to read: torch's zip reader and Python's list different" in (
        done.stderr
    )


def test_a_compressed_pickle_record_is_refused_before_it_is_inflated(tmp_path):
    """data.pkl deflated with many zero bytes after its STOP: a 1 MB file was inflated whole
    by torch.load (gigabytes of memory) before the refusal, which blamed a storage record.
    torch.save never compresses a record."""
    plain = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, plain)
    source = zipfile.ZipFile(plain)
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w") as out:
        for info in source.infolist():
            body, entry = source.read(info.filename), zipfile.ZipInfo(info.filename)
            if info.filename.endswith("/data.pkl"):
                entry.compress_type = zipfile.ZIP_DEFLATED
                body += bytes(64 << 20)
            out.writestr(entry, body)
    file = tmp_path / "ckpt" / "model_world_size_1_rank_0.pt"
    file.parent.mkdir()
    file.write_bytes(packed.getvalue())
    assert file.stat().st_size < (1 << 20)
    for args in (["inspect", str(file.parent)], ["verify", str(file.parent)]):
        done = _run(*args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert "data.pkl' is compressed" in done.stdout + done.stderr, (args, done)
        assert "Traceback" not in done.stderr


def _central_names(raw: bytes) -> dict[str, int]:
    """Each central directory entry's name -> where that name's bytes start in ``raw``."""
    end = raw.rfind(b"PK\x05\x06")
    at = struct.unpack_from("<I", raw, end + 16)[0]
    found = {}
    while raw[at : at + 4] == b"PK\x01\x02":
        n, e, c = struct.unpack_from("<HHH", raw, at + 28)
        found[raw[at + 46 : at + 46 + n].decode()] = at + 46
        at += 46 + n + e + c
    return found


@pytest.mark.parametrize("damage", ["two names swapped", "one name's bit flipped"])
def test_central_names_that_are_not_the_local_headers_are_refused(tmp_path, damage):
    """torch's reader finds a storage by its central directory name, a meta load by the
    records' order: two equal-size storages' central names swapped made torch.load give each
    tensor the other's bytes, while verify said OK and merge wrote the originals, exit 0; a
    flipped bit in one (``data/3`` -> ``tata/3``) left a file torch cannot load that verify
    passed. Every record's local header must name it as the central directory does."""
    file = tmp_path / "ckpt" / "model_world_size_1_rank_0.pt"
    file.parent.mkdir()
    torch.save({f"w{i}": torch.full((8,), float(i)) for i in range(4)}, file)
    raw = bytearray(file.read_bytes())
    names = _central_names(raw)
    a, b = (next(n for n in names if n.endswith(f"/data/{k}")) for k in (1, 2))
    if damage == "two names swapped":
        (pa, pb), n = (names[a], names[b]), len(a.encode())
        raw[pa : pa + n], raw[pb : pb + n] = raw[pb : pb + n], raw[pa : pa + n]
    else:
        raw[names[a] + len(a) - len("data/1")] ^= 0x10
    file.write_bytes(raw)
    for args in (["verify", str(file.parent)], ["merge", "--local_dir", str(file.parent),
                 "--target_dir", str(tmp_path / "out")]):  # fmt: skip
        done = _run(*args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert "in its local header" in done.stdout + done.stderr, (args, done)
        assert str(file) in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
