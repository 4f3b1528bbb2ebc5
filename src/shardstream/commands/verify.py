"""verify: recompute every checksum and check every checkpoint for completeness.

Works on a step directory, a manager root (all steps and the ``latest`` pointer), a HF model
directory, or verl's checkpoints (a step's ``actor/``, a step, a run: the CRC-32 of every zip
record). Problems are collected, not raised: one line each, naming file, tensor and bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine.checksum import digest, new_hasher
from ..errors import CheckpointFormatError, ShardstreamError, permission_denied
from ..formats import hf, jsondoc, native
from ..formats.regular_file import check_inside, kind_of, open_regular, present
from ..formats.safetensors import (
    FILES_KEY,
    UNPRINTABLE,
    SafetensorsHeader,
    build_header,
    encode_header,
    entries_digest,
    read_header,
    stored_checksums,
    tensors_in_range,
)
from ..formats.source import (
    PEFT_ADAPTER_FILES,
    TRAINER_CHECKPOINT,
    TRAINER_STATE,
    VERL_ANY_FILE,
    Kind,
    detect,
    second_model,
    unfinished_trainer_save,
    unread_hint,
    verl_roles,
)
from ..storage import locks
from ..units import DIRECT_ALIGN

READ_BYTES = 8 * 2**20


@dataclass
class Problem:
    path: str
    message: str
    tensor: str | None = None
    byte_range: tuple[int, int] | None = None

    def line(self) -> str:
        where = self.path
        if self.tensor:
            where += f" tensor {self.tensor!r}"
        if self.byte_range:
            where += f" bytes [{self.byte_range[0]}, {self.byte_range[1]})"
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    kind: str
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    steps: list[int] = field(default_factory=list)
    # data bytes with no checksum to check them against (safetensors files shardstream did
    # not write; torch.save records saved with CRC-32 off): their structure is checked, not
    # their contents; ``unchecked_why`` says which
    unchecked_bytes: int = 0
    unchecked_why: list[str] = field(default_factory=list)
    # a run's uncommitted leftovers (a save that was killed): not problems, never read as
    # steps, removed by the run's next save; said so that their space is not a surprise
    uncommitted: list[str] = field(default_factory=list)
    # data files beside a DCP checkpoint that its .metadata does not name (an earlier save's
    # at more ranks): no part of it, never read
    unnamed: list[str] = field(default_factory=list)
    # the checkpoints below a directory of them, by path relative to it, as they were checked
    checked: list[str] = field(default_factory=list)
    # what is no part of a checkpoint read here, beside them (a run's logs), not read
    not_read: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        out["problems"] = [{**asdict(p), "line": p.line()} for p in self.problems]
        return out


def verify(path: str | os.PathLike, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check ``path``; ``report.ok`` is True only if every byte and every reference checks out.

    A directory that is a checkpoint or model and also holds others (a Trainer's output_dir:
    the final model beside its ``checkpoint-N``) has them checked too."""
    from ..storage.run_layout import STEP_DIR

    report = _verify_here(path, progress)
    root = Path(path)
    if report.kind in ("huggingface", "huggingface (pytorch_model.bin)", "root"):
        skip = STEP_DIR.match if report.kind == "root" else None
        _verify_inside(root, report, progress, skip)
    unfinished = _unfinished_trainer_save(root)
    if unfinished is not None:
        report.problems.append(unfinished)
    _interrupted_update(root, report)
    return report


def _interrupted_update(root: Path, report: VerifyReport) -> None:
    """A merge's update in place of ``root`` cut short: a problem where ``root`` fails its
    checks (old and new files mixed), else a leftover (killed after its last move)."""
    from ..storage.commit import interrupted_update, old_folders

    cut = interrupted_update(root) if root.is_dir() else ""
    if not cut or any(cut in p.message for p in report.problems):
        return
    if report.ok:
        report.uncommitted += old_folders(root)
    else:
        report.problems.append(Problem(str(root), cut))


def _absorb(report: VerifyReport, part: VerifyReport, name: str) -> None:
    """``part``, the report of ``name`` below ``report``'s directory, into ``report``."""
    report.checked.append(name)
    report.problems.extend(part.problems)
    report.files_checked += part.files_checked
    report.bytes_checked += part.bytes_checked
    report.unchecked_bytes += part.unchecked_bytes
    _unchecked_because(report, *part.unchecked_why)
    report.uncommitted += [f"{name}/{leftover}" for leftover in part.uncommitted]
    report.unnamed += [f"{name}/{unnamed}" for unnamed in part.unnamed]


def _unfinished_trainer_save(directory: Path, siblings_finished: bool = False) -> Problem | None:
    """``source.unfinished_trainer_save`` as a problem of ``directory``, or None."""
    if not unfinished_trainer_save(directory, siblings_finished):
        return None
    return Problem(
        str(directory),
        f"no {TRAINER_STATE}, which the Trainer writes last into every checkpoint: an "
        "unfinished save (the Trainer cannot resume from it)",
    )


def _verify_inside(root: Path, report: VerifyReport, progress, skip=None) -> None:
    """Verify the checkpoints below ``root`` (``_checkpoints_in``) into ``report``."""
    from ..formats.dcp import step_of_name

    found = [e for e in _checkpoints_in(root) if not (skip and skip(e.name))]
    trainer = [e for e in found if TRAINER_CHECKPOINT.fullmatch(e.name)]
    finished = any((e / TRAINER_STATE).is_file() for e in trainer)
    for entry in found:
        part = verify(entry, progress)
        _absorb(report, part, entry.name)
        if (step := step_of_name(entry.name)) is not None and step not in report.steps:
            report.steps.append(step)
        if finished and not any(p.path == str(entry) for p in part.problems):
            unfinished = _unfinished_trainer_save(entry, siblings_finished=True)
            if unfinished is not None:
                report.problems.append(unfinished)
    _unread_trainer_checkpoints(root, found, report)


def _unread_trainer_checkpoints(root: Path, found: list[Path], report: VerifyReport) -> None:
    """The Trainer's ``checkpoint-N`` folders of ``root`` that no reader opens: one holding a
    PEFT adapter alone counts as unchecked bytes; any other is a problem (its model deleted,
    its shards without their index), since the Trainer resumes from the newest of them."""
    from ..storage.commit import is_temporary

    try:
        folders = [
            d
            for d in root.iterdir()
            if TRAINER_CHECKPOINT.fullmatch(d.name) and d.is_dir() and not is_temporary(d.name)
        ]
    except OSError:
        return
    for folder in sorted(set(folders) - set(found), key=lambda d: (len(d.name), d.name)):
        if any(p.path == str(folder) for p in report.problems):
            continue  # said already (a link out of the directory)
        try:
            files = [f for f in folder.rglob("*") if f.is_file() and not f.is_symlink()]
            names = {f.name for f in files}
        except OSError:
            continue  # gone meanwhile
        if names & PEFT_ADAPTER_FILES:
            report.unchecked_bytes += sum(f.stat().st_size for f in files)
            _unchecked_because(report, "a checkpoint-N holding a PEFT adapter alone is not read")
            continue
        report.problems.append(
            Problem(
                str(folder),
                "not a checkpoint shardstream reads (no model.safetensors or its index, "
                "pytorch_model*.bin, verl .pt files or DCP .metadata), so nothing of it was "
                "checked; the Trainer resumes from the newest checkpoint-N"
                + (unread_hint(folder, folder.name) or ""),
            )
        )


