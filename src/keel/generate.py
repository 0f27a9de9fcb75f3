"""Single-sequence generation with a contiguous KV cache: the reference path.

One prefill, then one token per forward, with the engine's sampler. The serving engine (paged
cache, continuous batching) is what `keel generate` and the server use; this path is the
baseline the engine is tested against and the decode benchmark's subject.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from keel.errors import KeelError
from keel.model.cache import ContiguousKVCache
from keel.model.transformer import Transformer
from keel.serve.sampling import RowState, Sampler, SamplingParams, request_generator


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
    stats.token_ids = []
    eos = set() if params.ignore_eos else set(eos_token_ids or [])
    sampler = Sampler()
    state = RowState(params, request_generator(params, model.device), prompt_ids, stats.token_ids, list(eos))

    device = model.device
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + max_new, model.dtype, device)
    tokens = torch.tensor([prompt_ids], device=device)
    start = time.perf_counter()
    logits = model(tokens, positions=torch.arange(len(prompt_ids), device=device)[None], cache=cache, last_only=True)
    token = int(sampler(logits[:, -1], [state]).token_ids[0])
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
        token = int(sampler(logits[:, -1], [state]).token_ids[0])
        position += 1
