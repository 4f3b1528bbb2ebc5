"""shardstream's own checkpoint format: per-rank safetensors files and a JSON manifest.

This module reads the format (manifest, headers, which bytes hold which tensor) and needs no
torch, so verify and inspect start fast. The torch.distributed.checkpoint plug-ins that write
and restore it are in ``native_storage``. The manifest is written last and is the commit
marker. See docs/format.md.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.checksum import digest, new_hasher
from ..engine.dtypes import ITEMSIZE
from ..engine.plan import (
    Block,
    GlobalTensor,
    GridBlocks,
    check_blocks_tile,
    chunk_extent,
    dense_block,
    stored_at,
)
from ..errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    UnsafeCheckpointError,
    UsageError,
)
from ..storage.commit import atomic_write_bytes, is_temporary
from ..storage.run_layout import MANIFEST, step_of
from ..storage.tree import walk
from . import jsondoc
from .layout_names import describe_mesh
from .regular_file import open_regular, present
from .safetensors import (
    SafetensorsHeader,
    parse_header,
    range_description,
    read_header,
    read_header_bytes,
    stored_checksums,
)

if TYPE_CHECKING:
    from ..engine.endpoints import FileEndpoint

FORMAT = "shardstream"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
Region = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape) of a block of a tensor
MAX_MANIFEST_BYTES = 1 << 30
# A file name in a manifest: a path relative to the step directory, '/'-separated, each part
# printable (no control characters), at most 255 characters, never "." or "..".
_NAME_PART = re.compile(r"[^/\x00-\x1f\x7f]{1,255}")
MAX_NAME_PARTS = 32
MAX_NAME_CHARS = 4096
# What shardstream itself leaves in a step directory only while writing it (or after a crash
# there): staged files and directories (``*.tmp-<hex>*``, storage/commit.py), the hf export's
# shared-filesystem probe, the manager's and verl roles' lock files. Never listed, never
# reported as unlisted.
_DEBRIS = re.compile(r"\.probe-[0-9a-f]{32}|\.shardstream(-.*)?\.lock")
# Manifest key: true when ``files`` lists every file of the step (side_file_records), so a
# file it does not list was added or renamed after the save. Older manifests lack it.
FILES_COMPLETE = "files_complete"
CONTENTS = ("model", "optimizer", "extra", "hf_model")  # what a step directory can hold
DEFAULT_CONTENTS = ("model", "optimizer", "extra")
MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."
# world_size is informational (inspect shows it), so only absurd values are refused: a million
# ranks is ten times the largest training runs. The files cannot bound it: an hf_model-only
# save of 8 ranks lists 3 files, and manifests without files_complete omit empty rank files.
MAX_WORLD_SIZE = 1 << 20
HF_DIR_PREFIX = "huggingface/"  # where share_hf_weights chunks live, under the HF tensor name


_RANK_FILE = re.compile(r"rank-[0-9]{5,}\.safetensors")
EXTRA_JSON = re.compile(r"extra-rank-[0-9]{5,}\.json")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def check_contents(contents: Iterable[str], what: str) -> tuple[str, ...]:
    """``contents`` as a tuple, each item one of ``CONTENTS``."""
    if isinstance(contents, (str, bytes)) or not isinstance(contents, Iterable):
        raise UsageError(
            f"{what}: {contents!r} is not a list of items; pass one such as ['model', 'optimizer']"
        )
    contents = tuple(contents)
    unknown = [c for c in contents if c not in CONTENTS]
    if unknown:
        raise UsageError(f"{what}: unknown item {unknown[0]!r}; expected any of {CONTENTS}")
    return contents


def extra_files(rank: int) -> tuple[str, str]:
    """A rank's extra state: its JSON file and the safetensors file of the tensors inside it."""
    return f"extra-rank-{rank:05d}.json", f"extra-rank-{rank:05d}.safetensors"


def is_safe_name(name: object) -> bool:
    """Whether ``name`` may name a file of a step: a relative path, each part printable and
    neither "." nor ".." (where it leads is checked separately, see ``check_name``)."""
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        return False
    try:
        name.encode()  # a lone surrogate ("\ud800") names no file: open() would raise
    except UnicodeEncodeError:
        return False
    parts = name.split("/")
    return len(parts) <= MAX_NAME_PARTS and all(
        _NAME_PART.fullmatch(part) and part not in (".", "..") for part in parts
    )


