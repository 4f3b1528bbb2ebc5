"""``make soak``: run the reliability trials at soak scale and write docs/reliability.md.

    python bench/soak.py            # make-test counts, then soak counts; writes the doc
    python bench/soak.py --soak-only
    python bench/soak.py --render   # re-render docs/reliability.md from bench/results/soak.json

Each run is ``pytest tests/reliability`` with ``SHARDSTREAM_RELIABILITY_LOG`` pointing at a
JSON-lines file the tests append their figures to (trials run, faults survived, bad inputs
tried, violations), and a JUnit XML report for pass/fail. ``SHARDSTREAM_SOAK=1`` selects the
soak counts. The exit status is pytest's (soak run), so a failing trial fails ``make soak``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from harness import REPO, RESULTS
from harness.machine import cpu_model, git_revision, mem_total_bytes, src_dirty
from harness.render import generated_note, table, write_doc

SOAK_JSON = RESULTS / "soak.json"
DOC = REPO / "docs" / "reliability.md"

# Tests whose failure could mean a lost or wrongly restored checkpoint.
DATA_TESTS = {
    "test_kill",
    "test_disk_full",
    "test_permissions",
    "test_corruption",
    "test_concurrency",
    "test_swap_crash",
    "test_mount_points",
}
# Every tests/reliability/test_*.py is in one section (main() refuses to run otherwise). A
# test file whose tests record no figures counts one trial per test case it ran.
SECTIONS = [
    (
        "verify",
        "1. `shardstream verify`",
        ("test_verify_cli", "test_verify_parts"),
        ("verify:",),
    ),  # fmt: skip
    (
        "kill",
        "2. kill -9, SIGTERM and Ctrl-C during save, merge and the commit swap",
        ("test_kill", "test_swap_crash", "test_interrupts"),
        ("kill -9",),
    ),  # fmt: skip
    ("disk", "3. Disk full", "test_disk_full", ("disk full",)),
    (
        "perm",
        "4. Read-only and forbidden directories",
        ("test_permissions", "test_mount_points"),
        ("read-only", "permission"),
    ),  # fmt: skip
    ("corrupt", "5. Corruption", "test_corruption", ("corruption:",)),
    (
        "hostile",
        "6. Hostile inputs",
        (
            "test_hostile",
            "test_hostile_inputs",
            "test_hostile_pickles",
            "test_hostile_campaign",
            "test_hostile_other_tools",
            "test_hostile_hf_source",
            "test_hostile_hf_torch",
            "test_hostile_layout_plan",
            "test_hostile_restore",
            "test_hostile_optimizer_state",
            "test_hostile_plain_restore",
            "test_hostile_zip_views",
            "test_accelerate_layouts",
        ),
        ("hostile",),
    ),  # fmt: skip
    ("fuzz", "7. Fuzzing the readers", ("test_fuzz", "test_fuzz_structured"), ("fuzz:",)),
    ("conc", "8. Concurrency", "test_concurrency", ("concurrency:",)),
    (
        "formats",
        "9. Older formats and partial reads",
        ("test_format_versions", "test_lazy_open"),
        ("format:",),
    ),  # fmt: skip
]


def unsectioned_test_files() -> list[str]:
    """tests/reliability/test_*.py files that no section reports."""
    known = {f for _, _, file, _ in SECTIONS for f in _files(file)}
    found = sorted(p.stem for p in (REPO / "tests" / "reliability").glob("test_*.py"))
    return [f for f in found if f not in known]


def run_pytest(soak: bool, workdir: Path, extra: list[str]) -> dict:
    log = workdir / f"figures-{'soak' if soak else 'test'}.jsonl"
    junit = workdir / f"junit-{'soak' if soak else 'test'}.xml"
    env = {**os.environ, "SHARDSTREAM_RELIABILITY_LOG": str(log), "PYTHONWARNINGS": "ignore"}
    env.pop("SHARDSTREAM_SOAK", None)
    if soak:
        env["SHARDSTREAM_SOAK"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging"]
    # Each run's temporary directories under its own workdir, a passing test's removed as it
    # ends: kept all session long they took 71 GB and filled the disk mid-run.
    basetemp = workdir / f"tmp-{'soak' if soak else 'test'}"
    cmd += [f"--basetemp={basetemp}", "-o", "tmp_path_retention_policy=failed"]
    cmd += [f"--junitxml={junit}", "tests/reliability", *extra]
    print(f"$ {'SHARDSTREAM_SOAK=1 ' if soak else ''}python {' '.join(cmd[1:])}", flush=True)
    started = time.time()
    code = subprocess.run(cmd, cwd=REPO, env=env).returncode
    wall = time.time() - started
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "soak": soak,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "records": records,
        "tests": _junit(junit),
    }


def _junit(path: Path) -> list[dict]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):  # none, or cut short: the run's exit code says it failed
        return []
    tests = []
    for case in root.iter("testcase"):
        outcome = "passed"
        message = ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", _failure_summary(child)
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if "xfail" in kind else "skipped"
                message = (child.get("message") or "")[:300]
        tests.append(
            {
                "file": case.get("classname", "").rsplit(".", 1)[-1],
                "name": case.get("name"),
                "time_s": float(case.get("time") or 0),
                "outcome": outcome,
                "message": message,
            }
        )
    return tests


ERROR_LINE = re.compile(r"^[\s|E]*((?:\w+\.)*\w*(?:Error|Exception)): (.+)$")


def _failure_summary(element) -> str:
    """The distinct ``SomeError: message`` lines of a failure, not just pytest's first line."""
    seen: list[str] = []
    for line in (element.text or "").splitlines():
        match = ERROR_LINE.match(line)
        if match and "ExceptionGroup" not in match[1]:
            text = f"{match[1]}: {match[2].strip()}"[:300]
            if text not in seen:
                seen.append(text)
    return " / ".join(seen[:4]) or (element.get("message") or "")[:500]