def _verify_here(path: str | os.PathLike, progress) -> VerifyReport:
    from ..storage.run_layout import (
        LATEST_FILE,
        STEP_DIR,
        committed_steps,
        read_latest,
        uncommitted,
    )

    root = Path(path)
    if _kind(root) is Kind.TORCH_FILE:  # one torch.save file (PyTorch's recipes)
        report = VerifyReport(str(root), "torch.save file")
        _verify_torch_file(root, report, progress)
        return report
    if not root.is_dir():
        kind = kind_of(root)
        report = VerifyReport(str(root), "missing" if kind is None else "unknown")
        said = (
            "no such directory"
            if kind is None
            else f"is {kind}, expected a checkpoint directory or a torch.save file"
        )
        report.problems.append(Problem(str(root), said))
        return report
    kind = _kind(root)
    if (beside := second_model(root, kind)) is not None:
        report = VerifyReport(str(root), kind.value)
        report.problems.append(Problem(str(root), beside))
        return report
    if kind in (Kind.VERL, Kind.VERL_ROLES):  # a checkpoint, or a step of actor/critic ones
        report = VerifyReport(str(root), "verl")
        for role in _verl_checkpoints(root, kind):
            _verify_role(role, report, progress)
        return report
    if kind is Kind.NATIVE or (kind is Kind.NONE and STEP_DIR.match(root.name)):
        report = VerifyReport(str(root), "step")  # a step's directory without its manifest too
        with locks.reading(root / native.MANIFEST):  # a live run's retention leaves it meanwhile
            _verify_step_or_report(root, report, progress)
        return report
    if kind is Kind.HF_MODEL:
        report = VerifyReport(str(root), "huggingface")
        with locks.reading(locks.manifest_read_by(root, native.MANIFEST)):  # a step's export
            _verify_hf(root, report, progress)
        return report
    if kind is Kind.HF_TORCH:
        report = VerifyReport(str(root), "huggingface (pytorch_model.bin)")
        _verify_hf_torch(root, report, progress)
        return report
    if kind is Kind.DCP:
        report = VerifyReport(str(root), "dcp")
        _verify_dcp(root, report, progress)
        return report
    if kind is Kind.ACCELERATE:
        report = VerifyReport(str(root), "accelerate")
        _verify_accelerate(root, report, progress)
        return report
    if kind is Kind.TORCH_SAVE:
        report = VerifyReport(str(root), "torch.save")
        _verify_torch_save(root, report, progress)
        return report
    if kind is Kind.DCP_HF:
        report = VerifyReport(str(root), "dcp_hf")
        _verify_dcp_hf(root, report, progress)
        return report
    if kind is Kind.NONE and (unread := _unread_local_state(root)) is not None:
        report = VerifyReport(str(root), "accelerate (LOCAL_STATE_DICT)")
        report.problems.append(unread)
        return report
    if kind is not Kind.RUN and _checkpoints_in(root):
        # checkpoints of other tools side by side: the Trainer's output_dir (checkpoint-N)
        report = VerifyReport(str(root), "checkpoints")
        _verify_inside(root, report, progress)
        _verify_beside_checkpoints(root, report, progress)
        return report
    if kind is not Kind.RUN:
        report = VerifyReport(str(root), "unknown")
        report.problems.append(
            Problem(
                str(root),
                "not a checkpoint: no manifest.json, step directories, HF model, verl .pt files "
                f"or DCP .metadata{unread_hint(root) or _hint_below(root)}",
            )
        )
        return report
    steps = committed_steps(root)
    step_dirs = [e for e in root.iterdir() if STEP_DIR.match(e.name)]
    report = VerifyReport(str(root), "root", steps=steps)  # verl steps join as they pass
    report.uncommitted = uncommitted(root)
    for entry in sorted(step_dirs, key=lambda e: int(STEP_DIR.match(e.name)[1])):
        before = len(report.problems)
        kind = _kind(entry)
        if kind in (Kind.VERL, Kind.VERL_ROLES):  # a verl run: steps of actor/ (critic/)
            for role in _verl_checkpoints(entry, kind):
                _verify_role(role, report, progress)
            steps.append(int(STEP_DIR.match(entry.name)[1]))
        elif kind is not Kind.NATIVE and (leftovers := _only_leftovers(entry)):
            # verl's layout: a role's save cut short (global_step_N/actor.tmp-*), nothing else
            report.uncommitted += [f"{entry.name}/{name}" for name in leftovers]
        elif kind is not Kind.NATIVE:
            report.problems.append(Problem(str(entry), "step directory has no manifest.json"))
        else:
            with locks.reading(entry / native.MANIFEST):
                _verify_step_or_report(entry, report, progress)
        if len(report.problems) > before and not entry.exists():
            del report.problems[before:]  # a live run's retention removed it while we read it
    latest = read_latest(root)
    if (root / LATEST_FILE).exists() and latest is None:
        report.problems.append(
            Problem(
                str(root / LATEST_FILE),
                "damaged: does not hold a step number (readers fall back to the highest "
                "committed step)",
            )
        )
    elif latest is not None and latest not in steps and latest not in committed_steps(root):
        # (a live run may have committed it, then moved the pointer, since the listing above)
        report.problems.append(
            Problem(str(root / LATEST_FILE), f"names step {latest}, which is not committed")
        )
    return report


def _verify_beside_checkpoints(root: Path, report: VerifyReport, progress) -> None:
    """The other folders of a directory of checkpoints: the ``torch.save`` files of one
    (torchtune's ``recipe_state/recipe_state.pt``, the training state it resumes from) are
    verified as such; a folder of anything else is listed as not read."""
    from ..storage.commit import is_temporary

    taken = set(report.checked)
    try:
        folders = sorted(
            d
            for d in root.iterdir()
            if d.is_dir() and not d.is_symlink() and d.name not in taken
            if not is_temporary(d.name) and not TRAINER_CHECKPOINT.fullmatch(d.name)
        )
    except OSError:
        return
    for folder in folders:
        try:
            files = sorted(f for f in folder.iterdir() if f.is_file() and not f.is_symlink())
        except OSError:
            continue  # gone meanwhile, or not ours to list
        torch_files = [f for f in files if f.suffix in (".pt", ".pth")]
        if not torch_files:
            report.not_read.append(folder.name)
            continue
        for file in torch_files:
            part = VerifyReport(str(file), "torch.save file")
            _verify_torch_file(file, part, progress)
            _absorb(report, part, f"{folder.name}/{file.name}")
        if len(torch_files) < len(files):
            report.not_read.append(f"{folder.name} (its other files)")


