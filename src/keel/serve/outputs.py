"""What the engine returns for a request after a step (vLLM's `RequestOutput` and `CompletionOutput`), and the
output-side state each request keeps to build them: its text, stop checks and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.serve.request import Request, Status
from keel.serve.sampling import RequestOutputKind, TokenLogprobs
from keel.serve.stop import StopChecker
from keel.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step. `delta_text` / `delta_token_ids` are what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: object | None = None  # RequestStats


class OutputTrack:
    """Output-side state of one request: text, stop checking, logprobs."""

    def __init__(self, request: Request, tokenizer: Tokenizer | None) -> None:
        self.detok: IncrementalDetokenizer | None = (
            tokenizer.detokenizer(request.params.skip_special_tokens) if tokenizer else None
        )
        self.stop = StopChecker(request.params, request.eos_token_ids)
        self.text = ""
        self.logprobs: list[TokenLogprobs] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0  # of `logprobs`, summed as they come (outputs report it every step)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [] if request.params.prompt_logprobs is not None else None
        )

    def add_logprob(self, entry: TokenLogprobs) -> None:
        assert self.logprobs is not None
        self.logprobs.append(entry)
        self.cumulative_logprob += entry.logprob


def build_output(request: Request, track: OutputTrack, delta: str, delta_ids: list[int]) -> RequestOutput:
    """The RequestOutput of a request after a step (`delta`: text this step released). Its lists are copies:
    the engine thread goes on appending to the request's while a server's event loop reads the output.
    Under RequestOutputKind.DELTA its text, token ids and logprobs are this step's only (prompt logprobs
    come with the first tokens), as vLLM's."""
    finished = request.status is Status.FINISHED
    delta_kind = request.params.output_kind is RequestOutputKind.DELTA
    every = track.logprobs
    cumulative_logprob = track.cumulative_logprob if every else None
    prompt_logprobs = track.prompt_logprobs
    if delta_kind:
        prompt_logprobs = prompt_logprobs if len(delta_ids) == len(request.output_token_ids) else None
        logprobs = every[len(every) - len(delta_ids) :] if every is not None else None
    else:
        logprobs = list(every) if every is not None else None
    completion = CompletionOutput(
        index=0,
        text=delta if delta_kind else track.text,
        token_ids=list(delta_ids) if delta_kind else list(request.output_token_ids),
        finish_reason=track.stop.finish_reason if finished else None,
        stop_reason=track.stop.stop_reason if finished else None,
        logprobs=logprobs,
        cumulative_logprob=cumulative_logprob,
    )
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        delta_text=delta,
        delta_token_ids=delta_ids,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=request.stats.cached_tokens,
        metrics=request.stats,
    )
