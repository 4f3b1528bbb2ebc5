"""inspect: describe a checkpoint from its layout alone (no tensor data is read).

The estimates are rough, and say so: memory is the fixed copy buffer plus the Python/torch
baseline of a shardstream process; time is the bytes a merge reads and writes divided by an
assumed disk throughput, since the real one is unknown until something is read.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..engine.dtypes import TORCH_NAME, itemsize
from ..errors import NamesUnderPrefixError, UsageError
from ..units import DEFAULT_BUFFER_BYTES, format_size

# Resident memory of a shardstream process before any buffer (interpreter, torch, numpy).
BASELINE_RSS_BYTES = 260 * 2**20
# What a merge holds per tensor (its header entry, blocks, output name and plan): measured as
# the growth of peak RSS from 2,000 to 100,000 one-file tensors (2.4 KiB each, 2026-12-07).
TENSOR_RSS_BYTES = 2560
# Assumed sequential disk throughput for the time estimate (a mid-range NVMe or a good network
# filesystem); merges on slower storage take proportionally longer.
ASSUMED_DISK_BYTES_PER_S = 500 * 10**6


def describe(
    path: str | os.PathLike,
    prefix: str | None = None,
    hf_model_path: str | os.PathLike | None = None,
) -> dict:
    """Everything known about the checkpoint at ``path`` without reading tensor data; for a
    run directory (a manager's), its steps and the newest committed one. ``prefix``: what a
    DCP checkpoint's model keys start with, where detection is ambiguous. ``hf_model_path``:
    the config directory merge would be given (``--hf_model_path``), else the checkpoint's."""
    from ..formats.hf import read_config
    from ..formats.source import Kind, detect, models_beside, open_checkpoint

    kind = detect(path)
    run = _run(Path(path)) if kind is Kind.RUN else None
    if run is None and kind in (Kind.RUN, Kind.NONE) and Path(path).is_dir():
        run = _role_run(Path(path))  # verl's (or the plug-in's) global_step_N/actor
    if run is None and kind is Kind.NONE and Path(path).is_dir():
        run = _named_steps_run(Path(path))  # torchtitan's step-N, a Trainer's checkpoint-N
    if run is not None:
        if run.get("named"):
            return {**describe(run["named"], prefix, hf_model_path), "run": run}
        newest = Path(path) / f"global_step_{run['newest']}"
        where = newest / run["role"] if run.get("role") else newest
        return {**describe(where, prefix, hf_model_path), "run": run}
    hf_model = kind is Kind.HF_MODEL  # --prefix is DCP's; an HF model's inspect ignores it
    checkpoint = open_checkpoint(path, prefix=None if hf_model else prefix)  # or its error
    config_dir = Path(hf_model_path) if hf_model_path else checkpoint.config_dir()
    if hf_model_path and not (config_dir / "config.json").is_file():
        raise UsageError(f"--hf_model_path {config_dir}: no config.json there")
    config = read_config(config_dir)
    if hf_model:  # merge re-lays an HF model out too: what it would write
        own = config if config_dir == Path(path) else read_config(Path(path))
        return {
            **_describe_hf_model(Path(path), checkpoint, own),
            "merge": _merge_estimate(checkpoint, config, config_dir),
        }
    placements, replicas = checkpoint.placements, checkpoint.replicas
    tensors = [
        {
            "name": t.name,
            "shape": list(t.shape),
            "dtype": _dtype_name(t.dtype),
            "placement": placements.get(t.name, ""),
            "bytes": t.nbytes,
            "blocks": len(t.blocks),
            "replicas": len(replicas.get(t.name, ())),
        }
        for t in checkpoint.tensors
    ]
    manifest = checkpoint.manifest
    contents = manifest.get("contents")
    step = manifest.get("step")
    key_prefix = None
    if kind in (Kind.DCP, Kind.DCP_HF, Kind.ACCELERATE):  # no manifest: the step its
        from ..formats.dcp import step_of_name  # directory is named for
        from ..formats.source import ACCELERATE_SHARDED_FORMAT

        step = step_of_name(Path(path).name)
        if kind is not Kind.ACCELERATE or checkpoint.format == ACCELERATE_SHARDED_FORMAT:
            key_prefix = checkpoint.prefix  # DCP's keys (whole state dicts hold their own)
    files = [str(f) for f in checkpoint.files]
    file_bytes = sum(os.path.getsize(f) for f in files)
    return {
        "path": str(Path(path)),
        "format": checkpoint.format,
        "world_size": checkpoint.world_size,
        "fsdp_version": checkpoint.fsdp_version,
        "mesh": checkpoint.mesh,
        "step": step,
        "prefix": key_prefix,
        "contents": [str(c) for c in contents] if isinstance(contents, list) else None,
        "config_dir": str(config_dir) if config_dir else None,
        "num_files": len(files),
        "files_bytes": file_bytes,
        "files": files,
        "num_tensors": len(tensors),
        "total_bytes": sum(t.nbytes for t in checkpoint.tensors),
        "tensors": tensors,
        "merge": _merge_estimate(checkpoint, config, config_dir),
        "model_objects": list(checkpoint.model_objects),
        "unread_groups": models_beside(checkpoint),
    }


def _merge_estimate(checkpoint, config: dict, config_dir: Path | None) -> dict:
    """What merge would write for ``checkpoint``: dtype, tied head dropped, layout, bytes read
    and written, and time and memory estimates."""
    from ..errors import ShardstreamError
    from ..formats.hf import cast_dtype, output_dtype, tied_duplicates
    from ..formats.source import verl_merges

    out_dtype = output_dtype(None, config, verl_merges(checkpoint), config_dir)
    try:
        _lora_merges(checkpoint)
        dropped, refused = tied_duplicates(checkpoint.tensors, config, False), None
    except ShardstreamError as exc:  # merge would refuse: say why, describe the rest
        dropped, refused = set(), str(exc)
    layout = (
        {"rule": None, "refused": refused, "renamed": {}, "split": {}}
        if refused
        else _layout(checkpoint.tensors, config, dropped, config_dir, _read_under(checkpoint))
    )
    dropped -= set(layout.pop("untied", ()))  # heads the model holds apart: written
    stored = sum(t.nbytes for t in checkpoint.tensors)
    written = sum(
        t.nbytes // itemsize(t.dtype) * itemsize(cast_dtype(t.dtype, out_dtype))
        for t in checkpoint.tensors
        if t.name not in dropped
    )
    replica_bytes = sum(
        b.numel * itemsize(b.dtype) for blocks in checkpoint.replicas.values() for b in blocks
    )
    read = stored + replica_bytes
    return {
        "output_dtype": _dtype_name(out_dtype) if out_dtype else "as stored",
        "dropped_tied": sorted(dropped),
        "layout": layout,
        "bytes_read": read,
        "bytes_written": written,
        "assumed_disk_bytes_per_s": ASSUMED_DISK_BYTES_PER_S,
        "estimated_seconds": (read + written) / ASSUMED_DISK_BYTES_PER_S,
        "buffer_bytes": DEFAULT_BUFFER_BYTES,
        "baseline_rss_bytes": BASELINE_RSS_BYTES,
        "tensors_rss_bytes": TENSOR_RSS_BYTES * len(checkpoint.tensors),
        "estimated_peak_rss_bytes": DEFAULT_BUFFER_BYTES
        + BASELINE_RSS_BYTES
        + TENSOR_RSS_BYTES * len(checkpoint.tensors),
    }


def _lora_merges(checkpoint) -> None:
    """Raise what merge raises for the checkpoint's LoRA weights: a PEFT variant it does not
    fuse, or no file saying their rank and alpha."""
    from ..formats import lora

    lora.refuse_unsupported_peft(checkpoint.directory, (t.name for t in checkpoint.tensors))
    if lora.split_lora(checkpoint.tensors):
        lora.lora_settings(checkpoint.directory, checkpoint.lora_settings)


def _read_under(checkpoint) -> str:
    """The prefix the model's names were read under (DCP's ``model.``; ``--prefix``)."""
    return getattr(checkpoint, "prefix", None) or ""


def _layout(
    tensors, config: dict, dropped: set[str], config_dir: Path | None = None, read_under: str = ""
) -> dict:
    """The names merge writes (``hf_names``): the rule, the renamed tensors and the fused
    tensors it splits, and under ``untied`` the heads of ``dropped`` the model holds apart
    (written); or why merge would refuse the layout."""
    from ..errors import ShardstreamError
    from ..formats.hf_names import plan_checkpoint_names

    if any(".lora_" in t.name for t in tensors):  # lora imports torch: only when needed
        from ..formats import lora

        split = lora.split_lora(tensors)
        tensors = split.base if split else tensors
    base = [t for t in tensors if t.name not in dropped]
    try:
        stored = [(t.name, t.dtype, t.shape) for t in base]
        where = str(config_dir / "config.json") if config_dir else "config.json"
        tied = [(t.name, t.dtype, t.shape) for t in tensors if t.name in dropped]
        plan = plan_checkpoint_names(stored, config, config_path=where, tied=tied)
    except NamesUnderPrefixError as exc:
        refused = str(exc.read_under(read_under))
        return {"rule": None, "refused": refused, "renamed": {}, "split": {}}
    except ShardstreamError as exc:
        return {"rule": None, "refused": str(exc), "renamed": {}, "split": {}}
    renamed = {p.stored: p.name for p in plan.pieces if p.whole and p.name != p.stored}
    parts: dict[str, list[str]] = {}
    for p in plan.pieces:
        if not p.whole:
            parts.setdefault(p.stored, []).append(p.name)
    layout = {"rule": plan.describe(), "refused": None, "renamed": renamed, "split": parts}
    return {**layout, "untied": list(plan.untied)}


def _describe_hf_model(path: Path, checkpoint, config: dict) -> dict:
    """A HF model directory (what merge wrote, or any HF model) from the headers its reader
    read: each tensor one dense block of a safetensors file; ``config``: its config.json."""
    dtype = config.get("dtype", config.get("torch_dtype"))
    architectures = config.get("architectures")
    return {
        "path": str(path),
        "format": "huggingface",
        "config_dtype": dtype if isinstance(dtype, str) else None,
        "architectures": [str(a) for a in architectures] if isinstance(architectures, list) else [],
        "num_files": len(checkpoint.files),
        "files_bytes": sum(os.path.getsize(f) for f in checkpoint.files),
        "files": checkpoint.files,
        "num_tensors": len(checkpoint.tensors),
        "total_bytes": sum(t.nbytes for t in checkpoint.tensors),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": _dtype_name(t.dtype),
                "placement": "",
                "bytes": t.nbytes,
                "file": os.path.basename(t.blocks[0].location),
            }
            for t in checkpoint.tensors
        ],
    }