def _machine() -> str:
    cpu = cpu_model() or platform.processor() or "?"
    mem = mem_total_bytes() / 2**30
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.1f} GiB RAM; Linux {platform.release()}; "
        f"Python {platform.python_version()}"
    )


def _commit() -> str:
    head = git_revision() or "?"
    return head + (" (+uncommitted changes in src/)" if src_dirty() else "")


def _torch() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "?"


# --- rendering ---------------------------------------------------------------------------------


def _files(file) -> tuple[str, ...]:
    return (file,) if isinstance(file, str) else tuple(file)


def _section_of(name: str, rec: dict | None = None) -> str | None:
    """A record's section: by its name's prefix, or (a failed test's record, named
    ``failed: ...``) by the test file it came from."""
    for key, _, _, prefixes in SECTIONS:
        if name.startswith(prefixes):
            return key
    test_file = ((rec or {}).get("test") or "").split("::")[0].rsplit("/", 1)[-1][:-3]
    for key, _, file, _ in SECTIONS:
        if test_file in _files(file):
            return key
    return None


def _case_trials(run: dict | None, keys=None) -> dict[str, int]:
    """Test cases of ``run`` (passed or failed, not skipped) that recorded no figures besides a
    ``failed:`` record, by test file, for the sections ``keys`` (None: all)."""
    if not run:
        return {}
    recorded = set()
    for rec in run["records"]:
        if rec.get("test") and not str(rec.get("name", "")).startswith("failed: "):
            file, _, name = rec["test"].partition("::")
            recorded.add((file.rsplit("/", 1)[-1].removesuffix(".py"), name))
    wanted = {
        f for key, _, file, _ in SECTIONS if keys is None or key in keys for f in _files(file)
    }
    out: dict[str, int] = {}
    for t in run["tests"]:
        if t["file"] not in wanted or t["outcome"] not in ("passed", "failed", "xfailed"):
            continue
        if (t["file"], t["name"]) not in recorded:
            out[t["file"]] = out.get(t["file"], 0) + 1
    return out


def _count(record: dict) -> int:
    return int(record.get("trials") or record.get("examples") or record.get("reads") or 0)


