"""A pydantic validation error as OpenAI's 400: the first error's message, and `param` its
dotted location ("messages.0.content"). The request models are common/api/protocol.py."""

from __future__ import annotations

from pydantic import ValidationError

from common.api.errors import InvalidRequestError


def validation_error_to_api_error(exc: ValidationError) -> InvalidRequestError:
    """The first error as a 400; `param` is its dotted location ("messages.0.content").

    Also takes FastAPI's `RequestValidationError` (its leading "body" location is dropped).
    """
    errors = [{**e, "loc": _strip_body(e["loc"])} for e in exc.errors()]
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    if first["type"] == "invalid_request":
        param = first["ctx"].get("param") or _dotted(first["loc"])
        return InvalidRequestError(first["msg"], param=param)
    if first["type"] == "extra_forbidden":
        param = _dotted(first["loc"])
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}", param=param)
    # a union reports one error per member (locs end in "str", "list[int]", ...): keep the field
    same_field = [e["loc"] for e in errors if e["loc"][:1] == first["loc"][:1]]
    loc = _common_prefix(same_field)
    param = _dotted(loc)
    if not param:
        return InvalidRequestError(first["msg"])
    if len(loc) < len(first["loc"]):
        message = f"{param}: matches no accepted type ({first['msg']}, ...)"
        return InvalidRequestError(message, param=param)
    return InvalidRequestError(f"{param}: {first['msg']}", param=param)


def _strip_body(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    return tuple(loc[1:]) if loc[:1] == ("body",) else tuple(loc)


def _common_prefix(locs: list[tuple[int | str, ...]]) -> tuple[int | str, ...]:
    prefix = locs[0]
    for loc in locs[1:]:
        size = next((i for i, (a, b) in enumerate(zip(prefix, loc)) if a != b), len(prefix))
        prefix = prefix[: min(size, len(loc))]
    return prefix


def _dotted(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)