def _run(path: Path) -> dict | None:
    """A shardstream run directory's committed steps, pointer and leftovers; None when it has
    no committed step."""
    from ..storage.run_layout import committed_steps, read_latest, uncommitted

    steps = committed_steps(path)
    if not steps:
        return None
    return {
        "directory": str(path),
        "steps": steps,
        "latest_pointer": read_latest(path),
        "newest": steps[-1],
        "uncommitted": uncommitted(path),
    }


def _role_run(path: Path) -> dict | None:
    """A run directory of verl's layout, ``global_step_N/<role>`` (verl's own checkpoints or
    the plug-in's): its steps that hold a checkpoint, and the newest one's actor (else its
    first role); None when it holds none."""
    from ..formats.source import looks_like_checkpoint
    from ..storage.commit import is_temporary
    from ..storage.run_layout import read_latest, step_dirs, uncommitted

    roles: dict[int, list[str]] = {}
    for step, step_path in step_dirs(path).items():
        if step_path.is_dir() and not is_temporary(step_path.name):
            found = sorted(p.name for p in step_path.iterdir() if looks_like_checkpoint(p))
            if found:
                roles[step] = found
    if not roles:
        return None
    newest = max(roles)
    return {
        "directory": str(path),
        "steps": sorted(roles),
        "latest_pointer": read_latest(path),
        "newest": newest,
        "role": "actor" if "actor" in roles[newest] else roles[newest][0],
        "roles": roles[newest],
        "uncommitted": uncommitted(path),
    }


