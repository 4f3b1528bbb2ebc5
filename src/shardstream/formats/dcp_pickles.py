"""DCP's two pickles, read without running code: ``.metadata`` and each chunk's ``data.pkl``.

``.metadata`` is a pickle of DCP's ``Metadata``; every tensor chunk in a ``.distcp`` file is a
``torch.save`` archive whose ``data.pkl`` rebuilds one tensor from a storage record. Restricted
unpicklers resolve only the handful of names DCP writes, each to an inert stand-in defined here,
after a pass over the opcodes: a hostile checkpoint cannot run code. ``read_chunk_layout`` then
finds the chunk's elements inside its archive (stored uncompressed) without reading them.
"""

from __future__ import annotations

import collections
import copy
import io
import math
import os
import pickle
import reprlib
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath

import torch

from ..engine.dtypes import code_of, itemsize
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from .regular_file import open_regular

# A chunk record's data.pkl and central directory are a few hundred bytes; refuse absurd sizes.
MAX_RECORD_PICKLE_BYTES = 1 << 20
MAX_RECORD_READ_BYTES = 16 << 20

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_MAGIC = 0x04034B50

# --------------------------------------------------------------------------- restricted unpickling


class _Frozen(type):
    """Metaclass of the stand-ins: pickle's BUILD can fill instances, never change the classes."""

    def __setattr__(cls, name, value):
        raise UnsafeCheckpointError(f"refused to unpickle: it tries to modify {cls.__name__}")

    def __delattr__(cls, name):
        raise UnsafeCheckpointError(f"refused to unpickle: it tries to modify {cls.__name__}")


class _Record(metaclass=_Frozen):
    """Inert stand-in for one of DCP's metadata dataclasses: pickle's BUILD fills ``__dict__``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class Metadata(_Record):
    state_dict_metadata = None
    planner_data = None
    storage_data = None
    storage_meta = None
    version = None


class TensorStorageMetadata(_Record):
    properties = None
    size = None
    chunks = None


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    offsets = None
    sizes = None


class TensorProperties(_Record):
    dtype = None

    def __setstate__(self, state) -> None:
        # DCP pickles (dtype, layout, requires_grad, memory_format, pin_memory).
        if isinstance(state, tuple) and state:
            self.__dict__["dtype"] = state[0]
        elif isinstance(state, dict):
            self.__dict__["dtype"] = state.get("dtype")
        else:
            raise CheckpointFormatError("TensorProperties with an unknown state layout")


class MetadataIndex(_Record):
    fqn = None
    offset = None
    index = None


class StorageMeta(_Record):
    pass


class StorageInfo(_Record):
    relative_path = None
    offset = None
    length = None
    transform_descriptors = None


class _Call:
    """A callable the unpickler may hand out; it has no state that BUILD could change."""

    __slots__ = ("_fn",)

    def __init__(self, fn):
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args):
        return self._fn(*args)

    def __setattr__(self, name, value):
        raise UnsafeCheckpointError("refused to unpickle: it tries to modify a callable")

    def __reduce__(self):
        raise TypeError("not picklable")


def _size(dims=()) -> tuple[int, ...]:
    """``torch.Size(dims)`` as a plain tuple of ints."""
    dims = tuple(dims)
    if not all(type(d) is int for d in dims):
        raise CheckpointFormatError(f"torch.Size with non-integer entries {short_repr(dims)}")
    return dims


def _enum_value(value=0):
    return value


_LAYOUTS = {"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn"}


def _layout(name: str) -> str:
    if name not in _LAYOUTS:
        raise CheckpointFormatError(f"unknown tensor layout {name!r}")
    return name


def _path(*parts) -> str:
    return str(PurePosixPath(*(str(p) for p in parts)))


def _windows_path(*parts) -> str:
    return str(PureWindowsPath(*(str(p) for p in parts)))


_DCP_META = "torch.distributed.checkpoint.metadata"
_OLD_SHARD_META = "torch.distributed._shard.sharded_tensor.metadata"
_METADATA_GLOBALS: dict[tuple[str, str], object] = {
    (_DCP_META, "Metadata"): Metadata,
    (_DCP_META, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP_META, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP_META, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP_META, "TensorProperties"): TensorProperties,
    (_DCP_META, "MetadataIndex"): MetadataIndex,
    (_DCP_META, "StorageMeta"): StorageMeta,
    (_DCP_META, "_MEM_FORMAT_ENCODING"): _Call(_enum_value),
    # torch <= 2.1 kept TensorProperties with the sharded-tensor metadata.
    (_OLD_SHARD_META, "TensorProperties"): TensorProperties,
    (_OLD_SHARD_META, "MEM_FORMAT_ENCODING"): _Call(_enum_value),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _Call(_size),
    ("torch.serialization", "_get_layout"): _Call(_layout),
    ("collections", "OrderedDict"): OrderedDict,
    # StorageMeta.checkpoint_id is the save path.
    ("pathlib", "PosixPath"): _Call(_path),
    ("pathlib", "PurePosixPath"): _Call(_path),
    ("pathlib", "Path"): _Call(_path),
    ("pathlib", "WindowsPath"): _Call(_windows_path),
    ("pathlib", "PureWindowsPath"): _Call(_windows_path),
}


def _torch_dtype(module: str, name: str):
    """``torch.float32`` and friends: values, never callables."""
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    return None


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``allowed`` (to stand-ins) and torch dtypes."""

    allowed: dict[tuple[str, str], object] = {}

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        dtype = _torch_dtype(module, name)
        if dtype is not None:
            return dtype
        raise UnsafeCheckpointError(
            f"{self.path}: refused to unpickle: it asks for {module}.{name}, which a DCP "
            "checkpoint never needs (the file may be hostile)"
        )

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.path}: refused to unpickle: unexpected persistent id")


