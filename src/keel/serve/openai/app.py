"""The FastAPI application: OpenAI routes, admission control, streaming, metrics, audit.

A request goes: ready? -> API key -> body (size limit, JSON, pydantic) -> model name -> prompt
tokens and max_tokens against the model length -> global queue (503 when full) -> tenant limits
(429, or a wait in the tenant's queue) -> the engine. `n` and prompt lists fan out into one
engine request per choice; their outputs are merged as they arrive. A deadline covers queueing
and generation; a client that disconnects, or a passed deadline, aborts every engine request of
the call (the engine frees their blocks before its next step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from keel.errors import KeelError
from keel.serve.async_engine import AsyncEngine, EngineDeadError
from keel.serve.engine import CompletionOutput, RequestOutput
from keel.serve.openai.errors import APIError, error_body
from keel.serve.openai.metrics import ServerMetrics
from keel.serve.openai.protocol import ChatCompletionRequest, CompletionRequest
from keel.serve.openai.responses import SSE_DONE, CompletionLogprobs, Usage, chat_logprobs, sse
from keel.serve.openai.tenants import Admission, Tenants, TenantState
from keel.serve.sampling import SamplingParams, TokenLogprobs

log = logging.getLogger("keel.serve")
audit_log = logging.getLogger("keel.audit")


@dataclass
class ServerSettings:
    served_model_name: str
    max_queue: int = 256  # accepted requests not yet running (engine queue + tenant queues)
    request_timeout: float | None = 600.0  # seconds, queue + generation
    max_tokens_cap: int | None = None
    max_body_bytes: int = 4 * 2**20
    audit_prompts: bool = False  # include prompt text in audit lines


@dataclass
class _Job:
    """One engine request of a call: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    final: RequestOutput | None = None
    sent_tokens: int = 0  # generated tokens already counted / streamed
    sent_logprobs: int = 0


@dataclass
class _Call:
    """Everything a route prepared before generation."""

    kind: str  # "completion" | "chat"
    tenant: TenantState
    jobs: list[_Job]
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None
    prompt_only: bool = False  # max_tokens 0 with echo: each job's one generated token is not returned
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    deadline: float | None = None


class ClientDisconnected(Exception):
    pass


