"""HTTP plumbing both the workers and the proxy use, torch-free: reading a JSON body within a
size limit, and turning every error into OpenAI's shape."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.api.errors import (
    APIError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    ServerError,
)

logger = logging.getLogger(__name__)

__all__ = ["error_response", "install_error_handlers", "read_json_body"]


async def read_json_body(request: Request, limit: int) -> dict:
    """The request's JSON object; 413 past `limit` bytes, 400 for anything not a JSON object."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"request body is {length} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(bytes(body).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"request body is not UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return data


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        err.to_response().model_dump(), status_code=int(err.status_code), headers=err.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(InvalidRequestError(first.get("msg", "invalid request"), param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        err = (
            NotFoundError(f"no route {request.method} {request.url.path}")
            if exc.status_code == 404
            else InvalidRequestError(str(exc.detail))
        )
        err.status_code = exc.status_code
        return error_response(err)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(ServerError(f"internal error: {type(exc).__name__}"))
