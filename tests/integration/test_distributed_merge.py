"""merge --distributed under torchrun writes the same bytes as a single-process merge."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest

from shardstream.formats.source import open_checkpoint
from shardstream.testing.distributed import run
from shardstream.testing.verl_checkpoint import VerlFixture, write_verl_checkpoint

from . import workers

# ~24 MB of bf16 output: several 4 MiB chunk ranges, so ranks split single files too.
BIGGER = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "vocab_size": 20000,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-big")
    fx = VerlFixture(
        world_size=2,
        train_steps=0,
        write_optimizer=False,
        write_reference=False,
        config_overrides=BIGGER,
    )
    return write_verl_checkpoint(root, fx)


def run_merge(args: list[str], nproc: int | None) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--standalone",
            "-m",
            "shardstream",
            "merge",
            *args,
            "--distributed",
        ]
    else:
        cmd = [sys.executable, "-m", "shardstream", "merge", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def same_tree(a, b) -> bool:
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


@pytest.mark.parametrize("max_shard", ["5GB", "9MB"], ids=["one-file", "split-files"])
def test_distributed_merge_is_byte_identical(actor, tmp_path, max_shard):
    single, distributed = tmp_path / "single", tmp_path / "distributed"
    common = ["--local_dir", str(actor), "--max-shard-size", max_shard]
    said = json.loads(run_merge([*common, "--target_dir", str(single), "--json"], None))
    out = run_merge([*common, "--target_dir", str(distributed), "--json"], 3)
    assert same_tree(single, distributed)
    # One answer, from the process that wrote the index, naming every byte written.
    (line,) = out.splitlines()
    answer = json.loads(line)
    assert answer["files"] == said["files"] and answer["tensors"] == said["tensors"]
    assert answer["bytes_written"] == said["bytes_written"] > 0
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_distributed_without_torchrun_is_a_usage_error(actor, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardstream",
            "merge",
            "--local_dir",
            str(actor),
            "--target_dir",
            str(tmp_path / "t"),
            "--distributed_merge",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "torchrun" in done.stderr
    assert not (tmp_path / "t").exists()


@pytest.fixture(scope="module")
def actor_ws4(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl-ws4")
    fx = VerlFixture(world_size=4, train_steps=0, write_optimizer=False, write_reference=False)
    return write_verl_checkpoint(root, fx)


@pytest.fixture(scope="module")
def native_ws4(tmp_path_factory):
    """shardstream's own format, saved by 4 FSDP2 ranks (model only)."""
    root = tmp_path_factory.mktemp("native-ws4")
    run(workers.save_run, 4, str(root), "fsdp", 1, 0, ("model",))
    return root / "global_step_1"


@pytest.mark.parametrize("source", ["verl", "native"])
def test_processes_share_the_reading_of_rank_file_headers(actor_ws4, native_ws4, source):
    path = actor_ws4 if source == "verl" else native_ws4
    expected = workers.opened(open_checkpoint(path, model_only=True))
    results = run(workers.shared_open_run, 3, str(path))
    names = {"verl": "model_world_size_4_rank_{}.pt", "native": "rank-{:05d}.safetensors"}
    name = names[source].format
    # 4 rank files over 3 processes: files 0 and 3 on the first, then one each
    assert [r["parsed"] for r in results] == [[name(0), name(3)], [name(1)], [name(2)]]
    for result in results:
        for key in ("tensors", "replicas", "digests"):
            assert result[key] == expected[key], key


