"""The FastAPI application: OpenAI routes wired to the serving objects that answer them.

The generation routes are OpenAIServingCompletion, OpenAIServingChat and OpenAIServingResponses
(serving_base.py has the path of a request through admission, the engine and the response);
OpenAIServingModels answers /v1/models; ServerState holds what they share, and /health.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from keel.serve.async_engine import AsyncEngine
from keel.serve.openai.errors import APIError, error_body
from keel.serve.openai.http_io import ClientDisconnected
from keel.serve.openai.request_id import RequestIdMiddleware
from keel.serve.openai.serving_chat import OpenAIServingChat
from keel.serve.openai.serving_completion import OpenAIServingCompletion
from keel.serve.openai.serving_models import OpenAIServingModels
from keel.serve.openai.serving_responses import OpenAIServingResponses
from keel.serve.openai.serving_tokens import OpenAIServingTokens
from keel.serve.openai.settings import ServerSettings
from keel.serve.openai.state import ServerState
from keel.serve.openai.tenants import Tenants
from keel.version import __version__

__all__ = ["ClientDisconnected", "ServerSettings", "create_app"]

log = logging.getLogger("keel.serve")

router = APIRouter()


def create_app(engine: AsyncEngine, settings: ServerSettings, tenants: Tenants) -> FastAPI:
    """The app over a running AsyncEngine (its engine: an LLMEngine or the naive baseline)."""
    state = ServerState(engine, settings, tenants)
    app = FastAPI(title="keel", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = state.metrics
    app.state.tenants = tenants
    app.state.server = state
    app.state.serving_completion = OpenAIServingCompletion(state)
    app.state.serving_chat = OpenAIServingChat(state)
    app.state.serving_responses = OpenAIServingResponses(state)
    app.state.serving_models = OpenAIServingModels(
        settings.served_model_names, engine.engine.max_model_len, tenants, settings.model_root
    )
    app.state.serving_tokens = OpenAIServingTokens(state)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _bad_method)
    app.include_router(router)
    cors = settings.cors
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.allowed_origins,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
        allow_credentials=cors.allow_credentials,
    )
    app.add_middleware(RequestIdMiddleware, always=settings.request_id_headers)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    app.state.server.shutdown()  # draining from here on: new requests get 503


def _server(request: Request) -> ServerState:
    return request.app.state.server


# ------------------------------------------------------------ errors
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error")
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(404, f"no route {request.method} {request.url.path}"), status_code=404)


async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(405, f"method {request.method} not allowed"), status_code=405)


# ------------------------------------------------------------ routes
@router.get("/health")
async def health(request: Request) -> Response:
    return _server(request).health()


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    """vLLM's liveness probe (SageMaker's): /health's status, with an empty body."""
    return Response(status_code=_server(request).health().status_code)


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": __version__})


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    serving: OpenAIServingTokens = request.app.state.serving_tokens
    return await serving.tokenize(request)


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    serving: OpenAIServingTokens = request.app.state.serving_tokens
    return await serving.detokenize(request)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    serving: OpenAIServingModels = request.app.state.serving_models
    return serving.list_models(request.headers.get("authorization"))


@router.get("/v1/models/{model_id:path}")  # :path: a served name may hold a slash (org/model)
async def retrieve_model(model_id: str, request: Request) -> Response:
    serving: OpenAIServingModels = request.app.state.serving_models
    return serving.retrieve_model(model_id, request.headers.get("authorization"))


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(_server(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    serving: OpenAIServingCompletion = request.app.state.serving_completion
    return await serving.handle(request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    serving: OpenAIServingChat = request.app.state.serving_chat
    return await serving.handle(request)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    serving: OpenAIServingResponses = request.app.state.serving_responses
    return await serving.handle(request)
