"""The X-Request-Id response header, as vLLM's --enable-request-id-headers sends it.

A client's own X-Request-Id is always echoed (tracing proxies and clients match it to their request); with
`always`, a response to a request without one gets a new id. A pure ASGI middleware, not Starlette's
BaseHTTPMiddleware, which would buffer streams and hide a client's disconnect from the routes.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, always: bool = False) -> None:
        self.app = app
        self.always = always

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
        if given is None and not self.always:
            await self.app(scope, receive, send)
            return
        request_id = given if given is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
