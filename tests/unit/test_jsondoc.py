"""The strict JSON reader: what JSON allows but no checkpoint document holds is refused."""

import json

import pytest

from shardstream.errors import CheckpointFormatError
from shardstream.formats import jsondoc

LIMIT = jsondoc.MAX_INT_DIGITS


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
@pytest.mark.parametrize("sign", ["", "-"])
def test_an_integer_of_more_digits_than_the_limit_is_refused(encoding, sign):
    raw = f'{{"n": {sign}{"9" * (LIMIT + 1)}}}'
    refused = f"config.json: holds an integer of {LIMIT + 1} digits"
    with pytest.raises(CheckpointFormatError, match=refused):
        jsondoc.loads(raw.encode(encoding), "config.json")
    with pytest.raises(CheckpointFormatError, match="integer"):
        jsondoc.loads(raw, "config.json")


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16"])
def test_integers_up_to_the_limit_and_long_digit_strings_are_read(encoding):
    doc = {"n": int("9" * LIMIT), "m": -int("9" * LIMIT), "digest": "1" * 64, "x": [1, 2.5]}
    assert jsondoc.loads(json.dumps(doc).encode(encoding), "config.json") == doc
    assert jsondoc.loads(json.dumps(doc), "config.json") == doc


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_refused(text):
    with pytest.raises(CheckpointFormatError, match="config.json: holds"):
        jsondoc.loads(f'{{"a": {text}, "b": 1}}'.encode(), "config.json")
