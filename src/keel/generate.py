"""Single-sequence generation with a contiguous KV cache (`keel generate`, the decode benchmark).

The serving engine (paged cache, continuous batching) replaces this for many requests; this is
the simplest correct path: one prefill, then one token per forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from keel.errors import KeelError
from keel.model.cache import ContiguousKVCache
from keel.model.transformer import Transformer


@dataclass
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise KeelError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise KeelError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KeelError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise KeelError(f"--top-k must be >= 0, got {self.top_k}")


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """logits [B, V] -> token ids [B]."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # from the first generated token to the last
    finish_reason: str = ""  # "stop" (EOS) or "length"
    token_ids: list[int] = field(default_factory=list)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.generated_tokens - 1  # the first token comes out of the prefill
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


@torch.inference_mode()
def stream_tokens(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: list[int] | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids one at a time (prefill once, then KV-cached decode)."""
    params.validate()
    context = model.config.max_position_embeddings
    if not prompt_ids:
        raise KeelError("the prompt is empty")
    if len(prompt_ids) >= context:
        raise KeelError(f"prompt has {len(prompt_ids)} tokens; the model's context is {context} tokens")
    max_new = min(params.max_tokens, context - len(prompt_ids))
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    eos = set() if params.ignore_eos else set(eos_token_ids or [])
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)

    device = model.device
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + max_new, model.dtype, device)
    tokens = torch.tensor([prompt_ids], device=device)
    start = time.perf_counter()
    logits = model(tokens, positions=torch.arange(len(prompt_ids), device=device)[None], cache=cache, last_only=True)
    token = int(sample(logits[:, -1], params, generator))
    stats.prefill_seconds = time.perf_counter() - start
    decode_start = time.perf_counter()
    position = len(prompt_ids)
    while True:
        stats.generated_tokens += 1
        stats.token_ids.append(token)
        stats.decode_seconds = time.perf_counter() - decode_start
        yield token
        if token in eos:
            stats.finish_reason = "stop"
            return
        if stats.generated_tokens >= max_new:
            stats.finish_reason = "length"
            return
        step = torch.tensor([[token]], device=device)
        logits = model(step, positions=torch.tensor([[position]], device=device), cache=cache, last_only=True)
        token = int(sample(logits[:, -1], params, generator))
        position += 1
