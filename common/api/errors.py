"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

A user's mistake is an `APIError` with a 4xx status (and `param` naming the field when there is
one); only the server's own failures are 5xx.
"""

from __future__ import annotations

from http import HTTPStatus

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    status_code: int = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type: str = "server_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=self.error_type, param=self.param, code=self.code
            )
        )


class InvalidRequestError(APIError):
    status_code = HTTPStatus.BAD_REQUEST
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = HTTPStatus.UNAUTHORIZED
    error_type = "authentication_error"


class NotFoundError(APIError):
    status_code = HTTPStatus.NOT_FOUND
    error_type = "not_found_error"


class PayloadTooLargeError(APIError):
    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    error_type = "invalid_request_error"


class OverloadedError(APIError):
    status_code = HTTPStatus.TOO_MANY_REQUESTS
    error_type = "rate_limit_error"


class UnavailableError(APIError):
    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "service_unavailable"


class WorkerDrainingError(UnavailableError):
    """A generation this worker ended on SIGTERM under `--drain-migrate`: the proxy moves it
    to another worker (a type of its own, so that it is told from any other 503)."""

    error_type = "worker_draining"

    def __init__(self, message: str = "the worker is draining: this generation moves elsewhere"):
        super().__init__(message, code=503)


class ServerError(APIError):
    status_code = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type = "server_error"