class _MetadataUnpickler(_SafeUnpickler):
    allowed = _METADATA_GLOBALS


# Pickle opcodes whose argument is a length followed by that many bytes: (size of the length
# field, signed). The C unpickler allocates the declared length before reading, so a flipped byte
# here is a memory bomb unless the length is checked against the bytes that are really there.
_COUNTED = {
    b"\x8a"[0]: (1, False),  # LONG1
    b"\x8b"[0]: (4, True),  # LONG4
    b"T"[0]: (4, True),  # BINSTRING
    b"U"[0]: (1, False),  # SHORT_BINSTRING
    b"B"[0]: (4, False),  # BINBYTES
    b"C"[0]: (1, False),  # SHORT_BINBYTES
    b"\x8e"[0]: (8, False),  # BINBYTES8
    b"\x96"[0]: (8, False),  # BYTEARRAY8
    b"\x8c"[0]: (1, False),  # SHORT_BINUNICODE
    b"X"[0]: (4, False),  # BINUNICODE
    b"\x8d"[0]: (8, False),  # BINUNICODE8
}
_FRAME = b"\x95"[0]
_STOP = b"."[0]
_LONG_BINPUT = b"r"[0]
_PUT = b"p"[0]
_GET = b"g"[0]
# Opcodes with a fixed-size argument (bytes), and those whose argument runs to a newline (lines).
_FIXED = {b"J"[0]: 4, b"K"[0]: 1, b"M"[0]: 2, b"G"[0]: 8, b"h"[0]: 1, b"j"[0]: 4, b"q"[0]: 1,
          b"r"[0]: 4, b"\x82"[0]: 1, b"\x83"[0]: 2, b"\x84"[0]: 4, b"\x80"[0]: 1}  # fmt: skip
_LINES = {b"I"[0]: 1, b"L"[0]: 1, b"S"[0]: 1, b"V"[0]: 1, b"F"[0]: 1, b"g"[0]: 1, b"p"[0]: 1,
          b"P"[0]: 1, b"c"[0]: 2, b"i"[0]: 2}  # fmt: skip
_INDEXED = frozenset(b"hjqr")  # BINGET, LONG_BINGET, BINPUT, LONG_BINPUT
_NO_ARGUMENT = frozenset(
    b"\x97\x98N\x88\x89]ael)t\x85\x86\x87}dsu\x8f\x90\x9102(1\x94\x93RboQ\x81\x92"
)

# Hashing a tuple hashes its items again every time (tuples cache no hash), so a few hundred
# bytes of tuples that each hold the previous one twice make one dict key cost 2**depth steps,
# inside the C unpickler where Ctrl-C cannot stop it. The opcode pass charges every hash the
# unpickler (or a constructor it calls) would do and refuses past this many steps.
WORK_BASE = 1_000_000
WORK_PER_BYTE = 8
MAX_NESTING = 100  # containers inside containers; real checkpoints nest a dozen deep
MAX_PERSISTENT_ID = 64  # items in a persistent id (torch's storage ids hold five)
# Pushes a new object whose hashing costs one step (scalars, strings, empty containers, globals).
_ATOMS = frozenset(b"IJKML\x8a\x8bSTUBC\x8e\x96\x97N\x88\x89V\x8cX\x8dFG])}\x8f\x82\x83\x84cP")