def _hint_below(directory: Path) -> str:
    """``unread_hint`` of the first of ``directory``'s checkpoint-N folders that has one (a
    Trainer's output_dir of PEFT adapters), with how many such folders there are."""
    try:
        folders = sorted(
            (d for d in directory.iterdir() if TRAINER_CHECKPOINT.fullmatch(d.name)),
            key=lambda d: (len(d.name), d.name),
        )
    except OSError:
        return ""
    for folder in folders:
        if hint := unread_hint(folder, f"{folder.name} (of {len(folders)} checkpoint-N)"):
            return hint
    return ""


def _only_leftovers(directory: Path) -> list[str]:
    """The names of ``directory``'s uncommitted temporaries when it holds nothing else (a
    step directory a killed save of one role left), else []."""
    from ..storage.commit import is_temporary

    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return names if names and all(is_temporary(name) for name in names) else []


def _unread_local_state(directory: Path) -> Problem | None:
    """accelerate's FSDP1 LOCAL_STATE_DICT model files, which nothing here reads: a problem
    (not checked is not OK), else None."""
    from ..formats.source import refuse_local_state_dict

    try:
        refuse_local_state_dict(directory)
    except ShardstreamError as exc:
        return _problem_in(directory, exc)
    return None


def _checkpoints_in(directory: Path) -> list[Path]:
    """The subdirectories of ``directory`` that verify knows (checkpoints of any format, HF
    models, runs), by the step they are named for (``checkpoint-N``, ``step-N``), then by
    name; none where it cannot be listed."""
    from ..formats.dcp import step_of_name
    from ..storage.commit import is_temporary

    try:
        entries = [d for d in directory.iterdir() if d.is_dir() and not is_temporary(d.name)]
        # a link to the directory itself or above it (checkpoint-30 -> ..) would walk it again
        here = directory.resolve()
        entries = [d for d in entries if not (d.is_symlink() and here.is_relative_to(d.resolve()))]
    except OSError:
        return []
    found = [d for d in entries if _kind(d) is not Kind.NONE]
    return sorted(found, key=lambda d: (step_of_name(d.name) or 0, d.name))


def _kind(directory: Path) -> Kind:
    try:
        return detect(directory)
    except OSError:  # gone (a live run's retention removed it while we looked)
        return Kind.NONE


def _verl_checkpoints(directory: Path, kind: Kind) -> list[Path]:
    """``directory`` if it is a verl checkpoint, else its subdirectories that are (a verl step
    directory holds ``actor/`` and maybe ``critic/``)."""
    if kind is Kind.VERL:
        return [directory]
    try:
        return verl_roles(directory)
    except OSError:  # gone meanwhile
        return []


def _verify_role(directory: Path, report: VerifyReport, progress) -> None:
    """A role of a verl step (``actor/``): verl's ``.pt`` files, or a shardstream checkpoint
    the verl plug-in wrote there."""
    if _kind(directory) is Kind.NATIVE:
        _verify_step_or_report(directory, report, progress)
    else:
        _verify_verl(directory, report, progress)


def _verl_replicas_agree(checkpoint, report: VerifyReport) -> None:
    """Plain tensors every rank stored must hold the same bytes, as merge requires: digests
    compared a buffer at a time, as merge compares them."""
    from ..engine.copy import Buffers, Streamer
    from ..engine.endpoints import OpenEndpoints
    from ..units import DEFAULT_BUFFER_BYTES
    from .merge import check_replicas

    endpoints = OpenEndpoints(checkpoint.endpoint)
    try:
        check_replicas(checkpoint, Streamer(endpoints, Buffers.sized(DEFAULT_BUFFER_BYTES)))
    except ShardstreamError as exc:
        head, _, rest = str(exc).partition(": ")
        report.problems.append(Problem(head, rest))
    finally:
        endpoints.close()


def _verl_shard_replicas_agree(checkpoint, report: VerifyReport) -> None:
    """HSDP: each DTensor piece a replicated mesh dimension (``ddp``) stores again must hold
    the bytes of the piece merge reads. A piece that fills its zip record compares by the
    records' CRC-32s (already checked against the bytes); any other, or records that differ, by
    digests of the elements, a buffer at a time. One problem per tensor."""
    from ..engine.copy import Buffers, Streamer, hash_block
    from ..engine.dtypes import itemsize
    from ..engine.endpoints import OpenEndpoints
    from ..engine.plan import row_major_strides
    from ..formats.torch_pt import zip_records
    from ..units import DEFAULT_BUFFER_BYTES

    records: dict[str, dict[int, object]] = {}

    def crc(block) -> str | None:
        if block.location not in records:
            records[block.location] = {r.start: r for r in zip_records(block.location)}
        record = records[block.location].get(block.offset)
        whole = block.numel * itemsize(block.dtype)
        dense = block.strides == row_major_strides(block.shape)
        if record is None or not dense or record.end - record.start != whole:
            return None
        return record.crc

    by_name = {t.name: t for t in checkpoint.tensors}
    endpoints = OpenEndpoints(checkpoint.endpoint)
    streamer = Streamer(endpoints, Buffers.sized(DEFAULT_BUFFER_BYTES))
    try:
        for name, pairs in checkpoint.shard_replicas.items():
            shape = by_name[name].shape
            for replica, first in pairs:
                stored = crc(replica)
                if stored is not None and stored == crc(first):
                    continue
                if hash_block(name, shape, replica, streamer) != hash_block(
                    name, shape, first, streamer
                ):
                    report.problems.append(
                        Problem(
                            replica.location,
                            f"tensor {name!r}: its piece at {list(replica.start)} differs from "
                            f"the replica in {first.location}, which merge reads; the "
                            "data-parallel (HSDP) replicas disagree",
                        )
                    )
                    break
    except (ShardstreamError, OSError) as exc:
        report.problems.append(_problem_in(checkpoint.directory, exc))
    finally:
        endpoints.close()


def _config_files_sound(directory: Path, config_dir: Callable[[], Path | None], report) -> None:
    """The config and tokenizer files merge copies into its output (``config_dir()`` finds
    them, as merge does) are regular files inside the checkpoint, and config.json a JSON
    object: merge refuses anything else."""
    from ..formats.hf import config_files, read_config

    try:
        found = config_dir()
        if found is not None:
            config_files(found)
            read_config(found)
    except (ShardstreamError, OSError) as exc:
        report.problems.append(_problem_in(directory, exc))


