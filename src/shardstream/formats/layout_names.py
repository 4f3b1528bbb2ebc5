"""How a sharded layout is spelled for people and in the manifest: meshes and placements.

Torch-free, so that inspect and verify of any format can use it without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def mesh_dim_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...]:
    """A device mesh's dimension names, ``dim0``, ``dim1``, ... where it has none."""
    return tuple(names) if names else tuple(f"dim{i}" for i in range(ndim))


def describe_mesh(names: Sequence[str] | None, shape: Sequence[int]) -> str:
    """``ddp=2 x fsdp=2``: how inspect shows a mesh."""
    return " x ".join(f"{n}={s}" for n, s in zip(mesh_dim_names(names, len(shape)), shape))


def describe_placements(names: Sequence[str] | None, kinds: Sequence[str]) -> str:
    """``ddp:R, fsdp:S(0)``: a tensor's placement per mesh dimension, as the manifest's
    ``placement`` spells it (``kinds`` as ``torch_pt.Placement`` prints them)."""
    return ", ".join(f"{n}:{k}" for n, k in zip(mesh_dim_names(names, len(kinds)), kinds))