_EMPTY_CONTAINERS = frozenset(b"]}\x8f")  # EMPTY_LIST, EMPTY_DICT, EMPTY_SET: grown in place
_MEMOIZE = b"\x94"[0]
_GETS = frozenset(b"ghj")
_MEMO_OPS = _GETS | frozenset(b"pqr\x94")


class _Node:
    """What the opcode pass knows of one object: the steps to hash it and how deep it nests."""

    __slots__ = ("cost", "depth")

    def __init__(self, cost: int = 1, depth: int = 0):
        self.cost = cost
        self.depth = depth


class _Memo:
    """The unpickler's memo of ``_Node``s: a list while entries come in index order, as
    picklers write them (8 bytes an entry, where a DCP .metadata has millions), a dict from
    the first that does not."""

    __slots__ = ("ordered", "keyed")

    def __init__(self):
        self.ordered: list[_Node] | None = []
        self.keyed: dict[int, _Node] = {}

    def __len__(self) -> int:
        return len(self.ordered) if self.ordered is not None else len(self.keyed)

    def put(self, index: int, node: _Node) -> None:
        ordered = self.ordered
        if ordered is not None:
            if index == len(ordered):
                ordered.append(node)
                return
            if index < len(ordered):
                ordered[index] = node
                return
            self.keyed, self.ordered = dict(enumerate(ordered)), None
        self.keyed[index] = node

    def get(self, index: int) -> _Node:
        ordered = self.ordered
        if ordered is not None:
            if 0 <= index < len(ordered):
                return ordered[index]
        elif index in self.keyed:
            return self.keyed[index]
        raise CheckpointFormatError(f"pickle reads memo entry {index}, never stored")


class _Machine:
    """The unpickler's stack and memo with ``_Node``s in place of objects."""

    def __init__(self, size: int):
        self.budget = WORK_BASE + WORK_PER_BYTE * size
        self.work = 0
        self.stack: list[_Node] = []
        self.marks: list[int] = []
        self.memo = _Memo()
        self.scalar = _Node()  # this pickle's: another's cannot have grown it

    def fence(self) -> int:
        return self.marks[-1] if self.marks else 0

    def pop(self, n: int = 1) -> list[_Node]:
        if len(self.stack) - n < self.fence():
            raise CheckpointFormatError("pickle stack underflow")
        items = self.stack[len(self.stack) - n :]
        del self.stack[len(self.stack) - n :]
        return items

    def pop_mark(self) -> list[_Node]:
        if not self.marks:
            raise CheckpointFormatError("pickle has no MARK where one is needed")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def top(self) -> _Node:
        if len(self.stack) <= self.fence():
            raise CheckpointFormatError("pickle stack underflow")
        return self.stack[-1]

    def charge(self, nodes) -> None:
        work = self.work
        for n in nodes:
            work += n.cost
        self.work = work
        if work > self.budget:
            raise UnsafeCheckpointError(
                f"refused to unpickle: it nests shared tuples or keys that would take more than "
                f"{self.budget} steps to hash (a hostile file?)"
            )

    def new(self, items) -> _Node:
        cost, depth = 1, 0
        for n in items:
            cost += n.cost
            if n.depth > depth:
                depth = n.depth
        node = _Node(min(self.budget + 1, cost), depth + 1)
        if node.depth > MAX_NESTING:
            raise UnsafeCheckpointError(
                f"refused to unpickle: it nests objects more than {MAX_NESTING} levels deep"
            )
        return node

    def grow(self, target: _Node, items) -> None:
        grown = self.new(items)
        target.cost = min(self.budget + 1, target.cost + grown.cost - 1)
        target.depth = max(target.depth, grown.depth)
        if target.depth > MAX_NESTING:
            raise UnsafeCheckpointError(
                f"refused to unpickle: it nests objects more than {MAX_NESTING} levels deep"
            )

    def step(self, op: int, index: int | None) -> None:
        """Apply opcode ``op``; ``index``: the memo index of a GET or PUT."""
        if op in _ATOMS:
            # A scalar's node is never grown (a pickle that tries makes every scalar of its
            # own dearer after it: refused sooner, never later), so its scalars share one;
            # containers do not.
            self.stack.append(_Node() if op in _EMPTY_CONTAINERS else self.scalar)
            return
        if op in _MEMO_OPS:  # the most frequent others first, without the chain below
            if op in _GETS:
                self.stack.append(self.memo.get(index))
            else:  # MEMOIZE (the next index), or (LONG_)BINPUT/PUT (their own)
                self.memo.put(len(self.memo) if index is None else index, self.top())
            return
        c = chr(op)
        if c in "ae":  # APPEND(S): a list grows; nothing is hashed
            items = self.pop() if c == "a" else self.pop_mark()
            self.grow(self.top(), items)
        elif c in "lt\x85\x86\x87\x91":  # LIST, TUPLE, TUPLE1-3, FROZENSET
            items = self.pop_mark() if c in "lt\x91" else self.pop(ord(c) - 0x84)
            if c == "\x91":
                self.charge(items)
            self.stack.append(self.new(items))
        elif c in "dsu\x90":  # DICT, SETITEM(S): keys are hashed; ADDITEMS: every item
            items = self.pop(2) if c == "s" else self.pop_mark()
            self.charge(items if c == "\x90" else items[::2])
            if c == "d":
                self.stack.append(self.new(items))
            else:
                self.grow(self.top(), items)
        elif c == "0":  # POP: an item, or the mark when the stack is at it
            if self.marks and len(self.stack) == self.marks[-1]:
                self.marks.pop()
            else:
                self.pop()
        elif c == "1":
            self.pop_mark()
        elif c == "2":
            self.stack.append(self.top())
        elif c == "(":
            self.marks.append(len(self.stack))
        elif c == "\x93":  # STACK_GLOBAL
            self.pop(2)
            self.stack.append(_Node())
        elif c in "R\x81\x92oi":  # REDUCE, NEWOBJ(_EX), OBJ, INST: a call may hash its arguments
            if c == "R" or c == "\x81":
                items = self.pop(2)[1:]
            elif c == "\x92":
                items = self.pop(3)[1:]
            else:
                items = self.pop_mark()[(1 if c == "o" else 0) :]
            self.charge(items)
            self.stack.append(self.new(items))
        elif c == "b":  # BUILD: the state's keys are hashed again into the instance
            (state,) = self.pop()
            self.top()
            self.charge([state])
        elif c == "Q":  # BINPERSID
            (pid,) = self.pop()
            if pid.cost > MAX_PERSISTENT_ID:
                raise UnsafeCheckpointError(
                    f"refused to unpickle: a persistent id of {pid.cost} or more items"
                )
            self.stack.append(_Node())


