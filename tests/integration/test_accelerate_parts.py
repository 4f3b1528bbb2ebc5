"""accelerate's save_state restored whole (issue #24): GradScaler, register_for_checkpointing
objects, several models; saved by accelerate itself at 2 ranks, restored at 3 bit for bit."""

from __future__ import annotations

import torch

from shardstream.commands.verify import verify
from shardstream.testing.distributed import run

from . import accelerate_workers
from .workers import assert_nested_equal as _assert_same


def test_scaler_custom_objects_and_second_model(tmp_path):
    saved = run(accelerate_workers.save_run, 2, str(tmp_path))[0]
    files = set(saved["files"])
    expected = {"pytorch_model_fsdp_1", "optimizer_1", "scheduler_1.bin", "scaler.pt"}
    assert expected | {"custom_checkpoint_0.pkl"} <= files, files
    report = verify(tmp_path / "accelerate_state")
    # 4 DCP parts of 3 files each (2 ranks + .metadata), 2 schedulers, 2 RNG, scaler, Counter
    assert report.ok and report.files_checked == 4 * 3 + 6, report

    for result in run(accelerate_workers.restore_run, 3, str(tmp_path)):
        assert "holds 2 models" in result["whole"] and "pytorch_model_fsdp_<i>" in result["whole"]
        for index in (0, 1):  # model, optimizer, scheduler, scaler, Counter
            _assert_same(saved["states"][index], result["states"][index], f"model {index}")
        assert result["states"][0]["scaler"] == accelerate_workers.SCALER_STATE
        assert result["states"][0]["counter"]["count"] == 7

    # A custom_checkpoint pickle naming os.system: refused, named, nothing touched.
    (hostile,) = run(accelerate_workers.hostile_run, 1, str(tmp_path))
    assert "custom_checkpoint_0" in hostile["error"] and "system" in hostile["error"]
    assert not hostile["ran"]
    _assert_same(hostile["before"], hostile["after"], "untouched")
    report = verify(tmp_path / "hostile")
    assert not report.ok and "custom_checkpoint_0.pkl" in report.problems[0].line()


def _model_saved_as_accelerate(root) -> torch.nn.Module:
    """A small model, saved with DCP where accelerate's FSDP saves the first one."""
    import warnings

    import torch.distributed.checkpoint as dcp

    model = torch.nn.Module()
    model.layer = torch.nn.Linear(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when used without a process group
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "pytorch_model_fsdp_0"))
    return model


def test_accelerate_state_files_by_name(tmp_path):
    """A part asked for that the directory lacks, and a pickled sampler: one-line errors,
    nothing touched; verify checks the sampler file's records (never unpickling it)."""

    import pytest

    import shardstream
    from shardstream.errors import CheckpointFormatError, UsageError

    root = tmp_path / "checkpoint_4"
    model = _model_saved_as_accelerate(root)
    torch.save({"torch_manual_seed": torch.get_rng_state()}, root / "random_states_0.pkl")
    torch.save({"epoch": 3}, root / "sampler.bin")
    torch.save({"scale": 2.0}, root / "scaler.pt")
    with pytest.raises(CheckpointFormatError, match="no 'custom_checkpoint_0' state.*scaler"):
        shardstream.load(root, model=model, states={"custom_checkpoint_0": object()})
    with pytest.raises(UsageError, match="never unpickles"):
        shardstream.load(root, model=model, states={"sampler": object()})
    report = verify(root)
    assert report.ok and report.files_checked == 2 + 3  # DCP (1 rank + .metadata), 3 files


def test_accelerate_custom_object_not_a_dict_is_named(tmp_path):
    """A custom_checkpoint_N whose saved state is no dict: the error names that object, not the
    LR scheduler (the merge over the live state_dict is the scheduler's), and nothing is
    touched."""

    import pytest

    import shardstream
    from shardstream.errors import CheckpointFormatError

    class Counter:
        def __init__(self):
            self.count = 5

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    root = tmp_path / "checkpoint_2"
    model = _model_saved_as_accelerate(root)
    torch.save([7], root / "custom_checkpoint_0.pkl")
    counter = Counter()
    with pytest.raises(CheckpointFormatError) as caught:
        shardstream.load(root, model=model, states={"custom_checkpoint_0": counter})
    text = str(caught.value)
    assert "custom_checkpoint_0: saved state is a list, not a dict" in text, text
    assert "lr_scheduler" not in text, text
    assert counter.count == 5
