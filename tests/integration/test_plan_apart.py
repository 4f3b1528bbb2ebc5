"""The ``shardstream`` command plans a layout transformers must plan in a forked child
(``hf_names.PLAN_APART``): the command's own process never imports transformers, whose
modules would stay resident through the copy, and writes the same files as a merge planned
in-process; the child's refusals reach the user as the command's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardstream import merge
from shardstream.errors import CheckpointFormatError
from shardstream.testing.tiny_models import randomized

from .test_hf_layout import assert_same_model_files

transformers = pytest.importorskip("transformers")

# Run as the command runs (console_main), reporting at exit whether this process imported
# transformers; the forked child exits through os._exit too, under another pid.
COMMAND = """
import os, sys
from shardstream import cli
parent, exit_ = os.getpid(), os._exit
def report(code):
    if os.getpid() == parent:
        print("IMPORTED", "transformers" in sys.modules, file=sys.stderr, flush=True)
    exit_(code)
os._exit = report
sys.argv = ["shardstream", *sys.argv[1:]]
cli.console_main()
"""


def _moe_state(directory: Path, reference: Path | None = None) -> torch.nn.Module:
    """A tiny Qwen3-MoE's in-memory state dict (fused experts) and config in ``directory``."""
    from safetensors.torch import save_file

    config = transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = randomized(transformers.Qwen3MoeForCausalLM(config))
    if reference is not None:
        model.save_pretrained(reference)
    directory.mkdir()
    state = {n: t.contiguous().clone() for n, t in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)  # as verl's huggingface/ folder holds
    return model


def _command(tmp_path: Path, *argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDSTREAM_CACHE_DIR": str(tmp_path / "cache")}  # cold: planned now
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-c", COMMAND, *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_the_command_plans_in_a_child_and_writes_what_save_pretrained_writes(tmp_path):
    _moe_state(tmp_path / "state", tmp_path / "reference")
    done = _command(tmp_path, "merge", "--local_dir", tmp_path / "state", "--target_dir",
                    tmp_path / "merged", "--dtype", "float32", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "IMPORTED False" in done.stderr
    summary = json.loads(done.stdout)
    assert summary["layout"].startswith("transformers ") and "split into" in summary["layout"]
    assert_same_model_files(tmp_path / "merged", tmp_path / "reference")
    # the plan the child made was kept: a second merge reads it, and writes the same
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    again = _command(tmp_path, "merge", "--local_dir", tmp_path / "state", "--target_dir",
                     tmp_path / "again", "--dtype", "float32")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert_same_model_files(tmp_path / "again", tmp_path / "reference")


def test_a_refusal_in_the_child_is_the_commands_own(tmp_path):
    """The trace refuses a stored tensor of another shape than the model's: the command
    exits as an in-process merge raises, with the same message naming the tensor."""
    from safetensors.torch import load_file, save_file

    _moe_state(tmp_path / "state")
    state = load_file(tmp_path / "state" / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    state[name] = state[name][:, :, :4].contiguous()
    save_file(state, str(tmp_path / "state" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError) as raised:
        merge(tmp_path / "state", tmp_path / "in-process")
    done = _command(tmp_path, "merge", "--local_dir", tmp_path / "state", "--target_dir",
                    tmp_path / "merged")  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert name in str(raised.value)
    assert str(raised.value) in done.stderr
    assert not (tmp_path / "merged").exists()


def test_inspect_plans_in_a_child_too(tmp_path):
    _moe_state(tmp_path / "state")
    done = _command(tmp_path, "inspect", tmp_path / "state")
    assert done.returncode == 0, done.stderr
    assert "IMPORTED False" in done.stderr
    assert "fused tensors split into" in done.stdout
