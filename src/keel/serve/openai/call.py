"""One API call as the engine runs it: its jobs (one engine request per choice) and their progress."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field

from keel.serve.openai.responses import Usage
from keel.serve.openai.tenants import TenantState
from keel.serve.outputs import RequestOutput
from keel.serve.sampling import SamplingParams


@dataclass
class Job:
    """One engine request of a call: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    final: RequestOutput | None = None
    generated: int = 0  # tokens the engine has generated for the job so far (its outputs may be deltas)
    sent_tokens: int = 0  # generated tokens already counted / streamed
    echoed: bool = False  # a stream has sent the echoed prompt of this choice
    writer: object | None = None  # chat: this choice's ChoiceWriter (reasoning and tool-call parsers)
    stream_logprobs: object | None = None  # completions stream: the choice's CompletionLogprobs, sent in slices


@dataclass
class Call:
    """Everything a route prepared before generation."""

    kind: str  # "completion" | "chat"
    tenant: TenantState
    jobs: list[Job]
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None
    prompt_only: bool = False  # max_tokens 0 with echo: each job's one generated token is not returned
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: returned beside the choices
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    priority: int = 0  # the scheduler's priority (lower first, under --scheduling-policy priority)
    response_id: str | None = None  # the client's request_id, shown as the response's id
    request: object | None = None  # the validated request body (the route's pydantic model)
    chat: object | None = None  # chat: keel.serve.openai.chat_output.ChatOutputs
    chat_echo: str = ""  # chat echo: the last message, which the reply continues
    responses: object | None = None  # /v1/responses: its request (protocol_responses.ResponsesRequest)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    deadline: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def cost(self) -> int:
        """The tokens a tenant's budget reserves for the call: every prompt and every job's max_tokens."""
        return self.prompt_tokens + sum(job.params.max_tokens for job in self.jobs)

    def unused_tokens(self) -> int:
        """What the reservation gets back when the call ends: the tokens no job generated."""
        return sum(job.params.max_tokens - job.sent_tokens for job in self.jobs)

    def usage(self) -> Usage:
        usage = Usage(prompt_tokens=self.prompt_tokens)
        if not self.prompt_only:  # an unfinished job's tokens too: the audit line of an aborted call counts them
            usage.completion_tokens = sum(job.generated for job in self.jobs)
        cached: dict[int, int] = {}  # the choices of one prompt share its cached prefix: count it once
        for job in self.jobs:
            if job.final is not None:
                cached[job.prompt_index] = max(cached.get(job.prompt_index, 0), job.final.num_cached_tokens)
        usage.cached_tokens = sum(cached.values())
        return usage

    def choice_usage(self, job: Job) -> dict:
        """A streamed chunk's usage under continuous_usage_stats, as vLLM sends it: the choice's prompt and the
        tokens that choice has generated so far."""
        prompt = len(self.prompts[job.prompt_index])
        completion = 0 if self.prompt_only else job.generated
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def finish_reasons(self) -> list[str | None]:
        return [job.final.outputs[0].finish_reason if job.final else "abort" for job in self.jobs]


def child_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own seed (seed + j), so n seeded choices differ but stay reproducible."""
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + j)
