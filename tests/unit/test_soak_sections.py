"""`make soak` reports every reliability test file in a section of docs/reliability.md, and
refuses to run when one is in none: a new file must be given a section when it is added."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_reliability_test_file_is_in_a_soak_section(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # soak.py imports the bench harness
    spec = importlib.util.spec_from_file_location("soak_sections", BENCH / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    assert soak.unsectioned_test_files() == []


def test_no_reliability_test_asks_for_caplog():
    """`make soak` runs pytest with ``-p no:logging``, which takes the caplog fixture away: a
    reliability test that asked for it errored there, though it passed under `make test`."""
    import re

    tests = Path(__file__).resolve().parents[1] / "reliability"
    asking = [p.name for p in sorted(tests.glob("*.py")) if re.search(r"\bcaplog\b", p.read_text())]
    assert asking == []
