"""The ``shardstream`` command line. verl's model_merger flags are accepted verbatim."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from .errors import COMMITTED_ATTR, ShardstreamError, Terminated, UsageError, os_error
from .units import check_buffer_size, format_size

EXIT_ERROR = 1
EXIT_USAGE = 2
PROBLEMS_SHOWN = 1000  # verify's problem lines printed; --json has them all


# verl 0.9.1's model_merger options (merge and test): a prefix that matches one of them and
# options of ours is that one, as verl's parser takes it.
VERL_OPTIONS = frozenset(
    {"--backend", "--local_dir", "--tie-word-embedding", "--trust-remote-code"}
    | {"--is-value-model", "--use_cpu_initialization", "--target_dir", "--hf_upload_path"}
    | {"--private", "--test_hf_dir"}
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a prefix that matches only the spellings of one option is that option:
    ``--local`` is ``--local_dir`` (as verl's parser takes it), not ambiguous between
    ``--local_dir`` and ``--local-dir``; and one that matches one of verl's options beside
    shardstream's own is verl's (``--b`` is ``--backend``, not ``--buffer-size``)."""

    json_errors = False  # main() sets it when the command line asks for --json

    def error(self, message):
        """A bad command line: argparse's usage and message on stderr, exit 2; with --json also
        the failure object on stdout, as every other failure gives it."""
        if _Parser.json_errors:
            print(json.dumps({"ok": False, "error": message, "exit_code": EXIT_USAGE}), flush=True)
        super().error(message)

    def _get_option_tuples(self, option_string):
        matches, actions = [], set()
        for match in super()._get_option_tuples(option_string):
            if id(match[0]) not in actions:
                actions.add(id(match[0]))
                matches.append(match)
        verls = [m for m in matches if VERL_OPTIONS & set(m[0].option_strings)]
        return verls if len(matches) > 1 and len(verls) == 1 else matches