@pytest.mark.parametrize("source", ["verl", "native"])
def test_a_bad_rank_file_fails_every_process_alike(actor_ws4, native_ws4, source, tmp_path):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(actor_ws4 if source == "verl" else native_ws4, path)
    bad = path / ("model_world_size_4_rank_0.pt" if source == "verl" else "rank-00000.safetensors")
    data = bytearray(bad.read_bytes())
    if source == "verl":
        del data[len(data) // 2 :]  # truncated
    else:
        data[20] ^= 0xFF  # inside the header, which the manifest's digest covers
    bad.write_bytes(bytes(data))
    results = run(workers.shared_open_run, 2, str(path))
    errors = {r["error"] for r in results}
    assert len(errors) == 1
    (error,) = errors
    assert error.split(":")[0] in ("CheckpointFormatError", "ChecksumMismatchError")
    assert str(bad) in error
    assert [len(r["parsed"]) for r in results] == [1, 1]  # none goes past the failed round


def test_distributed_merge_of_shardstream_format_is_byte_identical(native_ws4, tmp_path):
    single, distributed = tmp_path / "single", tmp_path / "distributed"
    common = ["--local_dir", str(native_ws4), "--quiet"]
    run_merge([*common, "--target_dir", str(single)], None)
    run_merge([*common, "--target_dir", str(distributed)], 2)
    assert same_tree(single, distributed)


def test_split_tensors_records_are_checked_once(tmp_path):
    """Shard(1) tensors: every process writing part of one reads part of each of its records.
    Their CRC-32s are checked once, dealt out over the processes, not once per process; the
    output is the single-process merge's, and a damaged record fails every process."""
    import shutil

    from shardstream.formats.torch_pt import zip_records

    fx = VerlFixture(
        world_size=2,
        shard_dim=1,
        train_steps=0,
        write_optimizer=False,
        write_reference=False,
        config_overrides=BIGGER,
    )
    actor = write_verl_checkpoint(tmp_path / "shard1", fx)
    single = tmp_path / "single"
    run_merge(["--local_dir", str(actor), "--target_dir", str(single), "--quiet"], None)
    results = run(workers.merge_hashing_run, 2, str(actor), str(tmp_path / "split"))
    assert [r["error"] for r in results] == [None, None]
    assert same_tree(single, tmp_path / "split")
    files = sorted(actor.glob("model_world_size_*_rank_*.pt"))
    stored = sum(r.end - r.start for f in files for r in zip_records(str(f)))
    hashed = [r["hashed"] for r in results]
    assert min(hashed) > 0, hashed  # both processes took a share of the checks
    assert sum(hashed) <= 1.05 * stored, (hashed, stored)

    victim = files[1]
    record = max(zip_records(str(victim)), key=lambda r: r.end - r.start)
    data = bytearray(victim.read_bytes())
    data[(record.start + record.end) // 2] ^= 0x04
    damaged = tmp_path / "damaged"
    shutil.copytree(actor, damaged)
    (damaged / victim.name).write_bytes(bytes(data))
    results = run(workers.merge_hashing_run, 2, str(damaged), str(tmp_path / "bad"))
    for result in results:
        assert result["error"] and "checksum mismatch" in result["error"], results
        assert victim.name in result["error"], results
    assert not (tmp_path / "bad").exists()


DIES = """
import os, sys
import shardstream.commands.merge as merge
if os.environ["RANK"] == "1":  # gone once the output is staged, as a killed or crashed rank
    merge.HfModelFiles.plan = lambda *args, **kwargs: os._exit(3)
from shardstream.cli import main
sys.exit(main(sys.argv[1:]))
"""


def merge_under_torchrun(
    script: str, name: str, actor, target, tmp_path
) -> subprocess.CompletedProcess:
    """``merge --distributed`` of ``actor`` into ``target`` by 2 torchrun processes, each
    running the Python ``script`` (which patches shardstream, then runs its CLI)."""
    path = tmp_path / name
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    cmd += [str(path), "merge", "--local_dir", str(actor), "--target_dir", str(target)]
    cmd += ["--distributed", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_a_process_that_dies_leaves_the_others_a_line_not_a_traceback(actor, tmp_path):
    """The survivors printed gloo's "Connection closed by peer" as chained tracebacks (from the
    collective, then from the barrier of leaving the group); under torchrun they are also
    sent SIGTERM. Either way: one line each, no output, nothing staged left behind."""
    target = tmp_path / "merged"
    done = merge_under_torchrun(DIES, "dies.py", actor, target, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    ours = [f for f in frames if any(s in f for s in ("/shardstream/", "distributed_c10d"))]
    ours = [f for f in ours if "/torch/distributed/run.py" not in f and "elastic" not in f]
    assert ours == [], output[-3000:]  # torchrun's own ChildFailedError may follow
    said = [line for line in output.splitlines() if line.startswith("shardstream merge:")]
    assert said and all("lost contact" in s or "terminated" in s for s in said), output[-3000:]
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_a_refusal_on_one_process_is_said_as_the_merges_on_the_others(actor, tmp_path):
    """A head trained apart beside a config.json that ties it, merged by 2 processes: the
    process that checks it refuses, and the other said 'save failed on another rank'."""
    config = json.loads((actor / "huggingface" / "config.json").read_text())
    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    target = tmp_path / "merged"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    cmd += ["-m", "shardstream", "merge", "--local_dir", str(actor), "--target_dir", str(target)]
    cmd += ["--hf_model_path", str(tied), "--distributed", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    said = done.stderr  # (two processes' lines may share one: not told apart by lines)
    assert done.returncode != 0 and said.count("shardstream merge: error: ") == 2, said[-3000:]
    differs = "'lm_head.weight' differs from 'model.embed_tokens.weight'"
    assert said.count(differs) == 2, said[-3000:]
    assert said.count("merge failed on another rank: rank 0: ") == 1, said[-3000:]
    assert not target.exists()


FULL_DISK = """
import errno, os, sys
import shardstream.commands.merge as merge
if os.environ["RANK"] == "0":  # the disk fills as process 0 creates the output files
    def create(self):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))
    merge.HfModelFiles.create = create
from shardstream.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_output_files_that_cannot_be_created_fail_every_process(actor, tmp_path):
    """Process 0 creates the output files; when it could not (a full disk), it went on to
    the next collective while the others waited at a barrier: the merge hung."""
    target = tmp_path / "merged"
    done = merge_under_torchrun(FULL_DISK, "full.py", actor, target, tmp_path)
    said = done.stderr  # (two processes' lines may share one: not told apart by lines)
    assert done.returncode != 0 and said.count("shardstream merge: error: ") == 2, said[-3000:]
    assert said.count("merge failed on another rank: rank 0: ") == 1, said[-3000:]
    assert said.lower().count("no space left on device") >= 2, said[-3000:]
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


GONE_AFTER = """
import os, sys
import shardstream.storage.collectives as coll
if os.environ["RANK"] == "1":  # gone after the last collective, before leaving the group
    coll.leave = lambda failed=False: os._exit(0)
from shardstream.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_process_lost_after_the_output_is_in_place_fails_nothing(actor, tmp_path):
    """Process 0 puts the output in place, then leaves the group at a barrier: a process gone
    by then made it report the merge failed ("lost contact") over a complete output."""
    target = tmp_path / "merged"
    done = merge_under_torchrun(GONE_AFTER, "gone.py", actor, target, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error" not in done.stderr.lower() or "is in place and complete" in done.stderr
    reference = tmp_path / "alone"
    run_merge(["--local_dir", str(actor), "--target_dir", str(reference), "--quiet"], None)
    assert same_tree(target, reference)
