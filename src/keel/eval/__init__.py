"""Evaluation: `keel eval ppl` (sliding-window perplexity over a corpus)."""
