"""POST /tokenize and /detokenize, as vLLM answers them: the server's own tokenizer and chat template.

A chat body renders through keel.serve.openai.chat_prompt, the function /v1/chat/completions uses, so the
tokens counted here are the tokens a chat request's prompt has.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from keel.serve.openai.chat_prompt import render_chat
from keel.serve.openai.errors import APIError, check_model_name
from keel.serve.openai.http_io import parse_body, read_json
from keel.serve.openai.protocol_tokens import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
)
from keel.serve.openai.state import ServerState
from keel.tokenizer import Tokenizer


class OpenAIServingTokens:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.settings = state.settings
        core = state.engine.engine
        self.tokenizer: Tokenizer | None = core.tokenizer
        self.max_model_len: int = core.max_model_len

    async def tokenize(self, request: Request) -> Response:
        try:
            req = await self._read(request, _tokenize_model)
            ids = self._encode(req)
        except APIError as e:
            return e.response()
        strs = [self._tokenizer().tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        try:
            req = await self._read(request, lambda body: DetokenizeRequest)
            tokenizer = self._tokenizer()
            vocab = tokenizer.vocab_size
            bad = next((t for t in req.tokens if t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of the vocabulary [0, {vocab})", param="tokens")
        except APIError as e:
            return e.response()
        # vLLM's: special tokens included, so that a tokenized prompt decodes back to what was sent
        return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def _read(self, request: Request, model_of) -> BaseModel:
        """The authenticated, validated body, for a model this server serves (as the generation routes check)."""
        self.state.tenants.authenticate(request.headers.get("authorization"))
        body = await read_json(request, self.settings.max_body_bytes)
        req = parse_body(body, model_of(body))
        check_model_name(req.model, self.settings.served_model_names)
        return req

    def _encode(self, req: TokenizeRequest) -> list[int]:
        tokenizer = self._tokenizer()
        if isinstance(req, TokenizeCompletionRequest):
            return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        req.check_unsupported()
        return render_chat(tokenizer, req.as_chat_request())

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (it is served by token ids only)")
        return self.tokenizer


def _tokenize_model(body: object) -> type[TokenizeRequest]:
    """vLLM's union: a body with messages is a chat body, one without a prompt body."""
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise APIError(400, "send 'prompt' or 'messages', not both", param="messages")
        return TokenizeChatRequest
    return TokenizeCompletionRequest