def create_app(engine: AsyncEngine, settings: ServerSettings, tenants: Tenants) -> FastAPI:
    """The app over a running AsyncEngine (its engine: an LLMEngine or the naive baseline)."""
    core = engine.engine
    tokenizer = core.tokenizer
    max_model_len: int = core.max_model_len
    vocab_size: int = core.model.config.vocab_size
    model_name = settings.served_model_name
    metrics = ServerMetrics(model_name, engine.stats)
    draining = {"value": False}

    @lru_cache(maxsize=65536)
    def token_bytes(token_id: int) -> bytes:
        return tokenizer.token_bytes(token_id) if tokenizer else str(token_id).encode()

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        """A token as logprobs show it; part of a UTF-8 character as OpenAI writes it: "bytes:\\xe2"."""
        raw = token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        draining["value"] = True
        engine.shutdown()

    app = FastAPI(title="keel", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.tenants = tenants

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(404, f"no route {request.method} {request.url.path}"), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(405, f"method {request.method} not allowed"), status_code=405)

    # ------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse({"status": "error", "error": str(engine.error)}, status_code=503)
        if draining["value"]:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        tenants.authenticate(request.headers.get("authorization"))
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "keel", "max_model_len": max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------ generation routes
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, "chat")

    async def _handle(request: Request, kind: str) -> Response:
        started = time.monotonic()
        tenant_name = "unknown"
        try:
            if draining["value"]:
                raise APIError(503, "server is shutting down")
            if not engine.alive:
                raise APIError(503, f"engine failed: {engine.error}")
            tenant = tenants.authenticate(request.headers.get("authorization"))
            tenant_name = tenant.name
            body = await _read_json(request, settings.max_body_bytes)
            call = _prepare(kind, body, tenant)
            _check_queue(call)
            call.deadline = None if settings.request_timeout is None else started + settings.request_timeout
            admission = await tenants.admit(tenant, _cost(call), call.deadline)
        except APIError as e:
            metrics.on_rejected(tenant_name, _reason(e))
            _audit(tenant_name, kind, e.status, started, error=e.message)
            return e.response()
        metrics.on_admitted(tenant.name, sum(len(p) for p in call.prompts))
        if call.stream:
            return StreamingResponse(
                _stream(call, admission),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            body = await _until_disconnected(request, _collect(call), call)
        except APIError as e:
            metrics.on_rejected(tenant.name, _reason(e))
            _audit(tenant.name, kind, e.status, started, call=call, error=e.message)
            return e.response()
        except ClientDisconnected:
            _audit(tenant.name, kind, 499, started, call=call, error="client disconnected")
            return Response(status_code=499)
        finally:
            admission.release(_unused(call))
        _audit(tenant.name, kind, 200, started, call=call)
        return JSONResponse(body)

    # ------------------------------------------------------------ preparation
    def _prepare(kind: str, body: object, tenant: TenantState) -> _Call:
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        model_cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        req.check_unsupported()
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        prompt_only = False
        if kind == "completion":
            prompt_only = req.prompt_only()
            prompts, texts = _completion_prompts(req)
            requested = req.max_tokens
            logprobs, echo = req.logprobs, req.echo
        else:
            prompts, texts = _chat_prompt(req)
            requested = req.requested_max_tokens()
            logprobs, echo = req.num_logprobs(), False
        jobs = []
        for p_index, prompt_ids in enumerate(prompts):
            max_tokens = _max_tokens(len(prompt_ids), requested, kind)
            try:
                params = req.sampling_params(max_tokens, logprobs, logprobs if echo and logprobs is not None else None)
                if prompt_only:
                    # Engine requests always generate (max_tokens >= 1): a prompt-only request runs as
                    # max_tokens 1 and its token is dropped from the response, as vLLM does. It costs no
                    # extra forward pass (the token is sampled from the prefill's last row), and the
                    # prompt logprobs are complete once that token exists: every prefill chunk is done.
                    params = dataclasses.replace(params, max_tokens=1)
                params.validate()
            except KeelError as e:
                raise APIError(400, str(e)) from None
            for j in range(req.n):
                child = params if req.n == 1 else _child_params(params, j)
                jobs.append(_Job(p_index * req.n + j, p_index, prompt_ids, child))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _Call(kind, tenant, jobs, prompts, texts, req.stream, include_usage, echo, logprobs, prompt_only)

    def _completion_prompts(req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        prompts, texts = [], []
        for item in req.prompts():
            if isinstance(item, str):
                if tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
                ids = tokenizer.encode(item)
                if not ids:
                    raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
                prompts.append(ids)
                texts.append(item)
            else:
                bad = next((t for t in item if t >= vocab_size), None)
                if bad is not None:
                    raise APIError(400, f"prompt token id {bad} is out of range [0, {vocab_size})", param="prompt")
                prompts.append(list(item))
                texts.append(None)
        return prompts, texts

    def _chat_prompt(req: ChatCompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions")
        messages = [m.to_template() for m in req.messages]
        try:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt)
        except KeelError as e:
            raise APIError(400, str(e), param="messages") from None
        return [ids], [None]

    def _max_tokens(prompt_len: int, requested: int | None, kind: str) -> int:
        name = "max_tokens" if kind == "completion" else "max_completion_tokens"
        cap = settings.max_tokens_cap
        if requested is not None and cap is not None and requested > cap:
            raise APIError(400, f"{name} ({requested}) exceeds this server's cap of {cap}", param=name)
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; the model's length is {max_model_len}",
                param="messages" if kind == "chat" else "prompt",
            )
        max_tokens = requested if requested is not None else max_model_len - prompt_len
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        if prompt_len + max_tokens > max_model_len:
            raise APIError(
                400,
                f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) = {prompt_len + max_tokens} exceeds the "
                f"model's length of {max_model_len} tokens",
                param=name,
            )
        return max_tokens

    def _check_queue(call: _Call) -> None:
        waiting = engine.stats()["num_requests_waiting"] + tenants.num_queued
        if waiting + len(call.jobs) > settings.max_queue:
            raise APIError(503, f"server queue is full ({int(waiting)} waiting, limit {settings.max_queue})",
                           code="queue_full", retry_after=1)  # fmt: skip

    def _cost(call: _Call) -> int:
        return sum(len(p) for p in call.prompts) + sum(job.params.max_tokens for job in call.jobs)

    def _unused(call: _Call) -> int:
        return sum(job.params.max_tokens - job.sent_tokens for job in call.jobs)

    # ------------------------------------------------------------ generation
    async def _outputs(call: _Call) -> AsyncIterator[tuple[_Job, RequestOutput]]:
        """Every job's outputs, merged in arrival order; aborts the unfinished ones on exit."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(job: _Job) -> None:
            try:
                async for out in engine.generate(job.prompt_ids, job.params, f"{call.request_id}-{job.index}"):
                    merged.put_nowait((job, out, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                merged.put_nowait((job, None, e))

        tasks = [asyncio.create_task(pump(job)) for job in call.jobs]
        remaining = len(call.jobs)
        try:
            while remaining:
                timeout = None if call.deadline is None else call.deadline - time.monotonic()
                try:
                    job, out, error = await asyncio.wait_for(merged.get(), timeout)
                except TimeoutError:
                    raise APIError(504, f"request deadline of {settings.request_timeout:g} s passed") from None
                if error is not None:
                    if isinstance(error, KeelError):
                        raise APIError(400, str(error))
                    if isinstance(error, EngineDeadError):
                        raise APIError(503, str(error))
                    raise error
                new = len(out.outputs[0].token_ids) - job.sent_tokens
                metrics.on_tokens(call.tenant.name, new)
                if out.finished:
                    job.final = out
                    remaining -= 1
                    metrics.on_finished(call.tenant.name, out.metrics, out.outputs[0].finish_reason or "abort")
                yield job, out
                job.sent_tokens += new
        finally:
            for task in tasks:
                task.cancel()  # an unfinished job's generate() aborts its engine request
            for job in call.jobs:
                if job.final is None:
                    metrics.on_finished(call.tenant.name, None, "abort")

    async def _collect(call: _Call) -> dict:
        async for _ in _outputs(call):
            pass
        return _final_body(call)

    async def _until_disconnected(request: Request, work, call: _Call):
        """Run `work`; cancel it (aborting its engine requests) if the client goes away first."""
        task = asyncio.ensure_future(work)

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientDisconnected()

    def _usage(call: _Call) -> Usage:
        usage = Usage(prompt_tokens=sum(len(p) for p in call.prompts))
        for job in call.jobs:
            if job.final is not None and not call.prompt_only:
                usage.completion_tokens += len(job.final.outputs[0].token_ids)
        cached = {}
        for job in call.jobs:
            if job.final is not None:
                cached[job.prompt_index] = max(cached.get(job.prompt_index, 0), job.final.num_cached_tokens)
        usage.cached_tokens = sum(cached.values())
        return usage

    def _final_body(call: _Call) -> dict:
        choices = []
        for job in call.jobs:
            out = job.final.outputs[0]
            if call.kind == "completion":
                text, generated = _generated(call, out)
                logprobs = None
                if call.logprobs is not None:
                    lp = CompletionLogprobs()
                    if call.echo:
                        lp.add_prompt(job.prompt_ids, job.final.prompt_logprobs or [], token_text)
                    lp.add(generated, token_text)
                    logprobs = lp.to_dict()
                if call.echo:
                    text = _prompt_text(call, job) + text
                finish, stop_reason = ("length", None) if call.prompt_only else (out.finish_reason, out.stop_reason)
                choices.append({"index": job.index, "text": text, "logprobs": logprobs,
                                "finish_reason": finish, "stop_reason": stop_reason})  # fmt: skip
            else:
                logprobs = None
                if call.logprobs is not None:
                    logprobs = chat_logprobs(out.logprobs or [], token_text, token_bytes)
                choices.append({
                    "index": job.index,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                })  # fmt: skip
        return {
            "id": _response_id(call),
            "object": "text_completion" if call.kind == "completion" else "chat.completion",
            "created": call.created,
            "model": model_name,
            "choices": choices,
            "usage": _usage(call).to_dict(),
        }

    def _generated(call: _Call, out: CompletionOutput) -> tuple[str, list[TokenLogprobs]]:
        """A completion's generated text and logprobs as the response shows them: none when prompt-only."""
        return ("", []) if call.prompt_only else (out.text, out.logprobs or [])

    def _prompt_text(call: _Call, job: _Job) -> str:
        text = call.prompt_texts[job.prompt_index]
        return text if text is not None else (tokenizer.decode(job.prompt_ids) if tokenizer else "")

    def _response_id(call: _Call) -> str:
        return ("cmpl-" if call.kind == "completion" else "chatcmpl-") + call.request_id

    async def _stream(call: _Call, admission: Admission) -> AsyncIterator[str]:
        status, error = 200, None
        head = {
            "id": _response_id(call),
            "object": "text_completion" if call.kind == "completion" else "chat.completion.chunk",
            "created": call.created,
            "model": model_name,
        }
        try:
            if call.kind == "chat":  # the role comes first, as OpenAI streams it
                for job in call.jobs:
                    delta = {"role": "assistant", "content": ""}
                    yield sse({**head, "choices": [_chat_choice(job.index, delta, None, None)]})
            echoed: set[int] = set()
            async for job, out in _outputs(call):
                completion = out.outputs[0]
                new_lps = (completion.logprobs or [])[job.sent_logprobs :]
                job.sent_logprobs += len(new_lps)
                finish = completion.finish_reason if out.finished else None
                delta_text = out.delta_text
                if call.prompt_only:  # the engine's one token is not part of the response (see _prepare)
                    delta_text, new_lps = "", []
                    finish = "length" if out.finished else None
                if not delta_text and finish is None and not new_lps:
                    continue  # text held back (a possible stop string): nothing to send yet
                if call.kind == "completion":
                    text, logprobs = delta_text, None
                    lp = CompletionLogprobs() if call.logprobs is not None else None
                    if call.echo and job.index not in echoed:
                        echoed.add(job.index)
                        text = _prompt_text(call, job) + text
                        if lp is not None:
                            lp.add_prompt(job.prompt_ids, out.prompt_logprobs or [], token_text)
                    if lp is not None:
                        lp.add(new_lps, token_text)
                        logprobs = lp.to_dict()
                    choice = {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
                else:
                    logprobs = chat_logprobs(new_lps, token_text, token_bytes) if call.logprobs is not None else None
                    delta = {"content": delta_text} if delta_text or finish is None else {}
                    choice = _chat_choice(job.index, delta, logprobs, finish)
                yield sse({**head, "choices": [choice]})
            if call.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(call).to_dict()})
            yield SSE_DONE
        except APIError as e:  # after the 200 header: the error travels as an event, as vLLM sends it
            status, error = e.status, e.message
            metrics.on_rejected(call.tenant.name, _reason(e))
            yield sse(e.body())
            yield SSE_DONE
        except asyncio.CancelledError:  # the client went away; _outputs aborted the engine requests
            status, error = 499, "client disconnected"
            raise
        finally:
            admission.release(_unused(call))
            _audit(call.tenant.name, call.kind, status, call.started, call=call, error=error, stream=True)

    def _audit(
        tenant: str,
        kind: str,
        status: int,
        started: float,
        *,
        call: _Call | None = None,
        error: str | None = None,
        stream: bool = False,
    ) -> None:
        record: dict = {"tenant": tenant, "endpoint": kind, "status": status,
                        "latency_s": round(time.monotonic() - started, 4)}  # fmt: skip
        if call is not None:
            usage = _usage(call)
            record.update(
                request_id=call.request_id,
                stream=stream,
                n=len(call.jobs),
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                finish_reasons=[job.final.outputs[0].finish_reason if job.final else "abort" for job in call.jobs],
            )
            finals = [job.final.metrics for job in call.jobs if job.final is not None and job.final.metrics]
            drafted = sum(m.spec_draft_tokens for m in finals)
            if drafted:  # speculative decoding: this request's acceptance
                accepted = sum(m.spec_accepted_tokens for m in finals)
                record.update(spec_draft_tokens=drafted, spec_accepted_tokens=accepted)
            if settings.audit_prompts:
                record["prompt_token_ids"] = call.prompts
        if error is not None:
            record["error"] = error
        audit_log.info(json.dumps(record))

    return app


def _chat_choice(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _child_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own seed (seed + j), so n seeded choices differ but stay reproducible."""
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + j)


def _reason(error: APIError) -> str:
    return {400: "invalid", 401: "unauthorized", 404: "invalid", 413: "too_large", 429: "rate_limited",
            503: "unavailable", 504: "timeout"}.get(error.status, "error")  # fmt: skip


def _validation_error(error: ValidationError) -> APIError:
    """The first pydantic error as one OpenAI-style message naming the field."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if not str(part).startswith(("function-", "constrained-"))]
    param = ".".join(loc) if loc else None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(400, message, param=param)


async def _read_json(request: Request, limit: int) -> object:
    """The body as JSON, at most `limit` bytes (413 beyond, even without Content-Length)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
