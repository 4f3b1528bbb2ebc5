"""Shared machinery of the reliability trials: the fork server client, checks, figures."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOAK = os.environ.get("SHARDSTREAM_SOAK", "") not in ("", "0")
LOG_ENV = "SHARDSTREAM_RELIABILITY_LOG"
HERE = Path(__file__).resolve().parent


def put_in_place_of(path: Path, kind: str, outside: str | Path | None = None) -> None:
    """Something other than what ``path`` was, where it was (its old entry gone): a "broken
    link", a "symlink loop", a "FIFO", a "directory", a "file", or a link to ``outside``."""
    if kind == "broken link":
        os.symlink("gone", path)
    elif kind == "symlink loop":
        os.symlink(path.name, path)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "file":
        path.write_text("{}")
    else:
        os.symlink(outside, path)


def trials(quick: int, soak: int) -> int:
    """How many trials: ``quick`` in ``make test``, ``soak`` in ``make soak``."""
    override = os.environ.get("SHARDSTREAM_TRIALS_SCALE")
    count = soak if SOAK else quick
    return max(1, int(count * float(override))) if override else count


# Invariant checks that failed, by test, not yet reported by record(): see trial().
_VIOLATIONS: dict[str, list[str]] = {}


class ViolationsFound(AssertionError):
    """record() found failed invariant checks: they are in the log, and the test fails."""


