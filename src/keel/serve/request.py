"""A request's state inside the engine: its tokens, progress, and timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from keel.serve.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Times are time.perf_counter() values; durations in seconds."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finished: float | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    preemptions: int = 0
    # Speculative decoding: draft tokens proposed and verified for this request, and how many the
    # target model accepted (acceptance rate = accepted / drafted); per position for the first k.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_times(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    priority: int = 0  # lower runs first under the "priority" policy (vLLM's convention)
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Asynchronous scheduling: tokens drawn by a step whose result the host has not read yet. They count
    # in num_tokens (the next step feeds them) but are not in output_token_ids until read.
    in_flight: int = 0
    status: Status = Status.WAITING
    # Set when preempted; cleared by the next generated token. A protected request is chosen as a
    # victim only when every other candidate is protected too (no preemption ping-pong).
    protected: bool = False
    arrival_order: int = 0
    generator: torch.Generator | None = None
    # Speculative decoding: this step's draft tokens (fed after the last known token and verified by
    # the target), the draft model's distributions they were sampled from ([k, V]; None when the
    # drafts are deterministic: n-gram lookup or greedy drafting), and how many of the request's
    # tokens the draft model's own KV cache holds.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    draft_computed: int = 0
    # Structured outputs: the request's grammar (keel.serve.structured.GrammarState), and this step's
    # bitmask rows of allowed tokens (one per sampled position: [1, W], or [k + 1, W] when verifying drafts).
    grammar: object | None = None
    token_bitmask: torch.Tensor | None = None
    stats: RequestStats = field(default_factory=lambda: RequestStats(arrival=time.perf_counter()))

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list (hot path)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, with those in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.in_flight

    @property
    def num_remaining(self) -> int:
        """Tokens to feed the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
