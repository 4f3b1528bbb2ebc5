"""What the CLI prints survives names no encoding holds."""

from shardstream import cli


def test_unprintable_characters_are_escaped_and_undecodable_bytes_kept():
    text = "a\ud800b" + b"\xff".decode("utf-8", "surrogateescape") + "c"
    assert text.encode("utf-8", cli.ESCAPING) == b"a\\ud800b\xffc"
