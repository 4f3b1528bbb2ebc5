"""The README's commands and snippets work as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardstream.cli import build_parser

README = (Path(__file__).parents[2] / "README.md").read_text()


def documented_commands() -> list[list[str]]:
    """Every `shardstream ...` command line in the README's code blocks, continuations joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith(("shardstream ", "python -m shardstream ")):
            words = shlex.split(line.replace("python -m shardstream", "shardstream"))
            commands.append([w.strip("[]") for w in words[1:]])
    return commands


@pytest.mark.parametrize("argv", documented_commands(), ids=lambda a: a[0])
def test_readme_command_parses(argv):
    # Optional flags shown in [brackets] are included: everything must parse as documented.
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


def test_readme_lists_every_subcommand():
    assert {a[0] for a in documented_commands()} == {"merge", "inspect", "test", "verify"}


def test_readme_from_dict_snippet(tmp_path):
    from shardstream import CheckpointConfig

    snippet = re.search(r"`(CheckpointConfig\.from_dict\(.*?\))`", README, re.S)[1]
    scope = {
        "CheckpointConfig": CheckpointConfig,
        "checkpoint_section": {"save_contents": ["model"], "load_contents": ["model"]},
        "trainer": SimpleNamespace(default_local_dir=str(tmp_path)),
    }
    config = eval(snippet.replace("\n", " "), scope)
    assert config.save_interval == 1000 and config.keep_last == 3
    assert config.save_contents == ("model",) and config.directory == str(tmp_path)