def _config_describes(checkpoint, report: VerifyReport) -> None:
    """The checkpoint's config.json describes its weights as merge checks it
    (``hf_names.check_config_agrees``: depth, embedding, widths, biases; no transformers):
    merge refuses a config.json of another model."""
    from ..formats import lora
    from ..formats.hf import read_config
    from ..formats.hf_names import check_config_agrees, strip_wrappers

    found = checkpoint.config_dir()
    if found is None or not (found / "config.json").is_file():
        return
    split = lora.split_lora(checkpoint.tensors)
    tensors = split.base if split else checkpoint.tensors
    plain = strip_wrappers([t.name for t in tensors])
    try:
        config = read_config(found)
        check_config_agrees(
            [(plain[t.name], t.shape) for t in tensors], config, str(found / "config.json")
        )
    except ShardstreamError as exc:
        report.problems.append(_problem_in(checkpoint.directory, exc))


def _verify_verl(directory: Path, report: VerifyReport, progress) -> None:
    """Every zip record of every ``.pt`` file against its CRC-32 (torch records one and checks
    none), every rank's files present, the layout consistent, and ``huggingface/`` if it holds
    weights. verl's files carry no checksum of their own beyond these."""
    from ..formats import verl

    bad = []
    buffer = memoryview(bytearray(READ_BYTES))
    stale = _other_world_sizes(directory)
    for file in sorted(directory.glob("*.pt")):
        if str(file) in stale or not VERL_ANY_FILE.fullmatch(file.name):
            # an earlier save's at another world size, or no rank file's name (rank_01.pt,
            # data.pt): never read
            report.unnamed.append(file.name)
            continue
        try:
            bad += [(file, record) for record in _bad_zip_records(file, report, progress, buffer)]
        except (ShardstreamError, OSError) as exc:
            report.problems.append(Problem(str(file), _strip(exc, file)))
            continue
        report.files_checked += 1
    for kind in ("optim", "extra_state"):
        _verl_ranks_complete(directory, kind, report)
    _verl_optimizer_layout(directory, report)
    try:
        checkpoint = verl.open_verl(directory, keep_shard_replicas=True)
        named = [(t.name, t.blocks) for t in checkpoint.tensors]
        named += list(checkpoint.replicas.items())
        _verify_lora(directory, checkpoint.tensors, None, report)
        _config_files_sound(directory, checkpoint.config_dir, report)
        _config_describes(checkpoint, report)
    except (ShardstreamError, OSError) as exc:
        named = []
        if not any(str(exc).startswith(str(file)) for file, _ in bad):  # not said already
            report.problems.append(_problem_in(directory, exc))
    for file, record in bad:
        report.problems.append(_crc_mismatch(file, record, named))
    if named and not bad and checkpoint.replicas:  # sound records: do the ranks agree?
        _verl_replicas_agree(checkpoint, report)
    if named and not bad and checkpoint.shard_replicas:
        _verl_shard_replicas_agree(checkpoint, report)
    hf_dir = directory / verl.HF_SUBDIR
    if (hf_dir / hf.SINGLE_FILE).is_file() or (hf_dir / hf.INDEX_FILE).is_file():
        _verify_hf(hf_dir, report, progress)


def _other_world_sizes(directory: Path) -> set[str]:
    """The rank files of a verl directory saved again at another world size that are not
    the save fsdp_config.json names (merge and restore read that one, with a warning)."""
    from ..formats import verl

    if len(verl.files_by_world_size(directory, "model")) < 2:
        return set()
    try:
        world, _ = verl._rank_files(directory)
    except (ShardstreamError, OSError):
        return set()  # no config names one: refused, and said, as merge refuses it
    return {
        path
        for kind in ("model", "optim", "extra_state")
        for size, ranks in verl.files_by_world_size(directory, kind).items()
        if size != world
        for path in ranks.values()
    }


def _bad_zip_records(file: Path, report: VerifyReport, progress, buffer) -> list:
    """The zip records of the torch archive ``file`` whose bytes fail their CRC-32 (torch
    records one and checks none); raises if the archive cannot be read. A record saved with
    CRC-32 off (0 there) counts as unchecked bytes (``_crc_recorded``)."""
    from ..engine.checksum import Crc32
    from ..formats.torch_pt import zip_records

    bad = []
    records = zip_records(str(file), unchecked=True)
    with open_regular(file, buffering=0) as f:
        for record in records:
            f.seek(record.start)
            hasher = Crc32()
            _hash_span(f, record.end - record.start, hasher, report, progress, buffer)
            if hasher.hexdigest() != record.crc and _crc_recorded(record, report):
                bad.append(record)
    return bad


NO_CRC = "torch.save records saved with CRC-32 off (set_crc32_options(False)) carry none"
NOT_OURS = "safetensors files shardstream did not write carry no checksums"


def _crc_recorded(record, report: VerifyReport) -> bool:
    """Whether ``record``'s CRC-32 field holds one: 0 (torch's ``set_crc32_options(False)``,
    or a field zeroed) checks nothing, so its bytes count as unchecked, said so."""
    if record.crc != "00000000":
        return True
    report.unchecked_bytes += record.end - record.start
    report.bytes_checked -= record.end - record.start  # read, but against nothing
    _unchecked_because(report, NO_CRC)
    return False


def _unchecked_because(report: VerifyReport, *why: str) -> None:
    report.unchecked_why += [w for w in why if w not in report.unchecked_why]


def _verify_dcp(directory: Path, report: VerifyReport, progress=None) -> None:
    """DCP's metadata is read (safely) and every byte range it names is checked to lie inside
    a data file that exists; then every item's zip records against their CRC-32s."""
    from ..formats.dcp import check_dcp, config_dir_of

    named = None
    try:
        named = set(check_dcp(directory))
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc))
    # the files looked at, passed or not (a failed check names its problem above); a data
    # file the .metadata does not name is not one of them
    try:
        configs = directory == config_dir_of(directory)  # its config files are checked below
    except (ShardstreamError, OSError):
        configs = False  # said by _config_files_sound
    for f in sorted(directory.iterdir()):
        if not f.is_file():
            continue
        if f.suffix == ".distcp":
            if named is not None and str(f) not in named:
                report.unnamed.append(f.name)
            else:
                report.files_checked += 1
        elif f.suffix in (".pt", ".pth"):  # a torch.save file beside (Lightning's meta.pt):
            _verify_pickled(f, report, progress, list)  # its records, no tensor of it read
        elif f.name.endswith(".metadata") or configs:
            report.files_checked += 1
        else:
            report.not_read.append(f.name)
    if not any(p.path.startswith(str(directory)) for p in report.problems):
        _verify_dcp_records(directory, report, progress)  # its structure is sound
    _config_files_sound(directory, lambda: config_dir_of(directory), report)


def _verify_dcp_hf(directory: Path, report: VerifyReport, progress) -> None:
    """DCP's HuggingFaceStorageWriter output: a consolidated model as any HF model; the
    per-rank files' headers, sharding records and tiling (they carry no checksums)."""
    from ..formats.dcp_hf import SHARDED_SUBDIR, open_dcp_hf, shard_files
    from ..formats.source import is_hf_model

    if is_hf_model(directory):
        _verify_hf(directory, report, progress)
        directory = directory / SHARDED_SUBDIR
    try:
        open_dcp_hf(directory)
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc))
    report.files_checked += len(shard_files(directory))


