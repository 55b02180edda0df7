"""The API's one error: what every stage of a request raises to refuse it with an OpenAI-style
body and a 4xx/5xx status. Below the stages (:mod:`engine.api.openai_schema` parses,
:mod:`engine.api.admit` admits, :mod:`engine.api.generate` generates, :mod:`engine.api.openai_answer`
shapes), so each can refuse without importing another; the HTTP layer (:mod:`engine.api.server`)
turns it into the answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import DeskfleetError

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


class ApiError(DeskfleetError):
    """A request the API answers with an OpenAI-style error body and a 4xx/5xx status."""

    def __init__(self, status: int, message: str, code: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        """OpenAI's error ``type`` for this status."""
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The JSON error body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 for an invalid request: ``invalid_value`` naming its field, else ``invalid_request``."""
    return ApiError(400, message, "invalid_value" if param else "invalid_request", param=param)


def model_not_found(model: str, served: Sequence[str]) -> ApiError:
    """The 404 for a request naming a model this server does not serve."""
    listed = ", ".join(repr(m) for m in served) or "none right now"
    return ApiError(404, f"model {model!r} is not served here; served models: {listed} (see /v1/models)",
                    "model_not_found", param="model")
