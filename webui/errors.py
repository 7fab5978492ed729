"""OpenAI-style API errors, and how fabric errors become them.

Every error the API returns is ``{"error": {"message", "type", "param", "code"}}`` with
an HTTP status; handlers raise ``ApiError`` and one error handler renders it.
"""
from __future__ import annotations

from dataclasses import dataclass

from fabric.client import FabricError
from fabric.wire.protocol import ErrorCode

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


@dataclass(eq=False)  # not frozen: Python sets __traceback__ and friends on exceptions
class ApiError(Exception):
    """An error response: HTTP ``status`` plus the OpenAI error object's fields."""

    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        """A 400 for a request the client got wrong."""
        return cls(400, message, INVALID_REQUEST, param, code)


# fabric ErrorCode -> (HTTP status, OpenAI error type, OpenAI error code, param)
_FABRIC_ERRORS: dict[str, tuple[int, str, str, str | None]] = {
    ErrorCode.UNKNOWN_MODEL: (404, INVALID_REQUEST, "model_not_found", "model"),
    ErrorCode.BAD_REQUEST: (400, INVALID_REQUEST, "bad_request", None),
    ErrorCode.PROMPT_TOO_LONG: (400, INVALID_REQUEST, "context_length_exceeded", None),
    ErrorCode.BUSY: (429, "rate_limit_error", "busy", None),
    ErrorCode.NO_ROUTE: (503, SERVER_ERROR, "no_route", None),
    ErrorCode.HOP_FAILED: (502, SERVER_ERROR, "hop_failed", None),
    ErrorCode.CANCELLED: (503, SERVER_ERROR, "cancelled", None),
    ErrorCode.INTERNAL: (500, SERVER_ERROR, "internal", None),
    ErrorCode.TRACKER_UNAVAILABLE: (503, SERVER_ERROR, "tracker_unavailable", None),
    ErrorCode.TRACKER_STARTING: (503, SERVER_ERROR, "tracker_starting", None),
    ErrorCode.LEAVING: (503, SERVER_ERROR, "node_leaving", None),
}


# fields a head names at the start of a refusal ("tools: this model's chat template ..."): the param
HEAD_NAMED = ("tools", "tool_choice", "response_format")


def from_fabric(code: str | None, message: str) -> ApiError:
    """The API error for a fabric error ``code`` (an ``ErrorCode`` value)."""
    status, type_, api_code, param = _FABRIC_ERRORS.get(code or "", _FABRIC_ERRORS[ErrorCode.INTERNAL])
    if code == ErrorCode.BAD_REQUEST and param is None:
        param = next((name for name in HEAD_NAMED if (message or "").startswith(name + ": ")), None)
    return ApiError(status, message or f"fabric error {code}", type_, param, api_code)


def fabric_timeout() -> ApiError:
    return ApiError(504, "the fabric did not answer in time", SERVER_ERROR, None, "timeout")


def api_error_from(exc: BaseException) -> ApiError | None:
    """The API error for an exception raised by the fabric client, or None if foreign."""
    if isinstance(exc, FabricError):
        return from_fabric(getattr(exc, "code", None), getattr(exc, "message", "") or str(exc))
    if isinstance(exc, TimeoutError):
        return fabric_timeout()
    return None
