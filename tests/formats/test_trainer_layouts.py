"""Trainers' checkpoint layouts in one process (issue #24): key prefixes, schedulers through
DCP, accelerate's save_state directory for verify and inspect, ``test --exact``."""

from __future__ import annotations

import functools
import json
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from transformers import get_cosine_schedule_with_warmup

from shardstream.cli import main
from shardstream.commands.inspect import describe, render
from shardstream.commands.test import compare_with_reference
from shardstream.commands.verify import verify
from shardstream.errors import CheckpointFormatError
from shardstream.formats.dcp import open_dcp_train_state
from shardstream.formats.source import Kind, detect, open_checkpoint
from shardstream.training import schedulers


def _save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when used without a process group
        dcp.save(state, checkpoint_id=str(path))


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(6, 4, generator=generator),
        "layer.bias": torch.randn(6, generator=generator),
    }


# --------------------------------------------------------------------------- key prefixes


def test_app_state_prefix_is_detected_and_shown(tmp_path):
    path = tmp_path / "step-3"
    _save({"app": {"model": _weights(), "optim": {"state": {}}}}, path)
    ckpt = open_checkpoint(path)
    assert ckpt.prefix == "app.model."
    assert sorted(t.name for t in ckpt.tensors) == ["layer.bias", "layer.weight"]
    info = describe(path)
    assert info["prefix"] == "app.model." and info["step"] == 3


def test_ambiguous_prefix_needs_one_named(tmp_path):
    path = tmp_path / "ckpt"
    _save({"actor": {"model": _weights(0)}, "critic": {"model": _weights(1)}}, path)
    with pytest.raises(CheckpointFormatError, match="'actor.model.', 'critic.model.'"):
        open_checkpoint(path)
    critic = open_checkpoint(path, prefix="critic.model")
    assert critic.prefix == "critic.model." and len(critic.tensors) == 2
    assert main(["inspect", str(path), "--prefix", "actor.model.", "--json"]) == 0


# --------------------------------------------------------------------------- schedulers


def _cosine(optimizer):
    return get_cosine_schedule_with_warmup(optimizer, 2, 20)


def _sequential(optimizer):
    lam = torch.optim.lr_scheduler.LambdaLR
    first = lam(optimizer, functools.partial(pow, 0.9))
    second = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.8)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [first, second], milestones=[3])


def _one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=20)


@pytest.mark.parametrize("build", [_cosine, _sequential, _one_cycle], ids=lambda f: f.__name__)
def test_scheduler_survives_dcp_and_merges_into_live_one(tmp_path, build):
    def fresh():
        weight = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
        return optimizer, build(optimizer)

    optimizer, scheduler = fresh()
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    _save({"model": {"w": torch.zeros(1)}, "lr_scheduler": scheduler.state_dict()}, tmp_path / "c")
    saved = open_dcp_train_state(tmp_path / "c").objects["lr_scheduler"]

    if build is _cosine:  # DCP dropped lr_lambdas' empty dict: loading it as saved fails
        with pytest.raises(KeyError, match="lr_lambdas"):
            fresh()[1].load_state_dict(dict(saved))
    optimizer2, scheduler2 = fresh()
    schedulers.check(scheduler2, saved)
    assert scheduler2.state_dict() == fresh()[1].state_dict()  # check leaves it as it was
    schedulers.load(scheduler2, saved)
    optimizer2.load_state_dict(optimizer.state_dict())  # restore sets the groups' lr too
    assert scheduler2.state_dict() == scheduler.state_dict()
    for _ in range(3):
        optimizer.step(), optimizer2.step()
        scheduler.step(), scheduler2.step()
        assert scheduler2.get_last_lr() == scheduler.get_last_lr()


# --------------------------------------------------------------------------- accelerate's directory


def _accelerate_dir(root, scheduler_state) -> None:
    _save({"model": _weights()}, root / "pytorch_model_fsdp_0")
    _save(
        {"optimizer": {"state": {"layer.bias": {"exp_avg": torch.ones(6)}}}}, root / "optimizer_0"
    )
    torch.save(scheduler_state, root / "scheduler.bin")
    torch.save({"torch_manual_seed": torch.get_rng_state()}, root / "random_states_0.pkl")


class _Hostile:
    def __reduce__(self):
        return (print, ("ran",))


def test_accelerate_directory_is_one_checkpoint(tmp_path):
    root = tmp_path / "checkpoint_4"
    _accelerate_dir(root, {"last_epoch": 4, "base_lrs": [0.1]})
    assert detect(root) is Kind.ACCELERATE
    report = verify(root)
    assert report.ok and report.kind == "accelerate"
    assert report.files_checked == 6  # two DCP parts of 2 files each, scheduler, RNG
    optimizer_only = verify(root / "optimizer_0")  # no model tensors, still checked
    assert optimizer_only.ok and optimizer_only.files_checked == 2
    assert describe(root)["step"] == 4 and describe(root)["prefix"] == "model."

    torch.save({"lr_lambdas": [_Hostile()]}, root / "scheduler.bin")
    report = verify(root)
    assert not report.ok and "refused" in report.problems[0].line()
    assert report.files_checked == 6