def _flag(parser: argparse.ArgumentParser, *names: str, **kwargs) -> None:
    """Add an option under its verl spelling and its dashed/underscored twin."""
    spellings: list[str] = []
    for name in names:
        body = name[2:]
        for variant in (name, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")):
            if variant not in spellings:
                spellings.append(variant)
    parser.add_argument(*spellings, **kwargs)


def _add_source_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "--local_dir", required=True, help="checkpoint directory (e.g. global_step_N/actor)")
    _flag(p, "--backend", default="fsdp", help="only 'fsdp' (verl compatibility)")
    _flag(p, "--hf_model_path", default=None, help="config/tokenizer source for old checkpoints")
    _flag(p, "--tie-word-embedding", action="store_true", help="drop lm_head.weight if tied")
    _flag(p, "--is-value-model", action="store_true", help="accepted for verl compatibility")
    _flag(p, "--trust-remote-code", action="store_true", help="accepted; no code is loaded")
    _flag(p, "--use_cpu_initialization", action="store_true", help="accepted; no model is built")
    _flag(p, "--buffer-size", default="64MiB", help="bounded copy buffer (default 64MiB)")
    _flag(p, "--quiet", action="store_true", help="no progress bar or summary line")
    _flag(p, "--json", action="store_true", help="print a machine-readable JSON summary")
    _flag(
        p,
        "--prefix",
        default=None,
        help="DCP or a torch.save file: what the model's keys start with (e.g. app.model.; "
        "model. for a Lightning module's model; '' for DCP's top level), where detection finds "
        "several or a training wrapper holds the model",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardstream",
        description="Streaming, crash-safe FSDP checkpoint tools in bounded memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    merge = sub.add_parser("merge", help="merge a sharded checkpoint into a HF safetensors model")
    _add_source_flags(merge)
    _flag(
        merge,
        "--target_dir",
        default="tmp",
        help="output HF model directory (default: tmp, as verl's merger)",
    )
    _flag(
        merge,
        "--dtype",
        default=None,
        help="a floating dtype, bfloat16... (default: bfloat16 for a checkpoint verl's merger "
        "merges, as it writes; else config.json's)",
    )
    _flag(
        merge,
        "--max-shard-size",
        default=None,
        help="split output files (default: save_pretrained's, 50GB in transformers 5, 5GB in 4)",
    )
    _flag(
        merge,
        "--overwrite",
        action="store_true",
        help="replace a non-empty target whole (default: write into it as verl's merger does, "
        "keeping its other files)",
    )
    _flag(merge, "--fuse-lora", action="store_true", help="fold LoRA (alpha/r)*B@A into weights")
    _flag(
        merge,
        "--keep-names",
        action="store_true",
        help="write the in-memory names, not the layout save_pretrained writes",
    )
    _flag(
        merge,
        "--no-direct-io",
        action="store_true",
        help="write through the page cache, not with O_DIRECT (used where the file system allows)",
    )
    merge.add_argument(
        "--distributed",
        "--distributed_merge",
        "--distributed-merge",
        dest="distributed",
        action="store_true",
        help="under torchrun: every rank writes its share of the output",
    )
    _flag(
        merge,
        "--hf_upload_path",
        default=None,
        help="then upload the merged directory to this Hugging Face Hub repository",
    )
    _flag(merge, "--private", action="store_true", help="with --hf_upload_path: a private repo")

    test = sub.add_parser("test", help="compare a checkpoint's merged tensors with a HF model")
    _add_source_flags(test)
    _flag(test, "--test_hf_dir", required=True, help="reference HF model directory")
    _flag(test, "--dtype", default=None, help="compare in this dtype (default: the reference's)")
    _flag(
        test,
        "--atol",
        type=float,
        default=None,
        help="absolute tolerance (default 1e-6, verl's; with the default rtol a one-ulp float32 "
        "change passes, a one-ulp bfloat16 one needs a larger --rtol, e.g. 1e-2)",
    )
    _flag(test, "--rtol", type=float, default=None, help="relative tolerance (default 1e-6)")
    _flag(test, "--exact", action="store_true", help="the same bits after the cast; no tolerance")

    verify = sub.add_parser("verify", help="recompute checksums; check completeness")
    verify.add_argument(
        "path",
        help="step directory, manager root, HF model directory, or verl checkpoint/step/run",
    )
    _flag(verify, "--json", action="store_true", help="machine-readable output")
    _flag(verify, "--quiet", action="store_true", help="print problems only")

    inspect = sub.add_parser("inspect", help="describe a checkpoint without reading its data")
    inspect.add_argument("path", help="checkpoint, run or HF model directory")
    _flag(inspect, "--json", action="store_true", help="machine-readable output")
    _flag(
        inspect,
        "--prefix",
        default=None,
        help="DCP or a torch.save file: what the model's keys start with",
    )
    _flag(
        inspect,
        "--hf_model_path",
        default=None,
        help="the config directory merge would be given: plan its layout with that config",
    )
    return parser


def _check_backend(args: argparse.Namespace) -> None:
    if getattr(args, "backend", "fsdp") != "fsdp":
        raise UsageError(
            f"--backend {args.backend!r} is not supported; shardstream merges FSDP checkpoints "
            "(use --backend fsdp)"
        )
    if getattr(args, "hf_upload_path", None):
        from .commands.upload import check_upload

        check_upload(args.hf_upload_path)


class _Progress:
    """A tqdm bar in bytes, created once the total is known."""

    def __init__(self, enabled: bool, desc: str):
        self.enabled, self.desc, self.bar = enabled, desc, None

    def start(self, total: int) -> None:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=self.desc,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def finish(self) -> None:
        """The work is done: the bar at its total (verify estimates it from whole files, and
        checks some of their bytes only: a torch archive's record data, not its zip headers)."""
        if self.bar is not None and self.bar.total:
            self.bar.update(max(0, self.bar.total - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_merge(args: argparse.Namespace) -> int:
    from .commands.merge import merge

    _check_backend(args)
    check_buffer_size(args.buffer_size)
    first_rank = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 reports
    progress = _Progress(not args.quiet and not args.json and first_rank, "merge")
    try:
        summary = merge(
            args.local_dir,
            args.target_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            buffer_size=args.buffer_size,
            overwrite=args.overwrite,
            update=True,
            hf_model_path=args.hf_model_path,
            tie_word_embedding=args.tie_word_embedding,
            fuse_lora=args.fuse_lora,
            keep_names=args.keep_names,
            distributed=args.distributed,
            direct_io=not args.no_direct_io,
            prefix=args.prefix,
            progress=progress.update,
            on_plan=progress.start,
        )
    finally:
        progress.close()
    if args.distributed and not first_rank:  # its group is gone by now: RANK says
        return 0
    uploaded = None
    if args.hf_upload_path:  # as verl's merger: once the directory is complete
        from .commands.upload import upload_to_hub

        uploaded = upload_to_hub(summary.target, args.hf_upload_path, args.private)
    if args.json:
        print(json.dumps({**summary.to_json(), **({"uploaded": uploaded} if uploaded else {})}))
    elif not args.quiet:
        print(
            f"merged {summary.tensors} tensors into {summary.target} ({len(summary.files)} "
            f"file{'s' if len(summary.files) != 1 else ''}): wrote "
            f"{format_size(summary.bytes_written)} in {summary.wall_s:.2f} s "
            f"({format_size(summary.throughput_bytes_per_s)}/s), peak RSS "
            f"{format_size(summary.peak_rss_bytes)}"
        )
        print(f"layout: {summary.layout}")
        if uploaded:
            print(f"uploaded to {args.hf_upload_path}: {uploaded}")
    if not args.quiet and summary.not_tensors:
        shown = ", ".join(repr(k) for k in summary.not_tensors[:3])
        more = len(summary.not_tensors) - 3
        print(
            f"note: left out {len(summary.not_tensors)} non-tensor entr"
            f"{'y' if len(summary.not_tensors) == 1 else 'ies'} of the model's state ({shown}"
            f"{f' and {more} more' if more > 0 else ''}): safetensors holds tensors only",
            file=sys.stderr,
        )
    if not args.quiet:
        for note in summary.notes:
            print(_one_line(f"note: {note}"), file=sys.stderr)
    return 0


def run_test(args: argparse.Namespace) -> int:
    from .commands.test import compare_with_reference

    _check_backend(args)
    check_buffer_size(args.buffer_size)
    report = compare_with_reference(
        args.local_dir,
        args.test_hf_dir,
        dtype=args.dtype,
        atol=args.atol,
        rtol=args.rtol,
        buffer_size=args.buffer_size,
        hf_model_path=args.hf_model_path,
        tie_word_embedding=args.tie_word_embedding,
        exact=args.exact,
        prefix=args.prefix,
    )
    code = 0 if report.ok else EXIT_ERROR
    if args.json:
        print(_json_report(report.to_json(), code, "MISMATCH", report.problems))
    else:
        for line in report.problems:
            print(_one_line(line), file=sys.stderr)
        if not args.quiet:
            count = len(report.problems)
            verdict = "OK" if report.ok else f"MISMATCH ({count} problem{'s' * (count != 1)} above)"
            print(
                f"{verdict}: compared {report.compared} tensors against {args.test_hf_dir}, "
                f"max abs diff {report.max_abs_diff:.3g}"
            )
    return code


def run_inspect(args: argparse.Namespace) -> int:
    from .commands.inspect import describe, render

    info = describe(args.path, args.prefix, args.hf_model_path)
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from .commands.verify import verify

    progress = _Progress(not args.quiet and not args.json, "verify")
    progress.start(_tree_bytes(args.path))
    try:
        report = verify(args.path, progress=progress.update)
        progress.finish()
    finally:
        progress.close()
    code = 0 if report.ok else EXIT_ERROR
    if args.json:
        lines = [problem.line() for problem in report.problems]
        print(_json_report(report.to_json(), code, "FAILED", lines))
    else:
        for problem in report.problems[:PROBLEMS_SHOWN]:
            print(_one_line(problem.line()), file=sys.stderr)
        if len(report.problems) > PROBLEMS_SHOWN:
            more = len(report.problems) - PROBLEMS_SHOWN
            print(f"... and {more:,} more problem(s) (--json lists every one)", file=sys.stderr)
        if not args.quiet:
            verdict = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
            steps = f", steps {report.steps}" if report.kind == "root" else ""
            if report.kind == "checkpoints":
                steps = f", checked {', '.join(report.checked)}"
            checked = f"{format_size(report.bytes_checked)} checked"
            if report.kind == "dcp":
                checked += " (every item's zip records against their CRC-32s)"
            elif report.kind == "dcp_hf" and not report.bytes_checked:
                checked = "headers and chunk tiling checked (the writer stores no checksums)"
            elif report.kind == "accelerate":
                checked += " (the zip records of every DCP item and torch.save file against "
                checked += "their CRC-32s)"
            if report.unchecked_bytes:
                checked += (
                    f"; {format_size(report.unchecked_bytes)} of tensor data not checked: "
                    + "; ".join(report.unchecked_why or ["no checksum recorded"])
                )
            print(
                f"{verdict}: {report.kind} {report.path}: {report.files_checked} "
                f"file{'' if report.files_checked == 1 else 's'}, "
                f"{checked}{steps}"
            )
            if report.uncommitted:
                leftovers = ", ".join(report.uncommitted)
                print(
                    _one_line(
                        "note: uncommitted leftovers of a save that was cut short (not read, "
                        f"removed by the run's next save): {leftovers}"
                    ),
                    file=sys.stderr,
                )
            if report.not_read:
                print(
                    _one_line(
                        "note: not read (no part of a checkpoint shardstream reads): "
                        + ", ".join(report.not_read)
                    ),
                    file=sys.stderr,
                )
            if report.unnamed:
                print(
                    _one_line(
                        "note: files no part of the checkpoint (its .metadata, index or "
                        "fsdp_config.json names others; an earlier save's?), not read: "
                        f"{', '.join(report.unnamed)}"
                    ),
                    file=sys.stderr,
                )
    return code


def _json_report(doc: dict, code: int, verdict: str, problems: Sequence[str]) -> str:
    """A check's JSON report with the keys every failure carries (``error``: the verdict and
    the first problems; ``exit_code``)."""
    failure = {"error": f"{verdict}: {'; '.join(problems[:3])}"} if code else {}
    return json.dumps({**doc, **failure, "exit_code": code})


def _tree_bytes(path: str) -> int:
    import os

    from .storage.tree import walk

    if os.path.isfile(path):  # one torch.save file
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    _Parser.json_errors = "--json" in words
    args = build_parser().parse_args(argv)
    handlers = {
        "merge": run_merge,
        "test": run_test,
        "inspect": run_inspect,
        "verify": run_verify,
    }
    with _escaping_unprintable(), _terminated_as_interrupt():
        return _run(handlers[args.command], args)


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` for the block (in the main thread), so that a merge told
    to stop removes its staged output as Ctrl-C does: the default action left it behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """The command's exit code; its errors as one line on stderr (and with ``--json`` as a
    JSON object on stdout, so that a script reading it gets an answer either way)."""
    try:
        code = handler(args)
        sys.stdout.flush()  # a closed pipe raises here, not at interpreter exit
        return code
    except UsageError as exc:
        return _failed(args, f"error: {exc}", EXIT_USAGE)
    except ShardstreamError as exc:
        return _failed(args, f"error: {exc}", EXIT_ERROR)
    except KeyboardInterrupt as exc:
        what = "terminated" if isinstance(exc, Terminated) else "interrupted"
        committed = getattr(exc, COMMITTED_ATTR, None)
        if committed:
            said = (
                f"{what} after {committed} was put in place, complete (what is left of its old "
                "output goes with its next write)"
            )
        else:
            said = f"{what}; nothing was committed"
        code = 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
        return _failed(args, said, code)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except Exception as exc:  # an OSError: named as errors.os_error names it, else as it says
        mapped = os_error(exc) or _system_error(exc) or _lost_peer(exc, args)
        if mapped is None:
            raise
        return _failed(args, f"error: {mapped}", EXIT_ERROR)


def _failed(args: argparse.Namespace, said: str, code: int) -> int:
    print(f"shardstream {args.command}: {_one_line(said)}", file=sys.stderr)
    if getattr(args, "json", False):
        message = said.removeprefix("error: ")
        print(json.dumps({"ok": False, "error": message, "exit_code": code}), flush=True)
    return code


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _one_line(said: str) -> str:
    """``said`` as one line a terminal shows as written: a control character from a path or a
    tensor name (a newline, an escape sequence) is spelled as its escape."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), said)


ESCAPING = "shardstream-escape"


def _escape(exc: UnicodeError) -> tuple[str | bytes, int]:
    """An encode error handler: a file name's undecodable bytes as they were
    (``surrogateescape``), anything else the encoding cannot hold as a backslash escape."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    try:
        return codecs.lookup_error("surrogateescape")(exc)
    except UnicodeEncodeError:
        return codecs.lookup_error("backslashreplace")(exc)


codecs.register_error(ESCAPING, _escape)


@contextlib.contextmanager
def _escaping_unprintable() -> Iterator[None]:
    """stdout and stderr escape what their encoding cannot hold for the block: names read from
    a checkpoint may hold lone surrogates (JSON spells one "\\ud800"), and printing one raised
    UnicodeEncodeError after the work was done."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if errors in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=ESCAPING)
            changed.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in changed:
            stream.reconfigure(errors=errors)


def _lost_peer(exc: BaseException, args: argparse.Namespace) -> str | None:
    """A distributed merge's collective broken by another process that stopped: one line."""
    if not getattr(args, "distributed", False):
        return None
    from .storage.collectives import lost_peer

    return lost_peer(exc)


def _system_error(exc: BaseException) -> str | None:
    """An OSError as one line naming its file(s); None for any other error (a bug, which
    keeps its traceback)."""
    if not isinstance(exc, OSError):
        return None
    reason = exc.strerror or str(exc) or type(exc).__name__
    names = [n for n in (exc.filename, exc.filename2) if n is not None]
    return ": ".join([*(os.fsdecode(n) for n in names), reason])


def console_main() -> None:
    """The ``shardstream`` command: ``main()``, then exit without tearing the interpreter down.

    Unloading torch's modules at exit takes ~0.5 s (a quarter of a small merge). By the time
    ``main`` returns every output is fsynced and renamed and every thread joined; only the
    standard streams are left to flush. An exception from ``main`` exits the usual way.
    """
    if os.environ.get("WORLD_SIZE", "1") == "1":  # no process group's threads to fork beside
        from .formats import hf_names

        hf_names.PLAN_APART = True
    try:
        code = main()
    except KeyboardInterrupt:  # before main's own handling (start-up, imports): nothing begun
        print("shardstream: interrupted; nothing was committed", file=sys.stderr)
        code = 128 + signal.SIGINT
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        code = code or EXIT_ERROR
    os._exit(code)


if __name__ == "__main__":
    console_main()
