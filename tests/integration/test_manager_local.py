"""CheckpointManager semantics in one process: config, interval, retention, commit, contents."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch

import shardstream
from shardstream import CheckpointConfig, CheckpointManager
from shardstream.engine import checksum
from shardstream.errors import (
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    UsageError,
)
from shardstream.formats import native
from shardstream.manager import LATEST_FILE
from shardstream.storage import commit
from shardstream.storage.commit import TMP_MARK


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    model.register_buffer("calls", torch.tensor(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return model, optimizer, scheduler


def step(model, optimizer, scheduler):
    model(torch.randn(4, 5)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def snapshot(model, optimizer, scheduler):
    import copy

    return copy.deepcopy(
        {"m": model.state_dict(), "o": optimizer.state_dict(), "s": scheduler.state_dict()}
    )


def assert_same(a, b):
    for k, v in a["m"].items():
        assert torch.equal(v, b["m"][k]), k
    for pid, entries in a["o"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["o"]["state"][pid][key]))
    assert a["o"]["param_groups"] == b["o"]["param_groups"]
    assert a["s"] == b["s"]


# --- config --------------------------------------------------------------------------------------


def test_from_dict_accepts_verl_keys(tmp_path):
    cfg = CheckpointConfig.from_dict(
        {
            "contents": ["model"],
            "save_freq": 1000,
            "default_local_dir": str(tmp_path),
            "max_ckpt_to_keep": 3,
            "incremental_save": True,
        }
    )
    assert cfg.save_contents == cfg.load_contents == ("model",)
    assert (cfg.save_interval, cfg.keep_last, cfg.directory) == (1000, 3, str(tmp_path))
    cfg = CheckpointConfig.from_dict(
        {
            "save_contents": ["model", "optimizer", "extra", "hf_model"],
            "load_contents": ["model"],
            "save_interval": 5,
            "directory": "x",
        }
    )
    assert cfg.save_contents[-1] == "hf_model" and cfg.load_contents == ("model",)
    # verl's PPO trainer saves nothing at save_freq <= 0, the last step neither
    never = CheckpointConfig.from_dict({"directory": str(tmp_path / "n"), "save_freq": -1})
    assert never.save_interval is None and never.save_final is False
    with CheckpointManager(never, model=torch.nn.Linear(2, 2)) as mgr:
        assert not mgr.should_save(20, final=True)
        assert not mgr.maybe_save(20, final=True)
    assert CheckpointConfig.from_dict({"directory": "x", "save_freq": 5}).save_final is True
    # shardstream's own key keeps its documented meaning: the final step is saved
    own = CheckpointConfig.from_dict({"directory": "x", "save_interval": -1})
    assert own.save_interval is None and own.save_final is True
    verl_section = {"save_contents": ["model"], "load_contents": ["model"], "async_save": False}
    cfg = CheckpointConfig.from_dict(verl_section, directory=tmp_path)  # trainer's dir apart
    assert cfg.directory == str(tmp_path) and cfg.save_contents == ("model",)
    trainer_keys = {"save_freq": 20, "max_actor_ckpt_to_keep": 2, "max_critic_ckpt_to_keep": 1}
    cfg = CheckpointConfig.from_dict({**verl_section, **trainer_keys}, directory=tmp_path)
    assert (cfg.save_interval, cfg.keep_last) == (20, 2)
    critic = CheckpointConfig.from_dict(
        {**verl_section, **trainer_keys}, directory=tmp_path, role="critic"
    )
    assert critic.keep_last == 1


@pytest.mark.parametrize("key", ["contents", "save_contents", "load_contents"])
def test_from_dict_refuses_contents_given_as_one_string_naming_it(tmp_path, key):
    with pytest.raises(UsageError, match="'model'"):
        CheckpointConfig.from_dict({key: "model"}, directory=tmp_path)


@pytest.mark.parametrize("interval", [0, -3])
def test_interval_of_zero_or_less_saves_only_when_final(interval, tmp_path):
    cfg = CheckpointConfig(str(tmp_path), save_interval=interval)
    with CheckpointManager(cfg, model=torch.nn.Linear(2, 2)) as mgr:
        assert not any(mgr.should_save(step) for step in range(-3, 10))
        assert mgr.should_save(7, final=True)


@pytest.mark.parametrize(
    "values, words",
    [
        ({"directory": "x", "bogus": 1}, "unknown checkpoint config key 'bogus'"),
        ({"directory": "x", "save_contents": ["weights"]}, "unknown item 'weights'"),
        ({"directory": "x", "keep_last": 0.5}, "keep_last"),
        ({"directory": "x", "staging_budget": "lots"}, "invalid size"),
        ({"directory": "x", "save_freq": 3, "save_interval": 4}, "twice"),
        ({"save_freq": 3}, "no directory: set 'default_local_dir'"),
        ({"directory": "x", "resume_mode": "latest"}, "resume_mode must be one of auto, "),
        ({"directory": "x", "resume_mode": "resume_path"}, "needs resume_from_path"),
    ],
)
def test_bad_config_is_refused(values, words):
    with pytest.raises(UsageError, match=words):
        CheckpointConfig.from_dict(values)


# --- interval, retention, latest -----------------------------------------------------------------


def test_interval_retention_and_latest(tmp_path):
    model, optimizer, scheduler = tiny()
    cfg = CheckpointConfig(str(tmp_path), save_interval=2, keep_last=2)
    with CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler) as mgr:
        saved = []
        for s in range(1, 8):
            step(model, optimizer, scheduler)
            saved.append(mgr.maybe_save(s, extra={"s": s}))
        assert saved == [False, True, False, True, False, True, False]
        assert mgr.maybe_save(7, extra={"s": 7}, final=True)
        assert mgr.all_steps() == [6, 7]
        assert (tmp_path / LATEST_FILE).read_text().strip() == "7"
        want = snapshot(model, optimizer, scheduler)
    model2, optimizer2, scheduler2 = tiny()
    with CheckpointManager(cfg, model=model2, optimizer=optimizer2, lr_scheduler=scheduler2) as m2:
        assert m2.restore() == (7, {"s": 7})
        assert_same(snapshot(model2, optimizer2, scheduler2), want)
        assert m2.restore(step=6)[0] == 6
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            m2.restore(step=2)


def test_directory_that_is_a_file_is_refused(tmp_path):
    model, _, _ = tiny()
    (tmp_path / "ckpts").write_text("not a directory")
    with pytest.raises(UsageError, match=f"{tmp_path / 'ckpts'} exists and is not a directory"):
        CheckpointManager(CheckpointConfig(str(tmp_path / "ckpts")), model=model)
    assert (tmp_path / "ckpts").read_text() == "not a directory"


def test_restore_returns_none_when_empty(tmp_path):
    model, optimizer, _ = tiny()
    with CheckpointManager(CheckpointConfig(str(tmp_path)), model=model) as mgr:
        assert mgr.restore() is None


def test_retention_keeps_newer_steps_and_the_newest(tmp_path):
    model, optimizer, scheduler = tiny()
    cfg = CheckpointConfig(str(tmp_path), keep_last=1)
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        mgr.save(10)
        mgr.save(5)  # rewinding: step 10 is newer and is not ours to delete
        assert mgr.all_steps() == [5, 10]
        assert mgr.latest_step() == 5


def _entries(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != LATEST_FILE)


def test_retention_drops_the_step_at_once_and_deletes_it_in_the_background(tmp_path, monkeypatch):
    """save() returns with the old step gone from every listing (renamed aside); the files go
    on a background thread, which wait() joins."""
    release = threading.Event()
    real_remove_tree = commit.remove_tree

    def held_remove_tree(path, *args, **kwargs):  # retention's deletion waits for the test
        if threading.current_thread().name == "shardstream-delete":
            assert release.wait(timeout=120)
        return real_remove_tree(path, *args, **kwargs)

    monkeypatch.setattr(commit, "remove_tree", held_remove_tree)
    model, optimizer, _ = tiny()
    cfg = CheckpointConfig(str(tmp_path), keep_last=1)
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        mgr.save(1)
        mgr.save(2)
        assert mgr.all_steps() == [2] and mgr.latest_step() == 2
        (grave,) = [name for name in _entries(tmp_path) if TMP_MARK in name]
        assert grave.startswith(f"global_step_1{TMP_MARK}")  # not deleted yet, not a step
        assert _entries(tmp_path) == sorted(["global_step_2", grave, ".shardstream.lock"])
        release.set()
        mgr.wait()
        assert _entries(tmp_path) == [".shardstream.lock", "global_step_2"]
        mgr.save(3)
        mgr.save(4)  # deletes step 3 after the deletion of step 2 has finished
    # close() joined the last deletion
    assert _entries(tmp_path) == [".shardstream.lock", "global_step_4"]


def test_async_save_retention_is_deleted_by_close(tmp_path):
    """With async_save the background save renames the old step away and hands its deletion
    on; close() joins the save, then the deletion."""
    model, optimizer, _ = tiny()
    cfg = CheckpointConfig(str(tmp_path), keep_last=1, async_save=True)
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        for s in (1, 2, 3):
            mgr.save(s)
    assert _entries(tmp_path) == [".shardstream.lock", "global_step_3"]


def test_retention_deletion_failure_is_a_warning_and_its_debris_is_swept(
    tmp_path, monkeypatch, caplog
):
    real_remove_tree = commit.remove_tree

    def failing_remove_tree(path, *args, **kwargs):
        if threading.current_thread().name != "shardstream-delete":
            return real_remove_tree(path, *args, **kwargs)
        if not kwargs.get("ignore_errors"):
            raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(commit, "remove_tree", failing_remove_tree)
    model, optimizer, _ = tiny()
    cfg = CheckpointConfig(str(tmp_path), keep_last=1)
    with caplog.at_level(logging.WARNING, logger="shardstream"):
        with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
            mgr.save(1)
            mgr.save(2)  # nothing raised here,
            mgr.wait()  # nor here
            assert mgr.all_steps() == [2]
    (grave,) = [name for name in _entries(tmp_path) if TMP_MARK in name]
    assert grave.startswith(f"global_step_1{TMP_MARK}")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not delete" in m and grave in m and "Permission denied" in m for m in warned)
    monkeypatch.undo()
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:  # the start sweeps
        assert _entries(tmp_path) == [".shardstream.lock", "global_step_2"]
        assert mgr.restore()[0] == 2


# --- commit protocol -----------------------------------------------------------------------------


def test_failed_save_is_invisible_and_cleaned(tmp_path, monkeypatch):
    model, optimizer, scheduler = tiny()
    cfg = CheckpointConfig(str(tmp_path), keep_last=1)
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        mgr.save(1)

        def crash(*args, **kwargs):
            raise OSError(5, "simulated I/O error before the manifest")

        monkeypatch.setattr(native, "write_manifest", crash)
        with pytest.raises(OSError):
            mgr.save(2)
        monkeypatch.undo()
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
        assert not any("tmp" in p.name for p in tmp_path.iterdir() if p.name != LATEST_FILE)
    # A crash that leaves debris behind (kill -9): the next manager removes it.
    debris = tmp_path / "global_step_3.tmp-deadbeef"
    debris.mkdir()
    (debris / "rank-00000.safetensors").write_bytes(b"partial")
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        assert not debris.exists()
        assert mgr.restore()[0] == 1


def test_directory_without_manifest_is_not_a_step(tmp_path):
    model, optimizer, _ = tiny()
    (tmp_path / "global_step_9").mkdir()
    (tmp_path / LATEST_FILE).write_text("9\n")
    with CheckpointManager(CheckpointConfig(str(tmp_path)), model=model) as mgr:
        assert mgr.all_steps() == [] and mgr.restore() is None


def verl_step(root, step: int) -> dict:
    """A stand-in for a verl checkpoint saved into ``root``: its files, and their bytes."""
    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"verl's weights")
    (root / f"global_step_{step}" / "data.pt").write_bytes(b"verl's dataloader")
    (root / LATEST_FILE).write_text(f"{step}\n")
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != LATEST_FILE}


def test_save_never_replaces_a_step_directory_it_did_not_write(tmp_path):
    """A verl run's checkpoints in the same directory (a one-word tool swap keeps verl's
    default_local_dir) are never deleted: saving a step they hold is refused, by name."""
    model, optimizer, _ = tiny()
    before = verl_step(tmp_path, 2)
    (tmp_path / "global_step_4").mkdir()  # empty: nothing to lose
    (tmp_path / "global_step_5").write_text("a file")
    cfg = CheckpointConfig(str(tmp_path), keep_last=1)
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        with pytest.raises(UsageError, match=r"global_step_2 exists and is not a shardstream "):
            mgr.save(2)
        with pytest.raises(UsageError, match=r"global_step_5 exists and is not a shardstream "):
            mgr.save(5)
        mgr.save(3)
        mgr.save(4)
        mgr.save(4)  # its own step: replaced
        assert mgr.all_steps() == [4]  # retention deleted step 3 and nothing else
    assert {p: p.read_bytes() for p in before} == before
    assert (tmp_path / "global_step_5").read_text() == "a file"


def test_restore_does_not_start_over_beside_another_formats_checkpoint(tmp_path):
    """restore() in a directory holding only verl checkpoints names them instead of returning
    None (which a training script reads as "start from scratch")."""
    model, optimizer, _ = tiny()
    verl_step(tmp_path, 1)
    verl_step(tmp_path, 7)
    cfg = CheckpointConfig(str(tmp_path))
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        with pytest.raises(CheckpointNotFoundError) as caught:
            mgr.restore()
        message = str(caught.value)
        assert f"{tmp_path} holds no shardstream checkpoint" in message
        assert str(tmp_path / "global_step_7" / "actor") in message
        assert "restore(path=...)" in message
        mgr.save(8)  # once it holds one of its own, that is the newest
        assert mgr.restore()[0] == 8


def test_restore_of_a_step_directory_names_the_checkpoint_inside(tmp_path):
    model, optimizer, _ = tiny()
    verl_step(tmp_path / "verl", 5)
    with CheckpointManager(CheckpointConfig(str(tmp_path / "run")), model=model) as mgr:
        with pytest.raises(CheckpointNotFoundError) as caught:
            mgr.restore(path=tmp_path / "verl" / "global_step_5")
    assert f"{tmp_path / 'verl' / 'global_step_5' / 'actor'} holds one: pass that path" in str(
        caught.value
    )


def test_restore_before_the_first_commit_ignores_a_save_in_progress(tmp_path):
    """A save's temporary directory holds its manifest for a moment before the rename: a
    reader finds no checkpoint yet, not one "of another format"."""
    model, optimizer, _ = tiny()
    with CheckpointManager(CheckpointConfig(str(tmp_path)), model=model) as mgr:
        staging = tmp_path / f"global_step_1{TMP_MARK}0123abcd"  # after the debris sweep
        staging.mkdir()
        (staging / native.MANIFEST).write_text("{}")
        assert mgr.restore() is None


def test_restore_refuses_the_pointed_step_that_lost_its_manifest(tmp_path):
    """The only step, named by the latest pointer, without its manifest.json (deleted, or the
    step damaged): restore() names it instead of returning None, which a training script reads
    as "start from scratch"; nothing in it is touched."""
    model, optimizer, _ = tiny()
    config = CheckpointConfig(str(tmp_path))
    with CheckpointManager(config, model=model, optimizer=optimizer) as mgr:
        mgr.save(1)
    step = tmp_path / "global_step_1"
    (step / native.MANIFEST).unlink()
    kept = sorted(p.name for p in step.iterdir())
    with CheckpointManager(config, model=model, optimizer=optimizer) as mgr:
        with pytest.raises(CheckpointNotFoundError) as caught:
            mgr.restore()
    assert f"{step}: the latest pointer names it, but it holds no manifest.json" in str(
        caught.value
    )
    assert sorted(p.name for p in step.iterdir()) == kept


def test_second_manager_on_the_same_directory_is_refused(tmp_path):
    model, optimizer, _ = tiny()
    config = CheckpointConfig(str(tmp_path))
    with CheckpointManager(config, model=model, optimizer=optimizer) as first:
        first.save(1)
        model2, optimizer2, _ = tiny()
        second = CheckpointManager(config, model=model2, optimizer=optimizer2)
        assert second.restore()[0] == 1  # reading needs no lock
        # the holder is this very process: said so (it was "another live process")
        with pytest.raises(CheckpointLockedError, match="this process saves here already"):
            second.save(2)
        with pytest.raises(CheckpointLockedError, match="earlier CheckpointManager"):
            second.acquire_lock()
        second.close()
        first.save(2)  # still the holder
    with CheckpointManager(config, model=model, optimizer=optimizer) as third:
        third.save(3)  # released by close()


# --- contents ------------------------------------------------------------------------------------


def test_model_only_save_cannot_restore_optimizer(tmp_path):
    model, optimizer, scheduler = tiny()
    cfg = CheckpointConfig(str(tmp_path), save_contents=("model",))
    with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
        mgr.save(1)
        manifest = json.loads((tmp_path / "global_step_1" / native.MANIFEST).read_text())
        assert manifest["contents"] == ["model"]
        assert all(k.startswith("model.") for k in manifest["tensors"])
        with pytest.raises(CheckpointFormatError, match="no optimizer state"):
            mgr.restore()
    cfg = CheckpointConfig(str(tmp_path), load_contents=("model",))
    model2, optimizer2, _ = tiny()
    with torch.no_grad():
        model2[0].weight.zero_()
    with CheckpointManager(cfg, model=model2, optimizer=optimizer2) as mgr:
        assert mgr.restore()[0] == 1
        assert torch.equal(model2[0].weight, model[0].weight)
        assert optimizer2.state_dict()["state"] == {}


def test_optimizer_without_its_model_is_refused_before_reading(tmp_path):
    model, optimizer, scheduler = tiny()
    step(model, optimizer, scheduler)
    shardstream.save(tmp_path / "ckpt", model=model, optimizer=optimizer)
    before = snapshot(model, optimizer, scheduler)
    for contents in (("model", "optimizer"), ("optimizer",)):
        with pytest.raises(UsageError, match="'optimizer' but no model was given"):
            shardstream.load(tmp_path / "ckpt", optimizer=optimizer, contents=contents)
    assert_same(before, snapshot(model, optimizer, scheduler))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda p, m, o: shardstream.save(p / "s", model=[m], contents=("model",)), "model="),
        (lambda p, m, o: shardstream.save(p / "s", model=m, optimizer=[o]), "optimizer="),
        (lambda p, m, o: shardstream.save(p / "s", model=m, step=-1), "step must be"),
        (lambda p, m, o: shardstream.save(p / "s", model=m, step="2"), "step must be"),
        (lambda p, m, o: shardstream.save(p / "s", model=m, contents="model"), "not a list"),
        (lambda p, m, o: shardstream.load(p / "ckpt", model={"w": 1}), "model="),
        (lambda p, m, o: shardstream.load(p / "ckpt", model=m, optimizer=o.state), "optimizer="),
        (lambda p, m, o: shardstream.load(p / "ckpt", model=m, lr_scheduler=1), "lr_scheduler="),
        (lambda p, m, o: shardstream.load(p / "ckpt", model=m, contents=None), "not a list"),
        (
            lambda p, m, o: CheckpointManager(CheckpointConfig(str(p)), model=m, optimizer=[o]),
            "optimizer=",
        ),
    ],
)
def test_arguments_of_the_wrong_kind_are_named(tmp_path, call, words):
    """A UsageError naming the argument, before anything is read or written (not an
    AttributeError from inside torch)."""
    model, optimizer, scheduler = tiny()
    step(model, optimizer, scheduler)
    shardstream.save(tmp_path / "ckpt", model=model, optimizer=optimizer)
    before = snapshot(model, optimizer, scheduler)
    with pytest.raises(UsageError, match=words):
        call(tmp_path, model, optimizer)
    assert_same(before, snapshot(model, optimizer, scheduler))
    assert not (tmp_path / "s").exists()


def test_a_file_is_not_a_checkpoint(tmp_path):
    model, _, _ = tiny()
    (tmp_path / "weights.txt").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="weights.txt: a file, not a checkpoint"):
        shardstream.load(tmp_path / "weights.txt", model=model)
    (tmp_path / "weights.pt").write_bytes(b"x")  # read as one torch.save file, which it is not
    with pytest.raises(CheckpointFormatError, match="weights.pt: corrupt or truncated torch"):
        shardstream.load(tmp_path / "weights.pt", model=model, contents=("model",))


def test_extra_round_trips_json_and_tensors(tmp_path):
    model, _, _ = tiny()
    extra = {
        "loader": {"epoch": 2, "indices": torch.arange(5), "pair": (1, "a"), 3: None},
        "nan": float("nan"),
    }
    shardstream.save(tmp_path / "c", model=model, contents=("model", "extra"), extra=extra, step=3)
    result = shardstream.load(tmp_path / "c", model=model, contents=("model", "extra"))
    assert result.step == 3
    loader = result.extra["loader"]
    assert loader["epoch"] == 2 and loader["pair"] == (1, "a") and loader[3] is None
    assert torch.equal(loader["indices"], torch.arange(5))
    assert result.extra["nan"] != result.extra["nan"]


def test_rng_is_restored(tmp_path):
    import random

    model, _, _ = tiny()
    torch.manual_seed(5)
    random.seed(5)
    shardstream.save(tmp_path / "c", model=model, contents=("model", "extra"))
    want = (torch.rand(2), random.random())
    torch.manual_seed(99)
    random.seed(99)
    shardstream.load(tmp_path / "c", model=model, contents=("model", "extra"))
    got = (torch.rand(2), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_unknown_content_and_existing_target(tmp_path):
    model, _, _ = tiny()
    with pytest.raises(UsageError, match="unknown item"):
        shardstream.save(tmp_path / "c", model=model, contents=("model", "weights"))
    shardstream.save(tmp_path / "c", model=model, contents=("model",))
    with pytest.raises(UsageError, match="already exists"):
        shardstream.save(tmp_path / "c", model=model, contents=("model",))
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_extra_state_nested_too_deep_is_a_usage_error_both_ways(tmp_path):
    """Extra state nested past ``MAX_NESTING`` (Python recursed until a bare RecursionError)
    is refused by save, leaving nothing; a manifest holding such a value (resealed by hand)
    is refused by the decoder restore uses, as a value no save writes."""
    from shardstream.training import state

    model, optimizer, _ = tiny()
    deep: list = []
    for _ in range(state.MAX_NESTING + 5):
        deep = [deep]
    config = CheckpointConfig(str(tmp_path))
    with CheckpointManager(config, model=model, optimizer=optimizer) as mgr:
        with pytest.raises(UsageError, match=f"nested over {state.MAX_NESTING} deep"):
            mgr.save(1, extra={"deep": deep})
        assert mgr.all_steps() == [] and mgr.restore() is None
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == []
    with pytest.raises(ValueError, match="no save writes"):
        state.decode(deep, {})
    shallow = [[[1]]]
    assert state.decode(state.encode(shallow, {}), {}) == shallow


def test_save_refuses_an_empty_path_and_one_that_would_replace_its_hf_source(tmp_path, monkeypatch):
    """``save("", overwrite=True)`` replaced the working directory, and a path that is (or
    holds) ``hf_source_dir`` replaced the pretrained model the export copies from."""
    model, _, _ = tiny()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("kept")
    with pytest.raises(UsageError, match="the path is empty"):
        shardstream.save("", model=model, contents=("model",), overwrite=True)
    source = tmp_path / "pretrained"
    source.mkdir()
    (source / "config.json").write_text("{}")
    for path in (source, tmp_path):
        with pytest.raises(UsageError, match="is hf_source_dir|contains hf_source_dir"):
            shardstream.save(
                path, model=model, contents=("model",), hf_source_dir=source, overwrite=True
            )
    assert sorted(os.listdir(tmp_path)) == ["pretrained", "train.py"]
    assert os.listdir(source) == ["config.json"]


def test_verify_refuses_the_extra_state_nesting_restore_refuses(tmp_path):
    """verify passed a resealed extra-state file nested deeper than any save writes, which
    restore then refused: both now draw the line at the same depth, and name the file."""
    from shardstream.commands.verify import verify
    from shardstream.formats import jsondoc
    from shardstream.training import state

    for depth in range(state.MAX_NESTING - 2, state.MAX_NESTING + 3):
        value: list = []
        for _ in range(depth):
            value = [value]
        try:
            state.decode(value, {})
            decoded = True
        except ValueError:
            decoded = False
        assert jsondoc.nested_deeper(value, state.MAX_NESTING) is not decoded, depth

    model, optimizer, _ = tiny()
    step = tmp_path / "global_step_1"
    shardstream.save(step, model=model, optimizer=optimizer, extra={"note": [[["kept"]]]})
    assert verify(step).ok
    extra = step / "extra-rank-00000.json"
    for body in ("[" * 250 + "]" * 250, "[" * 100_000 + "]" * 100_000):
        doc = native.read_manifest(step)
        doc["files"][extra.name].update(size=len(body), xxh3=checksum.digest(body.encode()))
        extra.write_text(body)
        native.write_manifest(step, doc)
        report = verify(step)
        assert not report.ok and report.problems[0].path == str(extra), report
        assert "nested over 200 deep" in report.problems[0].message
        with pytest.raises(CheckpointFormatError, match="extra state"):
            shardstream.load(step, model=model, optimizer=optimizer)
    doc = native.read_manifest(step)
    deep: list = []
    for _ in range(250):
        deep = [deep]
    doc["objects"]["optimizer"]["param_groups"][0]["deep"] = deep
    native.write_manifest(step, doc)
    problems = [p.line() for p in verify(step).problems]
    assert any(
        line.startswith(f"{step / native.MANIFEST}: objects: values nested") for line in problems
    )
    with pytest.raises(CheckpointFormatError, match="nested over 200 deep"):
        shardstream.load(step, model=model, optimizer=optimizer, contents=("model", "optimizer"))


def test_a_step_directory_holds_the_step_it_is_named_for(tmp_path):
    """save() refuses a global_step_N directory for another step, and every reader refuses a
    manifest whose step differs from its directory's name, or whose contents name an item
    no save writes (verify, merge and restore alike; merge exited 0 on both)."""
    from shardstream.commands.verify import verify

    model, _, _ = tiny()
    with pytest.raises(UsageError, match="named for step 5 must hold step 5, not step=3"):
        shardstream.save(tmp_path / "global_step_5", model=model, contents=("model",), step=3)
    assert not (tmp_path / "global_step_5").exists()
    step = tmp_path / "global_step_4"
    shardstream.save(step, model=model, contents=("model",), step=4)
    manifest = native.read_manifest(step)
    for change, error in (
        ({"step": 2}, "directory is named for step 4 but its manifest is step 2"),
        ({"contents": ["model", "weights"]}, "'contents' names 'weights', not one of model"),
    ):
        doc = {**manifest, **change}
        sealed = {**doc, "checksum": checksum.digest(native.canonical(doc))}
        (step / native.MANIFEST).write_bytes(native.canonical(sealed))
        report = verify(step)
        assert not report.ok and error in report.problems[0].message, report
        with pytest.raises(CheckpointFormatError, match=error):
            shardstream.merge(step, tmp_path / "merged")
        with pytest.raises(CheckpointFormatError, match=error):
            shardstream.load(step, model=model, contents=("model",))


def test_shape_mismatch_names_the_tensor(tmp_path):
    model, _, _ = tiny()
    shardstream.save(tmp_path / "c", model=model, contents=("model",))
    other = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    other.register_buffer("calls", torch.tensor(0))
    # named as the model names it, not by restore's internal "model." namespace
    with pytest.raises(
        CheckpointFormatError, match=r"model tensor '0\.weight' has shape \[7, 5\] in"
    ):
        shardstream.load(tmp_path / "c", model=other, contents=("model",))


def test_tensors_the_model_lacks_are_named_not_dropped(tmp_path):
    """A checkpoint of another model (here with biases the model lacks) is refused, as torch's
    strict load_state_dict would, instead of restoring the tensors both have."""
    model, _, _ = tiny()
    shardstream.save(tmp_path / "c", model=model, contents=("model",))
    other = torch.nn.Sequential(
        torch.nn.Linear(5, 7, bias=False), torch.nn.ReLU(), torch.nn.Linear(7, 3, bias=False)
    )
    other.register_buffer("calls", torch.tensor(0))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match=r"has model tensor '0.bias', which the model"):
        shardstream.load(tmp_path / "c", model=other, contents=("model",))
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


@pytest.mark.parametrize("hf_dtype", [None, "bfloat16"])
def test_save_with_hf_model_uses_one_buffer_set(tmp_path, monkeypatch, hf_dtype):
    """The sharded write, extra and hf export of one save share one budget-sized allocation,
    and the export (written from the live weights) holds the weights exactly."""
    from safetensors.torch import load_file

    from shardstream.engine import copy as copy_module
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2")
    model = build_tiny_model(config, seed=1)
    optimizer = torch.optim.AdamW(model.parameters())
    allocations = []
    real = copy_module.anonymous_memory
    monkeypatch.setattr(copy_module, "anonymous_memory", lambda n: allocations.append(n) or real(n))
    cfg = CheckpointConfig(
        str(tmp_path / "run"),
        save_contents=("model", "optimizer", "extra", "hf_model"),
        staging_budget="2MiB",
    )
    with CheckpointManager(
        cfg, model=model, optimizer=optimizer, hf_config=config, hf_dtype=hf_dtype
    ) as mgr:
        mgr.save(1, extra={"t": torch.arange(3)})
    assert allocations == [2 << 20]
    export = tmp_path / "run" / "global_step_1" / "huggingface"
    saved = {}
    for f in export.glob("*.safetensors"):
        saved.update(load_file(f))
    dtype = torch.bfloat16 if hf_dtype else torch.float32
    for name, tensor in model.state_dict().items():
        assert torch.equal(saved[name], tensor.to(dtype)), name
    assert shardstream.verify(tmp_path / "run").ok


def test_plain_save_exports_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2")
    model = build_tiny_model(config, seed=1)
    with pytest.raises(UsageError, match="hf_config="):
        shardstream.save(tmp_path / "a", model=model, contents=("model", "hf_model"))
    assert not (tmp_path / "a").exists()
    shardstream.save(
        tmp_path / "c",
        model=model,
        contents=("model", "hf_model"),
        hf_config=config,
        share_hf_weights=True,
    )
    manifest = json.loads((tmp_path / "c" / native.MANIFEST).read_text())
    first = manifest["tensors"]["model.model.embed_tokens.weight"]["chunks"][0]
    assert first["file"] == "huggingface/model.safetensors"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "c" / "huggingface")
    other = build_tiny_model(config, seed=2)
    shardstream.load(tmp_path / "c", model=other, contents=("model",))
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
        assert torch.equal(other.state_dict()[name], tensor), name


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize("given", ["objects", "source_dir"])
def test_hf_model_config_and_tokenizer_files(tmp_path, given):
    """hf_config= and tokenizer=, or hf_source_dir=: huggingface/ gets config.json (in the
    publish dtype), generation_config.json and the tokenizer, and loads with transformers."""
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2")
    model = build_tiny_model(config, seed=1)
    tokenizer = _tiny_tokenizer()
    if given == "objects":
        hf_args = {"hf_config": config, "tokenizer": tokenizer}
    else:
        source = tmp_path / "source"
        config.save_pretrained(source)
        tokenizer.save_pretrained(source)
        hf_args = {"hf_source_dir": source}
    contents = ("model", "hf_model")
    shardstream.save(tmp_path / "c", model=model, contents=contents, hf_dtype="bfloat16", **hf_args)
    export = tmp_path / "c" / "huggingface"
    assert AutoConfig.from_pretrained(export).dtype == torch.bfloat16
    loaded = PreTrainedTokenizerFast.from_pretrained(export)  # not Auto: config.json says qwen2
    assert loaded("hello world oops")["input_ids"] == [1, 2, 0]
    if given == "objects":
        assert (export / "generation_config.json").is_file()
    assert shardstream.verify(tmp_path / "c").ok


def test_share_hf_weights_without_hf_model_warns(tmp_path):
    with pytest.warns(UserWarning, match="share_hf_weights does nothing"):
        CheckpointConfig(str(tmp_path), save_contents=("model",), share_hf_weights=True)


class _Views(torch.nn.Module):
    """A parameter with a buffer that is its transpose (``transposed``), or a buffer whose
    rows are one row's memory (``expanded``); else (``saved``) three tensors of their own."""

    def __init__(self, kind: str):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(12.0).view(3, 4))
        other = torch.arange(12.0).view(3, 4).t() + 100
        self.register_buffer("wt", self.w.data.t() if kind == "transposed" else other)
        rows = torch.zeros(1, 4).expand(3, 4) if kind == "expanded" else torch.arange(12.0)
        self.register_buffer("rows", rows.reshape(3, 4))