TMP_PATHS = re.compile(r"/tmp/(?:pytest-of-[^/]+/pytest-\d+/[^/\s'\"]+|shardstream-\w+-\w+)")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "; ".join(_fmt(v) for v in value)
    text = TMP_PATHS.sub("TMP", str(value))
    return text.replace("|", "\\|").replace("\n", " ")


def _stats_table(stats: dict) -> list[str]:
    return table("outcome | count", "lr", [(_fmt(key.strip()), n) for key, n in stats.items()])


def render(results: dict) -> str:
    runs = {("soak" if r["soak"] else "test"): r for r in results["runs"]}
    by_name: dict[str, dict[str, dict]] = {}
    for mode, run in runs.items():
        for rec in run["records"]:
            by_name.setdefault(rec["name"], {})[mode] = rec
    tests = {mode: run["tests"] for mode, run in runs.items()}
    main = "soak" if "soak" in runs else "test"

    def section(name: str, rec: dict) -> str | None:
        return _section_of(name, next(iter(rec.values())))

    def case_trials(mode: str, keys=None) -> dict[str, int]:
        """Per test file, the test cases run that recorded no figures of their own (one
        trial each; a failed one's violations are counted from its ``failed:`` record)."""
        return _case_trials(runs.get(mode), keys)

    def totals(mode: str, keys=None) -> int:
        return sum(
            _count(rec[mode])
            for name, rec in by_name.items()
            if mode in rec and (keys is None or section(name, rec) in keys)
        ) + sum(case_trials(mode, keys).values())

    def violations_in(keys=None) -> int:
        return sum(
            int(rec[mode].get("violations", 0))
            for name, rec in by_name.items()
            for mode in rec
            if keys is None or section(name, rec) in keys
        )

    def outcomes(mode: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in tests.get(mode, []):
            out[t["outcome"]] = out.get(t["outcome"], 0) + 1
        return out

    violations = violations_in()
    data_keys = {key for key, _, file, _ in SECTIONS if set(_files(file)) & DATA_TESTS}
    data_violations = violations_in(data_keys)
    failed = [t for mode in tests for t in tests[mode] if t["outcome"] == "failed"]
    lost = [t for t in failed if t["file"] in DATA_TESTS]
    if data_violations == 0 and not lost:
        data_lost = "**Data lost: none**" + (
            " (the failing tests below are readers that mishandle hostile input; none of them "
            "concerns committed data)"
            if failed
            else ""
        )
    else:
        data_lost = (
            f"**Data lost: SEE FAILURES** ({data_violations} invariant violations recorded "
            "by the kill, disk, permission, corruption and concurrency trials)"
        )
    lines = [
        "# Reliability",
        "",
        generated_note("bench/soak.py (`make soak`)", "bench/results/soak.json"),
        "",
        "How shardstream is tested against the things that go wrong in real training runs: "
        "processes killed mid-write, disks that fill up, directories that turn read-only, bits "
        "that rot, files built to attack the reader, and two jobs pointed at one directory. In "
        "the spirit of [SQLite's testing page](https://sqlite.org/testing.html): every number "
        "below comes from a real run of `tests/reliability/`, recorded by the tests themselves.",
        "",
        f"- **Generated:** {results['generated']} at commit {results['commit']}",
        f"- **Machine:** {results['machine']}; torch {results['torch']}",
    ]
    for mode, label in (("test", "`make test`"), ("soak", "`make soak`")):
        if mode in runs:
            o = outcomes(mode)
            summary = ", ".join(f"{n} {k}" for k, n in sorted(o.items()))
            lines.append(
                f"- **{label} run:** {runs[mode]['wall_s'] / 60:.1f} min, tests {summary}, "
                f"pytest exit code {runs[mode]['exit_code']}"
            )
    lines += [
        "",
        "## Summary",
        "",
        f"- **Trials run** (soak): {totals(main):,} "
        f"(kill -9: {totals(main, {'kill'}):,}; full disk: {totals(main, {'disk'}):,}; "
        f"byte flips and structural damage: {totals(main, {'corrupt'}):,}; "
        f"fuzzed inputs: {totals(main, {'fuzz'}):,}; hostile files: "
        f"{totals(main, {'hostile'}):,}; reads during saves: {totals(main, {'conc'}):,})",
        f"- **Faults survived:** every kill, full disk, read-only or forbidden directory in "
        f"the table below left the last committed checkpoint complete, verified and restorable "
        f"bit for bit{'' if not failed else ' — except where a test failed (see below)'}",
        f"- **Bad inputs tried:** {totals(main, {'corrupt', 'hostile', 'fuzz'}):,}; each one "
        "either read correctly or was refused with a `ShardstreamError`"
        + (
            ""
            if not violations_in({"corrupt", "hostile", "fuzz"})
            else " — except the violations below"
        ),
        f"- **Invariant violations:** {violations} (each check that failed in a trial, counted "
        "by the tests, both runs; a test with one fails)",
        f"- {data_lost}",
        "",
    ]
    areas = []
    for key, title, file, _ in SECTIONS:
        quick = totals("test", {key}) if "test" in runs else "–"
        soak = totals("soak", {key}) if "soak" in runs else "–"
        cases = [t for t in tests.get(main, []) if t["file"] in _files(file)]
        passed = sum(t["outcome"] in ("passed", "xfailed") for t in cases)
        shown_files = ", ".join(f"`tests/reliability/{f}.py`" for f in _files(file))
        areas.append((title, shown_files, quick, soak, f"{passed}/{len(cases)}"))
    lines += table(
        "area | test file | `make test` trials | `make soak` trials | tests passed (soak)",
        "llrrr",
        areas,
    )
    if failed:
        lines += ["", "## Failures", ""]
        for t in failed:
            mode = "soak" if t in tests.get("soak", []) else "test"
            lines.append(f"- `{t['file']}::{t['name']}` (`make {mode}`): {_fmt(t['message'])}")
    for key, title, file, _ in SECTIONS:
        lines += ["", f"## {title}", "", INTRO[key], ""]
        for name, rec in sorted(by_name.items()):
            if section(name, rec) != key:
                continue
            shown = rec.get(main) or next(iter(rec.values()))
            counts = ", ".join(
                f"{_count(rec[m])} in `make {m}`" for m in ("test", "soak") if m in rec
            )
            extra = []
            for field in ("seed", "seconds", "saves", "checkpoint_bytes", "output_bytes",
                          "clean_merge_s", "detected_by_verify", "detected_by_restore",
                          "python_alloc_peak"):  # fmt: skip
                if field in shown:
                    extra.append(f"{field.replace('_', ' ')} {_fmt(shown[field])}")
            lines.append(
                f"- **{name}** — {counts}; violations {shown.get('violations', 0)}"
                + (f"; {', '.join(extra)}" if extra else "")
            )
            for part in ("stats", "debris", "survivors"):
                if shown.get(part):
                    label = {
                        "stats": "outcomes",
                        "debris": "leftovers found after the kill, all removed by the next start",
                        "survivors": "ranks left alive after killing one",
                    }[part]
                    lines += ["", f"  {label}:", ""]
                    lines += ["  " + row for row in _stats_table(shown[part])]
                    lines.append("")
            if shown.get("targets"):
                readers = [
                    (
                        target,
                        res.get("accepted", 0),
                        res.get("rejected with a ShardstreamError", 0),
                        res.get("VIOLATION", 0),
                    )
                    for target, res in sorted(shown["targets"].items())
                ]
                head = "reader | accepted | rejected with a ShardstreamError | violations"
                lines += ["", *("  " + line for line in table(head, "lrrr", readers)), ""]
            for one in shown.get("violation_messages") or []:
                lines.append(f"  - **violation**: `{_fmt(one)[:400]}`")
            for field in ("errors", "error", "message", "lines", "verify", "restore",
                          "entry_points"):  # fmt: skip
                if shown.get(field):
                    value = shown[field]
                    items = value.items() if isinstance(value, dict) else [(field, value)]
                    for k, v in items:
                        for one in v if isinstance(v, list) else [v]:
                            lines.append(f"  - {k}: `{_fmt(one)[:240]}`")
        plain = {m: case_trials(m, {key}) for m in ("test", "soak") if m in runs}
        for test_file in sorted({f for counts in plain.values() for f in counts}):
            counts = ", ".join(
                f"{plain[m].get(test_file, 0)} in `make {m}`"
                for m in ("test", "soak")
                if m in plain
            )
            failed_here = sum(
                1
                for t in tests.get(main, [])
                if t["file"] == test_file and t["outcome"] == "failed"
            )
            lines.append(
                f"- **`{test_file}.py`**, checks that record no figures (one trial per test "
                f"case run) — {counts}; failed {failed_here}"
            )
        cases = [t for t in tests.get(main, []) if t["file"] in _files(file)]
        if cases:
            lines += ["", "<details><summary>tests</summary>", ""]
            for t in cases:
                note = f" — {_fmt(t['message'])[:200]}" if t["message"] else ""
                lines.append(f"- `{t['name']}`: {t['outcome']} ({t['time_s']:.1f} s){note}")
            lines += ["", "</details>"]
    lines += ["", "## Known gaps", "", *KNOWN_GAPS, "", "## Reproduce", "", *REPRODUCE, ""]
    return "\n".join(lines)


INTRO = {
    "verify": "`shardstream verify DIR` on a step directory, a manager root (every step and the "
    "`latest` pointer) and merged HF directories (one file, and sharded with an index): exit 0 "
    "when all is well, otherwise exit 1 with one line per problem naming the file, the tensor "
    "and the byte range; `--json` gives the same as a document. Also run as a real "
    "`python -m shardstream` process. Every part of a checkpoint is checked "
    "(`test_verify_parts.py`): every file a step holds, at any depth and hidden ones too "
    "(config, generation config, tokenizer and processor files with their subfolders), is "
    "listed in the manifest with its digest, so verify reports a flipped, deleted or added "
    "file and a link out of the checkpoint, and merge checks what it copies; verify catches "
    "what restore catches (swapped verl optimizer rank files, a truncated DCP optimizer item, "
    "a flipped bit in any DCP item by its zip record's CRC-32), and restore of a DCP train "
    "state checks every item it reads against its CRC-32s before anything is touched.",
    "kill": '2 or 3 ranks (gloo, FSDP2 `fully_shard` on a ("fsdp",) mesh) train and save every '
    "step through `CheckpointManager(save_interval=1, keep_last=2)`; SIGKILL hits one rank (the "
    "others are given 5 s to fail by themselves, then killed) or all of them at a random moment "
    "of the save loop, or during start-up and restore. Runs are chained: each trial resumes the "
    "directory the previous one crashed in, at a random world size. After every kill: `latest` "
    "names a committed step no older than the last `save()` that returned; `verify` passes on "
    "the root and on that step; a new manager removes every `*.tmp-*` leftover, and `restore()` "
    "gives the model and optimizer state of that step bit for bit (written aside by the trainer "
    "before the save began); retention kept at most `keep_last` + 1 steps and never the wrong "
    "one. Ranks are forked from a warm interpreter so a trial costs about a second. The same "
    "with 4 ranks, killing one and all in turn, for saves and async saves. "
    "`shardstream merge` is killed the same way (forked, and once as a real exec'd process), "
    "and `merge --distributed` over 4 gloo ranks with one rank or all of them killed: "
    "the target is absent or complete and identical to a clean merge, never partial, and the "
    "same command run again succeeds and removes the killed run's `TARGET.tmp-*` directory (its "
    "owner process is dead), leaving nothing beside the target. Every check that fails in a "
    "trial is counted as a violation (the next trial starts a fresh directory) and fails the "
    "test. Inside the commit swap itself (`test_swap_crash.py`), a child replacing step N or "
    "a merge target kills itself right after the atomic exchange, or between the fallback's "
    "two renames: the next start finds the directory committed, old or new, and no temporary; "
    "retention killed between its rename and its delete never brings the dropped step back.",
    "disk": "A small tmpfs (or a loop-mounted image), filled by a ballast file to leave a chosen "
    "number of bytes, swept from 0 to more than a checkpoint needs so the space runs out at each "
    "stage in turn. A save fails with `OutOfSpaceError`, `latest` still names the previous "
    "step, which verifies and restores bit for bit, and no `*.tmp-*` is left; with two ranks "
    "every rank gets a shardstream error. A merge fails with exit 1 and one error line; an "
    "existing output under `--overwrite` is untouched.",
    "perm": "As root, permission bits do not apply, so: a tmpfs remounted read-only (EROFS), and "
    "a process that dropped to uid 65534 (EACCES) in a root-owned directory, and in its own run "
    "directory made read-only mid-run, and with data files made unreadable. Each gives one "
    "clear shardstream error; nothing on disk changes; reading (restore, verify, merge out of "
    "it) still works.",
    "corrupt": "Seeded random trials flip one byte (XOR with a random non-zero value) in tensor "
    "data, in a safetensors header, in the manifest or in an extra-state JSON file of a real "
    "2-rank checkpoint. `verify` must report each, naming the file (and for data, a tensor and a "
    "byte range holding the flipped byte), and `restore()` with `verify_on_load` must fail with "
    "a shardstream error naming the file. A 1-rank restore does not read rank 1's extra state, "
    "so for those files the trial also runs rank 1's part of a 2-rank restore (and one trial "
    "runs a real 2-rank restore). Merged HF files are checked with verify alone. Then: "
    "truncated files, a deleted rank file, swapped rank files, a step directory copied under "
    "another step's name. And every one of the 255 changes of every byte of "
    "`shardstream.chunk_bytes` in a one-chunk merged file (no digest covers that value).",
    "hostile": "Files built to attack the reader, through the entry points users run: pickles "
    "whose `__reduce__` would run code (model, optimizer and extra-state files of a verl "
    "directory, and stray `.pt` files beside it) — refused, and the marker file they would "
    "write never appears; safetensors files that lie about themselves (header length beyond the "
    "file or over 100 MB, overlapping, out-of-range or past-the-end offsets, unknown dtypes, "
    "shape/size mismatches, absurd shapes, deep nesting) — refused before anything is "
    "allocated (Python allocation peak measured); manifests re-sealed with a valid checksum "
    "that name files outside the checkpoint (`../`, absolute paths), symlinks out (a file, or "
    "the `huggingface/` directory), absurd sizes and counts — refused with a clear error. For a "
    "code-running pickle in the optimizer or extra-state file, restore refuses it, verify and "
    "inspect exit cleanly without running it, and merge succeeds without opening the file at "
    "all (an audit hook records every file it opens). Inputs that once ended in a traceback or "
    "a silent success (`test_hostile_inputs.py`): config and tokenizer files linked out of a "
    "DCP or verl checkpoint, a damaged `latest` pointer, JSON files that are not objects or "
    "hold NaN, Infinity or huge integers, unreadable files, absurd `--buffer-size`s, symlinked "
    "merge targets: one line `shardstream <cmd>: error: ...` naming the file, a non-zero exit, "
    "nothing written. Hostile pickles (`test_hostile_pickles.py`): exponential shared "
    "references, hashing bombs, `OrderedDict`s built with odd state and DeviceMesh-building "
    "pickles in verl `.pt` files and DCP `.metadata`, each run in a child under a wall-clock "
    "guard and an address-space limit with torchrun-style variables set: a prompt one-line "
    "error, no hang, no rendezvous.",
    "fuzz": "Hypothesis drives mutations of real files into every reader of untrusted bytes: "
    "the manifest (byte edits, which must all be rejected, and structural edits re-sealed with "
    "a valid checksum), safetensors headers, verl `.pt` files and DCP metadata and data files "
    "(byte edits, and the argument of a real pickle opcode overwritten with an extreme length, "
    "frame size or memo index). The only acceptable outcomes are success or a "
    "`ShardstreamError`, within 20 s per example and 256 MiB of Python allocations; each giant "
    "declared length of a DCP `.metadata` is also tried once deterministically. Then "
    "structure-aware inputs through every entry point (`inspect`, `verify`, `merge`, `test`, "
    "`load`), each in a forked process with a capped address space and a 120 s guard: pickles "
    "built from opcodes (shared references, BUILD and SETITEMS on odd objects, deep nesting, "
    "big memos, GLOBALs, tensors rebuilt with fuzzed storages, offsets, shapes and strides) in "
    "verl `.pt` files and DCP `.metadata` (also a real `Metadata` with fields made wrong), and "
    "a wrong value in any field of `manifest.json` (re-sealed), safetensors headers, "
    "`config.json`, `model.safetensors.index.json` and `fsdp_config.json` (non-objects, NaN, "
    "Infinity, huge integers, deep nesting, wrong types). Acceptable: exit 0, or one line "
    "`shardstream <cmd>: error: ...` (verify and test may list the problems they found); "
    "never a traceback, a signal or a hang. Derandomized with few examples in `make test`, "
    "random and many in `make soak`.",
    "conc": "A second `CheckpointManager` on a directory a live process saves to gets "
    "`CheckpointLockedError` (flock) when it tries to save, and its start leaves the live "
    "run's in-progress directory alone; once that process is killed -9 its lock no longer "
    "blocks. Two runs started on one directory at once: exactly one saves. Readers (`restore`, "
    "a restore-only `CheckpointManager`, `verify`, `merge`) loop while a run saves every step "
    "with `keep_last=2`: whatever they "
    "read equals that step's recorded state; the only failure allowed is a step that retention "
    "removed while it was read (a clean error, and the directory is then gone).",
    "formats": "Format version 1 manifests (chunk lists only, no grid entries) still open, "
    "restore and verify (`test_format_versions.py`). A restoring rank reads the headers of "
    "only the data files holding the rows it restores, and a merge only those holding model "
    "tensors; a grid entry that disagrees with a rank file, or spans more ranks than there "
    "are files, is refused naming the tensor and the file (`test_lazy_open.py`).",
}

KNOWN_GAPS = [
    "- Power loss is not simulated: kill -9 keeps the page cache, so these trials test the "
    "commit protocol's ordering, not fsync placement on a real crash.",
    "- A staged merge directory left by a shardstream older than its owner files (no "
    "`TARGET.tmp-*.owner` beside it) is not provably dead, so it is never removed automatically.",
]

REPRODUCE = [
    "```",
    "make soak                                   # this page: make-test counts, then soak counts",
    ".venv/bin/python -m pytest tests/reliability  # the make-test counts only (part of make test)",
    "SHARDSTREAM_SOAK=1 .venv/bin/python -m pytest tests/reliability -k kill   # one area, soaked",
    "```",
    "",
    "Trials are seeded (the seeds are listed above), so a failure reproduces; the fuzz tests are "
    "derandomized in `make test` and random in `make soak` (hypothesis prints the failing "
    "example). The full-disk and permission tests need root (`mount`, `setuid`) and skip with "
    "the reason otherwise.",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak-only", action="store_true", help="skip the make-test-count run")
    parser.add_argument("--render", action="store_true", help="only re-render the doc")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k kill)")
    args = parser.parse_args(argv)
    missing = unsectioned_test_files()
    if missing:
        parser.error(f"tests/reliability/{missing[0]}.py is in no section of SECTIONS: add it")
    if args.render:
        results = json.loads(SOAK_JSON.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="shardstream-soak-") as tmp:
            runs = []
            if not args.soak_only:
                runs.append(run_pytest(False, Path(tmp), args.pytest_args))
            runs.append(run_pytest(True, Path(tmp), args.pytest_args))
        results = {
            "generated": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"
            ),
            "commit": _commit(),
            "machine": _machine(),
            "torch": _torch(),
            "runs": runs,
        }
        SOAK_JSON.parent.mkdir(parents=True, exist_ok=True)
        SOAK_JSON.write_text(json.dumps(results, indent=1) + "\n")
    write_doc(DOC, render(results))
    print(f"wrote {DOC.relative_to(REPO)} and {SOAK_JSON.relative_to(REPO)}")
    return next((r["exit_code"] for r in results["runs"] if r["soak"]), 0)


if __name__ == "__main__":
    sys.exit(main())
