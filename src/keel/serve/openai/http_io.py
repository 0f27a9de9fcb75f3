"""The HTTP side of a request: reading its JSON body within a size limit, and noticing the client leave."""

from __future__ import annotations

import asyncio
import functools
import json
import typing
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from keel.serve.openai.errors import APIError

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class ClientDisconnected(Exception):
    pass


async def read_json(request: Request, limit: int) -> object:
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


@functools.cache
def _defaults_not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The optional fields of `model` whose type has no None (`n`, `stream`, `logprobs`, `echo`, ...): a JSON null
    there means "the default", as OpenAI's API and vLLM take it (its fields are Optional with these defaults);
    clients that serialise every field of their own request type send `"n": null`, `"stream": null`. Fields that
    take None keep it: completions' `"max_tokens": null` asks for the rest of the context, not 16."""
    names = set()
    for name, info in model.model_fields.items():
        if not info.is_required() and not _takes_none(info.annotation):
            names.add(name)
            if info.alias:
                names.add(info.alias)
    return frozenset(names)


def _takes_none(annotation: object) -> bool:
    if annotation is None or annotation is type(None) or annotation is typing.Any:
        return True
    return any(_takes_none(arg) for arg in typing.get_args(annotation) if arg is not Ellipsis)


def validation_error(error: ValidationError) -> APIError:
    """The first pydantic error as one OpenAI-style message naming the field."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if not str(part).startswith(("function-", "constrained-"))]
    param = ".".join(loc) if loc else None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(400, message, param=param)


def parse_body(body: object, model: type[M]) -> M:
    """A JSON body as the route's pydantic model; a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    not_nullable = _defaults_not_nullable(model)
    if not_nullable:
        body = {name: value for name, value in body.items() if value is not None or name not in not_nullable}
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
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


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