def is_debris(name: str) -> bool:
    """Whether a file or folder name is shardstream's own staging or lock debris."""
    return is_temporary(name) or bool(_DEBRIS.fullmatch(name))


def check_name(directory: Path, name: object, what: str) -> Path:
    """A file name from a manifest: plain, inside ``directory``, no links out."""
    if not is_safe_name(name):
        raise UnsafeCheckpointError(
            f"{directory / MANIFEST}: {what} names file {str(name)[:300]!r}, which is not a "
            "plain file name inside the checkpoint"
        )
    path = directory / name
    # The file, or a folder on its way (huggingface/, a tokenizer's subfolder), may be a link
    # out of the checkpoint.
    parts = name.split("/")
    if any(directory.joinpath(*parts[: i + 1]).is_symlink() for i in range(len(parts))):
        if not _inside(directory, path):
            raise UnsafeCheckpointError(f"{path}: symlink points outside the checkpoint")
    return path


def _inside(directory: Path, path: Path) -> bool:
    """Whether ``path``, its links followed, is inside ``directory`` (followed as well)."""
    base = Path(os.path.realpath(directory))
    return base in Path(os.path.realpath(path)).parents


def missing_note(manifest: dict, name: str) -> str:
    """What to add when file ``name`` is missing: a huggingface/ file that holds model weights
    (saved with share_hf_weights) cannot be left out."""
    if not name.startswith("huggingface/"):
        return ""
    for entry in manifest.get("tensors", {}).values():
        chunks = entry.get("chunks") if isinstance(entry, dict) else None
        if any(isinstance(c, dict) and c.get("file") == name for c in chunks or ()):
            return "; it holds model weights of this checkpoint (saved with share_hf_weights)"
    return ""


# --- the manifest ----------------------------------------------------------------------------