def current_test() -> str:
    """The running test's node id (pytest sets ``PYTEST_CURRENT_TEST``)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]


def violation(message: str) -> None:
    """Count one invariant check that failed in a trial of the running test."""
    _VIOLATIONS.setdefault(current_test(), []).append(message)


@contextlib.contextmanager
def trial(label: str):
    """One trial: an ``AssertionError`` inside it (an invariant check that failed) is counted
    as a violation and the test goes on with its next trial; ``record()`` then reports the count
    and fails the test. Anything else (the rig broke) propagates at once."""
    try:
        yield
    except AssertionError as exc:
        violation(f"{label}: {exc}")


def violations_so_far() -> int:
    return len(_VIOLATIONS.get(current_test(), []))


def record(name: str, **figures) -> None:
    """Append one test's figures to the log ``bench/soak.py`` turns into docs/reliability.md.

    ``violations`` is not a figure a test passes: it is the number of checks that failed in the
    running test's ``trial()``s (or were counted with ``violation()``). If there were any, they
    are logged and the test fails here.
    """
    if "violations" in figures:
        raise TypeError("record(): violations are counted by trial()/violation(), not passed")
    test = current_test()
    found = _VIOLATIONS.pop(test, [])
    path = os.environ.get(LOG_ENV)
    if path:
        doc = {"name": name, "soak": SOAK, "time": time.time(), "test": test, **figures}
        doc["violations"] = len(found)
        if found:
            doc["violation_messages"] = [m[:500] for m in found[:10]]
        with open(path, "a") as f:
            f.write(json.dumps(doc, sort_keys=True, default=str) + "\n")
    if found:
        raise ViolationsFound(
            f"{name}: {len(found)} invariant violation(s):\n" + "\n".join(found[:10])
        )


def record_failure(test: str, kind: str, count: int, message: str) -> None:
    """A test that failed outside ``trial()`` (an assertion that stopped it, an error): logged
    as ``count`` violations of that test (conftest.py calls this from pytest's report hook)."""
    _VIOLATIONS.pop(test, None)
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    doc = {
        "name": f"failed: {test.rsplit('/', 1)[-1]}",
        "soak": SOAK,
        "time": time.time(),
        "test": test,
        "failed": kind,
        "violations": count,
        "violation_messages": [message[:500]],
    }
    with open(path, "a") as f:
        f.write(json.dumps(doc, sort_keys=True, default=str) + "\n")


# --- fork server client -------------------------------------------------------------------------


class ForkServer:
    """One warm interpreter (``forkserver.py``) that forks victim processes on request."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        self.errors = open(self.log_dir / "forkserver.stderr", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "forkserver.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            env=env,
            cwd=str(HERE),
        )
        self._buffer = b""
        # its imports (torch, transformers) take seconds alone, minutes on a crowded machine:
        # the wait is for a server that is gone or stuck, not a measure of speed
        self._read(timeout=900)
        self.live: set[int] = set()
        self.last: list[int] = []
        self.spawns = 0
        self.log_names: dict[int, str] = {}  # pid -> its log (pids are reused over a run)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"fork server exited with {self.proc.returncode} (see {self.log_dir})"
                )
            if left <= 0:
                raise RuntimeError(
                    f"fork server did not answer in {timeout:.0f} s (see {self.log_dir})"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"fork server exited (see {self.log_dir})")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _ask(self, command: dict, timeout: float = 60) -> dict:
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout + 30)

    def spawn(self, job: str, spec: dict, nprocs: int = 1) -> list[int]:
        self.spawns += 1
        command = {"op": "spawn", "job": job, "spec": spec, "nprocs": nprocs}
        command.update(log=str(self.log_dir), seq=self.spawns)
        pids = self._ask(command)["pids"]
        self.live.update(pids)
        self.last = pids
        for rank, pid in enumerate(pids):
            self.log_names[pid] = f"{job}-{rank}-{pid}-{self.spawns}.log"
        return pids

    def log_path(self, pid: int) -> Path:
        """The output of process ``pid`` of the latest spawn that had it."""
        return self.log_dir / self.log_names[pid]

    def wait(self, pids, timeout: float) -> tuple[dict[int, int | None], list[int]]:
        answer = self._ask({"op": "wait", "pids": list(pids), "timeout": timeout}, timeout)
        exited = {int(k): v for k, v in answer["exited"].items()}
        self.live.difference_update(exited)
        return exited, answer["running"]

    def run(self, job: str, spec: dict, nprocs: int = 1, timeout: float = 120) -> list[int]:
        """Spawn and wait for completion; return the exit codes in rank order."""
        pids = self.spawn(job, spec, nprocs)
        exited, running = self.wait(pids, timeout)
        if running:
            kill(running)
            exited.update(self.wait(running, 30)[0])
            raise AssertionError(f"{job} did not finish in {timeout} s; logs in {self.log_dir}")
        return [exited[p] for p in pids]

    def kill_all(self) -> None:
        if self.live:
            kill(self.live)
            self.wait(list(self.live), 30)

    def close(self) -> None:
        try:
            self.kill_all()
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()
        self.errors.close()

    def logs(self, pids=None) -> str:
        """The tail of each process's output (default: the last ones spawned)."""
        out = []
        for pid in self.last if pids is None else pids:
            path = self.log_path(pid)
            if path.exists():
                text = path.read_text(errors="replace")
                out.append(f"--- {path.name} ---\n{text[-4000:]}")
        return "\n".join(out)


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(path: Path, server: ForkServer, pids, timeout: float = 60) -> bool:
    """Wait until ``path`` exists; False if every process in ``pids`` exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        exited, running = server.wait(pids, 0)
        if exited and any(code != 0 for code in exited.values()):
            raise AssertionError(f"a process failed before {path.name}:\n{server.logs(pids)}")
        if not running:
            return path.exists()
        time.sleep(0.01)
    raise AssertionError(f"{path} did not appear within {timeout} s:\n{server.logs(pids)}")


# --- state comparison ---------------------------------------------------------------------------


def state_differences(actual, expected, where: str = "") -> list[str]:
    """Bit-for-bit comparison of nested state (tensors compared by dtype, shape and bytes)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: expected a tensor, got {type(actual).__name__}"]
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return [f"{where}: {actual.dtype}{list(actual.shape)} != {expected.dtype}"]
        a = actual.detach().contiguous().view(-1).view(torch.uint8)
        b = expected.detach().contiguous().view(-1).view(torch.uint8)
        return [] if torch.equal(a, b) else [f"{where}: tensor bytes differ"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            keys = set(actual) ^ set(expected) if isinstance(actual, dict) else "?"
            return [f"{where}: keys differ ({sorted(map(str, keys))[:4]})"]
        out = []
        for key in expected:
            out += state_differences(actual[key], expected[key], f"{where}.{key}")
        return out
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [f"{where}: sequence differs"]
        out = []
        for i, (a, b) in enumerate(zip(actual, expected)):
            out += state_differences(a, b, f"{where}[{i}]")
        return out
    return [] if actual == expected else [f"{where}: {actual!r} != {expected!r}"]


def full_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"model": dict(model.state_dict()), "optim": get_optimizer_state_dict(model, optimizer)}


# --- checks after a crash -----------------------------------------------------------------------


def classify_debris(names) -> Counter:
    kinds: Counter = Counter()
    for name in names:
        if name.endswith(".owner"):
            kinds["writer's claim (owner file)"] += 1
        elif name.endswith(".old"):
            kinds["overwrite (old dir)"] += 1
        elif name.startswith("latest_checkpointed_iteration.txt"):
            kinds["latest pointer (tmp file)"] += 1
        else:
            kinds["staged or discarded step (tmp dir)"] += 1
    return kinds


def check_root_after_crash(
    root: Path,
    side: Path,
    durable: int | None,
    keep_last: int,
    hidden: int = 40,
    depth: int = 1,
) -> dict:
    """Every invariant a killed save must keep; returns what was found (for the figures).

    ``durable``: the newest step whose ``save()`` had returned before the kill (None: none).
    """
    from shardstream.commands.verify import verify
    from shardstream.manager import (
        LATEST_FILE,
        CheckpointConfig,
        CheckpointManager,
        committed_steps,
        read_latest,
    )
    from shardstream.storage.commit import TMP_MARK

    from .forkserver import build_model, build_optimizer

    if not root.exists():  # killed before the first manager created the directory
        assert durable is None, f"save() of step {durable} had returned, but {root} is gone"
        return {"debris": [], "steps": [], "pointer": None, "restored": None}
    debris = sorted(e.name for e in root.iterdir() if TMP_MARK in e.name)
    steps = committed_steps(root)
    pointer = read_latest(root)
    info = {"debris": debris, "steps": steps, "pointer": pointer}
    if (root / LATEST_FILE).exists():
        assert pointer in steps, f"latest names step {pointer}, not a committed one ({steps})"
    if durable is not None:
        assert pointer is not None and pointer >= durable, (
            f"save() of step {durable} had returned, but latest is {pointer} (steps {steps})"
        )
    assert len(steps) <= keep_last + 1, f"retention kept {steps} (keep_last={keep_last})"
    if pointer is not None:
        info["ahead_of_pointer"] = [s for s in steps if s > pointer]
    report = verify(root)
    if steps or pointer is not None:
        assert report.ok, "verify failed after a crash:\n" + "\n".join(
            p.line() for p in report.problems
        )
    else:  # killed before the first commit: nothing to verify, and verify must say so
        assert report.kind == "unknown" and len(report.problems) == 1, report.problems
    if pointer is not None:
        step_report = verify(root / f"global_step_{pointer}")
        assert step_report.ok, "\n".join(p.line() for p in step_report.problems)

    model = build_model(0, hidden, depth)
    optimizer = build_optimizer(model)
    config = CheckpointConfig(directory=str(root), save_interval=1, keep_last=keep_last)
    with CheckpointManager(config, model=model, optimizer=optimizer) as manager:
        left = sorted(e.name for e in root.iterdir() if TMP_MARK in e.name)
        assert not left, f"manager start left partial directories behind: {left}"
        restored = manager.restore()
        if steps:
            assert restored is not None, "committed steps exist but restore() found none"
            step, extra = restored
            assert step == manager.latest_step()
            assert pointer is None or step == pointer
            assert extra.get("step") == step, f"extra {extra} restored for step {step}"
            expected = torch.load(
                side / extra["run"] / f"step_{step}.pt", weights_only=True, map_location="cpu"
            )
            diffs = state_differences(full_state(model, optimizer), expected, f"step {step}")
            assert not diffs, "restore is not bit-for-bit:\n" + "\n".join(diffs[:10])
            info["restored"] = step
        else:
            assert restored is None
            info["restored"] = None
    return info


def durable_step(side_run: Path) -> int | None:
    path = side_run / "saved"
    if not path.exists():
        return None
    done = [int(x) for x in path.read_text().split() if x.isdigit()]
    return max(done) if done else None


def tree_contents(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes, a link's target, else its kind (a FIFO is
    never opened). Equal before and after: nothing under ``root`` changed."""
    out: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            out[str(path)] = ("link", os.readlink(path))
        elif stat.S_ISREG(mode):
            out[str(path)] = path.read_bytes()
        else:
            out[str(path)] = stat.S_IFMT(mode)
    return out


def local_state(model, optimizer) -> dict:
    """This rank's shards of the parameters, optimizer state and hyperparameters, cloned (no
    collective): what a refused restore must leave as it was."""
    from shardstream.testing.compare import clone_nested

    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {n: clone_nested(p, local=True) for n, p in model.named_parameters()},
        "state": {
            names[id(p)]: clone_nested(dict(s), local=True) for p, s in optimizer.state.items()
        },
        "groups": [
            clone_nested({k: v for k, v in g.items() if k != "params"}, local=True)
            for g in optimizer.param_groups
        ],
    }


def same_nested(a, b) -> bool:
    """``a`` and ``b`` equal all the way down, tensors by dtype, shape and value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b))
    return a == b


