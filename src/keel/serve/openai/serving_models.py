"""GET /v1/models (vLLM's list: a card per name this server answers to) and GET /v1/models/{id} (OpenAI's
retrieve: one card, or 404 in OpenAI's shape)."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from keel.serve.openai.errors import check_model_name
from keel.serve.openai.tenants import Tenants


class OpenAIServingModels:
    def __init__(self, model_names: tuple[str, ...], max_model_len: int, tenants: Tenants, root: str = "") -> None:
        self.model_names = model_names
        self.root = root or model_names[0]
        self.max_model_len = max_model_len
        self.tenants = tenants
        self.created = int(time.time())  # when the server started serving, as vLLM's cards say

    def _card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "keel",
            # vLLM's card: the model it serves (`root`), no parent (a base model, not a LoRA adapter), and
            # OpenAI's legacy permission object, which some clients still read
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    def list_models(self, authorization: str | None) -> JSONResponse:
        self.tenants.authenticate(authorization)
        return JSONResponse({"object": "list", "data": [self._card(name) for name in self.model_names]})

    def retrieve_model(self, model_id: str, authorization: str | None) -> JSONResponse:
        self.tenants.authenticate(authorization)
        check_model_name(model_id, self.model_names, param=None)  # a path segment, not a body field
        return JSONResponse(self._card(model_id))
