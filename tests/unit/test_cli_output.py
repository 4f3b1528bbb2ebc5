"""What the CLI prints survives names no encoding holds."""

from shardstream import cli


def test_unprintable_characters_are_escaped_and_undecodable_bytes_kept():
    text = "a\ud800b" + b"\xff".decode("utf-8", "surrogateescape") + "c"
    assert text.encode("utf-8", cli.ESCAPING) == b"a\\ud800b\xffc"


def test_an_error_naming_a_path_with_control_characters_stays_one_line(tmp_path, capsys):
    """A newline in a path broke the one-line error format; an escape sequence in a name
    reached the terminal as a command."""
    missing = tmp_path / "run\nshardstream merge: ok\x1b[2J"
    escaped = "run\\nshardstream merge: ok\\x1b[2J"
    code = cli.main(["merge", "--local_dir", str(missing), "--target_dir", str(tmp_path / "o")])
    lines = capsys.readouterr().err.splitlines()
    assert code != 0 and len(lines) == 1, lines
    assert lines[0].startswith("shardstream merge: error: ") and escaped in lines[0], lines
    code = cli.main(["verify", "--quiet", str(missing)])
    lines = capsys.readouterr().err.splitlines()
    assert code != 0 and len(lines) == 1 and escaped in lines[0], lines
