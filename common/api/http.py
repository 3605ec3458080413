"""HTTP plumbing both the workers and the proxy use, torch-free: reading a JSON body within a
size limit, and turning every error into OpenAI's shape."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.api.errors import (
    APIError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    ServerError,
)
from common.api.limits import RequestLimits, check_shape

logger = logging.getLogger(__name__)

__all__ = [
    "error_response",
    "install_error_handlers",
    "json_body_openapi",
    "parse_json_object",
    "read_body",
    "read_json_body",
]


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; 413 past `limit` bytes (announced or as it streams in)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"request body is {length} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


_MAX_DEPTH = RequestLimits().max_json_depth


async def read_json_body(
    request: Request, limit: int, max_depth: int = _MAX_DEPTH, max_fields: int | None = None
) -> dict:
    """The request's JSON object; 413 past `limit` bytes, 400 for anything not a JSON object,
    nested deeper than `max_depth` or with more than `max_fields` fields."""
    return parse_json_object(await read_body(request, limit), max_depth, max_fields)


# a \uXXXX escape of a UTF-16 surrogate: a pair is one character, a lone one is no text at all
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_object(
    raw: bytes, max_depth: int = _MAX_DEPTH, max_fields: int | None = None
) -> dict:
    """A request body as a JSON object of UTF-8 text, nested at most `max_depth` deep, with at
    most `max_fields` fields (None: any); 400 for anything else (a deep or wide body never
    reaches the parser, nor any recursive code after it)."""
    check_shape(raw, max_depth, max_fields)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"request body is not UTF-8: {e}") from e
    except (ValueError, RecursionError) as e:  # also: nested too deep, an int of 4300+ digits
        raise InvalidRequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # rare: check that every string is encodable text
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError) as e:
            raise InvalidRequestError("request body holds a lone UTF-16 surrogate escape") from e
    return data


def json_body_openapi(model: type[BaseModel]) -> dict:
    """`openapi_extra` of a route that parses its own body: `model` as its JSON request body,
    sub-models inlined so that the schema stands alone in the OpenAPI document."""
    schema = model.model_json_schema()
    schema = _inline_refs(schema, schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _inline_refs(node, defs: dict):
    if isinstance(node, dict):
        if "$ref" in node:  # "#/$defs/Name"; the models are not recursive
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {key: _inline_refs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline_refs(value, defs) for value in node]
    return node


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
