"""Reliability trials: kill -9, full disks, read-only and forbidden directories, corruption,
hostile and fuzzed inputs, concurrent managers and readers.

``make test`` runs every test with small trial counts; ``make soak`` (``bench/soak.py``) sets
``SHARDSTREAM_SOAK=1`` for the large counts (``harness.trials``) and collects each test's figures
into docs/reliability.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from . import harness
from .harness import ForkServer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Violations are counted, not assumed: a test that failed outside ``trial()`` is logged as
    violations (one per exception hypothesis or an exception group reports), and one whose
    ``trial()``s failed but which never reached ``record()`` fails here."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    pending = harness._VIOLATIONS.pop(item.nodeid, [])
    if report.failed and call.excinfo is not None:
        exc = call.excinfo.value
        if isinstance(exc, harness.ViolationsFound):
            return  # record() logged them
        inner = getattr(exc, "exceptions", None)  # an exception group (hypothesis's too)
        group = list(inner) if isinstance(inner, (list, tuple)) and inner else [exc]
        kind = "violation" if isinstance(group[0], AssertionError) else type(group[0]).__name__
        message = f"{type(group[0]).__name__}: {str(group[0]).strip()[:400]}"
        harness.record_failure(item.nodeid, kind, len(pending) + len(group), message)
    elif pending:
        harness.record_failure(item.nodeid, "violation", len(pending), pending[0])
        report.outcome = "failed"
        report.longrepr = f"{len(pending)} invariant violation(s) never recorded:\n" + "\n".join(
            pending[:10]
        )


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory):
    """A warm interpreter that forks trainer, CLI and lock-holder processes on request."""
    server = ForkServer(tmp_path_factory.mktemp("forkserver-logs"))
    try:
        yield server
    finally:
        server.close()


@dataclass(frozen=True)
class SavedRun:
    root: Path  # a manager root: global_step_2, global_step_3 and the latest pointer
    step: Path  # global_step_3: 2 ranks' model, optimizer and extra state
    expected: Path  # the full state of step 3, written by the trainer before the save
    hf: Path  # step 3 merged into one model.safetensors (+ config.json)
    hf_sharded: Path  # the same split into several files and an index


@pytest.fixture(scope="session")
def saved_run(forkserver, tmp_path_factory) -> SavedRun:
    """A real 2-rank FSDP2 run saved by CheckpointManager, and its merged HF outputs.

    Read-only for tests: copy what you mean to damage.
    """
    import json

    from shardstream.commands.merge import merge

    base = tmp_path_factory.mktemp("saved-run")
    spec = {
        "world": 2,
        "init": str(base / "gloo"),
        "root": str(base / "root"),
        "side": str(base / "side"),
        "run": "run",
        "steps": 3,
        "keep_last": 2,
    }
    assert forkserver.run("train", spec, nprocs=2) == [0, 0], forkserver.logs()
    step = base / "root" / "global_step_3"
    config = {"architectures": ["TinyMLP"], "model_type": "tiny-mlp", "torch_dtype": "float32"}
    (base / "config").mkdir()
    (base / "config" / "config.json").write_text(json.dumps(config))
    merge(step, base / "hf", hf_model_path=base / "config")
    merge(step, base / "hf-sharded", hf_model_path=base / "config", max_shard_size="2KB")
    return SavedRun(
        base / "root", step, base / "side" / "run" / "step_3.pt", base / "hf", base / "hf-sharded"
    )
