"""Hostile pickles in verl ``.pt`` files and DCP ``.metadata``: each ends in a prompt one-line
``shardstream <cmd>: error:`` naming the file, with nothing constructed that reaches the network.

Every case runs the CLI (or a loader) in a child process under a wall-clock guard and an address
space limit: a regression shows up as a hang, a MemoryError or a traceback, never as a slow
pass. The guards are generous (a minute; 2 GiB beyond the imports); no duration is asserted.
"""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

GUARD_S = 60
EXTRA_ADDRESS_SPACE = 2 << 30  # beyond what the imports take

MODEL = "model_world_size_1_rank_0.pt"


# --- building pickles from opcodes ----------------------------------------------------------


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def _doubling(levels: int, container: bytes) -> bytes:
    """Push one object built of ``levels`` nested ``container``s (b"]" lists, b")" tuples),
    each holding the previous one twice: a few bytes per level, 2**levels objects expanded.
    Tuples: the deepest one; lists: a tuple of them all. Memo entry 0: the deepest. Only
    opcodes torch's own weights-only unpickler runs (no POP), so either loader gets that far."""
    if container == b")":
        return b")" + _put(0) + (_get(0) + b"\x86" + _put(0)) * levels
    return b"()" + _put(0) + (b"](" + _get(0) + _get(0) + b"e" + _put(0)) * levels + b"t"


def _dict_pickle(*entries: bytes) -> bytes:
    """``{...}``: each entry pushes a key and a value."""
    return b"\x80\x02}" + _put(1) + b"(" + b"".join(entries) + b"u."


def _torch_zip(pickled: bytes) -> bytes:
    """A torch archive (as ``torch.save`` writes one) whose data.pkl is ``pickled``."""
    buf = io.BytesIO()
    torch.save({}, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src:
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                data = src.read(info)
                if info.filename.endswith("/data.pkl"):
                    data = pickled
                dst.writestr(info.filename, data)
    return out.getvalue()


def _verl_dir(tmp_path: Path, pickled: bytes) -> Path:
    actor = tmp_path / "actor"
    actor.mkdir()
    (actor / MODEL).write_bytes(_torch_zip(pickled))
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    return actor


def _dcp_dir(tmp_path: Path, pickled: bytes) -> Path:
    ckpt = tmp_path / "dcp"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickled)
    (ckpt / "__0_0.distcp").write_bytes(b"")
    return ckpt


# A DeviceMesh built by calling its constructor: torch's own class would join a process group.
_MESH_CALL = _global("torch.distributed.device_mesh", "DeviceMesh") + (
    _str("cpu") + b"](K\x00K\x01e" + b"\x86R"
)


# --- running the CLI in a guarded child -----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs argv[1] (a script, or "-m shardstream") with its address space capped at what the
# imports took plus EXTRA: torch's builds differ by gigabytes in what they map.
_GUARDED = """
import os, resource, runpy, sys
import torch, shardstream.cli, shardstream.formats.dcp, shardstream.formats.verl
status = open("/proc/self/status").read()
size = int(status.split("VmSize:")[1].split()[0]) * 1024 + int(os.environ["GUARD_EXTRA"])
resource.setrlimit(resource.RLIMIT_AS, (size, size))
if sys.argv[1] == "-m":
    sys.argv = ["shardstream", *sys.argv[3:]]
    shardstream.cli.console_main()
else:
    sys.argv = sys.argv[1:]
    exec(compile(sys.argv[0], "<script>", "exec"), {"__name__": "__main__"})
"""


