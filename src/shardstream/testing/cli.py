"""``shardstream ...`` for tests: in a child process as a user runs it (``run_cli``,
``cli_stdout``), or in this one (``main_stdout``: the same ``cli.main``, without the start of
an interpreter and its imports, seconds a call)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys


def run_cli(*argv: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the CLI with ``argv`` (each turned into a string) in this interpreter; stdout and
    stderr captured as text, undecodable bytes escaped."""
    return subprocess.run(
        [sys.executable, "-m", "shardstream", *map(str, argv)],
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=timeout,
    )


def cli_stdout(*argv: object, timeout: float = 300) -> str:
    """``run_cli``'s stdout, once it exited 0 (else an AssertionError with its output)."""
    done = run_cli(*argv, timeout=timeout)
    assert done.returncode == 0, (
        f"shardstream {argv}: exit {done.returncode}\n{done.stdout}{done.stderr}"
    )
    return done.stdout


def main_stdout(*argv: object) -> str:
    """What ``shardstream argv`` prints on stdout, run by ``cli.main`` in this process, once
    it returned 0 (else an AssertionError with its output)."""
    from ..cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    assert code == 0, f"shardstream {argv}: exit {code}\n{out.getvalue()}{err.getvalue()}"
    return out.getvalue()