def check_pickle(data: bytes, whole: bool = False) -> None:
    """Walk the pickle's opcodes without running any, refusing what would make the unpickler
    allocate more than the input justifies (a declared length of bytes, string, long or frame
    past the end of the data; a memo index beyond the data's length), nest deeper than
    ``MAX_NESTING``, or hash more than ``WORK_BASE + WORK_PER_BYTE * len(data)`` steps.
    ``whole``: the pickle must end where ``data`` does (a file that is one pickle: bytes after
    its STOP, which an unpickler never reads, are refused).
    Raises UnsafeCheckpointError or CheckpointFormatError without the path (the caller adds it).
    """
    end = len(data)
    machine = _Machine(end)
    at = 0
    while at < end:
        op = data[at]
        start = at
        at += 1
        index = None
        counted = _COUNTED.get(op)
        if counted is not None:
            width, signed = counted
            if at + width > end:
                raise CheckpointFormatError(f"pickle truncated at byte {start}")
            n = int.from_bytes(data[at : at + width], "little", signed=signed)
            at += width
            if n < 0 or n > end - at:
                raise UnsafeCheckpointError(
                    f"pickle opcode at byte {start} declares {n} bytes, but only {end - at} "
                    "follow (a corrupt or hostile length)"
                )
            at += n
        elif op == _FRAME:
            if at + 8 > end:
                raise CheckpointFormatError(f"pickle truncated at byte {start}")
            n = int.from_bytes(data[at : at + 8], "little")
            at += 8
            if n > end - at:
                raise UnsafeCheckpointError(
                    f"pickle frame at byte {start} declares {n} bytes, but only {end - at} follow "
                    "(a corrupt or hostile length)"
                )
            continue
        elif op in _FIXED:
            width = _FIXED[op]
            if at + width > end:
                raise CheckpointFormatError(f"pickle truncated at byte {start}")
            if op in _INDEXED:  # a memo index; the other arguments are plain values
                index = int.from_bytes(data[at : at + width], "little")
            if op == _LONG_BINPUT and index > end:
                raise UnsafeCheckpointError(
                    f"pickle opcode at byte {start} stores memo entry {index}, more than the "
                    "data has bytes"
                )
            at += width
        elif op in _LINES:
            for _ in range(_LINES[op]):
                newline = data.find(b"\n", at)
                if newline < 0:
                    raise CheckpointFormatError(f"pickle truncated at byte {start}")
                line = data[at:newline]
                at = newline + 1
            if op in (_PUT, _GET):
                if not (line.isdigit() and len(line) <= 19 and int(line) <= end):
                    raise UnsafeCheckpointError(
                        f"pickle opcode at byte {start} names memo entry {line[:30]!r}, not an "
                        "index within the data"
                    )
                index = int(line)
        elif op == _STOP:
            if whole and at != end:
                raise CheckpointFormatError(
                    f"{end - at} bytes follow the pickle's end (its STOP at byte {start}); a "
                    "pickle file holds nothing after it (damaged, or data appended)"
                )
            return
        elif op not in _NO_ARGUMENT:
            raise CheckpointFormatError(f"unknown pickle opcode {op:#04x} at byte {start}")
        machine.step(op, index)
    raise CheckpointFormatError("pickle ends without a STOP opcode (truncated?)")


