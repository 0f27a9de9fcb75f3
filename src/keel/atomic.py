"""Atomic file writes: a temp file in the same directory, flushed to disk, then renamed over the
target, so a reader (or a crash) sees the old file or the whole new one, never half of it.

A directory cannot be written that way; one built as a temp sibling is published by `replace_dir`
(or by renames of its own after `fsync_tree`), its files and entries flushed to disk before the
rename and the parent's entry after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def _temp_beside(path: Path) -> tuple[int, str]:
    """A temp file in `path`'s directory; where none can be made (no such directory, a file in its place, no
    permission) the error names `path`, the file the caller asked for, not the temp name."""
    try:
        return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: renamed over it, flushed to disk, when the block ends;
    on an error the temp file is removed and `path` is left as it was."""
    fd, tmp_name = _temp_beside(path)
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; written files should be readable like any other
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def write_through(path: Path, write: Callable[[str], None]) -> None:
    """`write(temp path)`, an exporter that takes a file name (torch's Chrome trace, a memory snapshot), published
    atomically at `path`. An exporter that reports a failure without raising (torch's trace export logs it) leaves
    no file: that is an OSError naming `path` here."""
    fd, tmp = _temp_beside(path)
    os.close(fd)
    try:
        os.unlink(tmp)  # the exporter creates the file; its absence afterwards means it failed
        write(tmp)
        if not os.path.exists(tmp):
            raise OSError(f"could not write {path}", path)
        write_atomic(path, Path(tmp).read_bytes())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_text_atomic(path: Path, text: str, encoding: str = "utf-8") -> None:
    write_atomic(path, text.encode(encoding))


def write_json_atomic(path: Path, obj: object, indent: int = 2, **dumps_options: object) -> None:
    """`obj` as JSON (and a final newline), written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, **dumps_options) + "\n")


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (the names created, renamed or removed in it) to disk; on a file path, the
    file's contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then every directory (the deepest first, `root` last), to disk."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            file = Path(directory, name)
            if not file.is_symlink():
                fsync_dir(file)
        fsync_dir(Path(directory))


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished directory `src` over `dst` (absent, or an empty directory) durably."""
    fsync_tree(src)
    os.replace(src, dst)
    fsync_dir(dst.parent)