@pytest.mark.parametrize(
    ("kind", "needle"),
    [("transposed", "'w' and 'wt' overlap in memory"), ("expanded", "'rows' has elements")],
)
def test_live_tensors_that_share_memory_are_refused(tmp_path, kind, needle):
    """Whichever value was written last won, and the restore said nothing."""
    shardstream.save(tmp_path / "c", model=_Views("saved"), contents=("model",))
    live = _Views(kind)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match=needle):
        shardstream.load(tmp_path / "c", model=live, contents=("model",))
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())


def test_retention_leaves_the_step_a_restore_is_reading(tmp_path, monkeypatch):
    """A reader restoring beside a run that saves: the run's retention keeps the step being
    read (past keep_last) and drops it at a save after the restore."""
    model, optimizer, scheduler = tiny()
    cfg = CheckpointConfig(str(tmp_path), keep_last=1)
    writer = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    step(model, optimizer, scheduler)
    writer.save(1, extra={"s": 1})
    want = snapshot(model, optimizer, scheduler)
    model2, optimizer2, scheduler2 = tiny()
    reader = CheckpointManager(cfg, model=model2, optimizer=optimizer2, lr_scheduler=scheduler2)
    read = reader._load

    def load_while_the_run_saves(path, *args, **kwargs):
        for s in (2, 3):
            step(model, optimizer, scheduler)
            writer.save(s, extra={"s": s})
        writer.wait()
        assert writer.all_steps() == [1, 3]  # step 1 is being read
        return read(path, *args, **kwargs)

    monkeypatch.setattr(reader, "_load", load_while_the_run_saves)
    assert reader.restore() == (1, {"s": 1})
    assert_same(snapshot(model2, optimizer2, scheduler2), want)
    writer.save(4)
    writer.wait()
    assert writer.all_steps() == [4]
    writer.close()
    reader.close()