_SHARED_BASE = 1_000_000
_SHARED_PER_BYTE = 2
_SCALARS = (str, bytes, int, float, bool, complex, type(None))


def _children(obj) -> list:
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
        extra = getattr(obj, "__dict__", None) if type(obj) is not dict else None
        if extra:  # an OrderedDict that a pickle's BUILD gave attributes
            if set(extra) != {"_metadata"} or not isinstance(extra["_metadata"], dict):
                raise CheckpointFormatError(
                    f"{type(obj).__name__} with unexpected state (the pickle sets its "
                    f"attributes {short_repr(sorted(map(str, extra)))})"
                )
            items.append(extra["_metadata"])
        return items
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    attrs = getattr(obj, "__dict__", None)
    return list(attrs.values()) if type(attrs) is dict else []


def check_unpickled(obj, size: int) -> None:
    """Refuse an unpickled object that would make a plain walk over it slow: more than
    ``1_000_000 + 2 * size`` objects counting a shared one at each place it appears, a cycle,
    or nesting deeper than ``MAX_NESTING``; and an OrderedDict whose pickle gave it attributes
    (they would hide its methods). Raises without the path (the caller adds it)."""
    limit = _SHARED_BASE + _SHARED_PER_BYTE * size
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [[obj, iter(_children(obj)), 1]]
    on_path.add(id(obj))
    while stack:
        entry = stack[-1]
        child = next(entry[1], stack)
        if child is stack:  # done with entry[0]
            stack.pop()
            on_path.discard(id(entry[0]))
            sizes[id(entry[0])] = entry[2]
            if stack:
                stack[-1][2] += entry[2]
                if stack[-1][2] > limit:
                    raise UnsafeCheckpointError(
                        f"refused to unpickle: shared objects in it expand to more than {limit} "
                        "(a hostile file?)"
                    )
            continue
        if isinstance(child, _SCALARS):
            entry[2] += 1
        elif id(child) in sizes:
            entry[2] += sizes[id(child)]
        elif id(child) in on_path:
            raise UnsafeCheckpointError("refused to unpickle: an object in it contains itself")
        else:
            if len(stack) >= MAX_NESTING:
                raise UnsafeCheckpointError(
                    f"refused to unpickle: it nests objects more than {MAX_NESTING} levels deep"
                )
            on_path.add(id(child))
            stack.append([child, iter(_children(child)), 1])
        if entry[2] > limit:
            raise UnsafeCheckpointError(
                f"refused to unpickle: shared objects in it expand to more than {limit} "
                "(a hostile file?)"
            )


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80


class _PlainDataUnpickler(_SafeUnpickler):
    """Resolves no global at all: a pickle of containers, numbers and strings only."""

    allowed: dict[tuple[str, str], object] = {}


def check_passed_pickle(data: bytes, name: str) -> None:
    """Bytes that a Stateful's own ``load_state_dict`` may unpickle (torchtitan's dataloader
    keeps ``pickle.dumps`` of its state): when they are a pickle any unpickler would load, it
    must hold plain data, since the object's code would run whatever it names. Bytes no
    unpickler loads pass as they are."""
    try:
        check_pickle(data)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{name}: its bytes are a hostile pickle: {exc}") from None
    except CheckpointFormatError:
        return  # not a loadable pickle: opaque bytes
    try:
        _PlainDataUnpickler(io.BytesIO(data), name).load()
    except UnsafeCheckpointError as exc:
        detail = str(exc).removeprefix(f"{name}: ")
        raise UnsafeCheckpointError(
            f"{name}: holds a pickle that the object's load_state_dict would unpickle, and it "
            f"names code ({detail}); shardstream passes pickled state on only when it is "
            "plain data"
        ) from None
    except Exception:  # noqa: BLE001 - pickle.loads fails on these bytes too
        return


