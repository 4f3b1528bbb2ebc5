"""Checkpoints written by PyTorch's own DCP code on real gloo ranks, for test_tool_written.py.

``write_all(rank, world, root)`` runs on every rank (``shardstream.testing.distributed.run``)
and writes, each with DCP's own saving code:

``float8``          ``dcp.save`` of float8_e4m3fn / float8_e5m2 tensors, plain and as DTensor
                    ``Shard(0)`` chunks (their storages pickle as ``torch.storage.UntypedStorage``)
``hf_mapped``       torchtitan's HF export path: ``HuggingFaceStorageWriter(save_distributed=True,
                    fqn_to_index_mapping=...)`` into ``sharded/``, then
                    ``consolidate_safetensors_files_on_every_rank`` beside it (2 output files,
                    so each rank writes 2 shard files)
``extras``          an FSDP2 model under ``model`` beside an ``extra`` Stateful's state that
                    holds a tensor, ints, strings and lists
``not_flattened``   ``dcp.save`` with ``DefaultSavePlanner(flatten_state_dict=False)``
``uncoordinated``   ``extras`` saved with ``use_collectives=False``: each rank's own
                    ``__R.metadata``, no global ``.metadata``

and rank 0 writes each one's reference tensors (``<name>.reference.safetensors``).
"""

from __future__ import annotations

from pathlib import Path

import torch

HF_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
EXTRA = {"step": 3, "name": "run-a", "steps": [1, 2.5, "x"], "seen": torch.arange(5)}


def float8_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "e4m3": torch.randn(5, 4, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(3, 2, generator=g).to(torch.float8_e5m2),
    }


def _sharded(value: torch.Tensor, mesh, rank: int, world: int):
    """``value`` as a DTensor ``Shard(0)`` over ``mesh`` (torch.chunk's split, as FSDP2 has it),
    built from the local chunk: gloo cannot scatter float8."""
    from torch.distributed.tensor import DTensor, Shard

    parts = list(torch.chunk(value, world, 0))
    parts += [value[:0]] * (world - len(parts))
    return DTensor.from_local(parts[rank].clone(), mesh, [Shard(0)], run_check=False,
                              shape=value.shape, stride=value.stride())  # fmt: skip


def _reference(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(path))


def write_all(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = Path(root)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))

    plain = float8_state()
    sharded = {f"sharded.{k}": _sharded(v, mesh, rank, world) for k, v in plain.items()}
    dcp.save({**plain, **sharded}, checkpoint_id=root / "float8")

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(7, 4)
    model.norm = torch.nn.LayerNorm(4, bias=False)
    model.head = torch.nn.Linear(4, 7, bias=False)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    hf = dict(zip(HF_NAMES, full.values()))
    fully_shard(model, mesh=mesh)
    sharded_hf = dict(zip(HF_NAMES, get_model_state_dict(model).values()))
    mapping = {name: 1 + i % 2 for i, name in enumerate(HF_NAMES)}
    writer = HuggingFaceStorageWriter(path=str(root / "hf_mapped" / "sharded"),
                                      save_distributed=True, fqn_to_index_mapping=mapping,
                                      enable_consolidation=False)  # fmt: skip
    dcp.save(sharded_hf, storage_writer=writer)
    consolidate_safetensors_files_on_every_rank(
        input_dir=str(root / "hf_mapped" / "sharded"),
        output_dir=str(root / "hf_mapped"),
        fqn_to_index_mapping=mapping,
        num_threads=1,
    )

    state = get_model_state_dict(model)
    dcp.save({"model": state, "extra": dict(EXTRA)}, checkpoint_id=root / "extras")
    dcp.save({"model": state, "extra": dict(EXTRA)}, checkpoint_id=root / "uncoordinated",
             use_collectives=False)  # fmt: skip
    dcp.save({"model": state}, checkpoint_id=root / "not_flattened",
             planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip

    if rank == 0:
        _reference(root / "float8.reference.safetensors",
                   {**plain, **{f"sharded.{k}": v for k, v in plain.items()}})  # fmt: skip
        _reference(root / "hf_mapped.reference.safetensors", hf)
        _reference(root / "extras.reference.safetensors", full)
    dist.barrier()
