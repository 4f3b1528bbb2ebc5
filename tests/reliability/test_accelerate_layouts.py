"""accelerate layouts no reader takes whole, said plainly. ``save_state`` without FSDP of two
models prepared together (model 0 as save_pretrained writes it, model 1 as
``model_1.safetensors`` or ``pytorch_model_1.bin``): merge and inspect name both and ask for
one, restore refuses before touching the model, verify checks model 1's file too. FSDP1's
LOCAL_STATE_DICT (``pytorch_model_fsdp_rankR.bin``): refused by name everywhere, and verify
does not call it OK."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardstream
from shardstream.commands.verify import verify
from shardstream.errors import ShardstreamError, UsageError
from shardstream.formats.torch_pt import zip_records

from .test_hostile_hf_source import _refused

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

CONFIG = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, vocab_size=64,
)  # fmt: skip


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    first = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG))
    second = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    return first, second


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Both layouts, from one accelerator: ``safetensors/`` and ``bin/``."""
    root = tmp_path_factory.mktemp("two-models")
    accelerator = accelerate.Accelerator(cpu=True)
    first, second = accelerator.prepare(*_models())
    accelerator.save_state(str(root / "safetensors"))
    accelerator.save_state(str(root / "bin"), safe_serialization=False)
    return root


@pytest.mark.parametrize(("layout", "second"), [("safetensors", "model_1.safetensors"),
                                                  ("bin", "pytorch_model_1.bin")])  # fmt: skip
def test_merge_and_inspect_name_both_models(saved, tmp_path, capsys, layout, second):
    source = tmp_path / layout
    shutil.copytree(saved / layout, source)
    assert (source / second).is_file()
    for command in ("merge", "inspect"):
        _refused(capsys, source, tmp_path, "holds 2 models saved without FSDP", second,
                 command=command)  # fmt: skip


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_restore_refuses_before_touching_the_model(saved, layout):
    model = _models()[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError, match="holds 2 models saved without FSDP"):
        shardstream.load(saved / layout, model=model, contents=("model",))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_verify_checks_the_second_model(saved, tmp_path):
    source = tmp_path / "bin"
    shutil.copytree(saved / "bin", source)
    assert verify(source).ok
    damaged = source / "pytorch_model_1.bin"
    record = next(r for r in zip_records(str(damaged)) if "/data/" in r.name)
    data = bytearray(damaged.read_bytes())
    data[record.start] ^= 0x40
    damaged.write_bytes(bytes(data))
    report = verify(source)
    assert not report.ok
    assert any("pytorch_model_1.bin" in p.line() for p in report.problems), report.problems


def test_local_state_dict_is_named_not_mistaken_for_its_optimizer(tmp_path, capsys):
    """Beside its rank files, the directory's optimizer_0/ is a DCP checkpoint: merge pointed
    there and verify checked it alone and said OK."""
    import torch.distributed.checkpoint as dcp

    source = tmp_path / "state"
    source.mkdir()
    for rank in (0, 1):
        torch.save({"flat": torch.zeros(8)}, source / f"pytorch_model_fsdp_rank{rank}.bin")
        torch.save({"torch": torch.get_rng_state()}, source / f"random_states_{rank}.pkl")
    dcp.save({"optimizer": {"state": {"w": torch.ones(2)}}}, checkpoint_id=source / "optimizer_0",
             no_dist=True)  # fmt: skip
    for command in ("merge", "inspect"):
        _refused(capsys, source, tmp_path, "LOCAL_STATE_DICT", "pytorch_model_fsdp_rank0.bin",
                 command=command)  # fmt: skip
    report = verify(source)
    assert not report.ok and "LOCAL_STATE_DICT" in report.problems[0].line()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ShardstreamError, match="LOCAL_STATE_DICT"):
        shardstream.load(source, model=model, contents=("model",))
