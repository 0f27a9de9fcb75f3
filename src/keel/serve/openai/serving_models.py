"""GET /v1/models: the one model this server serves, a card per name it answers to (vLLM's list)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from keel.serve.openai.tenants import Tenants


class OpenAIServingModels:
    def __init__(self, model_names: tuple[str, ...], max_model_len: int, tenants: Tenants) -> None:
        self.model_names = model_names
        self.max_model_len = max_model_len
        self.tenants = tenants

    def list_models(self, authorization: str | None) -> JSONResponse:
        self.tenants.authenticate(authorization)
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "keel", "max_model_len": self.max_model_len}
            for name in self.model_names
        ]
        return JSONResponse({"object": "list", "data": cards})
