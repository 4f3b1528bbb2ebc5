"""storage/tree.py: walking and deleting trees of any depth, as os.walk and rmtree do."""

from __future__ import annotations

import os
import sys

from shardstream.storage.tree import remove_tree, walk


def _tree(root):
    (root / "b" / "c").mkdir(parents=True)
    (root / "a").mkdir()
    (root / "f").write_text("f")
    (root / "b" / "g").write_text("g")
    (root / "b" / "c" / "h").write_text("h")
    outside = root.parent / "outside"
    outside.mkdir()
    (outside / "kept").write_text("kept")
    os.symlink(outside, root / "link")
    return outside


def _listing(rows):
    return sorted((path, sorted(dirs), sorted(files)) for path, dirs, files in rows)


def test_walk_lists_what_os_walk_lists(tmp_path):
    _tree(tmp_path / "root")
    assert _listing(walk(tmp_path / "root")) == _listing(os.walk(tmp_path / "root"))


def test_walk_skips_pruned_folders(tmp_path):
    _tree(tmp_path / "root")
    seen = []
    for path, dirs, _ in walk(tmp_path / "root"):
        seen.append(path)
        dirs[:] = [d for d in dirs if d != "b"]
    assert str(tmp_path / "root" / "b") not in seen and str(tmp_path / "root" / "a") in seen


def test_a_tree_deeper_than_the_recursion_limit(tmp_path):
    deep = tmp_path / "root"
    deep.mkdir()
    for _ in range(1500):
        deep = deep / "a"
        os.mkdir(deep)
    (deep / "x").write_text("x")
    files = [os.path.join(p, f) for p, _, names in walk(tmp_path / "root") for f in names]
    assert files == [str(deep / "x")]
    remove_tree(tmp_path / "root")
    assert not (tmp_path / "root").exists()


def test_remove_tree_removes_links_and_not_what_they_lead_to(tmp_path):
    outside = _tree(tmp_path / "root")
    remove_tree(tmp_path / "root")
    assert not (tmp_path / "root").exists()
    assert (outside / "kept").read_text() == "kept"


def test_fsync_tree_reaches_any_depth_and_syncs_folders_after_their_contents(tmp_path, monkeypatch):
    from shardstream.storage import commit

    root = tmp_path / "root"
    _tree(root)
    deep = root
    for _ in range(sys.getrecursionlimit() + 50):
        deep = deep / "d"
        os.mkdir(deep)
    (deep / "last").write_text("x")
    folders = sorted(path for path, _, _ in walk(root))
    synced = []
    monkeypatch.setattr(commit, "fsync_dir", lambda path: synced.append(os.fspath(path)))
    try:
        commit.fsync_tree(root)
    finally:
        monkeypatch.undo()
        remove_tree(root)  # pytest's own clean-up of tmp_path recurses
    assert sorted(synced) == folders
    for i, path in enumerate(synced):
        assert not any(p.startswith(path + os.sep) for p in synced[i + 1 :]), path