def short_repr(value) -> str:
    """``repr`` bounded in depth and length: unpickled values can be huge or nest shared parts."""
    return _REPR.repr(value)


def _safe_loads(unpickler_cls, data: bytes, path: str, what: str):
    """Unpickle ``data`` with ``unpickler_cls``, between ``check_pickle`` and
    ``check_unpickled``; any failure is a CheckpointFormatError (or UnsafeCheckpointError)
    naming ``path``."""
    try:
        check_pickle(data, whole=True)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{path}: {what}: {exc}") from None
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(
            f"{path}: {what} is not readable (truncated or corrupt?): {exc}"
        ) from None
    try:
        loaded = unpickler_cls(io.BytesIO(data), path).load()
        check_unpickled(loaded, len(data))
        return loaded
    except UnsafeCheckpointError as exc:
        if str(exc).startswith(path):
            raise
        raise UnsafeCheckpointError(f"{path}: {exc}") from None
    except CheckpointFormatError as exc:
        malformed = "" if isinstance(exc, _LazyView) else " is malformed"
        raise CheckpointFormatError(f"{path}: {what}{malformed}: {exc}") from None
    except Exception as exc:  # noqa: BLE001  (anything the unpickler raises means bad bytes)
        # OverflowError, MemoryError, RecursionError, UnpicklingError, EOFError, ValueError, ...
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointFormatError(
            f"{path}: {what} is not readable (truncated or corrupt?): "
            f"{type(exc).__name__}{': ' + detail[:200] if detail else ''}"
        ) from None


# DCP's .metadata lists every chunk of every tensor, some 150 bytes each: a 70B model's train
# state (~2,200 tensors) saved by 1,024 ranks holds ~2.3M chunks, ~0.35 GB. Held whole, as
# torch holds it; a larger claim is refused rather than read.
MAX_METADATA_BYTES = 4 << 30


def load_metadata(path: str | os.PathLike) -> Metadata:
    """Unpickle DCP's ``.metadata`` with the restricted unpickler (at most
    ``MAX_METADATA_BYTES`` of it: the unpickled object is held whole)."""
    path = str(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                raise UnsafeCheckpointError(
                    f"{path}: {size} bytes, over the {MAX_METADATA_BYTES} bytes a DCP .metadata "
                    "is read up to (one chunk entry takes about 150 bytes)"
                )
            f.seek(max(size - 1, 0))
            if f.read(1) != b".":  # a pickle ends with STOP: judged before reading it all
                raise CheckpointFormatError(
                    f"{path}: the DCP metadata is not readable: it does not end as a pickle "
                    "does (no STOP opcode as its last byte): damaged, or data appended"
                )
            f.seek(0)
            data = f.read(size + 1)  # not the limit: read(n) allocates n bytes first
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    except MemoryError:
        raise CheckpointFormatError(
            f"{path}: too large to hold in memory ({size} bytes of DCP metadata)"
        ) from None
    if len(data) > MAX_METADATA_BYTES:  # grew while read
        raise UnsafeCheckpointError(f"{path}: over {MAX_METADATA_BYTES} bytes")
    meta = _safe_loads(_MetadataUnpickler, data, path, "the DCP metadata")
    if not isinstance(meta, Metadata):
        raise CheckpointFormatError(
            f"{path}: expected DCP Metadata, found {type(meta).__name__}; not a DCP .metadata file"
        )
    return meta


# --------------------------------------------------------------------------- chunk records


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype | None  # None: an untyped storage (dtype comes with _rebuild_tensor_v3)
    key: str
    numel: int  # elements of ``dtype``, or bytes for an untyped storage


@dataclass(frozen=True)
class _TensorRecord:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        raise CheckpointFormatError(f"{what} is {short_repr(value)}, not a tuple of integers")
    return value


def int_sequence(value, what: str) -> tuple[int, ...]:
    """A tuple, list or ``torch.Size`` of ints from unpickled metadata (None: empty)."""
    if value is None:
        return ()
    if not isinstance(value, (tuple, list)):
        raise CheckpointFormatError(f"{what} is a {type(value).__name__}, not a tuple of integers")
    return ints(tuple(value), what)


class _LazyView(CheckpointFormatError):
    """A well-formed tensor whose values are not its stored bytes."""


def _refuse_lazy_view(metadata) -> None:
    """torch records a lazily conjugated or negated tensor as its stored bytes and a bit
    (``{"conj": True}``); its values are not those bytes, which are all shardstream copies."""
    if metadata is None or (isinstance(metadata, dict) and not metadata):
        return
    if not isinstance(metadata, dict):
        raise CheckpointFormatError(f"tensor metadata is {short_repr(metadata)}, not a dict")
    lazy = sorted(str(k) for k, v in metadata.items() if v)
    if lazy:
        raise _LazyView(
            f"a tensor saved as a lazily {' and '.join(lazy)} view (torch's tensor metadata "
            f"{short_repr(metadata)}): its stored bytes are not its values; save it resolved "
            "(.resolve_conj(), .resolve_neg())"
        )


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *rest):
    if not isinstance(storage, _StorageRef) or storage.dtype is None:
        raise CheckpointFormatError("tensor without a typed storage")
    _refuse_lazy_view(rest[0] if rest else None)
    return _TensorRecord(
        storage, storage_offset, ints(size, "size"), ints(stride, "stride"), storage.dtype
    )


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *rest):
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError("tensor without a storage or dtype")
    _refuse_lazy_view(rest[0] if rest else None)
    return _TensorRecord(storage, storage_offset, ints(size, "size"), ints(stride, "stride"), dtype)


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: torch.dtype | None


