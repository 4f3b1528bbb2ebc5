"""test: compare a sharded checkpoint with a reference Hugging Face model, streamed.

This is verl's ``model_merger test``: the tensors a merge would produce are checked against a
reference directory (``model.safetensors``, or shards listed by ``model.safetensors.index.json``)
for keys, shapes, dtypes and values. Neither model is ever loaded whole: tensors are compared
one at a time, window by window. The checkpoint side is assembled by the planner and executor
(``plan_copy`` into a dense window, ``Streamer.rows``) and the reference side is read with
``pread`` at the offsets its safetensors header gives, through the same machinery.

Choices, following verl (``FSDPModelMerger._test_state_dict``):

* Keys: a tensor in the reference but not the checkpoint is *missing*, one in the checkpoint
  but not the reference is *unexpected*. A tied ``lm_head.weight`` (``tie_word_embeddings`` in
  the checkpoint's or the reference's config.json, or ``--tie-word-embedding``) is dropped from
  the checkpoint side exactly as ``merge`` drops it; if the reference still stores it, it is
  compared anyway.
* Dtypes: verl casts both sides to bfloat16. Here both sides are cast to ``dtype`` when given,
  otherwise the checkpoint is cast to the reference tensor's dtype. Floating tensors may differ
  in width; a floating tensor against an integer/bool one, or integer tensors of different
  dtypes, is a dtype mismatch. Integer and bool tensors keep their dtype and must match exactly.
* Values: verl calls ``torch.testing.assert_close(reference, merged, atol=1e-6, rtol=1e-6)``,
  so the defaults are ``atol=1e-6`` and ``rtol=1e-6``: an element passes when ``|ref - ckpt|
  <= atol + rtol * |ckpt|``, computed in float64 after both sides are cast to the comparison
  dtype (so an exact cast gives exact equality). If only one of ``atol``/``rtol`` is given,
  the other keeps its default. Non-finite values must match exactly; unlike ``assert_close``'s
  default, NaN at the same position on both sides counts as equal, since a faithful merge of a
  checkpoint holding NaN reproduces it. The default tolerance lets a 1-ulp float32 change
  pass; ``exact=True`` (``--exact``) asks for the same bits after the cast instead (a
  bit-exact merge passes it; -0.0 against 0.0 or another NaN payload does not).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..engine.copy import Buffers, Streamer, fill_window
from ..engine.dtypes import TORCH_BY_CODE, is_floating, itemsize, parse_dtype
from ..engine.endpoints import FileEndpoint, OpenEndpoints
from ..engine.plan import CopyRun, GlobalTensor, dense_block, plan_copy, stored_at
from ..errors import NamesUnderPrefixError, UsageError
from ..formats import hf, lora
from ..formats.dcp_hf import safetensors_endpoint
from ..formats.safetensors import read_header
from ..formats.source import Kind, detect, open_checkpoint
from ..units import DEFAULT_BUFFER_BYTES, parse_size

# verl's model_merger test: torch.testing.assert_close(..., atol=1e-6, rtol=1e-6).
DEFAULT_ATOL = 1e-6
DEFAULT_RTOL = 1e-6
# Elements compared at once in float64 (bounds the temporaries to a few MiB).
_COMPARE_ELEMS = 1 << 17


@dataclass
class CompareReport:
    reference: str
    checkpoint: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    compared: int = 0
    elements: int = 0
    max_abs_diff: float = 0.0
    dtype: str | None = None
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    exact: bool = False
    skipped: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def problem(self, line: str) -> None:
        self.problems.append(line)
        self.ok = False

    def to_json(self) -> dict:
        finite = math.isfinite(self.max_abs_diff)
        return {
            "ok": self.ok,
            "reference": self.reference,
            "checkpoint": self.checkpoint,
            "compared": self.compared,
            "elements": self.elements,
            "max_abs_diff": self.max_abs_diff if finite else None,
            "dtype": self.dtype,
            "atol": self.atol,
            "rtol": self.rtol,
            "exact": self.exact,
            "skipped": self.skipped,
            "problems": self.problems,
            "wall_s": self.wall_s,
        }


def compare_with_reference(
    local_dir: str | os.PathLike,
    test_hf_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    buffer_size: int | str = DEFAULT_BUFFER_BYTES,
    hf_model_path: str | os.PathLike | None = None,
    tie_word_embedding: bool = False,
    exact: bool = False,
    prefix: str | None = None,
) -> CompareReport:
    """Compare the checkpoint in ``local_dir`` with the HF model in ``test_hf_dir``.

    ``exact``: every element must have the same bits after the cast (no tolerance).
    ``prefix``: what a DCP checkpoint's model keys start with, where detection is ambiguous.

    Returns a report; ``report.ok`` is False when anything differs, and ``report.problems``
    has one line per problem naming the tensor. Raises only for unreadable inputs.
    """
    from .merge import check_replicas, heads_trained_apart, tied_duplicates, values_differ

    start = time.perf_counter()
    buffer_bytes = parse_size(buffer_size)
    if buffer_bytes < 1 << 16:
        raise UsageError("--buffer-size must be at least 64KiB")
    if exact and (atol is not None or rtol is not None):
        raise UsageError("--exact compares bits; it takes no --atol or --rtol")
    if exact:
        atol = rtol = 0.0
    atol = DEFAULT_ATOL if atol is None else float(atol)
    rtol = DEFAULT_RTOL if rtol is None else float(rtol)
    if not (atol >= 0 and rtol >= 0):
        raise UsageError(f"tolerances must be non-negative numbers (atol={atol}, rtol={rtol})")
    wanted_dtype = parse_dtype(dtype) if dtype else None
    if wanted_dtype is not None and not is_floating(wanted_dtype):
        raise UsageError(
            f"--dtype {dtype}: expected a floating dtype (bfloat16, float16, float32, float64)"
        )

    ref_dir = Path(test_hf_dir)
    adapter_dir = _adapter_only(ref_dir)  # a PEFT adapter, e.g. merge of a save_lora_only run
    # A reference shardstream wrote is checked against its checksums as it is read, as merge
    # checks the same files; other safetensors carry none.
    ref_endpoint = safetensors_endpoint
    kind = detect(ref_dir) if ref_dir.is_dir() and adapter_dir is None else Kind.NONE
    if adapter_dir is not None:
        reference = hf.whole_tensors(hf.tensors_of(read_header(adapter_dir / lora.ADAPTER_FILE)))
        ref_config = hf.read_config(ref_dir)
    elif kind is Kind.HF_TORCH:  # pytorch_model.bin
        from ..formats.torch_state_dict import open_torch_weights

        saved = open_torch_weights(ref_dir)
        reference, ref_config, ref_endpoint = saved.tensors, hf.read_config(ref_dir), saved.endpoint
    else:
        _refuse_checkpoint_as_reference(ref_dir, kind)
        if ref_dir.is_dir():  # as merge reads such a directory: no file of it links out
            from ..formats.dcp_hf import link_root

            hf.check_no_links_out(ref_dir, link_root(ref_dir))
        hf_tensors, ref_config = hf.read_hf_model(test_hf_dir)
        reference = hf.whole_tensors(hf_tensors)
    checkpoint = open_checkpoint(local_dir, model_only=True, prefix=prefix)
    config_dir = Path(hf_model_path) if hf_model_path else checkpoint.config_dir()
    if hf_model_path and not (config_dir / "config.json").is_file():
        raise UsageError(f"--hf_model_path {config_dir}: no config.json there")
    config = hf.read_config(config_dir)
    if not config and not hf_model_path and adapter_dir is None and ref_dir.is_dir():
        # None beside the checkpoint (DCP's): the reference's describes the model compared
        config_dir, config = ref_dir, hf.read_config(ref_dir)
    reference_ties = "tie_word_embeddings" in ref_config and hf.ties_word_embeddings(ref_config)
    lora.refuse_unsupported_peft(local_dir, (t.name for t in checkpoint.tensors))
    tensors, factors = _merged_names(checkpoint.tensors)
    # A tied head is told by its stored name (``lm_head.weight``), as merge tells it, before
    # the layout renames it (PaliGemma's ``language_model.lm_head.weight``); a reference that
    # stores it all the same is compared with it.
    drop = tied_duplicates(tensors, config, tie_word_embedding, reference_ties=reference_ties)
    as_stored = tensors
    try:
        seen = {t.name for t in reference}
        tensors, aliases = _saved_layout(tensors, config, config_dir, drop, seen)
    except NamesUnderPrefixError as exc:
        raise exc.read_under(getattr(checkpoint, "prefix", None)) from None
    adapter = ref_dir / lora.ADAPTER_DIR / lora.ADAPTER_FILE
    unreferenced: list[str] = []
    if adapter_dir is not None:  # the reference is the adapter itself; base weights not compared
        unreferenced = [t.name for t in tensors]
        tensors, adapter = factors, adapter_dir / lora.ADAPTER_FILE
    elif factors and adapter.is_file():  # the adapter merge writes beside the model
        reference = reference + hf.whole_tensors(hf.tensors_of(read_header(adapter)))
        tensors = tensors + factors

    report = CompareReport(
        reference=str(test_hf_dir),
        checkpoint=str(local_dir),
        dtype=wanted_dtype,
        atol=atol,
        rtol=rtol,
        exact=exact,
    )
    ours = {t.name: t for t in tensors}
    theirs = {t.name: t for t in reference}
    report.skipped = sorted(n for n in drop if n not in theirs)
    if factors and not adapter.is_file():
        report.skipped += [t.name for t in factors]
    report.skipped += unreferenced
    for t in reference:
        if t.name not in ours:
            report.problem(
                f"tensor {t.name!r}: missing from the checkpoint (the reference has it in "
                f"{t.blocks[0].location if t.blocks else ref_dir})"
            )
    for t in tensors:
        if t.name not in theirs and t.name not in drop:
            report.problem(f"tensor {t.name!r}: unexpected; the reference has no such tensor")

    pairs = []
    for ref in reference:
        ckpt = ours.get(ref.name)
        if ckpt is None:
            continue
        if tuple(ckpt.shape) != tuple(ref.shape):
            report.problem(
                f"tensor {ref.name!r}: shape mismatch: reference {list(ref.shape)}, "
                f"checkpoint {list(ckpt.shape)}"
            )
            continue
        target = _comparison_dtype(ckpt.dtype, ref.dtype, wanted_dtype)
        if target is None:
            report.problem(
                f"tensor {ref.name!r}: dtype mismatch: reference {ref.dtype}, checkpoint "
                f"{ckpt.dtype} (only floating dtypes are cast for comparison)"
            )
            continue
        pairs.append((ref, ckpt, target))

    # The checkpoint's side in the order its files hold it, so each file is read front to back.
    pairs.sort(key=lambda pair: stored_at(pair[1]))
    # The checkpoint's files are verified as they are read (shardstream's chunk digests, the
    # CRC-32s of verl's .pt records), as merge and restore do; DCP's files carry none.
    reference_files = {b.location for ref, _, _ in pairs for b in ref.blocks}

    def open_endpoint(location: str) -> FileEndpoint:
        own = location not in reference_files
        return (checkpoint.endpoint if own else ref_endpoint)(location)

    endpoints = OpenEndpoints(open_endpoint)

    ratio = max(
        (itemsize(src) / itemsize(target) for r, c, target in pairs for src in (r.dtype, c.dtype)),
        default=1.0,
    )
    half = buffer_bytes // 2
    ours_side = Streamer(endpoints, Buffers.sized(half, ratio))
    ref_side = Streamer(endpoints, Buffers.sized(half, ratio))
    try:
        check_replicas(checkpoint, ours_side)
        # A head the reference ties is its embedding: compared as the checkpoint's own.
        unheld = {n for n in drop if n not in theirs}
        for head, said, _ in heads_trained_apart(unheld, as_stored, config, None, ours_side):
            report.problem(
                f"tensor {head.name!r}: {said}, but the reference ties the output head to the "
                "input embedding (it holds no head), so its model's head is not the checkpoint's"
            )
        by_name = {t.name: t for t in as_stored}
        for left, kept in aliases:  # left out as the written one's copy: it must hold its values
            if values_differ(by_name[left], by_name[kept], ours_side, by_name[kept].dtype):
                report.problem(
                    f"tensor {left!r}: differs from {kept!r}, but the model answers to both with "
                    "one parameter, so the reference holds the latter's values for both"
                )
        for ref, ckpt, target in pairs:
            _compare_tensor(ref, ckpt, target, ours_side, ref_side, report)
        endpoints.finish()
    finally:
        endpoints.close()
    report.wall_s = time.perf_counter() - start
    return report


_NOT_MODELS = {
    Kind.VERL: "a verl checkpoint",
    Kind.VERL_ROLES: "a verl step (its roles' checkpoints)",
    Kind.DCP: "a DCP checkpoint",
    Kind.NATIVE: "a shardstream checkpoint",
    Kind.RUN: "a run of shardstream checkpoints",
    Kind.ACCELERATE: "an accelerate checkpoint",
}


def _refuse_checkpoint_as_reference(ref_dir: Path, kind: Kind) -> None:
    """A training checkpoint given as the reference (``kind``: what ``detect`` says it is):
    said as such, not as a model directory whose files are of the wrong kind."""
    if kind in _NOT_MODELS:
        raise UsageError(
            f"--test_hf_dir {ref_dir}: {_NOT_MODELS[kind]}, not a Hugging Face model; "
            "pass it as --local_dir, and as --test_hf_dir a model save_pretrained (or merge) wrote"
        )


def _adapter_only(directory: Path) -> Path | None:
    """``directory`` when it holds a PEFT adapter and no model weights, else None."""
    if not directory.is_dir() or not (directory / lora.ADAPTER_FILE).is_file():
        return None
    if (directory / hf.SINGLE_FILE).is_file() or (directory / hf.INDEX_FILE).is_file():
        return None
    return directory


def _merged_names(tensors: list[GlobalTensor]) -> tuple[list[GlobalTensor], list[GlobalTensor]]:
    """The base tensors under the names merge writes, and LoRA factors under PEFT's names."""
    split = lora.split_lora(tensors)
    if split is None:
        return tensors, []
    factors = [
        GlobalTensor(name, t.dtype, t.shape, t.blocks) for name, t in lora.adapter_tensors(split)
    ]
    return split.base, factors


