"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

A user's mistake is an `APIError` with a 4xx status (and `param` naming the field when there is
one); only the server's own failures are 5xx. Every error says whose fault it is:

- `type`: OpenAI's kind (`invalid_request_error`, `server_error`, ...);
- `code`: a stable machine name (`grammar_violation`, `limit_exceeded`, `kv_transfer_failed`,
  `worker_draining`, ...): its class's, or a finer one its raise names;
- the status: a body's HTTP status; an error event inside a stream whose 200 was already sent
  carries the status it would have had as `status`, next to the four fields (`to_event`).

A 4xx is the request's fault: another worker would refuse it too, so the proxy passes it on and
never retries or moves it; a 5xx is the worker's (`fault_of`; docs/security.md, "Errors and
whose fault they are").
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Literal

from pydantic import BaseModel

Fault = Literal["request", "worker"]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamErrorInfo(ErrorInfo):
    status: int  # the HTTP status the error would have had before the stream began


class StreamError(BaseModel):
    """An error event's payload, in a stream whose 200 was already sent."""

    error: StreamErrorInfo


# 4xx statuses that speak of the worker or the cluster, not of the request: the proxy's
# --internal-token does not match the worker's (401, 403), the worker is full (429) or timed out
# waiting (408). Another worker may well take the request.
_WORKER_STATUSES = frozenset({401, 403, 408, 429})


def is_request_fault(status: int) -> bool:
    """A 4xx but those of `_WORKER_STATUSES`: the request's own fault, final (another worker
    would answer the same)."""
    return 400 <= status < 500 and status not in _WORKER_STATUSES


def fault_of(error: object) -> Fault:
    """Whose fault an error event says it is (`error`: the value of its "error"): by its
    `status`, or by an integer `code` (how the proxy wrote its own events before `status`
    existed). Anything else, such as an older worker's untyped event (`code` null, no
    `status`), is the worker's: it moves, as it always did."""
    fields = error if isinstance(error, dict) else {}
    status = fields.get("status")
    if not isinstance(status, int):
        status = fields.get("code")
    return "request" if isinstance(status, int) and is_request_fault(status) else "worker"


class APIError(Exception):
    status_code: int = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type: str = "server_error"
    error_code: str | None = None  # the class's `code` when a raise names none (else its type)

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.error_code or self.error_type
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=self.error_type, param=self.param, code=self.code
            )
        )

    def to_event(self) -> StreamError:
        """The same error inside a stream: its status travels in the payload."""
        info = self.to_response().error.model_dump()
        return StreamError(error=StreamErrorInfo(**info, status=int(self.status_code)))


class InvalidRequestError(APIError):
    status_code = HTTPStatus.BAD_REQUEST
    error_type = "invalid_request_error"
    error_code = "invalid_request"


class AuthenticationError(APIError):
    status_code = HTTPStatus.UNAUTHORIZED
    error_type = "authentication_error"
    error_code = "unauthenticated"


class NotFoundError(APIError):
    status_code = HTTPStatus.NOT_FOUND
    error_type = "not_found_error"
    error_code = "not_found"


class PayloadTooLargeError(APIError):
    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    error_type = "invalid_request_error"
    error_code = "body_too_large"


class OverloadedError(APIError):
    status_code = HTTPStatus.TOO_MANY_REQUESTS
    error_type = "rate_limit_error"
    error_code = "overloaded"


class UnavailableError(APIError):
    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "service_unavailable"
    error_code = "unavailable"


class WorkerDrainingError(UnavailableError):
    """A generation this worker ended on SIGTERM under `--drain-migrate`: the proxy moves it
    to another worker (a type and code of their own, so that it is told from any other 503)."""

    error_type = "worker_draining"
    error_code = "worker_draining"

    def __init__(self, message: str = "the worker is draining: this generation moves elsewhere"):
        super().__init__(message)


class ServerError(APIError):
    status_code = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type = "server_error"
    error_code = "internal_error"
