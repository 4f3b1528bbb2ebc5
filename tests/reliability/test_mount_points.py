"""Targets that are, or hold, mount points (root only: bind mounts).

``--overwrite`` replaced an old output holding a bind mount of the checkpoint and deleted the
checkpoint through it; a target that is itself a mount point was written whole beside it and
then failed with "Device or resource busy"."""

from __future__ import annotations

import os

from shardstream.cli import main

from .mounts import bind_mount


def _merge(capsys, local, target, *extra) -> tuple[int, str]:
    code = main(
        ["merge", "--local_dir", str(local), "--target_dir", str(target), "--quiet", *extra]
    )
    return code, capsys.readouterr().err


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_overwrite_leaves_what_a_mount_inside_the_old_target_holds(capsys, copy_variant, tmp_path):
    ckpt = copy_variant("base")
    before = _files(ckpt)
    target = tmp_path / "out" / "merged"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("old")
    with bind_mount(ckpt, target / "mounted"):
        code, err = _merge(capsys, ckpt, target, "--overwrite")
        assert code == 0, err
        assert (target / "model.safetensors").is_file() and not (target / "old.txt").exists()
        assert _files(ckpt) == before  # nothing deleted through the mount
        # the old output is left where the swap put it, with the mount and what it holds
        (aside,) = [p for p in target.parent.iterdir() if ".tmp-" in p.name and p.is_dir()]
        assert _files(aside / "mounted") == before
    assert _files(ckpt) == before


def test_a_target_that_is_a_mount_point_is_refused_before_writing(capsys, copy_variant, tmp_path):
    ckpt = copy_variant("base")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "README.md").write_text("kept")
    target = tmp_path / "out" / "merged"
    with bind_mount(elsewhere, target):
        for extra in ((), ("--overwrite",)):
            code, err = _merge(capsys, ckpt, target, *extra)
            assert code == 2 and f"target {target} is a mount point" in err, err
            assert os.listdir(target) == ["README.md"]
            assert os.listdir(target.parent) == ["merged"]
