"""verl's merger flags as a verl user types them, prefixes included: argparse takes a unique
prefix of an option, and verl's parser has one spelling of each."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize(
    ("flag", "field", "value"),
    [
        (["--b", "fsdp"], "backend", "fsdp"),  # or --buffer-size, ours
        (["--p"], "private", True),  # or --prefix
        (["--pr"], "private", True),
        (["--hf", "me/m"], "hf_upload_path", "me/m"),  # or --hf_model_path
        (["--hf_=me/m"], "hf_upload_path", "me/m"),
    ],
)
def test_a_prefix_verl_takes_as_its_option_is_that_option(flag, field, value):
    """verl's parser has fewer options, so a prefix it reads as one of them was ambiguous
    here with an option of ours: exit 2 for a command line verl runs."""
    args = build_parser().parse_args(["merge", "--local_dir", "D", *flag])
    assert getattr(args, field) == value


def test_a_prefix_of_two_options_stays_ambiguous(capsys):
    with pytest.raises(SystemExit) as exc:  # --t: --target_dir or --tie-word-embedding
        build_parser().parse_args(["merge", "--local_dir", "D", "--t", "T"])
    assert exc.value.code == 2
    assert "ambiguous option: --t could match" in capsys.readouterr().err


@pytest.mark.parametrize("link", [False, True], ids=["path", "linked"])
@pytest.mark.parametrize("layout", ["global_step_1/actor", "run/global_step_1"])
def test_a_checkpoint_the_verl_plugin_wrote_is_merged_to_bf16_as_verl_does(
    tmp_path, capsys, layout, link
):
    """verl's merge command on a checkpoint the verl plug-in saved (shardstream's format in
    global_step_N/actor) writes bfloat16, as verl's merger would, and says what config.json
    names; a step of shardstream's own run keeps config.json's float32."""
    import torch
    from safetensors.torch import load_file

    import shardstream
    from shardstream.cli import main

    model = torch.nn.Linear(4, 4)
    shardstream.save(tmp_path / layout, model=model, step=1, contents=("model",))
    (tmp_path / "config").mkdir()
    config = {"architectures": ["TinyMLP"], "model_type": "tiny-mlp", "torch_dtype": "float32"}
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    local = tmp_path / layout
    if link:  # the same checkpoint through a link: the dtype must not depend on the spelling
        (tmp_path / "link").symlink_to(local)
        local = tmp_path / "link"
    args = ["merge", "--backend", "fsdp", "--local_dir", str(local)]
    args += ["--hf_model_path", str(tmp_path / "config")]
    assert main([*args, "--target_dir", str(tmp_path / "merged")]) == 0
    err = capsys.readouterr().err
    in_verl_run = layout == "global_step_1/actor"
    noted = "note: wrote bfloat16, as verl's merger does" in err and "names float32" in err
    assert noted == in_verl_run
    dtypes = {t.dtype for t in load_file(tmp_path / "merged" / "model.safetensors").values()}
    assert dtypes == {torch.bfloat16 if in_verl_run else torch.float32}


@pytest.mark.parametrize("command", ["inspect", "merge"])
def test_json_failure_is_json_too(tmp_path, capsys, command):
    """inspect --json and merge --json printed nothing on stdout when they failed: a script
    parsing their answer got an empty string."""
    from shardstream.cli import main

    missing = tmp_path / "missing"
    argv = {
        "inspect": ["inspect", "--json", str(missing)],
        "merge": ["merge", "--json", "--local_dir", str(missing), "--target_dir", str(tmp_path)],
    }[command]
    code = main(argv)
    out = capsys.readouterr()
    answer = json.loads(out.out)
    assert code == 1 and answer == {
        "ok": False,
        "error": f"{missing}: no such directory",
        "exit_code": 1,
    }
    assert f"shardstream {command}: error: {missing}: no such directory" in out.err


@pytest.mark.parametrize("command", ["verify", "test"])
def test_json_reports_that_fail_carry_error_and_exit_code(tmp_path, capsys, command):
    from shardstream.cli import main

    missing = tmp_path / "missing"
    argv = {
        "verify": ["verify", "--json", str(missing)],
        "test": ["test", "--json", "--local_dir", str(missing), "--test_hf_dir", str(tmp_path)],
    }[command]
    code = main(argv)
    answer = json.loads(capsys.readouterr().out)
    assert code == 1 and answer["ok"] is False and answer["exit_code"] == 1
    assert str(tmp_path) in answer["error"]  # the path it failed on


def test_a_bad_command_line_with_json_answers_json_too(capsys):
    from shardstream.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["merge", "--json", "--local_dir", "x", "--no-such-flag"])
    out = capsys.readouterr()
    assert exit_.value.code == 2
    answer = json.loads(out.out)
    assert answer["ok"] is False and answer["exit_code"] == 2
    assert "--no-such-flag" in answer["error"] and "--no-such-flag" in out.err
