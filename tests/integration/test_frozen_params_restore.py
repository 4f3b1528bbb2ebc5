"""restore() of a DCP checkpoint saved with torch's ``ignore_frozen_params=True``: the frozen
parameters are not in it, and keep their live values when the restore is told so."""

from __future__ import annotations

import pytest
import torch

from shardstream.testing.distributed import run

from . import workers


@pytest.mark.parametrize("in_optimizer", [False, True], ids=["trainable-only", "all-params"])
def test_a_checkpoint_without_frozen_parameters_restores_with_ignore_frozen_params(
    tmp_path, in_optimizer
):
    saved = run(workers.frozen_params_run, 2, str(tmp_path), "save", in_optimizer, False)[0]
    restored = run(workers.frozen_params_run, 3, str(tmp_path), "restore", in_optimizer, True)
    for result in restored:
        assert "error" not in result, result.get("error")
        state, reference = result["state"], saved["state"]
        assert state["model"].keys() == reference["model"].keys()
        for name, tensor in reference["model"].items():  # the embedding: as it was loaded
            assert torch.equal(state["model"][name], tensor), name
        workers.assert_nested_equal(state["optim"], reference["optim"], "optim")
        assert abs(result["next"] - saved["next"]) < 1e-4


def test_a_checkpoint_without_frozen_parameters_is_refused_naming_the_option(tmp_path):
    run(workers.frozen_params_run, 2, str(tmp_path), "save", False, False)
    for result in run(workers.frozen_params_run, 2, str(tmp_path), "restore", False, False):
        error = result.get("error", "")
        assert "CheckpointFormatError" in error, result
        assert "model tensor 'model.embed_tokens.weight'" in error, error
        assert "ignore_frozen_params=True" in error, error
