"""The verl plug-in: verl 0.9.1's own modules build shardstream's checkpoint manager when
SHARDSTREAM_VERL=1, and verl's resume logic finds what it wrote."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardstream.cli import main
from shardstream.commands.merge import merge
from shardstream.commands.verify import verify
from shardstream.errors import UsageError
from shardstream.testing.distributed import run

from . import verl_plugin_workers as workers

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl 0.9.1 is not installed (make test installs it)", allow_module_level=True)
import verl  # noqa: E402  (installed but broken: an error, not a skip)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1-3 saved through the plug-in at 4 ranks (max_ckpt_to_keep=2) beside verl's own
    step 0; step 3 also saved by verl's manager into another run."""
    root = tmp_path_factory.mktemp("plugin-run")
    verl_root = tmp_path_factory.mktemp("verl-run")
    results = run(workers.save_run, 4, str(root), str(verl_root))
    return root, verl_root, results


def _reference(root: Path, rank: int) -> dict:
    return torch.load(root / f"reference_rank{rank}.pt", weights_only=False)


def _assert_same(state: dict, reference: dict) -> None:
    for name, tensor in reference["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    for fqn, entries in reference["optim"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(state["optim"]["state"][fqn][key], value), (fqn, key)
    # flat parameters (FSDP1, use_orig_params=False) list their parameters in their own order
    by_set = lambda groups: [{**g, "params": sorted(g["params"])} for g in groups]  # noqa: E731
    assert by_set(state["optim"]["param_groups"]) == by_set(reference["optim"]["param_groups"])
    assert state["scheduler"] == reference["scheduler"]


def test_plugin_is_registered_and_does_nothing_without_the_variable():
    if os.environ.get("SHARDSTREAM_VERL"):
        pytest.skip("SHARDSTREAM_VERL is set in this environment")
    from importlib.metadata import entry_points

    from verl.utils.checkpoint import fsdp_checkpoint_manager as defining
    from verl.workers.engine.fsdp import transformer_impl

    (entry,) = [e for e in entry_points(group="verl.plugins") if e.name == "shardstream"]
    assert entry.value == "shardstream.integrations.verl_plugin"
    assert transformer_impl.FSDPCheckpointManager is defining.FSDPCheckpointManager
    assert defining.FSDPCheckpointManager.__module__ == defining.__name__


def test_veomni_engine_module_builds_shardstreams_manager():
    """verl 0.9.1's VeOmni engine builds the manager with the keywords and calls of its FSDP
    engine; imported with the plug-in on, its module holds shardstream's class. veomni itself
    does not import beside transformers 5, so the check's process answers ``veomni.*`` imports
    with empty placeholder modules; verl's own module file runs unchanged."""
    script = Path(__file__).with_name("veomni_engine_check.py")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    built = done.stdout.strip().splitlines()[-1]
    assert built == "shardstream.integrations.verl.FSDPCheckpointManager", done.stdout


def test_a_module_without_the_name_is_refused_by_name():
    from shardstream.integrations.verl_plugin import VerlPluginError, _patch

    module = types.ModuleType("verl.workers.engine.fsdp.transformer_impl")
    with pytest.raises(VerlPluginError, match="transformer_impl has no FSDPCheckpointManager"):
        _patch(module)


def test_a_verl_that_moved_the_names_is_refused_naming_what_was_expected(tmp_path):
    from shardstream.integrations import verl_plugin

    installed = Path(verl.__file__).parent
    for name in verl_plugin.TARGETS:
        relative = Path(*name.split(".")[1:]).with_suffix(".py")
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / relative, tmp_path / relative)
    verl_plugin.check_verl_files(tmp_path)  # verl 0.9.1's own files pass
    engine = tmp_path / "workers/engine/fsdp/transformer_impl.py"
    engine.write_text(engine.read_text().replace("FSDPCheckpointManager", "CheckpointManager"))
    with pytest.raises(verl_plugin.VerlPluginError, match="transformer_impl.py: expected"):
        verl_plugin.check_verl_files(tmp_path)
    shutil.copyfile(installed / "workers/engine/fsdp/transformer_impl.py", engine)
    (tmp_path / "utils/checkpoint/fsdp_checkpoint_manager.py").unlink()
    with pytest.raises(verl_plugin.VerlPluginError, match="no module verl.utils.checkpoint"):
        verl_plugin.check_verl_files(tmp_path)