@pytest.mark.parametrize("read", ["step", "huggingface"])
@pytest.mark.parametrize("command", ["merge", "verify"])
def test_merge_and_verify_keep_the_step_they_read_from_retention(tmp_path, command, read):
    """A run saving beside the reader does not delete the step it reads; nor its
    huggingface/ export, which took no lease (retention deleted it mid-read, and the reader
    raised FileNotFoundError from deep inside, in 2-3% of reads beside a live run)."""
    from shardstream.commands.verify import verify
    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    config = tiny_config("qwen2")
    model = build_tiny_model(config, seed=1)
    optimizer = torch.optim.AdamW(model.parameters())
    contents = ("model", "optimizer", "hf_model")
    cfg = CheckpointConfig(str(tmp_path / "run"), keep_last=1, save_contents=contents)
    writer = CheckpointManager(cfg, model=model, optimizer=optimizer, hf_config=config)
    writer.save(1)
    saved_meanwhile = []

    def the_run_saves(_):
        if not saved_meanwhile:
            for s in (2, 3):
                writer.save(s)
            writer.wait()
            saved_meanwhile.append(writer.all_steps())

    source = writer.step_dir(1) / ("huggingface" if read == "huggingface" else "")
    if command == "merge":
        shardstream.merge(source, tmp_path / "out", progress=the_run_saves)
        assert verify(tmp_path / "out").ok
    else:
        report = verify(source, progress=the_run_saves)
        assert report.ok, report.problems
    assert saved_meanwhile == [[1, 3]]  # step 1 was being read
    writer.save(4)
    writer.wait()
    assert writer.all_steps() == [4]
    writer.close()


