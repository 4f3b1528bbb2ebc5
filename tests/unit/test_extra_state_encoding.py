"""Extra state (``CheckpointManager.save(extra=...)``) is kept as JSON, with tensors, tuples and
non-finite floats tagged by keys of its own: a user's dict that spells those keys, or holds both
``1`` and ``"1"``, came back as another value (a tuple, a float, a dict without one key) or
failed to save."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardstream.training.state import decode, encode


@pytest.mark.parametrize(
    "value",
    [
        {"sampler": {"__tuple__": [1, 2]}},
        {"meta": {"__float__": "nan", "note": "a user's dict"}},
        {"meta": {"__tensor__": "my-id"}},
        {"meta": {"__inline_tensor__": "x"}},
        {"meta": {"__int_keys__": ["a"], "a": 1}},
        {"meta": {"__int_keys__": "abc", 5: "x"}},
        {"meta": {"__dict__": [["a", 1, False]]}},
        {"meta": {1: "one", "1": "the string one"}},
        {"meta": {"numpy": True, "x": 1}},
        {"plain": {1: (2, 3.5), "k": [float("inf"), None]}},
    ],
)
def test_extra_state_comes_back_as_saved(value):
    tensors: dict[str, torch.Tensor] = {}
    back = decode(json.loads(json.dumps(encode(value, tensors))), tensors)
    assert back == value and [type(k) for k in back] == [type(k) for k in value]
    inner = next(iter(value.values()))
    assert [type(k) for k in next(iter(back.values()))] == [type(k) for k in inner]


def test_tensors_and_non_finite_floats_inside_a_dict_with_tag_keys():
    tensors: dict[str, torch.Tensor] = {}
    value = {"__tuple__": torch.arange(3), "f": float("-inf"), 2: (1,)}
    back = decode(json.loads(json.dumps(encode(value, tensors))), tensors)
    assert torch.equal(back["__tuple__"], torch.arange(3))
    assert math.isinf(back["f"]) and back["f"] < 0 and back[2] == (1,)