def test_bad_contents_are_refused_by_name():
    from verl.trainer.config import CheckpointConfig

    from shardstream.integrations.verl import FSDPCheckpointManager

    bad = CheckpointConfig(save_contents=["model", "weights"])
    with pytest.raises(UsageError, match="save_contents: unknown item 'weights'"):
        FSDPCheckpointManager(model=None, checkpoint_config=bad)
    with pytest.raises(UsageError, match="load_contents must be a list"):
        FSDPCheckpointManager(model=None, checkpoint_config={"load_contents": "model"})


def test_hf_model_of_a_peft_model_is_refused_when_the_manager_is_built():
    """As docs/verl.md says: refused when verl builds the manager, not at the first save a
    save_freq later (the plug-in built its run's manager only then)."""
    from shardstream.integrations.verl import FSDPCheckpointManager
    from shardstream.testing.tiny_models import add_lora, build_tiny_model, tiny_config

    model = add_lora(build_tiny_model(tiny_config("qwen2"), seed=0))
    contents = {"save_contents": ["model", "optimizer", "extra", "hf_model"]}
    with pytest.raises(UsageError, match="PEFT \\(LoRA\\) model"):
        FSDPCheckpointManager(model=model, checkpoint_config=contents)
    FSDPCheckpointManager(model=model, checkpoint_config={"save_contents": ["model"]})


def test_staging_budget_variable_is_a_size_or_state(monkeypatch):
    """SHARDSTREAM_STAGING_BUDGET: a size, or ``state`` (an async save may stage the rank's
    whole state); anything else is refused naming the variable."""
    from shardstream.integrations import verl as plugin

    monkeypatch.setenv("SHARDSTREAM_STAGING_BUDGET", "state")
    assert plugin._staging_budget() == ("state", None)
    monkeypatch.setenv("SHARDSTREAM_STAGING_BUDGET", "1GiB")
    assert plugin._staging_budget() == ("1GiB", 1 << 30)
    monkeypatch.setenv("SHARDSTREAM_STAGING_BUDGET", "lots")
    with pytest.raises(UsageError, match="SHARDSTREAM_STAGING_BUDGET: invalid size 'lots'"):
        plugin._staging_budget()
    # when verl builds its checkpoint manager, not at the first save a save interval later
    with pytest.raises(UsageError, match="SHARDSTREAM_STAGING_BUDGET: invalid size 'lots'"):
        plugin.FSDPCheckpointManager(model=None)


def test_config_as_dataclass_dictconfig_or_dict():
    from omegaconf import OmegaConf
    from verl.trainer.config import CheckpointConfig

    from shardstream.integrations.verl import FSDPCheckpointManager

    values = {"save_contents": ["model", "hf_model"], "load_contents": ["model"]}
    values |= {"async_save": True, "save_lora_only": True}
    for config in (CheckpointConfig(**values), OmegaConf.create(values), values):
        manager = FSDPCheckpointManager(model=None, checkpoint_config=config)
        assert manager.checkpoint_save_contents == ["model", "hf_model"]
        assert manager.should_save_hf_model and not manager.should_save_optimizer
        assert manager.should_load_model and not manager.should_load_extra
        assert manager.async_save and manager.should_save_lora_only
        assert (manager.rank, manager.world_size) == (0, 1)
    default = FSDPCheckpointManager(model=None)
    assert default.checkpoint_load_contents == ["model", "optimizer", "extra"]