def attempt_restore(report: dict, restore: Callable[[], Any]) -> None:
    """Run ``restore`` for a rank's ``report``: ``restored`` (what it returned) and ``ok``, or
    ``error`` (``error_report``). DCP's CheckpointException is a BaseException: any failure
    but an interrupt is reported, not raised."""
    try:
        report["restored"] = restore()
        report["ok"] = True
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        report["error"] = error_report(exc)


def error_report(exc: BaseException) -> dict:
    """What a rank reports of the exception it caught (call inside the ``except``)."""
    import traceback

    from shardstream.errors import ShardstreamError

    return {
        "type": type(exc).__name__,
        "shardstream": isinstance(exc, ShardstreamError),
        "message": str(exc),
        "traceback": traceback.format_exc(),
    }


def assert_refused_everywhere(reports: list[dict], *needles: str, untouched: bool = True) -> None:
    """Every rank's report (``ok``, ``error`` from ``error_report``, ``unchanged``) says it
    raised a one-line ShardstreamError naming every needle; ``untouched``: with its live
    model and optimizer as they were."""
    for report in reports:
        assert not report["ok"], f"rank {report['rank']} restored: {report.get('restored')}"
        error = report["error"]
        where = f"rank {report['rank']}: {error['type']}: {error['message']}"
        assert error["shardstream"], where + "\n" + error["traceback"]
        message = error["message"]
        assert "Traceback" not in message and "\n" not in message.strip(), where
        for needle in needles:
            assert needle in message, f"{needle!r} not named; {where}"
        if untouched:
            assert report["unchanged"], f"rank {report['rank']}: failed restore changed live state"