def _verify_accelerate(directory: Path, report: VerifyReport, progress=None) -> None:
    """accelerate's save_state: every DCP part (models, optimizers) as ``_verify_dcp``; the
    whole state dicts of ``FULL_STATE_DICT`` (``pytorch_model_fsdp.bin``, ``optimizer.bin``) as
    ``_verify_full_state``; its other torch.save files (scheduler, RNG, GradScaler,
    register_for_checkpointing objects, stateful dataloaders) record by record against their
    CRC-32s and through the restricted unpickler (which refuses code); a pickled sampler object
    and the Trainer's ``training_args.bin`` by their records only (never unpickled); a model
    ``save_pretrained`` wrote beside them as ``_verify_hf``, and the other models of a save
    without FSDP (``model_N.safetensors``, ``pytorch_model_N.bin``) file by file."""
    from ..formats.source import (
        ACCELERATE_FULL_MODEL_FILE,
        ACCELERATE_FULL_OPTIMIZER_FILE,
        ACCELERATE_MODEL_DIR,
        ACCELERATE_OPTIMIZER_DIR,
        ACCELERATE_PLAIN_MODEL_FILE,
        ACCELERATE_RNG_FILE,
        ACCELERATE_SAMPLER_FILE,
        ACCELERATE_SCHEDULER_FILE,
        ACCELERATE_STATE_FILE,
        TRAINER_ARGS_FILE,
        accelerate_state,
        is_hf_model,
        is_hf_torch_model,
    )
    from ..formats.torch_pt import check_records, load_restricted, numpy_globals

    try:
        parts = accelerate_state(directory)  # model 0 in both layouts: said here
        world_size = parts.world_size if parts else 1
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc))
        world_size = 1
    pickles = (ACCELERATE_SCHEDULER_FILE, ACCELERATE_RNG_FILE, ACCELERATE_STATE_FILE)
    # pickled objects (a sampler, the Trainer's TrainingArguments): records only, never unpickled
    objects = (ACCELERATE_SAMPLER_FILE, TRAINER_ARGS_FILE)
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if entry.is_dir() and (
            ACCELERATE_MODEL_DIR.match(name) or ACCELERATE_OPTIMIZER_DIR.match(name)
        ):
            _verify_dcp(entry, report)
        elif entry.is_file() and ACCELERATE_FULL_MODEL_FILE.match(name):
            _verify_full_state(entry, report, progress, world_size)
        elif entry.is_file() and ACCELERATE_FULL_OPTIMIZER_FILE.match(name):
            _verify_full_state(entry, report, progress)
        elif entry.is_file() and ACCELERATE_PLAIN_MODEL_FILE.match(name):  # model N >= 1
            if name.endswith(".bin"):
                _verify_full_state(entry, report, progress, world_size=1)
            else:
                _verify_safetensors(entry, report, progress)
        elif any(p.match(name) for p in (*pickles, *objects)):
            report.files_checked += 1
            try:
                present(entry)  # a directory or FIFO in a state file's place: restore fails
                check_records(str(entry))
                if not any(p.match(name) for p in objects):
                    load_restricted(str(entry), str(entry), "cpu", numpy_globals())
                report.bytes_checked += entry.stat().st_size
            except ShardstreamError as exc:
                report.problems.append(Problem(str(entry), _strip(exc, entry)))
    # save_pretrained's output beside: the Trainer's checkpoint-N (FULL_STATE_DICT), and the
    # model itself of a save without FSDP
    if is_hf_model(directory):
        _verify_hf(directory, report, progress)
    elif is_hf_torch_model(directory):
        _verify_hf_torch(directory, report, progress)


def _verify_torch_save(directory: Path, report: VerifyReport, progress=None) -> None:
    """PyTorch's FSDP2 example: the model's and the optimizer's whole state dicts, each as
    ``_verify_full_state``."""
    from ..formats.source import TORCH_SAVE_MODEL_FILE, TORCH_SAVE_OPTIMIZER_FILE

    _verify_full_state(directory / TORCH_SAVE_MODEL_FILE, report, progress, world_size=1)
    optimizer_file = directory / TORCH_SAVE_OPTIMIZER_FILE
    if os.path.lexists(optimizer_file):
        _verify_full_state(optimizer_file, report, progress)


def _verify_torch_file(file: Path, report: VerifyReport, progress=None) -> None:
    """One torch.save file (PyTorch's recipes): as ``_verify_pickled``, its layout the model's
    state dict (at the top level or under a general checkpoint's key) as merge reads it, and
    an optimizer state dict beside it if one is."""
    from ..formats.torch_pt import load_layout
    from ..formats.torch_state_dict import (
        OPTIMIZER_PARTS,
        NoModelInFileError,
        open_torch_file,
        torch_file_layout,
    )

    def layout() -> list:
        state = load_layout(str(file))
        try:
            found = torch_file_layout(state, file)
        except NoModelInFileError:  # training state alone (torchtune's recipe_state.pt)
            key = next((k for k in OPTIMIZER_PARTS if isinstance(state.get(k), dict)), None)
            part, where = (state, str(file)) if key is None else (state[key], f"{file} [{key!r}]")
            _check_optimizer_state(part, where)  # flattened at the top level where key is None
            report.kind = "torch.save file (training state: an optimizer's, no model)"
            return []
        named = [(t.name, t.blocks) for t in open_torch_file(file, layout=found).tensors]
        if not named:
            raise CheckpointFormatError(f"{file}: holds no model tensors (merge refuses it)")
        if found.optimizer is not None:
            _check_optimizer_state(state[found.optimizer], f"{file} [{found.optimizer!r}]")
        return named

    _verify_pickled(file, report, progress, layout)


def _verify_full_state(
    file: Path, report: VerifyReport, progress, world_size: int | None = None
) -> None:
    """One whole state dict saved with ``torch.save`` (accelerate's ``FULL_STATE_DICT``), as
    ``_verify_pickled``: a model's layout as merge reads it (``world_size`` given: tensors
    under their names, each inside its record), an optimizer's as an optimizer state dict
    (``state``, ``param_groups``)."""
    from ..formats.torch_pt import load_layout
    from ..formats.torch_state_dict import open_torch_state_dict

    def layout() -> list:
        if world_size is None:
            _check_optimizer_state(load_layout(str(file)), str(file))
            return []
        checkpoint = open_torch_state_dict(file, world_size=world_size)
        return [(t.name, t.blocks) for t in checkpoint.tensors]

    _verify_pickled(file, report, progress, layout)


def _check_optimizer_state(state: object, where: str) -> None:
    from ..formats.torch_state_dict import nested_optimizer

    state = nested_optimizer(state)  # saved flattened (flatten_optimizer_state_dict)
    if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
        raise CheckpointFormatError(
            f"{where}: not an optimizer state dict (no state and param_groups)"
        )


