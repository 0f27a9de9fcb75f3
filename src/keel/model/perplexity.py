"""Perplexity of token sequences under a model: one window (`perplexity`, `perplexity_of_logits`), and
sliding windows over a whole corpus (`sliding_window_perplexity`, what `keel eval ppl` reports).

It lives in keel.model because it needs nothing but a model and token ids: the quantization layer's
sensitivity analysis (keel.quant) and the evaluation tools (keel.eval) both measure with it.

Sliding windows are computed the way transformers' perplexity guide and lm-eval's rolling
log-likelihood compute them. The corpus is one token sequence. Windows of `context` tokens advance by
`stride` tokens (at most context - 1: each window's first scored token keeps one token of prefix);
each window scores only the tokens the previous window did not (its last `stride`), with the
`context - stride` tokens before them as context. Every token but the first (which has no prefix) is
scored exactly once. With stride == context the windows do not overlap (cheapest, least context); a
smaller stride gives each scored token more context at the cost of recomputing the overlap.
Deterministic: one forward per window, float32 log-softmax, no sampling.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from keel.errors import KeelError
from keel.model.loss import cross_entropy_loss
from keel.model.transformer import Transformer
from keel.tokenizer import Tokenizer


@torch.inference_mode()
def perplexity(model: Transformer, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of tokens 1..N-1 given their prefixes), in one window."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    if len(token_ids) > model.config.max_position_embeddings:
        raise ValueError(f"{len(token_ids)} tokens exceed the context of {model.config.max_position_embeddings}")
    tokens = torch.tensor([token_ids], device=model.device)
    return perplexity_of_logits(model(tokens), tokens)


def perplexity_of_logits(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """The same from logits [B, N, V] already computed for tokens [B, N]."""
    return math.exp(cross_entropy_loss(logits[:, :-1], tokens[:, 1:]).item())


@dataclass
class PerplexityResult:
    tokens_scored: int
    windows: int
    nll_sum: float
    seconds: float
    context: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_scored / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_nll": self.mean_nll,
            "perplexity": self.perplexity,
            "tokens_per_s": self.tokens_per_s,
        }


def leading_tokens(tokenizer: Tokenizer, text: str, n: int | None) -> list[int]:
    """The first n tokens of `text` (all with n None) without tokenising a whole corpus for a slice:
    a prefix of 8 characters per token is tokenised first (tokens near its end may differ from the
    whole text's, so it is only used when it yields twice the tokens needed)."""
    if n is not None and len(text) > 8 * n:
        ids = tokenizer.encode(text[: 8 * n])
        if len(ids) >= 2 * n:
            return ids[:n]
    ids = tokenizer.encode(text)
    return ids if n is None else ids[:n]


def check_window_options(context: int, stride: int) -> None:
    if context < 2:
        raise KeelError(f"--context must be >= 2, got {context}")
    if not 1 <= stride <= context:
        raise KeelError(f"--stride must be between 1 and --context ({context}), got {stride}")


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) per window: tokens [begin, end) are fed and the last `scored` of them
    are predicted, each from the tokens before it in the window. The first window scores its
    tokens 1..end-1; every later one scores the next min(stride, context - 1) tokens with the
    window filled up to `context` tokens of context before them (so stride == context, "no
    overlap", still gives each window's first scored token one token of prefix)."""
    check_window_options(context, stride)
    if num_tokens < 2:
        raise KeelError(f"the corpus has {num_tokens} token(s); perplexity needs at least 2")
    end = min(context, num_tokens)
    result = [(0, end, end - 1)]
    step = min(stride, context - 1)
    while end < num_tokens:
        new_end = min(end + step, num_tokens)
        result.append((max(0, new_end - context), new_end, new_end - end))
        end = new_end
    return result


@torch.inference_mode()
def sliding_window_perplexity(
    model: Transformer,
    token_ids: list[int],
    context: int = 1024,
    stride: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of `token_ids` under `model` (see the module docstring)."""
    if context > model.config.max_position_embeddings:
        raise KeelError(f"--context {context} exceeds the model's context of {model.config.max_position_embeddings}")
    plan = windows(len(token_ids), context, stride)
    ids = torch.tensor(token_ids, device=model.device)
    nll_sum, scored_total = 0.0, 0
    start = time.perf_counter()
    for i, (begin, end, scored) in enumerate(plan):
        tokens = ids[begin:end][None]
        # Logits only where a scored token is predicted: positions end-scored-1 .. end-2.
        first = end - begin - scored - 1
        select = torch.arange(first, end - begin - 1, device=model.device)
        logits = model(tokens, select=select).float()
        targets = ids[begin + first + 1 : end]
        nll_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        scored_total += scored
        if progress is not None:
            progress(i + 1, len(plan))
    seconds = time.perf_counter() - start
    return PerplexityResult(scored_total, len(plan), nll_sum, seconds, context, stride)
