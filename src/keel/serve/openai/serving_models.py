"""GET /v1/models: the one model this server serves."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from keel.serve.openai.tenants import Tenants


class OpenAIServingModels:
    def __init__(self, model_name: str, max_model_len: int, tenants: Tenants) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tenants = tenants

    def list_models(self, authorization: str | None) -> JSONResponse:
        self.tenants.authenticate(authorization)
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "keel",
            "max_model_len": self.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})
