"""Speculative decoding: cheap drafts verified by the target model in one forward.

`SpeculativeConfig` takes vLLM's `speculative_config` keys; the engine proposes drafts (n-gram
lookup in `ngram`, or a draft model in `draft`) before a step, the runner feeds them after each
request's last token, and `verify` keeps what the target accepts (lossless: greedy output is the
plain greedy output, sampled tokens have plain sampling's distribution).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from keel.errors import KeelError

METHODS = ("ngram", "draft_model")

# Tokens one forward can take while it still costs about what one token costs (the step streams the
# weights once either way). CPU: measured with `python bench/speculative.py --sweep` (docs/BENCHMARKS.md,
# "Speculative decoding"). CUDA: an assumed value (not measured here): a GPU's decode step stays
# bandwidth-bound to a few hundred tokens.
BANDWIDTH_BOUND_TOKENS = {"cpu": 8, "cuda": 256}


@dataclass
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) | "draft_model"
    num_speculative_tokens: int = 4  # k: drafts verified per step
    prompt_lookup_min: int = 1  # ngram: shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    model: str | None = None  # draft_model: a path or catalog name; None: the target's own checkpoint
    # draft_model: quantize the draft ("int8", "int4"): a cheap copy of the target; unset: the draft's own storage
    # (`--quantize auto`: a GGUF file's blocks as stored, other checkpoints float)
    quantization: str | None = None
    # Speculation is off in a step when more requests than this are running: a batch that large
    # already keeps the matmuls busy, so drafts that get rejected cost real compute. None: the
    # device's rule, B * (k + 1) <= BANDWIDTH_BOUND_TOKENS (docs/SERVING.md).
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise KeelError(f"speculative config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise KeelError(f"speculative config: method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise KeelError(
                f"speculative config: num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise KeelError("speculative config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise KeelError("speculative config: disable_by_batch_size must be >= 1")
        if self.method == "ngram" and (self.model is not None or self.quantization is not None):
            raise KeelError("speculative config: 'model' and 'quantization' apply to method 'draft_model' only")
        if self.quantization not in (None, "int8", "int4"):
            raise KeelError(f"speculative config: quantization {self.quantization!r} is not int8 or int4")

    def max_batch(self, device_type: str) -> int:
        """The largest number of running requests that still speculates."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        tokens = BANDWIDTH_BOUND_TOKENS.get(device_type, BANDWIDTH_BOUND_TOKENS["cuda"])
        return max(1, tokens // (self.num_speculative_tokens + 1))
