"""N-gram (prompt lookup) drafting: copy what followed the last time the recent tokens appeared.

Editing code, answering with quotes from a document, or summarising with citations repeat long
spans of the context; when the last n tokens occurred before, the tokens that followed them then
are a good guess for what follows now (Saxena's prompt lookup decoding; vLLM's `ngram` method).
No model, no KV cache: the cost is a vectorised search over the request's tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` (from max_n down to min_n tokens long); [] when no suffix occurred before."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    fallback: list[int] = []
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        # Windows that end before the last token, so that a match is followed by at least one token.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if not hits.size:
            continue
        # The most recent occurrence is the likeliest to continue the same way; but one that ends just
        # before the suffix (inside a run of repeats) has only a token or two after it. Prefer the
        # longest suffix with an occurrence followed by k tokens; else the longest suffix's latest.
        full = hits[hits + n + k <= len(arr)]
        if full.size:
            start = int(full[-1]) + n
            return arr[start : start + k].tolist()
        if not fallback:
            start = int(hits[-1]) + n
            fallback = arr[start : start + k].tolist()
    return fallback
