"""API errors: raised by the routes and schemas, answered in the shape of the dialect
the request spoke (OpenAI's, Ollama's or Anthropic's)."""

from __future__ import annotations

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """An error answered with ``status``: ``body`` is OpenAI's shape
    (``{"error": {"message", "type", "param", "code"}}``), ``body_for`` the dialect's."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def body_for(self, path: str) -> dict:
        """The error in the shape of the API ``path`` belongs to: Ollama's
        ``{"error": message}``, Anthropic's ``{"type": "error", "error": {type, message}}``,
        else OpenAI's."""
        kind = dialect(path)
        if kind == "ollama":
            return {"error": self.message}
        if kind == "anthropic":
            name = _ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": name, "message": self.message}}
        return self.body


# Anthropic's error types by status (its API reference, "Errors").
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def dialect(path: str) -> str:
    """Which client dialect a request path speaks: "ollama", "anthropic" or "openai"."""
    if path.startswith("/api/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai"


def validation_error(errors: list) -> ApiError:
    """A 400 naming the first bad field (FastAPI's default is a 422 of another shape)."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    where = f"{param}: " if param else ""
    return ApiError(400, f"{where}{first.get('msg', 'invalid value')}", param=param)