# --------------------------------------------------------------------------- test --exact


def test_exact_comparison_catches_one_ulp(tmp_path):
    weights = _weights()
    _save(weights, tmp_path / "dcp")
    changed = {k: v.clone() for k, v in weights.items()}
    flat = changed["layer.weight"].view(-1)
    flat[5] = torch.nextafter(flat[5], torch.tensor(float("inf")))
    (tmp_path / "ref").mkdir()
    save_file(changed, str(tmp_path / "ref" / "model.safetensors"))
    (tmp_path / "ref" / "config.json").write_text(json.dumps({"model_type": "custom"}))
    loose = compare_with_reference(tmp_path / "dcp", tmp_path / "ref")
    assert loose.ok  # within the default atol=rtol=1e-6
    exact = compare_with_reference(tmp_path / "dcp", tmp_path / "ref", exact=True)
    assert not exact.ok and "1 of 24 elements differ (exact" in exact.problems[0]
    save_file(weights, str(tmp_path / "ref" / "model.safetensors"))
    assert compare_with_reference(tmp_path / "dcp", tmp_path / "ref", exact=True).ok


def test_accelerate_parts_point_at_the_whole_directory(tmp_path):
    import shardstream

    root = tmp_path / "checkpoint_4"
    _accelerate_dir(root, {"last_epoch": 4, "base_lrs": [0.1]})
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(4, 6)
    optimizer = torch.optim.AdamW(model.parameters())
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        with pytest.raises(CheckpointFormatError, match="pass .*checkpoint_4 to restore"):
            shardstream.load(root / part, model=model, optimizer=optimizer)
    result = shardstream.load(root, model=model, contents=("model",))
    assert result.step == 4
    for name, tensor in _weights().items():
        assert torch.equal(model.state_dict()[name], tensor)


# --------------------------------------------------------------------------- a Trainer's output_dir


def _trainer_checkpoint(path, seed: int, finished: bool = True) -> None:
    """checkpoint-N as the Trainer leaves it with SHARDED_STATE_DICT: the model through DCP,
    training_args.bin, and trainer_state.json written last."""
    _save({"model": _weights(seed)}, path / "pytorch_model_fsdp_0")
    torch.save({"output_dir": str(path.parent)}, path / "training_args.bin")
    if finished:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": seed}))


