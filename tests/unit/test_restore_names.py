"""Saved names with wrapper prefixes, renamed to the live FQNs a restore matches (pure)."""

from __future__ import annotations

import pytest
import torch

from shardstream.errors import CheckpointFormatError
from shardstream.training.load import _renamed_optimizer, _unwrapper


def test_wrapper_parts_and_a_ddp_prefix_on_every_key_are_dropped():
    saved = ["module._orig_mod.a.weight", "module.b._checkpoint_wrapped_module.w"]
    unwrap = _unwrapper(saved, None)
    assert unwrap("module._orig_mod.a.weight") == "a.weight"
    assert unwrap("module.b._checkpoint_wrapped_module.w") == "b.w"


def test_a_ddp_prefix_under_a_compiled_wrapper_is_dropped_too():
    """torch.compile(DDP(model)).state_dict() names every key ``_orig_mod.module.*``."""
    saved = ["_orig_mod.module.a.weight", "_orig_mod.module.b.w"]
    unwrap = _unwrapper(saved, None)
    assert [unwrap(n) for n in saved] == ["a.weight", "b.w"]


def test_names_without_wrappers_are_kept():
    unwrap = _unwrapper(["module.a", "b"], None)  # not every key: a module named "module"
    assert unwrap("module.a") == "module.a"


def test_a_live_model_whose_names_start_with_module_keeps_them():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    unwrap = _unwrapper(["module._orig_mod.weight", "module._orig_mod.bias"], Outer())
    assert unwrap("module._orig_mod.weight") == "module.weight"


def test_two_names_that_become_one_are_refused():
    with pytest.raises(CheckpointFormatError, match="'_orig_mod.a'.*'a'"):
        _unwrapper(["a", "_orig_mod.a"], None)


def test_an_optimizer_saved_under_wrapped_names_is_renamed():
    unwrap = _unwrapper(["_orig_mod.a", "_orig_mod.b"], None)
    flat = {"state._orig_mod.a.exp_avg": 1, "param_groups._orig_mod.a.lr": 0.1, "other": 2}
    assert _renamed_optimizer(flat, unwrap, unwrap) == {
        "state.a.exp_avg": 1, "param_groups.a.lr": 0.1, "other": 2,
    }  # fmt: skip
    nested = {"state": {"_orig_mod.a": {"step": 1}}}
    nested["param_groups"] = [{"params": ["_orig_mod.a", 0]}]
    assert _renamed_optimizer(nested, unwrap, unwrap) == {
        "state": {"a": {"step": 1}}, "param_groups": [{"params": ["a", 0]}],
    }  # fmt: skip


def test_peft_weights_saved_without_the_adapter_name_find_the_live_ones():
    from shardstream.training.load import _adapter_names

    live = ["m.q.base_layer.weight", "m.q.lora_A.default.weight", "m.q.lora_B.default.weight",
            "m.e.lora_embedding_A.default", "m.q.lora_magnitude_vector.default.weight"]  # fmt: skip
    saved = ["m.q.lora_A.weight", "m.q.lora_B.weight", "m.e.lora_embedding_A",
             "m.q.lora_magnitude_vector.weight"]  # fmt: skip
    assert _adapter_names(live, saved) == {
        "m.q.lora_A.weight": "m.q.lora_A.default.weight",
        "m.q.lora_B.weight": "m.q.lora_B.default.weight",
        "m.e.lora_embedding_A": "m.e.lora_embedding_A.default",
        "m.q.lora_magnitude_vector.weight": "m.q.lora_magnitude_vector.default.weight",
    }
    assert _adapter_names(live, ["m.q.lora_A.default.weight"]) == {}  # saved as live: as is
    two = ["m.q.lora_A.first.weight", "m.q.lora_A.second.weight"]
    assert _adapter_names(two, ["m.q.lora_A.weight"]) == {}  # which adapter: unknown


def test_param_groups_of_another_model_name_the_parameter_one_side_lacks(tmp_path):
    """A model one layer deeper than the saved one: DCP's nested param groups then differ in
    size, which was said as "(1 saved, 1 live)" groups, blaming the optimizer."""
    from shardstream.training.load import _check_group_sizes

    saved = [{"lr": 0.1, "params": ["a.weight", "b.weight"]}]
    deeper = [{"params": ["a.weight", "b.weight", "c.weight"]}]
    with pytest.raises(CheckpointFormatError) as raised:
        _check_group_sizes(tmp_path, saved, deeper)
    assert str(raised.value) == (
        f"{tmp_path}: param group 0 holds 2 parameters saved, 3 live: no saved state of live "
        "parameter 'c.weight' (1 missing, 0 unexpected); was it saved from a different model?"
    )
    with pytest.raises(CheckpointFormatError, match="saved state of 'b.weight', which the live"):
        _check_group_sizes(tmp_path, saved, [{"params": ["a.weight"]}])
    with pytest.raises(CheckpointFormatError, match="param groups: 1 saved, 2 live"):
        _check_group_sizes(tmp_path, saved, [*deeper, {"params": []}])
    _check_group_sizes(tmp_path, saved, [{"params": ["a.weight", "b.weight"]}])


@pytest.mark.parametrize("change", ["unfrozen", "frozen", "other"])
def test_param_groups_that_differ_from_the_live_ones_say_how(change):
    """Parameters frozen (left out of the optimizer) when saved and trainable at restore: the
    refusal asked whether the checkpoint came from a different model."""
    from shardstream.errors import CheckpointFormatError
    from shardstream.training.state import check_param_groups

    saved_params = {"unfrozen": ["a", "b"], "frozen": ["a", "b", "c", "d"], "other": ["a", "x"]}
    saved = [{"lr": 0.1, "params": saved_params[change]}]
    live = [{"lr": 0.1, "params": ["a", "b", "c"]}]
    with pytest.raises(CheckpointFormatError) as refused:
        check_param_groups(live, saved, {"lr"})
    said = str(refused.value)
    expected = {
        "unfrozen": "now holds parameters it did not hold when saved",
        "frozen": "now lacks parameters it held when saved",
        "other": "was it saved from a different model?",
    }
    assert expected[change] in said, said