def _named_steps_run(path: Path) -> dict | None:
    """A directory of checkpoints named for their steps (torchtitan's ``checkpoint/step-N``,
    a Trainer's ``checkpoint-N`` without a final model): its finished ones' steps and the
    newest one's path (``named``); None unless every checkpoint in it has a step number."""
    from ..formats.dcp import step_of_name
    from ..formats.source import checkpoints_below, unfinished_below

    found = checkpoints_below(path)
    steps = [step_of_name(p.name) for p in found]
    if not found or None in steps or any(p.parent != path for p in found):
        return None
    return {
        "directory": str(path),
        "steps": steps,
        "latest_pointer": None,
        "newest": steps[-1],
        "named": str(found[-1]),
        "uncommitted": [p.name for p in unfinished_below(path)],
    }


def _roles(run: dict) -> str:
    return f" (roles {', '.join(run['roles'])}; this is {run['role']})" if run.get("role") else ""


def _dtype_name(code: str) -> str:
    return TORCH_NAME.get(code, code)


def render(info: dict) -> str:
    """A human-readable report of ``describe``'s result."""
    m = info["merge"]
    lines = []
    run = info.get("run")
    if run and run.get("named"):
        unfinished = run["uncommitted"]
        lines += [
            f"{run['directory']}: checkpoints named for their steps, "
            f"{', '.join(map(str, run['steps']))}"
            + (f"; unfinished (ignored): {', '.join(unfinished)}" if unfinished else ""),
            f"the newest, {Path(run['named']).name} (merge and test take it as --local_dir):",
            "",
        ]
    elif run:
        layout = (
            f"run of global_step_N/{run['role']}, steps"
            if run.get("role")
            else "shardstream run, committed steps"
        )
        lines += [
            f"{run['directory']}: {layout} "
            f"{', '.join(map(str, run['steps']))}; latest_checkpointed_iteration.txt: "
            f"{run['latest_pointer'] if run['latest_pointer'] is not None else 'missing'}"
            + (
                f"; uncommitted (ignored): {', '.join(run['uncommitted'])}"
                if run["uncommitted"]
                else ""
            ),
            f"the newest committed step, {run['newest']}{_roles(run)}:",
            "",
        ]
    if info["format"] == "huggingface":
        arch = ", ".join(info["architectures"])
        lines += [
            f"{info['path']}: huggingface model"
            + (f" ({arch})" if arch else "")
            + (f", config dtype {info['config_dtype']}" if info["config_dtype"] else ""),
            f"files: {info['num_files']} ({format_size(info['files_bytes'])} on disk)",
            f"tensors: {info['num_tensors']}, {format_size(info['total_bytes'])}",
            "",
        ]
        return "\n".join(lines + _tensor_table(info["tensors"]) + _merge_lines(m))
    lines += [
        f"{info['path']}: {info['format']} checkpoint, world size {info['world_size']}"
        + (f", FSDP v{info['fsdp_version']}" if info.get("fsdp_version") else ""),
        *([f"mesh: {info['mesh']}"] if info.get("mesh") else []),
        *(
            [f"step {info['step']}, contents: {', '.join(info['contents'])}"]
            if info.get("contents") is not None
            else []
        ),
        *(
            [f"step {info['step']} (from the directory name)"]
            if info.get("contents") is None and info.get("step") is not None
            else []
        ),
        *(
            [f"model keys: {info['prefix'] or '(top level)'}{'*' if info['prefix'] else ''}"]
            if info.get("prefix") is not None
            else []
        ),
        *(
            f"not read: {group}* ({count} tensors; --prefix {group} reads them as the model)"
            for group, count in (info.get("unread_groups") or {}).items()
        ),
        f"model files: {info['num_files']} ({format_size(info['files_bytes'])} on disk)",
        f"config: {info['config_dir'] or 'none found (pass --hf_model_path)'}",
        f"tensors: {info['num_tensors']}, {format_size(info['total_bytes'])}",
        *_objects_line(info.get("model_objects") or []),
        "",
    ]
    return "\n".join(lines + _tensor_table(info["tensors"]) + _merge_lines(m))


