"""Sizes: ``parse_size`` agrees with transformers' ``convert_file_size_to_int``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.hub import convert_file_size_to_int

from shardstream.errors import UsageError
from shardstream.units import format_size, parse_size

# Every unit transformers accepts; case is drawn at random below.
UNITS = ["GiB", "MiB", "KiB", "GB", "MB", "KB"]


@st.composite
def transformers_sizes(draw) -> str:
    number = draw(st.integers(0, 10**22))
    unit = draw(st.sampled_from(UNITS))
    cased = "".join(draw(st.sampled_from([c.lower(), c.upper()])) for c in unit)
    return f"{number}{cased}"


@settings(max_examples=300, deadline=None)
@given(transformers_sizes())
def test_parse_size_matches_transformers(text):
    assert parse_size(text) == convert_file_size_to_int(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("5Gb", 5 * 10**9 // 8),  # lower-case b: bits
        ("5gb", 5 * 10**9 // 8),
        ("5gB", 5 * 10**9),
        ("5gib", 5 * 2**30),
        ("64MiB", 64 * 2**20),
        ("7Kb", 875),
        ("10MB", 10**7),
        ("123456789123GB", 123456789123 * 10**9),  # exact beyond float precision
    ],
)
def test_parse_size_examples(text, expected):
    assert parse_size(text) == expected == convert_file_size_to_int(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1.5GB", 1_500_000_000),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("4096", 4096),
        ("512B", 512),
        (" 5 GB ", 5 * 10**9),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size_extensions(text, expected):
    """Beyond transformers: fractions, TB, bare numbers, bytes, spaces, ints."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "5XB", "5 G B", "-5GB", "5GBs", "five", "5iB", "1e3GB"])
def test_parse_size_rejects_garbage(bad):
    with pytest.raises(UsageError, match="invalid size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", [-1, True, False])
def test_parse_size_rejects_negative_and_bool(bad):
    with pytest.raises(UsageError, match="invalid size"):
        parse_size(bad)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (64 * 2**20, "64.00 MiB"),
        (5 * 2**40, "5.00 TiB"),
    ],
)
def test_format_size(n, text):
    assert format_size(n) == text


def test_format_size_caps_at_tib():
    assert format_size(3 * 2**50) == "3072.00 TiB"
