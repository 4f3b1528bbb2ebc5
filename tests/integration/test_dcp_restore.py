"""restore() of a PyTorch DCP checkpoint (model weights) at another world size."""

from __future__ import annotations

import torch

from shardstream.testing.distributed import run

from . import workers


def test_dcp_checkpoint_restores_at_another_world_size(tmp_path):
    saved = run(workers.dcp_restore_run, 2, str(tmp_path), "save")[0]
    restored = run(workers.dcp_restore_run, 3, str(tmp_path), "restore")
    for state in restored:
        assert state.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor), name