def _verify_pickled(file: Path, report: VerifyReport, progress, layout: Callable[[], list]) -> None:
    """Every zip record of the torch.save ``file`` against its CRC-32, then its pickle through
    the restricted unpickler (layout only, onto the meta device) by ``layout``, which returns
    the (name, blocks) of the tensors it holds: a damaged record is named with its tensors."""
    report.files_checked += 1
    try:
        bad = _bad_zip_records(file, report, progress, memoryview(bytearray(READ_BYTES)))
    except (ShardstreamError, OSError) as exc:
        report.problems.append(Problem(str(file), _strip(exc, file)))
        return
    named = []
    try:
        named = layout()
    except (ShardstreamError, OSError) as exc:
        if not bad:  # a damaged record explains it, and is said below
            report.problems.append(Problem(str(file), _strip(exc, file)))
    for record in bad:
        report.problems.append(_crc_mismatch(file, record, named))


def _verify_hf_torch(directory: Path, report: VerifyReport, progress) -> None:
    """A Hugging Face model saved with ``torch.save``: every weights file as a whole state
    dict (``_verify_full_state``), then the index against what the files hold, and
    config.json, as merge reads them."""
    from ..formats.dcp_hf import link_root
    from ..formats.torch_state_dict import open_torch_weights, torch_weights_files

    try:
        hf.check_no_links_out(directory, link_root(directory))
        hf.read_config(directory)
        hf.config_files(directory)
        files = torch_weights_files(directory)[0]
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc))
        return
    before = len(report.problems)
    for file in files:
        try:
            if not present(file):
                report.problems.append(Problem(str(file), "missing (named in the index)"))
                continue
        except ShardstreamError as exc:  # a FIFO, a directory, a broken link: what it is
            report.problems.append(Problem(str(file), _strip(exc, file)))
            continue
        _verify_full_state(file, report, progress, world_size=1)
    if len(report.problems) == before:  # the files are sound: do they make the model?
        try:
            if not open_torch_weights(directory).tensors:
                report.problems.append(
                    Problem(str(directory), "holds no model tensors (merge refuses it)")
                )
        except ShardstreamError as exc:
            report.problems.append(_problem_in(directory, exc))


def _verl_optimizer_layout(directory: Path, report: VerifyReport) -> None:
    """The optimizer files' layout, read as restore reads it: each rank file must hold the
    state its name says (the saving rank its DTensors record), the same tensors as rank 0's,
    and pieces that tile every tensor. Swapped rank files fail here, as in restore."""
    from ..formats import verl

    found = verl.files_by_world_size(directory, "optim")
    if len(found) != 1:
        return  # none, or several world sizes (reported above)
    ((world, ranks),) = found.items()
    if set(ranks) != set(range(world)):
        return  # a missing rank file (reported above)

    def flatten(state, path: str) -> dict:
        entries = state.get("state") if isinstance(state, dict) else None
        if not isinstance(entries, dict):
            raise CheckpointFormatError(f"{path}: not an optimizer state dict (no state)")
        return {
            f"state.{pid}.{key}": value
            for pid, values in entries.items()
            if isinstance(values, dict)
            for key, value in values.items()
        }

    try:
        files = [str(check_inside(Path(ranks[r]), directory)) for r in range(world)]
        _, plain = verl.saved_param_groups(directory, world)
        if plain:  # FSDP1: each rank's runs of elements; a rank holding none of a parameter
            for path in files:  # has no state for it, so only each file's layout is checked
                verl.read_entries(path, flatten, keep_scalars=True)
        else:
            verl.read_rank_layouts(files, flatten, keep_scalars=True)
    except (ShardstreamError, OSError) as exc:
        report.problems.append(_problem_in(directory, exc))


def _verify_dcp_records(directory: Path, report: VerifyReport, progress) -> None:
    """Every item DCP wrote (model, optimizer, anything) is a ``torch.save`` archive whose zip
    records carry CRC-32s: each record against its CRC, as for verl's ``.pt`` files."""
    from ..engine.checksum import Crc32
    from ..formats.dcp import item_ranges
    from ..formats.torch_pt import zip_records_in

    try:  # .metadata, or the per-rank metadata of a save without collectives
        items = item_ranges(directory)
    except (ShardstreamError, OSError) as exc:
        report.problems.append(_problem_in(directory, exc))
        return
    if not items:
        report.problems.append(
            Problem(str(directory), "holds no entries: an empty state dict was saved")
        )
    buffer = memoryview(bytearray(READ_BYTES))
    for key, path, start, length in items:
        try:
            with open_regular(path, buffering=0) as f:
                records = zip_records_in(str(path), start, length, f.fileno(), unchecked=True)
                for record in records:
                    f.seek(record.start)
                    hasher = Crc32()
                    _hash_span(f, record.end - record.start, hasher, report, progress, buffer)
                    if hasher.hexdigest() != record.crc and _crc_recorded(record, report):
                        report.problems.append(
                            Problem(
                                str(path),
                                f"CRC-32 mismatch in zip record {record.name}",
                                key,
                                (record.start, record.end),
                            )
                        )
        except (ShardstreamError, OSError) as exc:
            report.problems.append(Problem(str(path), f"item {key!r}: {_strip(exc, path)}"))


def _verl_ranks_complete(directory: Path, kind: str, report: VerifyReport) -> None:
    """verl's optimizer or extra-state files, if any, come from one world size, every rank."""
    from ..formats import verl

    found = verl.files_by_world_size(directory, kind)
    if len(found) > 1:
        report.problems.append(
            Problem(str(directory), f"{kind} files from several world sizes {sorted(found)}")
        )
    elif found:
        ((world, ranks),) = found.items()
        for rank in sorted(set(range(world)) - set(ranks)):
            name = f"{kind}_world_size_{world}_rank_{rank}.pt"
            report.problems.append(Problem(str(directory / name), "missing"))


def _verify_step_or_report(directory: Path, report: VerifyReport, progress) -> None:
    """``_verify_step``, with a file that cannot be read (or vanished) reported, not raised."""
    try:
        _verify_step(directory, report, progress)
    except OSError as exc:
        where = exc.filename if exc.filename else directory
        report.problems.append(Problem(str(where), _cannot_read(exc)))