def test_an_output_dirs_final_model_does_not_hide_its_checkpoints(tmp_path, capsys):
    """verify of a Trainer's output_dir holding the final model checked that model alone: a
    damaged checkpoint-N beside it, or one whose save did not finish, passed."""
    out = tmp_path / "out"
    _trainer_checkpoint(out / "checkpoint-1", 1)
    _trainer_checkpoint(out / "checkpoint-2", 2, finished=False)  # killed mid-save
    save_file(_weights(2), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    report = verify(out)
    assert report.kind == "huggingface" and report.steps == [1, 2]
    assert [p.path for p in report.problems] == [str(out / "checkpoint-2")]
    assert "trainer_state.json" in report.problems[0].message
    # the same checkpoint on its own: training_args.bin without trainer_state.json
    alone = verify(out / "checkpoint-2")
    assert [p.path for p in alone.problems] == [str(out / "checkpoint-2")]

    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    assert verify(out).ok
    record = out / "checkpoint-1" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data = bytearray(record.read_bytes())
    at = data.find(_weights(1)["layer.weight"].numpy().tobytes())  # inside a tensor's record
    assert at > 0
    data[at + 5] ^= 0x40
    record.write_bytes(bytes(data))
    assert main(["verify", str(out), "--quiet"]) == 1
    assert str(record) in capsys.readouterr().err


def test_an_output_dirs_checkpoint_no_reader_opens_is_not_passed_over(tmp_path):
    """Beside the final model, a checkpoint-N whose model was deleted (trainer_state.json and
    optimizer.pt left) or whose shards lost their index was skipped, and verify said OK with
    no byte unchecked, though the Trainer resumes from it. One holding a PEFT adapter alone
    (no reader opens adapters) counts as unchecked bytes."""
    out = tmp_path / "out"
    out.mkdir()
    save_file(_weights(2), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    _trainer_checkpoint(out / "checkpoint-1", 1)
    assert verify(out).ok
    lost = out / "checkpoint-2"
    lost.mkdir()
    (lost / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    torch.save({"step": 2}, lost / "optimizer.pt")
    report = verify(out)
    assert [p.path for p in report.problems] == [str(lost)]
    assert "not a checkpoint shardstream reads" in report.problems[0].message
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file(_weights(2), str(lost / name))  # the index lost
    assert [p.path for p in verify(out).problems] == [str(lost)]
    shutil.rmtree(lost)
    before = verify(out).unchecked_bytes  # the final model's, written without checksums
    adapter = out / "checkpoint-3"
    adapter.mkdir()
    save_file(_weights(3), str(adapter / "adapter_model.safetensors"))
    report = verify(out)
    size = (adapter / "adapter_model.safetensors").stat().st_size
    assert report.ok and report.unchecked_bytes == before + size


def test_a_sharded_trainer_checkpoint_takes_the_output_dirs_config(tmp_path):
    """The Trainer writes no config.json into a SHARDED_STATE_DICT checkpoint-N; save_model
    writes one into its output_dir, which merge then copies (it wrote weights alone)."""
    from shardstream.commands.merge import merge
    from shardstream.formats.dcp import config_dir_of

    out = tmp_path / "out"
    _trainer_checkpoint(out / "checkpoint-2", 2)
    model_dir = out / "checkpoint-2" / "pytorch_model_fsdp_0"
    assert config_dir_of(model_dir) is None
    (out / "config.json").write_text(json.dumps({"model_type": "tiny", "dtype": "float32"}))
    assert config_dir_of(model_dir) == out
    assert config_dir_of(tmp_path / "elsewhere" / "pytorch_model_fsdp_0") is None
    merge(out / "checkpoint-2", tmp_path / "merged")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "tiny"


def test_an_output_dirs_unchecked_bytes_count_its_checkpoints(tmp_path):
    """safetensors of checkpoint-N (the Trainer's FULL_STATE_DICT saves) carry no checksums:
    each alone was said as not checked, while verify of the output_dir holding them said
    nothing of them (unchecked_bytes counted the final model's at most)."""
    out = tmp_path / "out"
    for step in (5, 10):
        path = out / f"checkpoint-{step}"
        path.mkdir(parents=True)
        save_file(_weights(step), str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"model_type": "tiny"}))
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    each = verify(out / "checkpoint-5").unchecked_bytes
    assert each > 0
    report = verify(out)
    assert report.ok and report.steps == [5, 10] and report.unchecked_bytes == 2 * each
    save_file(_weights(10), str(out / "model.safetensors"))  # the final model beside them
    (out / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    assert verify(out).unchecked_bytes == 3 * each


def test_an_output_dir_of_peft_adapters_is_said_to_hold_them(tmp_path, capsys):
    """A Trainer's output_dir whose checkpoint-N hold a PEFT adapter alone: verify said 'not a
    checkpoint' without a word of the folders; each alone is explained."""
    from shardstream.cli import main

    out = tmp_path / "out"
    for step in (1, 2):
        path = out / f"checkpoint-{step}"
        path.mkdir(parents=True)
        save_file({"q.lora_A.weight": torch.ones(2, 4)}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert "checkpoint-1 (of 2 checkpoint-N) holds a PEFT adapter alone" in err, err


def test_a_checkpoint_n_linking_above_its_output_dir_is_said_not_walked(tmp_path):
    """``checkpoint-30 -> ..`` in an output_dir: verify said the link points outside, then
    walked the whole parent directory (its other folders' problems reported as this one's)."""
    out = tmp_path / "out"
    out.mkdir()
    save_file(_weights(2), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    neighbour = tmp_path / "neighbour"
    neighbour.mkdir()
    (neighbour / "model.safetensors").write_bytes(b"not safetensors")
    (out / "checkpoint-30").symlink_to("..")
    report = verify(out)
    assert [p.path for p in report.problems] == [str(out / "checkpoint-30")]
    assert "symlink points outside" in report.problems[0].message


def test_inspect_of_a_directory_of_step_named_checkpoints_describes_the_newest(tmp_path, capsys):
    """torchtitan's checkpoint/ of step-N folders, a Trainer's output_dir without its final
    model: verify read them all, inspect said only to pass one of them. It describes the
    newest finished one now, as for a run, and says which steps there are."""
    out = tmp_path / "out"
    for step in (5, 10):
        _trainer_checkpoint(out / f"checkpoint-{step}", step)
    _trainer_checkpoint(out / "checkpoint-15", 15, finished=False)
    info = describe(out)
    assert info["run"]["steps"] == [5, 10]
    assert info["run"]["named"] == str(out / "checkpoint-10")
    assert info["run"]["uncommitted"] == ["checkpoint-15"]
    assert info["path"] == str(out / "checkpoint-10")
    text = render(info)
    assert "checkpoints named for their steps, 5, 10; unfinished (ignored): checkpoint-15" in text
    assert "the newest, checkpoint-10" in text
    assert main(["inspect", str(out)]) == 0
    assert capsys.readouterr().out.strip() == text