def test_async_staging_memory_is_faulted_in_after_the_first_step_and_used_by_the_first_save(
    tmp_path,
):
    """With async_save, the plug-in faults its staging memory in after the optimizer's first
    step, before any save knows where it saves; the first role run saves into that memory. A
    run that saves synchronously (verl's SFT layout) lets it go."""
    from verl.trainer.config import CheckpointConfig

    from shardstream.integrations.verl import FSDPCheckpointManager

    config = CheckpointConfig(save_contents=["model", "optimizer"], async_save=True)
    for local_path, role_run in (
        (tmp_path / "ppo" / "global_step_1" / "actor", True),
        (tmp_path / "sft" / "global_step_1", False),
    ):
        model = torch.nn.Linear(64, 32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        manager = FSDPCheckpointManager(model, optimizer, checkpoint_config=config)
        staging = manager._staging
        assert staging is not None and staging.held_bytes == 0
        model(torch.ones(2, 64)).sum().backward()
        optimizer.step()
        held = staging.held_bytes
        memory = staging.take(1, False).data_ptr()
        assert held > 3 * 4 * (64 * 32 + 32)  # the weights and AdamW's two moments
        manager.save_checkpoint(str(local_path), global_step=1)
        manager.wait()
        (run,) = manager._runs.values()
        if role_run:
            assert run._async.staging is staging and manager._staging is None
            assert staging.held_bytes == held and staging.take(1, False).data_ptr() == memory
        else:
            assert run._async is None and staging.held_bytes == 0
        assert (local_path / "manifest.json").is_file()
        manager.close()


def test_layout_retention_and_side_files(saved):
    root, _, results = saved
    # max_ckpt_to_keep=2 deleted step 1 (and its emptied directory), not verl's step 0
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("global_step_")) == [
        "global_step_0",
        "global_step_2",
        "global_step_3",
    ]
    assert (root / "global_step_0/actor/model_world_size_4_rank_3.pt").is_file()
    assert results[0]["previous"] == [str(root / f"global_step_{s}/actor") for s in (2, 3)]
    assert results[0]["gone_at_once"]  # renamed away before save_checkpoint returned
    actor = root / "global_step_3/actor"
    manifest = json.loads((actor / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 4
    hf = actor / "huggingface"
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in hf.iterdir()}
    # a synchronous save leaves the pointer to verl's trainer, which writes it on return
    assert not (root / "latest_checkpointed_iteration.txt").exists()


def test_save_at_4_loads_bit_for_bit_at_2_with_verls_own_checkpoint(saved):
    root, verl_root, _ = saved
    actors = [str(root / "global_step_3/actor"), str(verl_root / "global_step_3/actor")]
    results = run(workers.load_run, 2, actors, True, True)
    for rank, per_actor in enumerate(results):
        reference = _reference(root, rank)
        for loaded in per_actor:
            _assert_same(loaded["state"], reference)
            assert torch.equal(loaded["rng_next"], reference["rng_next"])


def test_fsdp2_checkpoints_load_into_fsdp1_flat_parameters(saved):
    """A run switching from ``strategy: fsdp2`` to ``fsdp`` (verl's default
    ``use_orig_params=False``): the optimizer state saved per parameter, by verl's own
    manager and by the plug-in, fills the flat parameters' state, each parameter's own. The
    flat parameters list the parameters in their own order, by which the saved ids were
    matched ("'exp_avg' has shape [48, 48] in the checkpoint but [48] in the model")."""
    root, verl_root, _ = saved
    reference = _reference(root, 0)
    for actor in (root / "global_step_3/actor", verl_root / "global_step_3/actor"):
        for state in run(workers.fsdp1_load_run, 2, str(actor), False):
            _assert_same(state, reference)


def test_save_at_4_loads_bit_for_bit_at_1(saved):
    root, _, _ = saved
    (loaded,) = run(workers.load_run, 1, [str(root / "global_step_3/actor")], False, False)[0]
    reference = _reference(root, 0)
    _assert_same(loaded["state"], reference)
    assert torch.equal(loaded["rng_next"], reference["rng_next"])


def test_hf_model_equals_merge_and_commands_read_it(saved, tmp_path, capsys):
    root, _, _ = saved
    actor = root / "global_step_3/actor"
    target = tmp_path / "merged"
    args = ["merge", "--local_dir", str(actor), "--target_dir", str(target)]
    assert main([*args, "--dtype", "float32"]) == 0
    merged = load_file(target / "model.safetensors")
    exported = load_file(actor / "huggingface/model.safetensors")
    assert merged.keys() == exported.keys()
    for name, tensor in merged.items():
        assert torch.equal(tensor, exported[name]), name
    # verl's hf_model: the tensors as trained, config.json naming bfloat16 (verl builds the
    # model it saves with torch_dtype=bfloat16), so verl's merge command writes bfloat16
    config = json.loads((actor / "huggingface/config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert main([*args[:-1], str(tmp_path / "default")]) == 0
    default = load_file(tmp_path / "default" / "model.safetensors")
    assert all(torch.equal(default[k], exported[k].to(torch.bfloat16)) for k in exported)
    assert verify(actor).ok
    assert main(["verify", str(actor)]) == 0
    assert main(["inspect", str(actor)]) == 0
    assert str(actor) in capsys.readouterr().out


def test_lora_only_and_damaged_checkpoints_refused_before_the_model_changes(saved, tmp_path):
    root, _, _ = saved
    damaged = []
    for case in ("flipped", "truncated", "foreign"):
        actor = tmp_path / case / "global_step_3/actor"
        shutil.copytree(root / "global_step_3/actor", actor)
        rank_file = actor / "rank-00001.safetensors"
        if case == "flipped":
            data = bytearray(rank_file.read_bytes())
            data[-5] ^= 0xFF
            rank_file.write_bytes(bytes(data))
        elif case == "truncated":
            rank_file.write_bytes(rank_file.read_bytes()[:-100])
        else:
            (actor / "manifest.json").unlink()  # a partial save: no manifest, so no checkpoint
        damaged.append(str(actor))
    results = run(workers.misc_run, 2, str(tmp_path / "lora"), damaged)
    for result in results:
        assert result["lora"]["equal"]
        flipped, truncated, foreign = result["damaged"]
        assert "checksum" in flipped["error"].lower() and "rank-00001" in flipped["error"]
        assert "rank-00001" in truncated["error"]
        assert str(Path(damaged[2])) in foreign["error"]
        assert all(case["untouched"] for case in result["damaged"])
    lora_actor = tmp_path / "lora/global_step_1/actor"
    meta = json.loads((lora_actor / "lora_train_meta.json").read_text())
    assert (meta["r"], meta["lora_alpha"]) == (3, 6)
    names = json.loads((lora_actor / "manifest.json").read_text())["tensors"]
    model_names = [n for n in names if n.startswith("model.")]
    assert model_names and all("lora_" in n for n in model_names)


def test_async_save_killed_anywhere_leaves_verl_a_complete_step(tmp_path):
    """kill -9 of every rank at random points of async saves: verl's find_latest_ckpt_path
    always names a committed step that verifies."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for trial in range(3):
        root = tmp_path / f"trial{trial}"
        delay = rng.uniform(0, 1.5)
        with pytest.raises(RuntimeError):  # the ranks died
            run(workers.async_kill_run, 2, str(root), delay, 6)
        found = find_latest_ckpt_path(str(root))
        assert found is not None, f"trial {trial}, kill after {delay:.2f} s"
        report = verify(Path(found) / "actor")
        assert report.ok, (delay, [p.line() for p in report.problems])


def test_actor_and_critic_save_side_by_side_and_load_at_another_world_size(tmp_path):
    run(workers.actor_critic_run, 2, str(tmp_path))
    steps = {
        p.name: sorted(c.name for c in p.iterdir())
        for p in tmp_path.iterdir()
        if p.name.startswith("global_step_")
    }
    # each role kept its own last max_ckpt_to_keep steps and deleted only what it wrote
    assert steps == {"global_step_2": ["actor"], "global_step_3": ["actor", "critic"]}
    for role in ("actor", "critic"):
        assert verify(str(tmp_path / "global_step_3" / role)).ok, role
    loaded = run(workers.load_roles_run, 1, str(tmp_path), 3)[0]
    for role in ("actor", "critic"):
        reference = torch.load(tmp_path / f"reference_{role}.pt", weights_only=False)
        _assert_same(loaded[role], reference)


def test_fsdp1_saves_at_2_and_loads_bit_for_bit_at_1_and_2(tmp_path):
    """verl's ``strategy: fsdp`` (FSDP1, whose state dict hands out copies of its flat
    parameters): the load must reach the flat parameters, not only those copies."""
    run(workers.fsdp1_save_run, 2, str(tmp_path))
    reference = torch.load(tmp_path / "reference_fsdp1.pt", weights_only=False)
    actor = str(tmp_path / "global_step_2" / "actor")
    assert verify(actor).ok
    for world in (1, 2):
        for state in run(workers.fsdp1_load_run, world, actor):
            _assert_same(state, reference)


def test_hybrid_sharded_fsdp1_checkpoint_of_verls_own_manager_loads_through_the_plugin(tmp_path):
    """verl's ``fsdp_size`` below the world size: FSDP1 ``HYBRID_SHARD`` over its
    ``("ddp", "fsdp")`` mesh, where each ``ddp`` row of ranks saves the same flat optimizer
    parts. verl's ``.pt`` files of 4 ranks as 2 replicas of 2 parts load through the plug-in
    at 2 ranks fully sharded and at 4 ranks as 2 x 2 again, bit for bit, and merge."""
    run(workers.fsdp1_verl_save_run, 4, str(tmp_path), False, 2)
    reference = torch.load(tmp_path / "reference_fsdp1.pt", weights_only=False)
    actor = str(tmp_path / "global_step_2" / "actor")
    report = verify(actor)
    assert report.ok, report.problems
    for world, fsdp_size in ((2, -1), (4, 2)):
        for state in run(workers.fsdp1_load_run, world, actor, False, workers.CONTENTS, fsdp_size):
            _assert_same(state, reference)
    merge(actor, tmp_path / "merged", dtype="float32")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged.keys() == reference["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(merged[name], tensor), name


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_fsdp1_checkpoint_of_verls_own_manager_loads_through_the_plugin(tmp_path, use_orig_params):
    """A run switching to the plug-in mid-run with ``strategy: fsdp``: verl's ``.pt`` files of
    FSDP1 at 2 ranks (its optimizer state as plain per-rank parts of flat tensors: each flat
    parameter's, or with use_orig_params each parameter's) fill the FSDP1 flat shards and
    optimizer state at 1 and 4 ranks, bit for bit; verify passes on them. They also resume
    into FSDP2 at 3 ranks (switching to ``strategy: fsdp2``): with use_orig_params=False the
    flat parameters are placed by verl's wrap policy, read from the model's own classes."""
    run(workers.fsdp1_verl_save_run, 2, str(tmp_path), use_orig_params)
    reference = torch.load(tmp_path / "reference_fsdp1.pt", weights_only=False)
    actor = str(tmp_path / "global_step_2" / "actor")
    # With use_orig_params a rank holding none of a parameter has no state for it.
    report = verify(actor)
    assert report.ok, report.problems
    for world in (1, 4):
        for state in run(workers.fsdp1_load_run, world, actor, use_orig_params):
            _assert_same(state, reference)
    if use_orig_params:  # switched to use_orig_params=False: per-parameter state into flat
        for state in run(workers.fsdp1_load_run, 2, actor, False):
            _assert_same(state, reference)
    # Units that do not match the saved flat sizes are refused, before the model changes.
    wrong = None if use_orig_params else {"Qwen2MLP"}
    for result in run(workers.fsdp2_switch_run, 3, actor, wrong):
        if wrong:
            assert "the run wrapped the model in other units" in result["refused"]["error"]
            assert result["refused"]["untouched"]
        state = result["state"]
        assert state["model"].keys() == reference["model"].keys()
        for name, tensor in reference["model"].items():
            assert torch.equal(state["model"][name], tensor), name
        for fqn, entries in reference["optim"]["state"].items():
            for key, value in entries.items():
                assert torch.equal(state["optim"]["state"][fqn][key], value), (fqn, key)


def test_verls_merged_lora_sync_waits_for_an_async_save_to_read_the_weights(tmp_path):
    """verl's rollout sync with ``lora.merge`` writes the adapters into the base weights in
    place (through ``.data``, which no version counter sees) and restores them afterwards;
    the plug-in's fence makes it wait for an async save still reading them, so the checkpoint
    holds the weights of its step, not the merged ones."""
    for rank in run(workers.lora_sync_run, 2, str(tmp_path)):
        assert rank["sync_changed_weights"]
        assert rank["differ"] == []


def test_verls_trainer_waits_for_the_last_async_save_through_the_actor_workers(tmp_path):
    """After its last step verl's PPO trainer calls ``async_calls_finalize_fn_exec
    (blocking=True)`` on its actor workers' group where the worker class has it: the plug-in
    gives verl's class that method, which verl's worker group binds, and it returns only once
    the save has committed (Ray ends the workers right after)."""
    for rank in run(workers.finalize_run, 2, str(tmp_path)):
        assert rank == {
            "bound": True,
            "one_to_all": True,
            "committed_early": False,
            "waited": True,
            "committed": True,
        }