def _verify_step(directory: Path, report: VerifyReport, progress) -> None:

    try:
        manifest = native.read_manifest(directory)
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc, directory / native.MANIFEST))
        return
    before = len(report.problems)
    files = manifest.get("files", {})
    for name, info in files.items():
        try:
            file = native.check_name(directory, name, "files")
        except ShardstreamError as exc:
            report.problems.append(Problem(str(directory / native.MANIFEST), str(exc)))
            continue
        try:
            found = present(file)
        except ShardstreamError as exc:  # a FIFO, a device, a folder, a broken link
            report.problems.append(Problem(str(file), _strip(exc, file)))
            continue
        if not found:
            note = native.missing_note(manifest, name)
            report.problems.append(Problem(str(file), f"missing (named in the manifest){note}"))
            continue
        size = file.stat().st_size
        if not isinstance(info, dict) or size != info.get("size"):
            expected = info.get("size") if isinstance(info, dict) else "?"
            report.problems.append(
                Problem(str(file), f"size {size} bytes, manifest says {expected}")
            )
            continue
        if "header_xxh3" in info:
            _verify_safetensors(file, report, progress, info["header_xxh3"])
        else:
            _verify_whole(file, info.get("xxh3"), report, progress)
    if len(report.problems) == before:
        try:
            # cross-checks chunks against headers and tiling
            checkpoint = native.open_native(directory)
        except ShardstreamError as exc:
            report.problems.append(_problem_in(directory, exc))
        else:
            _verify_lora(directory, checkpoint.tensors, checkpoint.lora_settings, report)
            _verify_state_nesting(directory, manifest, report)
    # A manifest that lists every file: one it does not list was added or renamed since.
    for path, problem in native.unlisted_files(directory, manifest):
        report.problems.append(Problem(str(path), problem))


def _verify_state_nesting(directory: Path, manifest: dict, report: VerifyReport) -> None:
    """Saved state (the manifest's objects, each rank's extra-state JSON) as restore decodes
    it: nested no deeper than a save writes (``jsondoc.MAX_NESTING``)."""
    limit = jsondoc.MAX_NESTING
    too_deep = f"values nested over {limit} deep, which no save writes; restore refuses them"
    if jsondoc.nested_deeper(manifest.get("objects"), limit + 1):  # below the 'objects' key
        report.problems.append(Problem(str(directory / native.MANIFEST), f"objects: {too_deep}"))
    for name in manifest.get("files", {}):
        if not native.EXTRA_JSON.fullmatch(name):
            continue
        path = native.check_name(directory, name, "files")
        try:
            with open_regular(path) as f:
                value = json.loads(f.read())  # as restore reads it
        except (OSError, ShardstreamError, ValueError) as exc:
            report.problems.append(
                Problem(str(path), f"extra state unreadable: {_strip(exc, path)}")
            )
            continue
        except RecursionError:
            value = None
        if value is None or jsondoc.nested_deeper(value, limit):
            report.problems.append(Problem(str(path), f"extra state: {too_deep}"))


def _verify_lora(directory: Path, tensors, recorded: dict | None, report: VerifyReport) -> None:
    """LoRA factors as merge needs them: settings it can apply, every factor of rank r, and
    (unless the adapter was saved alone) a base weight each pair fits."""
    from ..formats import lora

    tensors = list(tensors)
    if lora.unsupported_peft(t.name for t in tensors) is not None:
        return  # intact, though merge refuses it (it says why): not a problem of the files
    try:
        split = lora.split_lora(tensors)
        if split is None:
            return
        lora.check_factors(split, lora.lora_settings(directory, recorded).r)
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc))


def _verify_whole(file: Path, expected: str | None, report: VerifyReport, progress) -> None:
    hasher = new_hasher()
    try:
        f = open_regular(file, buffering=0)
    except OSError as exc:
        report.problems.append(Problem(str(file), _cannot_read(exc)))
        return
    except ShardstreamError as exc:
        report.problems.append(Problem(str(file), _strip(exc, file)))
        return
    with f:
        _hash_span(f, os.fstat(f.fileno()).st_size, hasher, report, progress)
    report.files_checked += 1
    if hasher.hexdigest() != expected:
        report.problems.append(Problem(str(file), "checksum mismatch"))


def _hash_span(f, length: int, hasher, report: VerifyReport, progress, buffer=None) -> None:
    """Feed the next ``length`` bytes of the unbuffered file ``f`` to ``hasher``, read into one
    reused buffer (a fresh ``bytes`` per read cost an allocation and its page faults)."""
    buffer = buffer if buffer is not None else memoryview(bytearray(min(READ_BYTES, length)))
    while length > 0:
        n = f.readinto(buffer[: min(length, len(buffer))])
        if not n:
            return
        hasher.update(buffer[:n])
        length -= n
        report.bytes_checked += n
        if progress:
            progress(n)


def _verify_safetensors(
    file: Path, report: VerifyReport, progress, header_digest: str | None = None
) -> SafetensorsHeader | None:
    try:
        header = read_header(file)
    except ShardstreamError as exc:
        report.problems.append(Problem(str(file), _strip(exc, file)))
        return None
    with open_regular(file) as f:
        raw = f.read(header.data_start)
    if header_digest is not None and digest(raw) != header_digest:
        report.problems.append(
            Problem(
                str(file),
                "header checksum mismatch (header altered or file swapped)",
                byte_range=(0, header.data_start),
            )
        )
    try:
        sums = stored_checksums(header)
    except ShardstreamError as exc:
        report.problems.append(Problem(str(file), _strip(exc, file)))
        return header
    report.files_checked += 1
    if sums is None:
        report.bytes_checked += header.data_start
        report.unchecked_bytes += header.file_size - header.data_start
        _unchecked_because(report, NOT_OURS)
        return header  # a foreign file: structure checked, no checksums to compare
    if entries_digest(header.tensors.values()) != sums.entries:
        report.problems.append(
            Problem(
                str(file),
                "tensor table does not match its recorded digest (header altered)",
                byte_range=(0, header.data_start),
            )
        )
    elif header_digest is None and not _canonical_header(header, raw):
        # No manifest digest to anchor this header (a merged HF file): shardstream writes it in
        # one exact form, so any other text (padding, escapes, metadata) is an alteration.
        report.problems.append(
            Problem(
                str(file),
                "header differs from the form shardstream wrote (header altered)",
                byte_range=(0, header.data_start),
            )
        )
    with open_regular(file, buffering=0) as f:
        f.seek(header.data_start)
        buffer = memoryview(bytearray(min(READ_BYTES, sums.chunk_bytes)))
        for index, expected in enumerate(sums.chunks):
            lo = header.data_start + index * sums.chunk_bytes
            hasher = new_hasher()
            length = min(sums.chunk_bytes, header.file_size - lo)
            _hash_span(f, length, hasher, report, progress, buffer)
            if hasher.hexdigest() != expected:
                hi = min(lo + sums.chunk_bytes, header.file_size)
                names = tensors_in_range(header, lo, hi)
                report.problems.append(
                    Problem(str(file), "checksum mismatch", ", ".join(names) or None, (lo, hi))
                )
    return header


def _canonical_header(header: SafetensorsHeader, raw: bytes) -> bool:
    """Whether ``raw`` is exactly what shardstream's writer makes of this header's contents:
    data aligned for direct I/O, or (files written before that) to 8 bytes. A header listing
    the files beside the weights (``FILES_KEY``) kept room for that list before it was
    known: its spaces run to where the data starts."""
    entries = sorted(header.tensors.values(), key=lambda e: e.begin)
    layout = [(e.name, e.dtype, e.shape) for e in entries]
    if header.metadata.get("format") != "pt":
        return False
    if FILES_KEY in header.metadata:
        rebuilt = encode_header(entries, header.metadata, 8, len(raw))
        return len(raw) % 8 == 0 and rebuilt == raw
    return any(
        build_header(layout, header.metadata, align)[0] == raw for align in (DIRECT_ALIGN, 8)
    )


