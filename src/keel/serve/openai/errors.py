"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# Status -> OpenAI error type (what the official clients map to exception classes).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client: status, message, and the field it concerns."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(-(-self.retry_after // 1))))  # whole seconds, rounded up
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def check_model_name(model: str | None, served: tuple[str, ...], param: str | None = "model") -> None:
    """404 unless the request's model is one of the served names (or left out: absent, null or "", as vLLM's
    _is_model_supported takes any falsy name for the served model)."""
    if model and model not in served:
        names = ", ".join(repr(name) for name in served)
        raise APIError(
            404, f"model {model!r} does not exist; this server serves {names}", param=param, code="model_not_found"
        )
