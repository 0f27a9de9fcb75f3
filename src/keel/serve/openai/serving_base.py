"""What the generation routes share: admission, preparation, the engine run, responses and streaming.

A request goes: ready? -> API key -> body (size limit, JSON, pydantic) -> model name -> prompt
tokens and max_tokens against the model length -> global queue (503 when full) -> tenant limits
(429, or a wait in the tenant's queue) -> the engine. `n` and prompt lists fan out into one
engine request per choice; their outputs are merged as they arrive. A deadline covers queueing
and generation; a client that disconnects, or a passed deadline, aborts every engine request of
the call (the engine frees their blocks before its next step).

A route (serving_completion, serving_chat) says how its request becomes prompts and how a choice
looks; the rest is here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from keel.errors import KeelError
from keel.serve.openai.call import Call, Job, child_params
from keel.serve.openai.errors import APIError, check_model_name
from keel.serve.openai.generation import CallRunner
from keel.serve.openai.http_io import ClientDisconnected, parse_body, read_json, until_disconnected
from keel.serve.openai.protocol import ChatCompletionRequest, CompletionRequest
from keel.serve.openai.responses import SSE_DONE, sse, vllm_prompt_logprobs
from keel.serve.openai.state import ServerState
from keel.serve.openai.tenants import Admission, TenantState
from keel.serve.outputs import RequestOutput
from keel.serve.sampling import RequestOutputKind, SamplingParams, TokenLogprobs

GenerationRequest = CompletionRequest | ChatCompletionRequest

# APIError status -> the `reason` label of the rejected-requests metric
_REJECTION_REASONS = {
    400: "invalid",
    401: "unauthorized",
    404: "invalid",
    413: "too_large",
    429: "rate_limited",
    503: "unavailable",
    504: "timeout",
}


def rejection_reason(error: APIError) -> str:
    return _REJECTION_REASONS.get(error.status, "error")


@dataclass
class PromptSpec:
    """What a route reads from its request: the prompts, and what to generate and return for them."""

    prompts: list[list[int]]
    texts: list[str | None]  # each prompt's text when it came as text (echo returns it as sent)
    requested_max_tokens: int | None
    logprobs: int | None
    echo: bool = False
    prompt_only: bool = False


class StreamDelta(NamedTuple):
    """What one engine output adds to a streamed choice."""

    text: str
    logprobs: list[TokenLogprobs]
    finish: str | None
    stop_reason: str | int | None = None  # the stop string or token id that ended the choice


class OpenAIServing:
    """One generation route over the shared ServerState; subclasses fill in the route's hooks."""

    kind: ClassVar[str]  # "completion" | "chat": the audit line's endpoint
    request_model: ClassVar[type[GenerationRequest]]
    max_tokens_param: ClassVar[str]  # the request field errors about max_tokens name
    prompt_param: ClassVar[str]  # the request field errors about the prompt's length name
    id_prefix: ClassVar[str]
    response_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.settings = state.settings
        self.metrics = state.metrics
        self.tokens = state.tokens
        core = state.engine.engine
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.vocab_size: int = core.model.config.vocab_size
        self.model_name = state.settings.served_model_name
        self.runner = CallRunner(state.engine, state.metrics, state.settings.request_timeout, state.in_flight)

    # ------------------------------------------------------------ the route's hooks
    def _prompt_spec(self, req: GenerationRequest) -> PromptSpec:
        raise NotImplementedError

    def _first_choices(self, call: Call) -> list[dict]:
        """Choices a stream sends before any output."""
        return []

    def _stream_choice(self, call: Call, job: Job, out: RequestOutput, delta: StreamDelta) -> dict | None:
        """A chunk's choice for `delta`; None when it shows nothing (the chunk is then not sent)."""
        raise NotImplementedError

    def _final_choice(self, call: Call, job: Job) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------ the request
    async def handle(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            self.state.check_ready()
            tenant = self.state.tenants.authenticate(request.headers.get("authorization"))
        except APIError as e:
            return self._reject("unknown", e, started)
        try:
            call, admission = await self._admit(request, tenant, started)
        except APIError as e:
            return self._reject(tenant.name, e, started)
        self.metrics.on_admitted(tenant.name, call.prompt_tokens)
        if call.stream:
            return StreamingResponse(
                self._stream(call, admission),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._respond(request, call, admission, started)

    async def _admit(self, request: Request, tenant: TenantState, started: float) -> tuple[Call, Admission]:
        """The prepared call, once the queue and the tenant's limits let it in (APIError otherwise)."""
        body = await read_json(request, self.settings.max_body_bytes)
        call = self._prepare(body, tenant)
        # vLLM's: the client's X-Request-Id header names the response (chatcmpl-<it>), before the body's request_id
        call.response_id = request.headers.get("x-request-id") or call.response_id
        await self._compile_grammars(call)
        self._check_queue(call)
        timeout = self.settings.request_timeout
        call.deadline = None if timeout is None else started + timeout
        admission = await self.state.tenants.admit(tenant, call.cost(), call.deadline)
        if self.state.draining:  # the shutdown's drain ended while it waited for its tenant's slot
            admission.release(call.unused_tokens())
            raise APIError(503, "server is shutting down")
        return call, admission

    async def _compile_grammars(self, call: Call) -> None:
        """Compile the call's structured-output constraint off the event loop, so a bad schema, regex or
        grammar is a 400 before the request queues (the engine then finds it in the compiler's cache)."""
        specs = {job.params.structured_outputs for job in call.jobs} - {None}
        if not specs:
            return
        engine = self.state.engine.engine
        if not hasattr(engine, "grammar_backend"):
            raise APIError(400, "structured outputs need the keel engine (this server runs --engine naive)")

        def compile_all() -> None:
            backend = engine.grammar_backend()
            for spec in specs:
                try:
                    backend.compile(spec)
                except KeelError as e:
                    raise APIError(400, str(e), param=spec.source or None) from None

        await asyncio.to_thread(compile_all)

    def _check_queue(self, call: Call) -> None:
        waiting = self.state.engine.stats()["num_requests_waiting"] + self.state.tenants.num_queued
        limit = self.settings.max_queue
        if len(call.jobs) > limit:  # never admitted, however empty the queue: a 503 would invite retries forever
            raise APIError(
                400,
                f"the request has {len(call.jobs)} sequences (prompts x n); this server queues at most {limit} "
                "(--max-queue)",
                # the field to lower: n where it multiplies the prompts, else the prompts themselves
                param="n" if getattr(call.request, "n", 1) > 1 else self.prompt_param,
            )
        if waiting + len(call.jobs) > limit:
            raise APIError(
                503, f"server queue is full ({int(waiting)} waiting, limit {limit})", code="queue_full", retry_after=1
            )

    def _reject(self, tenant: str, error: APIError, started: float, call: Call | None = None) -> JSONResponse:
        self.metrics.on_rejected(tenant, rejection_reason(error))
        self.state.audit.write(tenant, self.kind, error.status, started, call=call, error=error.message)
        return error.response()

    async def _respond(self, request: Request, call: Call, admission: Admission, started: float) -> Response:
        """The whole response at once (stream false)."""
        tenant = call.tenant.name
        try:
            body = await until_disconnected(request, self._collect(call))
        except APIError as e:
            return self._reject(tenant, e, started, call=call)
        except ClientDisconnected:
            self.state.audit.write(tenant, self.kind, 499, started, call=call, error="client disconnected")
            return Response(status_code=499)
        finally:
            admission.release(call.unused_tokens())
        self.state.audit.write(tenant, self.kind, 200, started, call=call)
        return JSONResponse(body)

    # ------------------------------------------------------------ preparation
    def _prepare(self, body: object, tenant: TenantState) -> Call:
        req = self._with_defaults(self._validate(body))
        spec = self._prompt_spec(req)
        if req.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last N tokens (echo then shows those)
            keep = req.truncate_prompt_tokens
            spec.texts = [text if len(p) <= keep else None for p, text in zip(spec.prompts, spec.texts, strict=True)]
            spec.prompts = [p[-keep:] for p in spec.prompts]
        jobs = []
        for p_index, prompt_ids in enumerate(spec.prompts):
            params = self._params(req, spec, len(prompt_ids))
            # As vLLM's server asks: a stream sends each step's new text, tokens and logprobs (DELTA); a whole
            # response is built from the finished output alone (FINAL_ONLY). No per-step copies of the output.
            kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
            params = dataclasses.replace(params, output_kind=kind)
            for j in range(req.n):
                child = params if req.n == 1 else child_params(params, j)
                jobs.append(Job(p_index * req.n + j, p_index, prompt_ids, child))
        options = req.stream_options
        include_usage = bool(options and options.include_usage) or self.settings.force_include_usage
        call = Call(self.kind, tenant, jobs, spec.prompts, spec.texts, req.stream, include_usage)
        call.echo, call.logprobs, call.prompt_only = spec.echo, spec.logprobs, spec.prompt_only
        # vLLM's: per-chunk usage only where the final usage chunk was asked for too
        call.continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
        call.prompt_logprobs = req.prompt_logprobs
        call.priority = self._priority(req)
        call.request = req
        call.response_id = req.request_id
        return call

    def _priority(self, req: GenerationRequest) -> int:
        """The request's priority for the scheduler; refused (as vLLM does) where the policy ignores it."""
        if req.priority == 0:
            return 0
        config = getattr(self.state.engine.engine, "config", None)
        policy = getattr(getattr(config, "scheduler", None), "scheduling_policy", "fcfs")
        if policy != "priority":
            raise APIError(400, "'priority' needs a server started with --scheduling-policy priority", param="priority")
        return req.priority

    def _validate(self, body: object) -> GenerationRequest:
        """The body as the route's request model, with a model name this server serves."""
        req = parse_body(body, self.request_model)
        req.check_unsupported()
        if req.stream and req.prompt_logprobs:  # vLLM's rule: 0 (none) streams
            raise APIError(400, "'prompt_logprobs' are not available when stream is true", param="prompt_logprobs")
        if req.stream_options is not None and not req.stream:  # vLLM's rule
            raise APIError(400, "'stream_options' can only be set when stream is true", param="stream_options")
        check_model_name(req.model, self.settings.served_model_names)
        return req

    def _params(self, req: GenerationRequest, spec: PromptSpec, prompt_len: int) -> SamplingParams:
        """One prompt's engine sampling parameters (each of its n choices gets its own seed)."""
        max_tokens = self._max_tokens(prompt_len, spec.requested_max_tokens, self._max_tokens_name(req))
        prompt_logprobs = spec.logprobs if spec.echo and spec.logprobs is not None else None
        try:
            params = req.sampling_params(max_tokens, spec.logprobs, prompt_logprobs)
            if spec.prompt_only:
                # Engine requests always generate (max_tokens >= 1): a prompt-only request runs as
                # max_tokens 1 and its token is dropped from the response, as vLLM does. It costs no
                # extra forward pass (the token is sampled from the prefill's last row), and the
                # prompt logprobs are complete once that token exists: every prefill chunk is done.
                params = dataclasses.replace(params, max_tokens=1)
            params.validate()
            params.check_vocabulary(self.vocab_size)  # here, before queueing: a 400 naming the field
        except KeelError as e:
            # the messages begin with the field's name ("logit_bias: token id ...", "top_k must be ...")
            name = str(e).replace(":", " ").split(" ", 1)[0]
            raise APIError(400, str(e), param=name if name in type(req).model_fields else None) from None
        return params

    def _with_defaults(self, req: GenerationRequest) -> GenerationRequest:
        """The request with the server's sampling defaults (--generation-config) in the fields it left out."""
        defaults = self.settings.default_sampling
        fill = {name: value for name, value in defaults.items() if name != "max_tokens" and getattr(req, name) is None}
        return req.model_copy(update=fill) if fill else req

    def _max_tokens_name(self, req: GenerationRequest) -> str:
        """The request field an error about the output length names."""
        return self.max_tokens_param

    def _max_tokens(self, prompt_len: int, requested: int | None, name: str | None = None) -> int:
        name = name or self.max_tokens_param
        cap, model_len = self.settings.max_tokens_cap, self.max_model_len
        if requested is not None and cap is not None and requested > cap:
            raise APIError(400, f"{name} ({requested}) exceeds this server's cap of {cap}", param=name)
        # The messages begin with OpenAI's (and vLLM's) "This model's maximum context length is N tokens", and
        # carry OpenAI's code: clients (LiteLLM, LangChain, agents that trim history) match either to tell a
        # prompt that does not fit from other 400s.
        if prompt_len >= model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {model_len} tokens. However, your request has {prompt_len} "
                "input tokens. Please reduce the length of the input.",
                param=self.prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else model_len - prompt_len
        default = self.settings.default_sampling.get("max_tokens")  # the model's max_new_tokens, as vLLM's
        if requested is None and default is not None:
            max_tokens = min(max_tokens, default)
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        if prompt_len + max_tokens > model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in {name}). "
                f"Please reduce the length of the input or {name}.",
                param=name,
                code="context_length_exceeded",
            )
        return max_tokens

    # ------------------------------------------------------------ responses
    async def _collect(self, call: Call) -> dict:
        async for _ in self.runner.outputs(call):
            pass
        body = {
            "id": self.id_prefix + (call.response_id or call.request_id),
            "object": self.response_object,
            "created": call.created,
            "model": self.model_name,
            "choices": [self._final_choice(call, job) for job in call.jobs],
            "usage": call.usage().to_dict(),
        }
        return self._finish_body(call, body)

    def _finish_body(self, call: Call, body: dict) -> dict:
        """The route's additions to a whole response."""
        return body

    def _prompt_logprobs(self, job: Job) -> list[dict | None] | None:
        if job.final is None or job.final.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(job.final.prompt_logprobs, self.tokens.token_text)

    def _stream(self, call: Call, admission: Admission) -> AsyncIterator[str]:
        """The stream of chunks: the route's events (`_chunks`), the error as vLLM sends it (an error event, then
        [DONE])."""
        return self._guarded_stream(call, admission, self._chunks(call), lambda e: [sse(e.body()), SSE_DONE])

    async def _chunks(self, call: Call) -> AsyncIterator[str]:
        head = {
            "id": self.id_prefix + (call.response_id or call.request_id),
            "object": self.chunk_object,
            "created": call.created,
            "model": self.model_name,
        }
        for choice in self._first_choices(call):
            chunk = {**head, "choices": [choice]}
            if call.continuous_usage:
                chunk["usage"] = call.choice_usage(call.jobs[choice["index"]])
            yield sse(chunk)
        async for job, out in self.runner.outputs(call):
            delta = self._stream_delta(call, job, out)
            if delta is None:
                continue  # text held back (a possible stop string): nothing to send yet
            choice = self._stream_choice(call, job, out, delta)
            if choice is None:
                continue  # nothing a client would see (text a tool-call parser holds)
            chunk = {**head, "choices": [choice]}
            if call.continuous_usage:
                chunk["usage"] = call.choice_usage(job)
            yield sse(chunk)
        if call.include_usage:
            yield sse({**head, "choices": [], "usage": call.usage().to_dict()})
        yield SSE_DONE

    async def _guarded_stream(
        self,
        call: Call,
        admission: Admission,
        events: AsyncIterator[str],
        error_events: Callable[[APIError], list[str]],
    ) -> AsyncIterator[str]:
        """What every route's stream shares: `events`; an APIError after the 200 header travels as the route's
        `error_events`; and, however it ends, the tenant's unused tokens released and the audit line written."""
        status, error = 200, None
        try:
            async for event in events:
                yield event
        except APIError as e:
            status, error = e.status, e.message
            self.metrics.on_rejected(call.tenant.name, rejection_reason(e))
            for event in error_events(e):
                yield event
        except asyncio.CancelledError:  # the client went away; the runner aborted the engine requests
            status, error = 499, "client disconnected"
            raise
        finally:
            admission.release(call.unused_tokens())
            audit = self.state.audit
            audit.write(call.tenant.name, self.kind, status, call.started, call=call, error=error, stream=True)

    def _stream_delta(self, call: Call, job: Job, out: RequestOutput) -> StreamDelta | None:
        """What `out` adds to its choice; None when nothing (yet)."""
        completion = out.outputs[0]
        new_lps = completion.logprobs or []  # the step's own (a stream's outputs are DELTA)
        finish = completion.finish_reason if out.finished else None
        text = out.delta_text
        if call.prompt_only:  # the engine's one token is not part of the response (see _params)
            text, new_lps = "", []
            finish = "length" if out.finished else None
        if not text and finish is None and not new_lps:
            return None
        stop_reason = completion.stop_reason if finish is not None and not call.prompt_only else None
        return StreamDelta(text, new_lps, finish, stop_reason)
