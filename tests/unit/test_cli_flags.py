"""verl's merger flags as a verl user types them, prefixes included: argparse takes a unique
prefix of an option, and verl's parser has one spelling of each."""

from __future__ import annotations

import pytest

from shardstream.cli import build_parser


def test_a_prefix_of_one_option_is_that_option():
    """``--local`` matched both spellings of --local_dir and was refused as ambiguous; verl
    takes it."""
    args = build_parser().parse_args(
        ["merge", "--backend", "fsdp", "--local", "D", "--target", "T"]
    )
    assert (args.local_dir, args.target_dir) == ("D", "T")
    args = build_parser().parse_args(["merge", "--local-d", "D", "--hf_model", "H"])
    assert (args.local_dir, args.hf_model_path) == ("D", "H")


def test_a_prefix_of_two_options_stays_ambiguous(capsys):
    with pytest.raises(SystemExit) as exc:  # --t: --target_dir or --tie-word-embedding
        build_parser().parse_args(["merge", "--local_dir", "D", "--t", "T"])
    assert exc.value.code == 2
    assert "ambiguous option: --t could match" in capsys.readouterr().err