def _objects_line(objects: list[str], shown: int = 5) -> list[str]:
    if not objects:
        return []
    more = f" and {len(objects) - shown} more" if len(objects) > shown else ""
    return [f"non-tensor model entries, left out by merge: {', '.join(objects[:shown])}{more}"]


def _merge_lines(m: dict) -> list[str]:
    return [
        "",
        f"merge estimate: output dtype {m['output_dtype']}"
        + (f", drops tied {', '.join(m['dropped_tied'])}" if m["dropped_tied"] else ""),
        *_layout_lines(m["layout"]),
        f"  reads {format_size(m['bytes_read'])}, writes {format_size(m['bytes_written'])}: "
        f"~{_duration(m['estimated_seconds'])} at an assumed "
        f"{m['assumed_disk_bytes_per_s'] / 1e6:.0f} MB/s disk throughput",
        f"  peak memory ~{format_size(m['estimated_peak_rss_bytes'])} "
        f"({format_size(m['buffer_bytes'])} buffer + "
        f"~{format_size(m['baseline_rss_bytes'])} Python/torch baseline + "
        f"~{format_size(m['tensors_rss_bytes'])} for the tensors' names and plan), "
        "independent of their bytes",
    ]


def _layout_lines(layout: dict, shown: int = 5) -> list[str]:
    """The output layout in a few lines: the rule, then some renames and splits."""
    if layout["refused"]:
        return [f"  layout: merge would refuse: {layout['refused']}"]
    lines = [f"  layout: {layout['rule']}"]
    renamed = sorted(layout["renamed"].items())
    lines += [f"    {a} -> {b}" for a, b in renamed[:shown]]
    if len(renamed) > shown:
        lines.append(f"    ... and {len(renamed) - shown} more renamed")
    parts = sorted(layout["split"].items())
    for name, outputs in parts[:shown]:
        lines.append(f"    {name} -> {len(outputs)} tensors: {outputs[0]}, ...")
    if len(parts) > shown:
        lines.append(f"    ... and {len(parts) - shown} more split")
    return lines


def _tensor_table(tensors: list[dict]) -> list[str]:
    """One line per tensor: name, shape, dtype, placement (or file), size."""
    where = "file" if tensors and "file" in tensors[0] else "placement"
    rows = [("name", "shape", "dtype", where, "size")]
    for t in tensors:
        shape = "x".join(str(d) for d in t["shape"]) or "scalar"
        rows.append((t["name"], shape, t["dtype"], t.get(where, ""), format_size(t["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + f"  {r[4]:>10}" for r in rows]


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "<1 s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
