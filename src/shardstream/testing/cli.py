"""``python -m shardstream ...`` in a child process, as a user runs it (tests)."""

from __future__ import annotations

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