def _verify_hf(directory: Path, report: VerifyReport, progress) -> None:
    index_path = directory / hf.INDEX_FILE
    try:
        both = hf.both_weights_files(directory)
    except ShardstreamError as exc:  # a FIFO, directory or broken link under either name
        report.problems.append(_problem_in(directory, exc))
        return
    if both:
        report.problems.append(Problem(str(directory), both))
    config = None
    try:  # merge reads config.json and copies the tokenizer files: refused there, named here
        from ..formats.dcp_hf import link_root

        hf.check_no_links_out(directory, link_root(directory))
        config = hf.read_config(directory)
        hf.config_files(directory)
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc))
    if index_path.is_file():
        try:
            index = jsondoc.read_object(index_path, "safetensors index (JSON object)")
            weight_map = index["weight_map"]
            metadata = index.get("metadata", {})
            if not isinstance(weight_map, dict) or not isinstance(metadata, dict):
                raise ValueError("weight_map or metadata is not an object")
            total = metadata.get("total_size")  # None: not said
            if total is not None and type(total) is not int:
                raise ValueError(f"total_size {total!r} is not an integer")
            odd = [v for v in weight_map.values() if not isinstance(v, str)]
            if odd:
                raise ValueError(f"weight_map names a file {str(odd[0])[:80]!r}, not a string")
            if not weight_map:
                raise ValueError("weight_map lists no tensor")
        except ShardstreamError as exc:
            report.problems.append(Problem(str(index_path), _strip(exc, index_path)))
            return
        except (ValueError, KeyError, TypeError) as exc:
            report.problems.append(Problem(str(index_path), f"malformed index ({exc})"))
            return
        indexed = set(weight_map.values())
        names = sorted(indexed)
        # other weights beside (an earlier save's shards, Mistral's consolidated.safetensors):
        # never read, so said, not counted as checked
        report.unnamed += sorted(
            p.name for p in directory.glob("*.safetensors") if p.name not in indexed
        )
    else:
        weight_map, total, names = None, -1, [hf.SINGLE_FILE]
    seen: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    total_bytes = 0
    first = None  # the first weight file's header: merge lists the other files there
    for name in names:
        if not hf.is_plain_file_name(name):
            report.problems.append(Problem(str(index_path), f"unsafe file name {name[:300]!r}"))
            continue
        file = directory / name
        if not file.is_file():
            report.problems.append(Problem(str(file), "missing (named in the index)"))
            continue
        header = _verify_safetensors(file, report, progress)
        if header is None:
            continue
        if name == names[0]:
            first = header
        for tensor, entry in header.tensors.items():
            if tensor in seen:
                report.problems.append(
                    Problem(str(file), f"duplicate of the tensor in {seen[tensor]}", tensor)
                )
            if char := UNPRINTABLE.search(tensor):  # merge refuses to write such a name
                report.problems.append(
                    Problem(
                        str(file),
                        f"the name holds U+{ord(char.group()):04X}, a control or text-direction "
                        "character no module's name holds (merge refuses it)",
                        tensor[:200],
                    )
                )
            seen[tensor] = name
            shapes[tensor] = entry.shape
            total_bytes += entry.nbytes
    if weight_map is not None:
        for tensor, name in weight_map.items():
            if seen.get(tensor) != name and (directory / str(name)).is_file():
                report.problems.append(
                    Problem(
                        str(directory / str(name)), "tensor named in the index is missing", tensor
                    )
                )
        for tensor, name in seen.items():
            if tensor not in weight_map:
                report.problems.append(
                    Problem(str(directory / name), "tensor is not in the index", tensor)
                )
        if total is not None and total != total_bytes:
            report.problems.append(
                Problem(str(index_path), f"total_size {total} but tensors hold {total_bytes} bytes")
            )
    if first is not None and FILES_KEY in first.metadata:
        _verify_files_beside(directory, first, report)
    if not seen and not report.problems:
        report.problems.append(Problem(str(directory), "holds no model tensors (merge refuses it)"))
    try:  # config.json's depth and embedding against the stored tensors, as merge checks them
        from ..formats.hf_names import check_config_agrees

        check_config_agrees(list(shapes.items()), config or {}, str(directory / "config.json"))
    except ShardstreamError as exc:
        report.problems.append(_problem_in(directory, exc))


def _verify_files_beside(directory: Path, first: SafetensorsHeader, report: VerifyReport) -> None:
    """The files merge wrote beside the weights (config, tokenizer, index, adapter) against
    the digests the first weight file's header keeps (``FILES_KEY``)."""
    from ..formats.native import file_digest
    from ..formats.safetensors import read_files_value

    where = f"listed in the header of {Path(first.path).name}"
    listed = read_files_value(first.metadata[FILES_KEY])
    if listed is None:
        report.problems.append(Problem(first.path, f"its {FILES_KEY} metadata is malformed"))
        return
    for name, expected in listed.items():
        path = directory / name
        try:
            check_inside(path, directory)
            if not present(path):
                report.problems.append(Problem(str(path), f"missing ({where})"))
                continue
            found = file_digest(path)
        except ShardstreamError as exc:
            report.problems.append(_problem_in(directory, exc))
            continue
        except OSError as exc:
            report.problems.append(Problem(str(path), _cannot_read(exc)))
            continue
        if found != expected:
            report.problems.append(
                Problem(str(path), f"differs from what merge wrote (its digest is {where})")
            )
            continue
        report.files_checked += 1
        report.bytes_checked += path.stat().st_size


def _cannot_read(exc: OSError) -> str:
    """A file's OSError as a problem: "permission denied" as errors.py names it, else why."""
    if permission_denied(exc) is not None:
        return "permission denied"
    return f"cannot read: {exc.strerror or exc}"


def _problem_in(directory: Path, exc: Exception, where: Path | None = None) -> Problem:
    """``exc`` as a problem of the file inside ``directory`` its message starts with ("<dir>/
    manifest.json: ..."), said once; else of ``where`` (default ``directory``)."""
    text = str(exc)
    head, sep, rest = text.partition(": ")
    if sep and head.startswith(f"{directory}{os.sep}"):
        return Problem(head, rest)
    return Problem(str(where or directory), _strip(exc, directory))


def _strip(exc: Exception, path: Path) -> str:
    text = str(exc)
    prefix = f"{path}: "
    return text[len(prefix) :] if text.startswith(prefix) else text


def _crc_mismatch(file, record, named) -> Problem:
    """A zip record whose bytes fail its CRC-32, with the tensors it holds part of."""
    from ..engine.plan import tensors_touching

    tensors = tensors_touching(named, str(file), record.start, record.end)
    return Problem(
        str(file),
        f"CRC-32 mismatch in zip record {record.name}",
        ", ".join(tensors) or None,
        (record.start, record.end),
    )
