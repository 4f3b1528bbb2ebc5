"""Writing a Hugging Face model directory: the tensors and files ``hf``'s policy gives, each
file created at full size, filled by its caller, then sealed with its chunk digests, and the
index. merge (ranks filling byte ranges) and the training export (ranks writing their own
rows) both write through it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..engine.plan import GlobalTensor, slice_tensor
from . import hf
from .hf_names import NamePlan, plan_checkpoint_names
from .safetensors import files_value_length
from .writer import FileJob, OutputTensor, WrittenFile, create_file, plan_file, seal_file

# (file index, first chunk) -> the digests of the chunks from there on, as one writer hashed
# them; the writers' parts together cover every chunk of every file once.
ChunkDigests = Mapping[tuple[int, int], Sequence[str]]


def output_tensors(
    tensors: Sequence[GlobalTensor],
    out_dtype: str | None,
    drop: set[str],
    config: dict,
    keep_names: bool = False,
) -> list[OutputTensor]:
    """What the model directory holds (``output_layout``'s tensors)."""
    return output_layout(tensors, out_dtype, drop, config, keep_names)[1]


def output_layout(
    tensors: Sequence[GlobalTensor],
    out_dtype: str | None,
    drop: set[str],
    config: dict,
    keep_names: bool = False,
    config_path: str = "config.json",
    model_order: bool = False,
) -> tuple[NamePlan, list[OutputTensor]]:
    """Every tensor but those in ``drop``, under the names, shapes and order ``save_pretrained``
    gives them (``hf_names.plan_checkpoint_names``) and in its output dtype
    (``hf.cast_dtype``). A renamed tensor keeps its source; a slice of a stored tensor reads
    its box (``TensorSlice``), so splitting a fused tensor stays a byte-range plan.
    ``source.name`` is the stored name. ``model_order``: as ``hf_names.plan_names``'s.
    ``drop`` holds the heads config.json ties (``hf.tied_duplicates``): one the model holds
    apart all the same is written (``NamePlan.untied``)."""
    kept = [t for t in tensors if t.name not in drop]
    stored = [(t.name, t.dtype, t.shape) for t in kept]
    tied = [(t.name, t.dtype, t.shape) for t in tensors if t.name in drop]
    plan = plan_checkpoint_names(stored, config, keep_names, config_path, model_order, tied)
    by_name = {t.name: t for t in tensors}
    outputs = []
    for piece in plan.pieces:
        source = by_name[piece.stored]
        if not piece.whole:
            source = slice_tensor(source, piece.start, piece.extent, piece.dims)
        outputs.append(OutputTensor(piece.name, hf.cast_dtype(source.dtype, out_dtype), source))
    return plan, outputs


@dataclass(frozen=True)
class HfModelFiles:
    """The safetensors files of one HF model directory: names, contents and file plans."""

    directory: Path
    files: list[tuple[str, list[OutputTensor]]]  # as hf.plan_hf_files gives them
    jobs: list[FileJob]  # one per file, in that order; copy runs planned when filled
    buffers: tuple[str, ...] = ()  # outputs total_parameters leaves out (NamePlan.buffers)

    @classmethod
    def plan(
        cls,
        directory: Path,
        files: list[tuple[str, list[OutputTensor]]],
        align: int = 8,
        side_files: Iterable[str] = (),
        buffers: Iterable[str] = (),
    ) -> HfModelFiles:
        """``align``: where each file's data starts (``DIRECT_ALIGN`` for direct writes).
        ``side_files``: the names of the files that may be written beside the weights (the
        index included), whose digests the first file's header keeps (``seal``)."""
        reserve = files_value_length(side_files)
        jobs = [
            plan_file(
                str(directory / name),
                group,
                align=align,
                plan_runs=False,
                reserved=reserve if i == 0 else 0,
            )
            for i, (name, group) in enumerate(files)
        ]
        return cls(directory, files, jobs, tuple(buffers))

    def write_index(self) -> None:
        """The index, when there are several files (before ``seal``, to be in its list)."""
        if len(self.files) > 1:
            document = hf.index_document(self.files, self.buffers)
            index = json.dumps(document, indent=2) + "\n"
            (self.directory / hf.INDEX_FILE).write_text(index)

    def create(self) -> None:
        """Every file at full size, its header (placeholder digests) written: a full disk
        fails here, before any rank streams, and the writes find their blocks allocated."""
        self.directory.mkdir(exist_ok=True)
        for job in self.jobs:
            create_file(job)

    def seal(self, parts: Iterable[ChunkDigests], side_files: bool = False) -> list[WrittenFile]:
        """Seal every file with its chunk digests, from the writers' ``parts``; fsync; write
        the index when there are several files and ``write_index`` has not. ``side_files``:
        the first file's header lists every other file of the directory (``FILES_KEY``),
        which must all be written by now."""
        parts = list(parts)
        if not (self.directory / hf.INDEX_FILE).exists():
            self.write_index()
        files = ""
        if side_files and self.jobs:
            weights = {name for name, _ in self.files}
            files = files_value(self.directory, weights)
            if len(json.dumps(files)) - 2 > self.jobs[0].reserved:  # a file not planned for
                raise AssertionError(f"files beside the weights not planned for: {files}")
        return [
            seal_file(job, _assemble(i, job, parts), files if i == 0 else "")
            for i, job in enumerate(self.jobs)
        ]


def files_value(directory: Path, weights: set[str]) -> str:
    """``FILES_KEY``'s value: every file of ``directory`` and its folders but the ``weights``,
    as ``name=xxh3`` pairs (names relative, with "/"), sorted, joined by ";"."""
    from .native import file_digest

    found = sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.relative_to(directory).as_posix() not in weights
    )
    return ";".join(f"{name}={file_digest(directory / name)}" for name in found)


def _assemble(index: int, job: FileJob, parts: list[ChunkDigests]) -> list[str]:
    """File ``index``'s chunk digests, from every writer's parts, in order."""
    pieces = sorted(
        (first, digests)
        for part in parts
        for (file_index, first), digests in part.items()
        if file_index == index
    )
    chunks: list[str] = []
    for first, digests in pieces:
        if first != len(chunks):
            raise AssertionError(f"chunk {len(chunks)} of output file {index} has no digest")
        chunks.extend(digests)
    if len(chunks) != job.chunk_count:
        raise AssertionError(f"output file {index} has {len(chunks)} of {job.chunk_count} digests")
    return chunks