def _storage_types() -> dict[tuple[str, str], object]:
    from torch.storage import _dtype_to_storage_type_map

    types: dict[tuple[str, str], object] = {
        ("torch", name): _StorageType(dtype) for dtype, name in _dtype_to_storage_type_map().items()
    }
    types[("torch", "UntypedStorage")] = _StorageType(None)
    # dtypes with no typed storage class (float8_*, uint16/32/64) pickle their storage as
    # torch.storage.UntypedStorage; the dtype comes with _rebuild_tensor_v3.
    types[("torch.storage", "UntypedStorage")] = _StorageType(None)
    return types


class _RecordUnpickler(_SafeUnpickler):
    allowed: dict[tuple[str, str], object] = {}

    def persistent_load(self, pid):
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and type(pid[4]) is int
        ):
            raise CheckpointFormatError(f"unexpected persistent id {short_repr(pid)}")
        return _StorageRef(pid[1].dtype, pid[2], pid[4])


def _record_unpickler() -> type[_RecordUnpickler]:
    if not _RecordUnpickler.allowed:
        _RecordUnpickler.allowed = {
            ("torch._utils", "_rebuild_tensor_v2"): _Call(_rebuild_v2),
            ("torch._utils", "_rebuild_tensor_v3"): _Call(_rebuild_v3),
            ("collections", "OrderedDict"): OrderedDict,
            **_storage_types(),
        }
    return _RecordUnpickler


class RangeReader(io.RawIOBase):
    """A read-only, seekable window [start, start + length) of an open file, via ``pread``."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the record")
        self.pos = base + offset
        return self.pos

    def read(self, size: int = -1) -> bytes:
        remaining = max(0, self.length - self.pos)
        size = remaining if size is None or size < 0 else min(size, remaining)
        if size > MAX_RECORD_READ_BYTES:
            # Only zip directories and data.pkl are read here, never tensor data.
            raise CheckpointFormatError(f"asked to read {size} bytes of zip metadata; too large")
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(buffer)])

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:n]], self.start + self.pos + done)
            if got == 0:
                break
            done += got
        self.pos += done
        return done

    def pread(self, offset: int, size: int) -> bytes:
        self.seek(offset)
        return self.read(size)


# What Python's zip reader raises for a damaged archive: a flipped bit can mark a record
# compressed (zlib.error), encrypted (RuntimeError) or of a newer zip version
# (NotImplementedError).
ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    OSError,
    EOFError,
    ValueError,
    struct.error,
    NotImplementedError,
    RuntimeError,
    zlib.error,
)


def open_zip_record(archive: zipfile.ZipFile, name: str | zipfile.ZipInfo):
    """A record of ``archive`` to read, its CRC-32 checked at the end unless torch saved none
    (0, with ``torch.serialization.set_crc32_options(False)``: a valid archive torch reads)."""
    info = name if isinstance(name, zipfile.ZipInfo) else archive.getinfo(name)
    if info.CRC == 0 and info.file_size:
        info = copy.copy(info)
        del info.CRC  # zipfile checks a CRC-32 only where the record has one
    return archive.open(info)


def read_zip_record(archive: zipfile.ZipFile, name: str | zipfile.ZipInfo) -> bytes:
    """``open_zip_record``'s bytes, whole (small records: a pickle, the byte order)."""
    with open_zip_record(archive, name) as record:
        return record.read()