def test_contents_save_would_refuse_are_said_when_the_manager_is_built(tmp_path, caplog):
    """A manager given a model alone, with the default save_contents (which holds the
    optimizer), said nothing until its first save refused, after the steps before it."""
    model = torch.nn.Linear(4, 2)
    with caplog.at_level(logging.WARNING, logger="shardstream.manager"):
        manager = CheckpointManager(CheckpointConfig(tmp_path / "run"), model=model)
    said = [r.getMessage() for r in caplog.records]
    assert any("'optimizer' but no optimizer was given" in m for m in said), said
    with pytest.raises(UsageError, match="no optimizer"):
        manager.save(1)
    manager.close()
    caplog.clear()
    config = CheckpointConfig(tmp_path / "run2", save_contents=("model", "hf_model"))
    with caplog.at_level(logging.WARNING, logger="shardstream.manager"):
        CheckpointManager(config, model=model).close()
    said = [r.getMessage() for r in caplog.records]
    assert any("'hf_model' but no hf_config= or hf_source_dir= was given" in m for m in said)
    assert not any("'model'" in m and "no model" in m for m in said), said
    caplog.clear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="shardstream.manager"):
        CheckpointManager(CheckpointConfig(tmp_path / "run3"), model, optimizer).close()
    assert not caplog.records