def grid_chunks(
    fqn: str, shape: list[int], world: int, rows: tuple[int, int] | None = None
) -> Iterator[dict]:
    """The chunks of a grid entry: FSDP2's ``Shard(0)`` split of ``shape`` over ``world`` ranks
    (``torch.chunk``), rank r's rows in ``rank_file(r)`` under key ``fqn@offsets``. Ranks past
    the last row hold nothing and are left out. With ``rows`` = (first, end), only the chunks
    holding some of those rows."""
    ranks = range(world)
    if rows is not None:
        step = -(-shape[0] // world) if shape[0] else 1
        first, end = max(0, rows[0]), min(shape[0], rows[1])
        ranks = range(min(world, first // step), min(world, -(-end // step))) if end > first else ()
    for r in ranks:
        start, rows = chunk_extent(shape[0], world, r)
        if rows == 0:
            return
        yield {
            "offsets": [start] + [0] * (len(shape) - 1),
            "sizes": [rows, *shape[1:]],
            "file": rank_file(r),
            "key": grid_key(fqn, start, len(shape)),
        }


def whole_chunk(shape: list[int], file: str, key: str) -> dict:
    """The one chunk of a tensor stored whole, as tensor ``key`` of ``file``."""
    return {"offsets": [0] * len(shape), "sizes": list(shape), "file": file, "key": key}


def item_key(fqn: str, offsets: list[int]) -> str:
    """The rank-file key of the piece of ``fqn`` that starts at ``offsets``: ``fqn@o0,o1,...``."""
    return f"{fqn}@{','.join(map(str, offsets))}"


def grid_key(fqn: str, start: int, ndim: int) -> str:
    """The rank-file key of a grid chunk starting at row ``start``: ``fqn@start,0,...``."""
    return item_key(fqn, [start] + [0] * (ndim - 1))


def _is_grid(fqn: str, shape: list[int], chunks: list[dict], world: int) -> bool:
    """Whether the non-empty chunks are exactly ``grid_chunks`` (then the list is implied)."""
    if not shape or 0 in shape or world < 1:
        return False
    nonempty = [c for c in chunks if all(c["sizes"])]
    return sorted(nonempty, key=lambda c: c["offsets"]) == list(grid_chunks(fqn, shape, world))


def canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def side_file_records(directory: Path, listed: dict) -> dict[str, dict]:
    """``{"size", "xxh3"}`` of every regular file of the step ``directory``, at any depth,
    that ``listed`` (the manifest's ``files`` so far) does not name: config, generation config,
    tokenizer and processor files (with their subfolders, a chat template's), hidden files,
    LoRA metadata, anything written beside the data. Only manifest.json, shardstream's own
    staging and lock debris (``is_debris``) and symlinks are left out. Every file a
    checkpoint holds is then checked, by verify and when merge copies it; verify reports a
    file the manifest does not list (``unlisted_files``)."""
    records = {}
    for name, entry in _regular_files(directory):
        if name in listed or name == MANIFEST:
            continue
        if entry.is_symlink():
            continue  # a link is checked where the file it names is
        if not is_safe_name(name):
            raise CheckpointFormatError(
                f"{entry}: a file name the manifest cannot list (a control character, or "
                "too long); rename or remove it"
            )
        records[name] = {"size": entry.stat().st_size, "xxh3": file_digest(entry)}
    return records


def _regular_files(directory: Path) -> Iterator[tuple[str, Path]]:
    """(name relative to ``directory``, path) of every file below ``directory`` that is not
    a folder, symlinks included, in sorted order; debris and linked folders are not entered."""
    for dirpath, dirnames, filenames in walk(directory):
        base = Path(dirpath)
        prefix = os.path.relpath(dirpath, directory)
        prefix = "" if prefix == "." else prefix.replace(os.sep, "/") + "/"
        dirnames[:] = sorted(d for d in dirnames if not is_debris(d))
        for d in dirnames:
            if (base / d).is_symlink():  # walk does not enter it; a link is named as one
                yield prefix + d, base / d
        for f in sorted(filenames):
            if not is_debris(f):
                yield prefix + f, base / f


def unlisted_files(directory: Path, manifest: dict) -> list[tuple[Path, str]]:
    """Files of the step ``directory`` that its manifest does not list, each with what is
    wrong: a regular file or a link to one that no listed name leads to, or a link out of the
    checkpoint. Only for manifests that say they list every file (``FILES_COMPLETE``)."""
    if manifest.get(FILES_COMPLETE) is not True:
        return []
    listed = manifest.get("files", {})
    unnamed = [
        entry
        for name, entry in _regular_files(directory)
        if name not in listed and name != MANIFEST
    ]
    if not unnamed:
        return []
    # What the listed names lead to, links followed: a file one of them links to is listed.
    covered = {os.path.realpath(directory / name) for name in listed if is_safe_name(name)}
    found = []
    for entry in unnamed:
        if entry.is_symlink():
            if not _inside(directory, entry):
                found.append((entry, "symlink points outside the checkpoint"))
                continue
            if entry.is_dir() or os.path.realpath(entry) in covered:
                continue  # a link to a folder (walked where it is) or to a listed file
        elif not entry.is_file():
            found.append((entry, "not a regular file (named in no manifest entry)"))
            continue
        elif os.path.realpath(entry) in covered:
            continue  # a listed name is a link to it
        found.append((entry, "not in the manifest (added or renamed after the save)"))
    return found


def file_digest(path: Path) -> str:
    """xxh3-64 of a whole file, read in bounded pieces."""
    hasher = new_hasher()
    with open_regular(path, buffering=0) as f:
        while block := f.read(8 * 2**20):
            hasher.update(block)
    return hasher.hexdigest()


def check_side_files(directory: Path, manifest: dict, names: list[str]) -> None:
    """Files of the step that are about to be copied out (config and tokenizer files, as
    ``huggingface/<name>``) against the digests the manifest records; a file the manifest
    names that is missing is an error too. Files of older manifests that recorded none are
    taken as they are."""
    files = manifest.get("files", {})
    for name in names:
        info = files.get(name)
        if not isinstance(info, dict) or "xxh3" not in info:
            continue
        path = directory / name
        if file_digest(path) != info["xxh3"]:
            raise ChecksumMismatchError(
                f"{path}: checksum mismatch (differs from the manifest's record)"
            )
    for name, info in files.items():
        if isinstance(info, dict) and "xxh3" in info and not present(directory / name):
            raise CheckpointNotFoundError(f"{directory / name}: named in the manifest but missing")


def write_manifest(directory: Path, doc: dict) -> None:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    sealed = {**body, "checksum": digest(canonical(body))}
    atomic_write_bytes(directory / MANIFEST, canonical(sealed))


def read_manifest(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not present(path):
        raise CheckpointNotFoundError(
            f"{directory}: no {MANIFEST}; not a committed shardstream checkpoint"
        )
    if path.is_symlink() and not _inside(directory, path):  # as every file it names
        raise UnsafeCheckpointError(f"{path}: symlink points outside the checkpoint")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise UnsafeCheckpointError(f"{path}: {size} bytes exceeds the manifest size limit")
    with open_regular(path) as f:
        raw = f.read(size + 1)  # read(n) allocates n bytes first
    try:
        doc = json.loads(raw, **jsondoc.strict(raw))
    except jsondoc.Refused as exc:  # Infinity, NaN, 1e999, an integer of 5000 digits
        raise CheckpointFormatError(f"{path}: manifest {exc}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ChecksumMismatchError(f"{path}: manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: manifest is not a JSON object")
    stored = doc.pop("checksum", None)
    # The file must also be the canonical text byte for byte: an edit that parses to the same
    # values ("1e-08" -> "1E-08", "\u00e9" -> "\u00E9") is an alteration all the same.
    if stored != digest(canonical(doc)) or canonical({**doc, "checksum": stored}) != raw:
        raise ChecksumMismatchError(f"{path}: manifest checksum mismatch (the file was altered)")
    if doc.get("format") != FORMAT or doc.get("version") not in READABLE_VERSIONS:
        raise CheckpointFormatError(
            f"{path}: format {doc.get('format')!r} version {doc.get('version')!r}; expected "
            f"{FORMAT!r} version {' or '.join(map(str, READABLE_VERSIONS))}"
        )
    for section in ("tensors", "files", "objects"):
        if not isinstance(doc.get(section, {}), dict):
            raise CheckpointFormatError(f"{path}: section {section!r} is not an object")
    world_size = doc.get("world_size", 1)
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise CheckpointFormatError(
            f"{path}: world_size {repr(world_size)[:80]} is not a positive integer of at most "
            f"{MAX_WORLD_SIZE}"
        )
    contents = doc.get("contents", [])
    if not isinstance(contents, list) or not all(isinstance(c, str) for c in contents):
        raise CheckpointFormatError(f"{path}: 'contents' is not a list of names")
    unknown = [c for c in contents if c not in CONTENTS]
    if unknown:
        raise CheckpointFormatError(
            f"{path}: 'contents' names {unknown[0][:80]!r}, not one of {', '.join(CONTENTS)}"
        )
    step = doc.get("step", 0)
    if type(step) is not int or step < 0:
        raise CheckpointFormatError(f"{path}: step {repr(step)[:80]} is not a non-negative integer")
    named = step_of(directory.name)
    if named is not None and named != step:
        raise CheckpointFormatError(
            f"{directory}: directory is named for step {named} but its manifest is step "
            f"{step} (copied or renamed?)"
        )
    # "yes" is not true: read as absent, it would silently skip the check for added files.
    if doc.get(FILES_COMPLETE, True) is not True:
        raise CheckpointFormatError(
            f"{path}: {FILES_COMPLETE} is {repr(doc[FILES_COMPLETE])[:80]}, not true"
        )
    return doc


# --- reading -----------------------------------------------------------------------------------


@dataclass
class NativeCheckpoint:
    """A committed shardstream step directory, described as blocks of bytes in its files."""

    directory: Path
    manifest: dict
    all_tensors: dict[str, GlobalTensor]
    digests: dict[str, tuple[int, int, list[str]]] = field(default_factory=dict)
    headers: dict[str, Any] = field(default_factory=dict)

    @property
    def format(self) -> str:
        return FORMAT

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size", 1))

    @property
    def fsdp_version(self) -> int | None:
        return None  # not recorded

    @property
    def replicas(self) -> dict[str, list[Block]]:
        return {}  # each tensor's bytes are saved once

    @property
    def mesh(self) -> str:
        """The saving ranks' device mesh, e.g. ``ddp=2 x fsdp=2``; empty when not recorded."""
        mesh = self.manifest.get("mesh")
        if not isinstance(mesh, dict):
            return ""
        shape, names = mesh.get("shape"), mesh.get("dim_names")
        if not isinstance(shape, list) or not isinstance(names, list):
            return ""
        return describe_mesh(names, shape)

    @property
    def files(self) -> list[str]:
        return [str(self.directory / f) for f in self.manifest.get("files", {})]

    @property
    def tensors(self) -> list[GlobalTensor]:
        """Model tensors under their module names (what merge and inspect see)."""
        return [
            GlobalTensor(name[len(MODEL_PREFIX) :], t.dtype, t.shape, t.blocks)
            for name, t in self.all_tensors.items()
            if name.startswith(MODEL_PREFIX)
        ]

    @property
    def placements(self) -> dict[str, str]:
        """How each model tensor was laid out when saved, and where its chunks are."""
        hf_dir = str(self.directory / "huggingface") + os.sep
        entries = self.manifest.get("tensors", {})
        out = {}
        for t in self.tensors:
            entry = entries.get(MODEL_PREFIX + t.name)
            saved = entry.get("placement") if isinstance(entry, dict) else None
            files = len({b.location for b in t.blocks})
            if t.blocks and all(str(b.location).startswith(hf_dir) for b in t.blocks):
                where = "in huggingface/ (shared with the export)"
            else:
                where = f"{len(t.blocks)} chunk(s) in {files} file(s)"
            out[t.name] = f"{saved}; {where}" if isinstance(saved, str) else where
        return out

    @property
    def lora_settings(self) -> dict | None:
        """``{"r", "lora_alpha", ...}`` of a model saved with LoRA adapters, else None."""
        return self.manifest.get("objects", {}).get("lora")

    @property
    def model_objects(self) -> tuple[str, ...]:
        return ()  # every model entry is a tensor

    def config_dir(self) -> Path | None:
        hf = self.directory / "huggingface"
        if not (hf / "config.json").is_file():
            return None
        from .hf import check_no_links_out, config_files

        check_no_links_out(hf, self.directory)
        names = [f"huggingface/{p.name}" for p in config_files(hf)]
        check_side_files(self.directory, self.manifest, names)  # what merge copies from here
        return hf

    def endpoint(self, location: str) -> FileEndpoint:
        """A reader of one data file that checks every chunk it reads."""
        if location not in self.digests:
            self.headers.get(location)  # read and checked now if it was not yet
        if location not in self.digests:
            raise CheckpointFormatError(f"{location}: not a data file of this checkpoint")
        data_start, chunk_bytes, chunks = self.digests[location]
        from ..engine.endpoints import FileEndpoint

        return FileEndpoint(
            location,
            chunks,
            data_start,
            chunk_bytes,
            describe=lambda lo, hi: self._describe_range(location, lo, hi),
        )

    def check_split_records(self, tensors: list[GlobalTensor]) -> None:
        """Nothing to check ahead of a merge: ``endpoint`` checks every chunk it reads."""

    def _describe_range(self, location: str, lo: int, hi: int) -> str:
        """The tensors a damaged range belongs to, for the error message."""
        header = self.headers.get(location)
        try:
            return range_description(header or read_header(location), lo, hi)
        except (OSError, CheckpointFormatError):
            return ""


def is_native_checkpoint(directory: Path) -> bool:
    return os.path.lexists(directory / MANIFEST)  # a FIFO or broken link: refused by name


def open_native(
    directory: str | os.PathLike,
    regions: dict[str, Region] | None = None,
    *,
    model_only: bool = False,
    shared: bool = False,
) -> NativeCheckpoint:
    """Read and cross-check the manifest against every data file's header.

    With ``regions`` (tensor name -> the (start, shape) a restoring rank needs), only those
    tensors are described, grid entries only by the chunks overlapping the region, and only
    the headers of the files they name are read: a rank's work no longer grows with the
    number of ranks that saved (docs/scaling.md). With ``model_only`` (a merge), only model
    tensors are described (``merge_view``), and only the headers of files holding them are
    read, one at a time; with ``shared`` too, every process of the current group calls this
    together and each reads a share of those headers (a distributed merge).
    """
    try:
        return _open_native(Path(directory), regions, model_only, shared)
    except FileNotFoundError as exc:
        if isinstance(exc, CheckpointNotFoundError):
            raise
        # Listed, then gone: removed while we read (a live run's retention, or by hand).
        raise CheckpointNotFoundError(f"{exc.filename}: missing (removed meanwhile?)") from None


def _open_native(
    directory: Path,
    regions: dict[str, Region] | None = None,
    model_only: bool = False,
    shared: bool = False,
) -> NativeCheckpoint:
    manifest = read_manifest(directory)
    headers = _Headers(manifest.get("tensors", {}))
    digests = headers.digests
    files = manifest.get("files", {})

    # Data files first: when huggingface/ is gone, its weights are the news, not its config.
    def is_data(name: str) -> bool:
        return isinstance(files[name], dict) and "header_xxh3" in files[name]

    data_first = sorted(files, key=lambda n: not is_data(n))
    for name in data_first:
        info = files[name]
        path = check_name(directory, name, "files")
        if not present(path):
            what = "data file" if is_data(name) else "file"
            raise CheckpointNotFoundError(
                f"{path}: {what} named in the manifest is missing{missing_note(manifest, name)}"
            )
        size = path.stat().st_size
        if not isinstance(info, dict) or size != info.get("size"):
            expected = info.get("size") if isinstance(info, dict) else None
            raise CheckpointFormatError(
                f"{path}: file is {size} bytes, manifest says {expected}; truncated or replaced"
            )
        if "header_xxh3" not in info:
            continue  # a JSON side file; its digest is checked when it is read
        headers.pending[str(path)] = info["header_xxh3"]
        if regions is None and not model_only:
            headers.get(str(path))
    checked: dict[str, str] = {}  # file names are few; chunks are many
    if model_only and regions is None:
        tensors = merge_view(directory, manifest, headers, checked, shared)
        return NativeCheckpoint(directory, manifest, tensors, digests, headers)
    tensors: dict[str, GlobalTensor] = {}
    for fqn, info in manifest.get("tensors", {}).items():
        if model_only and not fqn.startswith(MODEL_PREFIX):
            continue
        if regions is None:
            tensors[fqn] = _global_tensor(directory, fqn, info, headers, checked)
        elif fqn in regions:
            tensors[fqn] = _global_tensor(directory, fqn, info, headers, checked, regions[fqn])
    return NativeCheckpoint(directory, manifest, tensors, digests, headers)


def merge_view(
    directory: Path,
    manifest: dict,
    headers: _Headers,
    checked: dict[str, str],
    shared: bool = False,
) -> dict[str, GlobalTensor]:
    """The model tensors as a merge reads them: grid entries as one offset per rank
    (``_open_grids``), the rest as blocks. No header is kept after.

    They come in the order the rank files hold them (the model's own order), so a merge
    that writes them in turn reads every rank file front to back, each byte once.
    """
    tensors = _open_grids(directory, manifest, headers, checked, shared)
    for fqn, info in manifest.get("tensors", {}).items():
        if fqn.startswith(MODEL_PREFIX) and fqn not in tensors:
            tensors[fqn] = _global_tensor(directory, fqn, info, headers, checked)
    headers.clear()  # the blocks hold every offset a merge needs; the digests stay
    return {fqn: tensors[fqn] for fqn in sorted(tensors, key=lambda f: stored_at(tensors[f]))}


class _Headers(dict):
    """Parsed data-file headers by path, each read and checked against its manifest digest on
    first use; every record of a rank file must belong to one of the manifest's ``entries``
    (a record no entry names: the manifest lost it, and its tensor would go unread)."""

    def __init__(self, entries: Mapping[str, Any] | None = None):
        super().__init__()
        self.pending: dict[str, str] = {}
        self.digests: dict[str, tuple[int, int, list[str]]] = {}
        self.entries = entries
        # (huggingface/ file, record) -> the tensor whose chunk it is: each is one tensor's
        self.claimed: dict[tuple[str, str], str] = {}

    def get(self, path, default=None):
        if path in self:
            return self[path]
        expected = self.pending.pop(path, None)
        if expected is None:
            return default
        raw, file_size = read_header_bytes(path)  # checked before a word of it is believed
        if digest(raw) != expected:
            raise ChecksumMismatchError(
                f"{path}: header checksum mismatch (header altered, or file swapped)"
            )
        header = parse_header(path, raw[8:], file_size)
        sums = stored_checksums(header)
        if sums is None:
            raise CheckpointFormatError(f"{path}: no shardstream checksums in the header")
        if self.entries is not None and _RANK_FILE.fullmatch(Path(path).name):
            _refuse_unlisted(path, header, self.entries)
        self.digests[path] = (header.data_start, sums.chunk_bytes, sums.chunks)
        self[path] = header
        return header


def _refuse_unlisted(path: str, header: SafetensorsHeader, entries: Mapping[str, Any]) -> None:
    unlisted = [k for k in header.tensors if k.rpartition("@")[0] not in entries]
    if unlisted:
        names = ", ".join(repr(k[:200]) for k in unlisted[:3])
        raise CheckpointFormatError(
            f"{path}: holds {len(unlisted)} record(s) of tensors the manifest has no entry for "
            f"({names}{', ...' if len(unlisted) > 3 else ''}); the manifest lost them, or the "
            "file belongs to another save"
        )


def _global_tensor(
    directory: Path,
    fqn: str,
    info: Any,
    headers: dict,
    checked: dict[str, str] | None = None,
    region: Region | None = None,
) -> GlobalTensor:
    checked = {} if checked is None else checked
    where = f"{directory / MANIFEST}: tensor {fqn!r}"
    rows = None
    files = len(headers) + len(getattr(headers, "pending", ()))
    dtype, shape, world = _entry_layout(where, info, files)
    try:
        if world is not None:
            if region is not None:  # the grid tiles by construction: only what is needed
                start, count = region[0][0], region[1][0]
                rows = (start, start + count) if all(region[1]) else (0, 0)
            chunks = grid_chunks(fqn, list(shape), world, rows)
        else:
            chunks = info["chunks"]
            if not isinstance(chunks, list):
                raise TypeError(f"chunks is a {type(chunks).__name__}, not a list")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointFormatError(f"{where}: malformed entry ({exc})") from None
    blocks = []
    for chunk in chunks:
        try:
            name = chunk["file"]
            if name not in checked:
                checked[name] = str(check_name(directory, name, f"tensor {fqn!r}"))
            path = checked[name]
            offsets = _counts(chunk["offsets"], "offsets")
            sizes = _counts(chunk["sizes"], "sizes")
            key = chunk["key"]
            if not isinstance(key, str):
                raise TypeError(f"key {key!r} is not a string")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointFormatError(f"{where}: malformed chunk ({exc})") from None
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CheckpointFormatError(
                f"{where}: chunk {key!r} has {len(offsets)} offsets and {len(sizes)} sizes "
                f"for {len(shape)} dims"
            )
        # A rank file holds each chunk under the key its name and offsets give: another key
        # is another tensor's record (an optimizer state of the same shape, say), not this one.
        expected = item_key(fqn, list(offsets))
        if key != expected and not name.startswith(HF_DIR_PREFIX):
            raise CheckpointFormatError(
                f"{where}: chunk at offsets {list(offsets)} has key {key[:300]!r}; the format "
                f"stores it as {expected!r}"
            )
        # A huggingface/ record is named as save_pretrained names it, which only the layout
        # says; but it holds one tensor: a record two entries name is another's bytes.
        claimed = getattr(headers, "claimed", None)
        if claimed is not None and name.startswith(HF_DIR_PREFIX):
            owner = claimed.setdefault((path, key), fqn)
            if owner != fqn:
                raise CheckpointFormatError(
                    f"{where}: chunk names record {key[:300]!r} of {path}, which tensor "
                    f"{owner!r} names too; each record is one tensor's"
                )
        header = headers.get(path)
        entry = header.tensors.get(key) if header else None
        _check_chunk(directory, fqn, key, path, entry, dtype, sizes)
        blocks.append(dense_block(path, header.data_start + entry.begin, dtype, sizes, offsets))
    if "grid" not in info:  # a grid tiles by construction (and a part of one would not)
        check_blocks_tile(fqn, shape, blocks)
    return GlobalTensor(fqn, dtype, shape, tuple(blocks))


def _entry_layout(where: str, info: Any, files: int) -> tuple[str, tuple[int, ...], int | None]:
    """A manifest tensor entry's dtype, shape and grid size (None for a chunk list)."""
    try:
        dtype = info["dtype"]
        shape = _counts(info["shape"], "shape")
        if dtype not in ITEMSIZE:
            raise ValueError(f"dtype {dtype!r}")
        world = info.get("grid")
        # A grid names one file per rank; more ranks than files is damage, not a layout.
        if "grid" in info and (type(world) is not int or not 1 <= world <= files or not shape):
            raise ValueError(f"grid {world!r} for shape {list(shape)}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointFormatError(f"{where}: malformed entry ({exc})") from None
    return dtype, shape, world


def _counts(value: Any, what: str) -> tuple[int, ...]:
    """A shape, offsets or sizes, as ``jsondoc.is_counts`` takes them."""
    if not jsondoc.is_counts(value):
        raise ValueError(f"{what} {repr(value)[:80]} is not a list of non-negative integers")
    return tuple(value)


def _check_chunk(
    directory: Path, fqn: str, key: str, path: str, entry: Any, dtype: str, sizes: tuple
) -> None:
    """Raise unless a rank file's header ``entry`` holds the chunk the manifest describes."""
    if entry is not None and entry.dtype == dtype and entry.shape == sizes:
        return
    where = f"{directory / MANIFEST}: tensor {fqn!r}"
    if entry is None:
        raise CheckpointFormatError(f"{where}: chunk {key!r} is not in {path}")
    raise CheckpointFormatError(
        f"{where}: chunk {key!r} in {path} is {entry.dtype}{list(entry.shape)}, "
        f"manifest says {dtype}{list(sizes)}"
    )


def _open_grids(
    directory: Path, manifest: dict, headers: _Headers, checked: dict[str, str], shared: bool
) -> dict[str, GlobalTensor]:
    """The model's grid tensors, for a merge: rank file by rank file, each header is read
    once, the offsets of its grid chunks noted, and the header let go (unless a chunk-list
    tensor needs it too). Heap: 8 bytes per chunk, one header at a time. ``shared``: the
    processes of a distributed merge read a share of the headers each and exchange the
    offsets and chunk digests."""
    files = len(headers) + len(headers.pending)
    grids: dict[str, tuple[str, tuple[int, ...], int]] = {}
    listed: set[str] = set()  # files that chunk-list model tensors name
    for fqn, info in manifest.get("tensors", {}).items():
        if not fqn.startswith(MODEL_PREFIX):
            continue
        where = f"{directory / MANIFEST}: tensor {fqn!r}"
        dtype, shape, world = _entry_layout(where, info, files)
        if world is not None:
            grids[fqn] = (dtype, shape, world)
        elif isinstance(info.get("chunks"), list):
            listed.update(c.get("file") for c in info["chunks"] if isinstance(c, dict))
    ranks = max((world for _, _, world in grids.values()), default=0)
    paths: list[str] = []
    for r in range(ranks):
        name = rank_file(r)
        if name not in checked:
            checked[name] = str(check_name(directory, name, "a grid entry"))
        paths.append(checked[name])

    def located(r: int, path: str) -> tuple[list[int | None], tuple | None]:
        """Rank file ``r``'s offset of each grid's chunk (None: it holds none) and digests."""
        header = headers.get(path)
        found: list[int | None] = []
        for fqn, (dtype, shape, world) in grids.items():
            start, rows = chunk_extent(shape[0], world, r)
            if r >= world or rows == 0:
                found.append(None)
                continue
            key = grid_key(fqn, start, len(shape))
            entry = header.tensors.get(key) if header else None
            _check_chunk(directory, fqn, key, path, entry, dtype, (rows, *shape[1:]))
            found.append(header.data_start + entry.begin)
        if rank_file(r) not in listed:
            headers.pop(path, None)
        return found, headers.digests.get(path)

    if shared:  # only a distributed merge gets here, with torch.distributed loaded already
        from ..storage.collectives import in_turns

        turns = in_turns(paths, located)
    else:
        turns = ((r, path, located(r, path)) for r, path in enumerate(paths))
    offsets = {fqn: array("q") for fqn in grids}
    for r, path, (found, sums) in turns:
        for fqn, offset in zip(grids, found):
            if offset is not None:
                offsets[fqn].append(offset)
        if sums is not None:  # read by another process: its digests, and no second read
            headers.digests[path] = sums
            if rank_file(r) not in listed:
                headers.pending.pop(path, None)
    return {
        fqn: GlobalTensor(fqn, dtype, shape, GridBlocks(dtype, shape, world, paths, offsets[fqn]))
        for fqn, (dtype, shape, world) in grids.items()
    }
