"""The errors a client gets, in the OpenAI shape: {"error": {"message", "type", "param", "code"}} and a status.

Every refusal of what a client sent is an APIError raised where the fault is found; the app turns it into its
response. Anything else that escapes is the server's own fault (a 500, logged).
"""

from __future__ import annotations


class APIError(Exception):
    """status: the HTTP status; message: one line naming what is wrong; param: the request field at fault (None when
    it is the request as a whole); code: a short machine-readable reason; headers: extra response headers (such as
    Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 for a field (or a request) that is not valid."""
    return APIError(400, message, param=param, code=code)


def busy(message: str, retry_after: int = 1) -> APIError:
    """A 429: the queue is full; try again after `retry_after` seconds."""
    return APIError(429, message, code="queue_full", type="rate_limit_error",
                    headers={"Retry-After": str(retry_after)})


def unavailable(message: str, retry_after: int = 5) -> APIError:
    """A 503: the server is loading the model or shutting down."""
    return APIError(503, message, code="unavailable", type="server_error", headers={"Retry-After": str(retry_after)})