@pytest.mark.parametrize("lazy", ["neg", "conj"])
def test_a_lazily_negated_or_conjugated_parameter_is_refused_before_anything_is_written(
    tmp_path, lazy
):
    """A parameter that is a lazy view (``torch._neg_view``, ``.conj()`` of a complex one)
    keeps other bytes than its values: save stored the bytes (restore gave [1, 2] for
    [-1, -2], verify OK), and a restore into one wrote the values' bytes under the bit."""
    if lazy == "neg":
        value = torch._neg_view(torch.tensor([1.0, 2.0]))
    else:
        value = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(value, requires_grad=False)
    cfg = CheckpointConfig(directory=tmp_path / "run", save_contents=("model",))
    with CheckpointManager(cfg, model=model) as manager:
        with pytest.raises(UsageError, match=f"tensor 'w' is a lazily {lazy}[a-z]* view"):
            manager.save(1)
    assert not any((tmp_path / "run").glob("global_step_*"))
    plain = torch.nn.Module()
    plain.w = torch.nn.Parameter(value.resolve_conj().resolve_neg().clone(), requires_grad=False)
    with CheckpointManager(cfg, model=plain) as manager:
        manager.save(1)
    with CheckpointManager(cfg, model=model) as manager:
        with pytest.raises(UsageError, match=f"tensor 'w' is a lazily {lazy}[a-z]* view"):
            manager.restore()
