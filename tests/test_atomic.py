"""keel.atomic: a failed write leaves the old file and no temp file; directories are published whole."""

from __future__ import annotations

import os
import stat

import pytest

from keel.atomic import atomic_file, fsync_tree, replace_dir, write_atomic, write_text_atomic


def test_write_replaces_the_file_readable_by_all(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    write_text_atomic(path, "new ü\n")
    assert path.read_text(encoding="utf-8") == "new ü\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write(b"half")
        raise RuntimeError("interrupted")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.bin"]


def test_replace_dir_publishes_a_finished_directory(tmp_path):
    src = tmp_path / ".model.tmp"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "weights.bin").write_bytes(b"w")
    os.symlink("config.json", src / "link")  # links are left alone by fsync_tree
    fsync_tree(src)
    replace_dir(src, tmp_path / "model")  # absent destination
    assert (tmp_path / "model" / "sub" / "weights.bin").read_bytes() == b"w"
    again = tmp_path / ".again.tmp"
    again.mkdir()
    (again / "a").write_text("a")
    (tmp_path / "empty").mkdir()
    replace_dir(again, tmp_path / "empty")  # an empty destination is replaced
    assert (tmp_path / "empty" / "a").read_text() == "a"
    assert not src.exists() and not again.exists()
