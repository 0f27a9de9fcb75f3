"""Where keel keeps what it downloads or builds once and reuses: every cache path is computed here.

The root is `cache_dir` when a caller passes one, else `$KEEL_CACHE`, else `~/.cache/keel`; the
prepared text corpora live in `<root>/corpora` and torch.compile's (inductor's) generated code in
`<root>/inductor/<CPU level>-<vector ISA>` (`inductor_cache_dir`).
"""

from __future__ import annotations

import os
from pathlib import Path

# Whether the user chose inductor's cache directory (read at import: compiling can make torch fill in
# its default /tmp one).
_USER_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" in os.environ


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
    """torch.compile's generated code (the compiled decode step, compiled training blocks), in a
    directory of its own per host class (`Platform.generated_code_key`). Why: inductor's cache keys leave
    out the vector ISA its C++ was generated for, which ATEN_CPU_CAPABILITY changes between two runs on
    one machine (make test's forced-AVX2 leg) and which differs between machines sharing a home
    directory. A graph generated for 8-lane AVX2 vectors, loaded and compiled for 16-lane AVX-512 ones,
    stores whole vectors past the ends of its buffers: it corrupted the heap of a later process."""
    from keel.platform import host

    return cache_root() / "inductor" / host().generated_code_key


def use_inductor_cache_dir() -> None:
    """Point torch.compile's caches in this process at `inductor_cache_dir()`, unless the user set
    TORCHINDUCTOR_CACHE_DIR (then theirs is used as it is). Called before keel compiles anything."""
    if not _USER_INDUCTOR_CACHE:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
