"""restore() of a PyTorch DCP checkpoint (model weights) at another world size."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize(
    ("flatten", "model_keys"),
    [(True, "api"), (False, "api"), (True, "compiled"), (False, "ddp"), (True, "beside")],
    ids=["torchtitan-flat", "nested", "compiled-model-keys", "ddp-model-keys", "flat-beside"],
)
def test_dcp_train_state_restores_optimizer_and_scheduler(tmp_path, flatten, model_keys):
    """Model keys saved with wrapper prefixes (a compiled model's own state_dict(), DDP's)
    restore under the live names, which torch's state-dict API gives without them. A
    flattened optimizer saved at the top level beside the model's keys is the optimizer
    (restored) and not part of the model (merged without it)."""
    args = (str(tmp_path), "save", flatten, model_keys)
    saved = run(workers.dcp_train_state_run, 2, *args)[0]
    if model_keys == "beside":
        from safetensors import safe_open

        from shardstream import merge

        merge(tmp_path / "step-2", tmp_path / "merged")
        with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as merged:
            assert set(merged.keys()) == set(saved["state"]["model"]), sorted(merged.keys())
    restored = run(workers.dcp_train_state_run, 3, str(tmp_path), "restore", flatten)
    for result in restored:
        assert result["step"][0] == 2  # (step, extra), step from the directory name
        workers.assert_nested_equal(result["state"], saved["state"], "state")
        # The next step matches up to the reduction order of another world size.
        assert abs(result["next"] - saved["next"]) < 1e-4