def _run(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``args`` after the interpreter, in a child under the guards."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "GUARD_EXTRA": str(EXTRA_ADDRESS_SPACE)}
    try:
        return subprocess.run(
            [sys.executable, "-c", _GUARDED, *args],
            capture_output=True,
            text=True,
            timeout=GUARD_S,
            env={**env, **(env_extra or {})},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[-1]}: no answer within {GUARD_S} s (a hang)")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return _run(["-m", "shardstream", *args], env)


def _assert_one_line_error(proc: subprocess.CompletedProcess, command: str, path: Path) -> str:
    """One line naming ``path``: ``shardstream <command>: error: ...``, or for verify (which
    reports what it finds, one problem a line) the problem."""
    output = proc.stderr + proc.stdout
    lines = output.strip().splitlines()
    assert proc.returncode == 1, output[-2000:]
    assert len(lines) == 1 and "Traceback" not in output, output[-2000:]
    if command != "verify":
        assert lines[0].startswith(f"shardstream {command}: error: "), lines[0]
    assert str(path) in lines[0], lines[0]
    return lines[0]


def _torchrun_env() -> dict:
    """What torchrun exports: a real DeviceMesh would wait here for a second rank."""
    port = str(_free_port())
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "2"}


# --- 1. data never starts network activity --------------------------------------------------


def test_device_mesh_the_stand_ins_refuse_is_an_error_not_a_rendezvous(tmp_path):
    """A mesh whose BUILD state the stand-ins refuse once made the loader retry with torch's
    classes, whose DeviceMesh joined a process group: inspect hung in the rendezvous."""
    pickled = _dict_pickle(_str("w") + _MESH_CALL + b"K\x05b")
    actor = _verl_dir(tmp_path, pickled)
    proc = _cli("inspect", str(actor), env=_torchrun_env())
    _assert_one_line_error(proc, "inspect", actor / MODEL)


_LOAD_AFTER_DTENSOR = """
import sys
import torch.distributed.tensor  # torch's DTensor classes are loaded (as in restore())
from shardstream.errors import ShardstreamError
from shardstream.formats.torch_pt import load_layout
try:
    state = load_layout(sys.argv[1])
except ShardstreamError as exc:
    print(exc)
    sys.exit(1)
print(sorted((k, type(v).__module__) for k, v in state.items()))
"""