def _saved_layout(
    tensors: list[GlobalTensor],
    config: dict,
    config_dir: Path | None = None,
    drop: set[str] = frozenset(),
    kept: set[str] = frozenset(),
) -> tuple[list[GlobalTensor], tuple[tuple[str, str], ...]]:
    """The base tensors under the names and shapes merge writes (save_pretrained's layout),
    but ``drop`` (stored names) unless their output is named in ``kept``: a reference saved
    by transformers is compared name by name, an expert of a fused tensor with its box of the
    stored tensor. And the aliases the layout leaves out (``NamePlan.aliases``)."""
    from ..formats.hf_writer import output_layout

    where = str(config_dir / "config.json") if config_dir else "config.json"
    # Planned whole and dropped after: a head the reference ties may be one the checkpoint's
    # config.json unties, which the plan then needs.
    plan, outputs = output_layout(tensors, None, set(), config, config_path=where)
    wanted = [out for out in outputs if out.source.name not in drop or out.name in kept]
    return [dataclasses.replace(out.source, name=out.name) for out in wanted], plan.aliases


def _comparison_dtype(ckpt: str, ref: str, wanted: str | None) -> str | None:
    """The dtype both sides are cast to, or None when they cannot be compared."""
    if is_floating(ckpt) and is_floating(ref):
        return wanted or ref
    if ckpt == ref:
        return ref
    return None


