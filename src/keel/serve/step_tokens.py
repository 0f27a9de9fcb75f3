"""Tokens per engine step, kept as histogram bucket counts (vLLM's `vllm:iteration_tokens_total`).

The engine observes one value per step that ran the model; the metrics endpoint reads a copy of the counts
from the snapshot the engine thread publishes after each step. Counts, not a list of values: memory stays
fixed however long the server runs, and nothing has to drain it between scrapes.
"""

from __future__ import annotations

from bisect import bisect_left

# vLLM's buckets for iteration_tokens_total (vllm/v1/metrics/loggers.py).
ITERATION_TOKENS_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenHistogram:
    """Observations per bucket (the last one is +Inf), not cumulative, and their sum."""

    def __init__(self, bounds: tuple[int, ...] = ITERATION_TOKENS_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0

    def observe(self, value: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus' `le`
        self.sum += value