# --- cases that share one job of ranks ----------------------------------------------------------


def case_after_case(rank: int, world: int, case: Callable, specs: list[dict]) -> list[dict]:
    """Run on each rank of a job: ``case(rank, world, spec)`` for each spec in turn, so the
    ranks start once and their caches are warm after the first. This rank's report of each,
    or, where ``case`` raised, ``{"rank", "ok": False, "crashed": traceback}``."""
    import traceback

    reports = []
    for spec in specs:
        try:
            reports.append(case(rank, world, spec))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - the case's test reports it (DCP's are Base)
            reports.append({"rank": rank, "ok": False, "crashed": traceback.format_exc()})
    return reports


def jobs_by_world(case: Callable, cases: dict, timeout: Callable[[int], float]) -> dict:
    """``cases`` (key -> (world size, spec)) run as one job of ranks per world size
    (``case_after_case``; ``timeout(cases in the job)``, a hang guard): key -> every rank's
    report, or the text of what failed its job (a crash or a hang)."""
    from shardstream.testing.distributed import run

    out: dict = {}
    for world in sorted({world for world, _ in cases.values()}):
        keys = [key for key, (w, _) in cases.items() if w == world]
        specs = [cases[key][1] for key in keys]
        try:
            ranks = run(case_after_case, world, case, specs, timeout=timeout(len(specs)))
        except Exception as exc:  # noqa: BLE001 - each case's test reports it
            failed = f"the job of restores failed (a crash or a hang): {type(exc).__name__}: {exc}"
            out.update(dict.fromkeys(keys, failed))
            continue
        for i, key in enumerate(keys):
            out[key] = [rank[i] for rank in ranks]
    return out


def job_reports(outcomes: dict, *key) -> list[dict]:
    """Every rank's report of the case ``key`` from ``outcomes`` (key -> the reports, or the
    text of what failed the case's job); the test fails if its job or a rank failed."""
    import pytest

    reports = outcomes[key]
    if isinstance(reports, str):
        text = reports if len(reports) <= 12000 else f"{reports[:2000]}\n...\n{reports[-10000:]}"
        pytest.fail(text)
    for report in reports:
        if "crashed" in report:
            pytest.fail(f"rank {report['rank']} raised:\n{report['crashed']}")
    return reports
