"""A step the runner has queued on the device and not yet read back (keel.serve.runner.ModelRunner.launch).

With asynchronous scheduling the engine schedules and queues step N+1 while step N still runs, and reads
step N's tokens afterwards: a token drawn by step N and fed by step N+1 never visits the host on the way
(`TokenFill` copies it on the device from step N's drawn tokens into step N+1's inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from keel.serve.request import Request
from keel.serve.sampling import LogprobsTensors, TokenLogprobs
from keel.serve.staging import HostCopy, host_int64


@dataclass
class StepResult:
    """Per scheduled request that reached the end of its known tokens: the tokens it gained (one, or
    with speculation the accepted drafts and one more), with their logprobs when asked."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """What `collect` needs: the requests that drew a token (in row order), the drawn tokens on the device,
    their copies on the way to the host, and what the step already knows on the host (verified drafts and
    prompt logprobs, which read their logits back as they run)."""

    result: StepResult = field(default_factory=StepResult)
    samplers: list[Request] = field(default_factory=list)
    token_ids: Tensor | None = None
    readback: HostCopy | None = None
    logprobs: LogprobsTensors | None = None

    def row_of(self) -> dict[str, int]:
        """Request id -> its row in `token_ids`."""
        return {r.request_id: i for i, r in enumerate(self.samplers)}


@dataclass
class TokenFill:
    """In-flight tokens into a step's flat token ids: position dst[i] gets drawn[src[i]], on the device."""

    drawn: Tensor
    dst: list[int]
    src: list[int]

    def host(self) -> list[Tensor]:
        """dst and src as int64 host tensors, to cross to the device with the step's other inputs (one copy)."""
        return [host_int64(self.dst), host_int64(self.src)]

    def apply(self, tokens: Tensor, dst: Tensor, src: Tensor) -> None:
        """`tokens` (flat) gets the drawn tokens; dst and src are `host()` moved to the device."""
        tokens.index_copy_(0, dst, self.drawn.index_select(0, src).to(tokens.dtype))