def _compare_tensor(
    ref: GlobalTensor,
    ckpt: GlobalTensor,
    target: str,
    ours: Streamer,
    theirs: Streamer,
    report: CompareReport,
) -> None:
    name, shape = ref.name, tuple(ref.shape)
    report.compared += 1
    numel = math.prod(shape)
    if numel == 0:
        return
    isz = itemsize(target)
    window = dense_block("compare", 0, target, shape)
    ckpt_runs = sorted(
        (r for b in ckpt.blocks for r in plan_copy(name, shape, b, window)),
        key=lambda r: r.dst_offset,
    )
    ref_runs = sorted(
        (r for b in ref.blocks for r in plan_copy(name, shape, b, window)),
        key=lambda r: r.dst_offset,
    )
    capacity = min(ours.buf.window.nbytes, theirs.buf.window.nbytes) // isz * isz
    total = numel * isz
    floating = is_floating(target)
    bad = 0
    worst = (-1.0, -1, 0.0, 0.0)  # (diff, flat index, checkpoint value, reference value)
    lo = 0
    active: list[CopyRun] = []
    next_run = 0
    while lo < total:
        hi = min(total, lo + capacity)
        while next_run < len(ckpt_runs) and ckpt_runs[next_run].dst_offset < hi:
            active.append(ckpt_runs[next_run])
            next_run += 1
        active = [r for r in active if r.dst_end() > lo]
        a = fill_window(ours, active, lo, hi, name)
        b = fill_window(theirs, ref_runs, lo, hi, name)
        for s in range(0, hi - lo, _COMPARE_ELEMS * isz):
            e = min(hi - lo, s + _COMPARE_ELEMS * isz)
            first = (lo + s) // isz
            n_bad, piece_worst = _compare_piece(a[s:e], b[s:e], target, floating, report)
            bad += n_bad
            if piece_worst[0] > worst[0]:
                worst = (piece_worst[0], first + piece_worst[1], *piece_worst[2:])
        lo = hi
    report.elements += numel
    if bad:
        index = list(np.unravel_index(worst[1], shape)) if shape else []
        exact = not floating or report.exact
        tolerance = "exact" if exact else f"atol={report.atol:g}, rtol={report.rtol:g}"
        report.problem(
            f"tensor {name!r}: {bad} of {numel} elements differ ({tolerance}, as {target}); "
            f"max abs diff {worst[0]:.6g} at {[int(i) for i in index]}: checkpoint "
            f"{worst[2]:.9g} vs reference {worst[3]:.9g}"
        )