def test_device_mesh_with_torch_distributed_tensor_loaded(tmp_path):
    """With torch.distributed.tensor imported, torch's classes were the only path; the
    stand-ins are now, and a constructed mesh stays a record."""
    actor = _verl_dir(tmp_path, _dict_pickle(_str("w") + _MESH_CALL))
    proc = _run([_LOAD_AFTER_DTENSOR, str(actor / MODEL)], _torchrun_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shardstream.formats.torch_pt" in proc.stdout, proc.stdout
    proc = _cli("inspect", str(actor), env=_torchrun_env())
    line = _assert_one_line_error(proc, "inspect", actor / MODEL)
    assert "not a tensor" in line


def test_stand_ins_read_real_dtensors_with_torchs_classes_loaded(tmp_path):
    """A DTensor that FSDP2 saved reads the same with torch.distributed.tensor imported: its
    placements and mesh come from the stand-ins."""
    script = f"""
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{_free_port()}", RANK="0",
                  WORLD_SIZE="1")
import torch, torch.distributed as dist
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
torch.save({{"w": distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])}}, sys.argv[1])
dist.destroy_process_group()
from shardstream.formats.torch_pt import DistributedTensor, load_layout
value = load_layout(sys.argv[1])["w"]
assert isinstance(value, DistributedTensor), value
print(value.shape, [repr(p) for p in value.placements], value.mesh.shape, value.mesh.dim_names)
"""
    proc = _run([script, str(tmp_path / "w.pt")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == "(4, 6) ['Shard(dim=1)'] (1,) ('fsdp',)".split()


# --- 2. tiny pickles, exponential work ------------------------------------------------------


def test_pt_lists_doubling_per_level(tmp_path):
    """~400 bytes of lists, each holding the previous one twice: 2**40 objects expanded."""
    actor = _verl_dir(tmp_path, _dict_pickle(_str("w") + _doubling(40, b"]")))
    line = _assert_one_line_error(_cli("inspect", str(actor)), "inspect", actor / MODEL)
    assert "refused to unpickle" in line


def test_pt_tuple_keys_doubling_per_level(tmp_path):
    """A dict key of tuples doubling per level: hashing it alone is 2**40 steps."""
    actor = _verl_dir(tmp_path, _dict_pickle(_doubling(40, b")") + b"N"))
    line = _assert_one_line_error(_cli("inspect", str(actor)), "inspect", actor / MODEL)
    assert "refused to unpickle" in line


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_dcp_metadata_tuple_keys_doubling_per_level(tmp_path, command):
    """The same key in DCP's .metadata: it was hashed inside the C unpickler, for minutes,
    where Ctrl-C does not reach."""
    ckpt = _dcp_dir(tmp_path, _dict_pickle(_doubling(40, b")") + b"N"))
    args = [command, str(ckpt)] + (["--quiet"] if command == "verify" else [])
    line = _assert_one_line_error(_cli(*args), command, ckpt / ".metadata")
    assert "refused to unpickle" in line


def test_dcp_metadata_lists_doubling_per_level(tmp_path):
    metadata = (
        b"\x80\x02"
        + _global("torch.distributed.checkpoint.metadata", "Metadata")
        + b")\x81"
        + b"}("
        + _str("state_dict_metadata")
        + _doubling(40, b"]")
        + b"ub."
    )
    ckpt = _dcp_dir(tmp_path, metadata)
    line = _assert_one_line_error(_cli("inspect", str(ckpt)), "inspect", ckpt / ".metadata")
    assert "refused to unpickle" in line


def test_deep_tuple_nesting_is_refused(tmp_path):
    """Tuples nested 100000 deep: hashing or printing one recurses in C."""
    nested = b")" + b"\x85" * 100_000
    actor = _verl_dir(tmp_path, _dict_pickle(nested + b"N"))
    line = _assert_one_line_error(_cli("inspect", str(actor)), "inspect", actor / MODEL)
    assert "levels deep" in line


# --- 3. an OrderedDict that BUILD gives unexpected state ------------------------------------


_ODICT = _global("collections", "OrderedDict") + b")R"
# Attributes that would hide the dict's methods.
_HIDING = b"}(" + _str("items") + b"N" + _str("update") + b"Nub"


@pytest.mark.parametrize("command", ["inspect", "verify", "merge"])
def test_pt_ordered_dict_with_unexpected_state(tmp_path, command):
    actor = _verl_dir(tmp_path, b"\x80\x02" + _ODICT + _HIDING + b".")
    args = [command, str(actor)] + (["--quiet"] if command == "verify" else [])
    if command == "merge":
        args = [command, "--local_dir", str(actor), "--target_dir", str(tmp_path / "out")]
    line = _assert_one_line_error(_cli(*args), command, actor / MODEL)
    assert "OrderedDict with unexpected state" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["inspect", "verify", "merge"])
def test_dcp_metadata_ordered_dict_with_unexpected_state(tmp_path, command):
    metadata = (
        b"\x80\x02"
        + _global("torch.distributed.checkpoint.metadata", "Metadata")
        + b")\x81}("
        + _str("state_dict_metadata")
        + _ODICT
        + _HIDING
        + b"ub."
    )
    ckpt = _dcp_dir(tmp_path, metadata)
    args = [command, str(ckpt)] + (["--quiet"] if command == "verify" else [])
    if command == "merge":
        args = [command, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "out")]
    line = _assert_one_line_error(_cli(*args), command, ckpt / ".metadata")
    assert "OrderedDict with unexpected state" in line


def test_state_dict_metadata_still_loads(tmp_path):
    """torch's own state dicts carry ``_metadata`` through BUILD: still read."""
    state = torch.nn.Linear(2, 3).state_dict()
    assert hasattr(state, "_metadata")
    torch.save(state, tmp_path / "m.pt")
    from shardstream.formats.torch_pt import load_layout

    loaded = load_layout(str(tmp_path / "m.pt"))
    assert sorted(loaded) == ["bias", "weight"]
    assert loaded["weight"].shape == (3, 2) and loaded["weight"].device.type == "meta"
