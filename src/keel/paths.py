"""Where keel keeps what it downloads or builds once and reuses: every cache path is computed here.

The root is `cache_dir` when a caller passes one, else `$KEEL_CACHE`, else `~/.cache/keel`; the
prepared text corpora live in `<root>/corpora` and torch.compile's (inductor's) generated code in
`<root>/inductor`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: Path | None = None) -> Path:
    """keel's cache directory: `cache_dir`, else $KEEL_CACHE, else ~/.cache/keel."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("KEEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "keel"


def corpora_dir(cache_dir: Path | None = None) -> Path:
    """The prepared text corpora (keel.data.corpora)."""
    return cache_root(cache_dir) / "corpora"


def inductor_cache_dir() -> Path:
    """torch.compile's generated code for the compiled decode step (keel.serve.compiled_decode)."""
    return cache_root() / "inductor"