def _compare_piece(
    a_bytes: np.ndarray, b_bytes: np.ndarray, dtype: str, floating: bool, report: CompareReport
) -> tuple[int, tuple[float, int, float, float]]:
    """Count elements that differ; return (count, (diff, index, a, b) of the worst one).

    torch casts to float64 (it knows bfloat16); numpy does the element-wise tests, which on
    few cores are many times faster than torch's multi-threaded comparison kernels.
    """
    if np.array_equal(a_bytes, b_bytes):  # the common case, at memcmp speed
        return 0, (-1.0, -1, 0.0, 0.0)
    torch_dtype = TORCH_BY_CODE[dtype]
    a64 = torch.from_numpy(a_bytes).view(torch_dtype).to(torch.float64).numpy()
    b64 = torch.from_numpy(b_bytes).view(torch_dtype).to(torch.float64).numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a64 - b64)
        if floating:
            same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
            diff[same] = 0.0
            diff[np.isnan(diff)] = math.inf
            nonfinite = ~(np.isfinite(a64) & np.isfinite(b64))
            bad_mask = (diff > report.atol + report.rtol * np.abs(a64)) | (nonfinite & ~same)
        if floating and report.exact:
            width = itemsize(dtype)
            bad_mask = (a_bytes.reshape(-1, width) != b_bytes.reshape(-1, width)).any(axis=1)
        elif not floating:
            # Exact, bytewise: works for every integer width and bool.
            width = itemsize(dtype)
            bad_mask = (a_bytes.reshape(-1, width) != b_bytes.reshape(-1, width)).any(axis=1)
            diff[~bad_mask] = 0.0
    if diff.size:
        report.max_abs_diff = max(report.max_abs_diff, float(diff.max()))
    n_bad = int(np.count_nonzero(bad_mask))
    if not n_bad:
        return 0, (-1.0, -1, 0.0, 0.0)
    candidates = np.where(bad_mask, diff, -1.0)
    index = int(candidates.argmax())
    return n_bad, (float(candidates[index]), index, float(a64[index]), float(b64[index]))