@dataclass(frozen=True)
class ChunkLayout:
    """Where a saved chunk's elements are: ``offset`` is the file offset of element [0, ...]."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


def named_twice(infos: list[zipfile.ZipInfo]) -> str | None:
    """A record name the zip directory lists more than once (readers disagree on which
    counts), or None."""
    counts = collections.Counter(info.filename for info in infos)
    return next((name for name, count in counts.items() if count > 1), None)


def read_chunk_layout(fd: int, path: str, offset: int, length: int, what: str) -> ChunkLayout:
    """Locate the elements of the ``torch.save`` archive in bytes [offset, offset+length)."""
    view = RangeReader(fd, offset, length)
    where = f"{path}: {what} (bytes [{offset}, {offset + length}))"
    if view.pread(0, 4) != b"PK\x03\x04":
        raise CheckpointFormatError(
            f"{where} is not a torch.save archive; shardstream reads DCP's default torch_save "
            "serialization (the safetensors serialization format and custom storage writers "
            "are not supported)"
        )
    try:
        archive = zipfile.ZipFile(view)
        listed = archive.infolist()
        if (twice := named_twice(listed)) is not None:  # readers disagree on which counts
            raise CheckpointFormatError(f"{where}: the zip archive holds record {twice!r} twice")
        infos = {info.filename: info for info in listed}
        pickles = [name for name in infos if name.endswith("data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointFormatError(f"{where}: expected one data.pkl, found {len(pickles)}")
        prefix = pickles[0][: -len("data.pkl")]
        pkl = infos[pickles[0]]
        if pkl.file_size > MAX_RECORD_PICKLE_BYTES:
            raise UnsafeCheckpointError(
                f"{where}: data.pkl claims {pkl.file_size} bytes; a tensor record needs a few "
                "hundred"
            )
        byteorder = infos.get(prefix + "byteorder")
        if byteorder is not None and read_zip_record(archive, byteorder) != b"little":
            raise CheckpointFormatError(f"{where}: saved on a big-endian machine; unsupported")
        pickled = read_zip_record(archive, pkl)
    except ZIP_ERRORS as exc:
        if isinstance(exc, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{where}: not a readable torch.save archive: {exc}") from None
    record = _safe_loads(_record_unpickler(), pickled, path, f"{what} (its data.pkl)")
    if not isinstance(record, _TensorRecord):
        raise CheckpointFormatError(f"{where}: holds a {type(record).__name__}, not a plain tensor")
    info = infos.get(f"{prefix}data/{record.storage.key}")
    if info is None:
        raise CheckpointFormatError(f"{where}: storage {record.storage.key!r} is missing")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointFormatError(f"{where}: storage record is compressed; expected stored")
    if info.header_offset < 0:
        raise CheckpointFormatError(f"{where}: bad zip directory (negative record offset)")
    header = view.pread(info.header_offset, _LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_HEADER_MAGIC:
        raise CheckpointFormatError(f"{where}: bad zip local header for the storage record")
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[9:11]
    data_start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    nbytes = info.file_size
    if data_start + nbytes > length:
        raise CheckpointFormatError(
            f"{where}: storage data [{data_start}, {data_start + nbytes}) runs past the record"
        )
    try:
        dtype = code_of(record.dtype)
    except CheckpointFormatError:
        raise CheckpointFormatError(f"{where}: unsupported dtype {record.dtype}") from None
    isz = itemsize(dtype)
    expected = record.storage.numel * (isz if record.storage.dtype is not None else 1)
    if expected != nbytes:
        raise CheckpointFormatError(
            f"{where}: storage holds {nbytes} bytes but the pickle says {expected}"
        )
    size, stride = record.size, record.stride
    if (
        len(size) != len(stride)
        or any(n < 0 for n in size)
        or any(s < 0 for s in stride)
        or type(record.storage_offset) is not int
        or record.storage_offset < 0
    ):
        raise CheckpointFormatError(f"{where}: invalid size/stride/offset in the pickle")
    if math.prod(size):
        last = record.storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
        if (last + 1) * isz > nbytes:
            raise CheckpointFormatError(f"{where}: tensor reaches past the end of its storage")
    return ChunkLayout(dtype, size, stride, offset + data_start + record.storage_offset * isz)
