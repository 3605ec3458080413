"""What one request may ask for: every size a client controls, bounded before anything is built
from it.

`RequestLimits` holds the limits; the proxy and the workers take the same flags
(`add_limit_flags`, one per field: `--max-n`, `--max-json-depth`, ...) and check every
generation body twice, at the proxy and again at the worker, with `check_body`: on the parsed
JSON object, before a request model, a choice, a grammar or a stream is made from it. A request
over a limit is a 400 in OpenAI's shape (`code: "limit_exceeded"`) whose message names the
limit's flag and whose `param` names the field. docs/security.md lists them.

Two limits act earlier: `max_json_depth` while the body is parsed (`json_depth`, a scan of the
raw bytes, so that no deep structure ever reaches the recursive code that would fail on it), and
`max_header_bytes` in the HTTP server itself (common/api/http_server.py).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from common.api.errors import InvalidRequestError

LIMIT_CODE = "limit_exceeded"
MAX_LOGPROBS = 20  # the most alternatives per token the sampler returns
# the deepest JSON any limit allows: Python's recursive code (json.dumps, pydantic, templates)
# fails near 1000 levels, less whatever stack its caller already holds
MAX_JSON_DEPTH = 256


def _limit(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = _limit(128, "choices a request may ask for (n, best_of)")
    max_logprobs: int = _limit(MAX_LOGPROBS, "alternatives per token (logprobs, top_logprobs)")
    max_tokens: int = _limit(1 << 20, "tokens a choice may ask for (max_tokens); a worker "
                             "bounds it by its model's context too")  # fmt: skip
    max_stop: int = _limit(16, "stop strings of a request")
    max_stop_chars: int = _limit(1024, "characters of one stop string")
    max_stop_token_ids: int = _limit(1024, "stop_token_ids of a request")
    max_tools: int = _limit(128, "tools of a chat request")
    max_tools_bytes: int = _limit(256 << 10, "bytes of a request's tools, as JSON")
    max_spec_bytes: int = _limit(64 << 10, "bytes of a structured output's spec (JSON schema, "
                                 "regex, grammar or choices)")  # fmt: skip
    max_choices: int = _limit(1024, "options of a choice (guided_choice)")
    max_json_depth: int = _limit(64, "nesting of a body's JSON, and of JSON in its strings "
                                 "(tool-call arguments, schemas)")  # fmt: skip
    max_fields: int = _limit(256, "top-level fields of a body (unknown ones are ignored)")
    max_header_bytes: int = _limit(64 << 10, "bytes of a request's line and headers; 431 "
                                   "above, the connection closed")  # fmt: skip
    max_request_id_chars: int = _limit(256, "characters of an X-Request-Id")
    max_cache_salt_chars: int = _limit(1024, "characters of a cache_salt")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{_flag(f.name)} must be >= 1, got {getattr(self, f.name)}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be <= {MAX_LOGPROBS}, got {self.max_logprobs}")
        if self.max_json_depth > MAX_JSON_DEPTH:
            raise ValueError(
                f"--max-json-depth must be <= {MAX_JSON_DEPTH}, got {self.max_json_depth}"
            )
        if self.max_header_bytes < 1024:
            raise ValueError(f"--max-header-bytes must be >= 1024, got {self.max_header_bytes}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_limit_flags(parser: argparse.ArgumentParser, show_defaults: bool = True) -> None:
    """One flag per limit; `show_defaults` False: they default to None (the proxy's parser,
    whose config file may set them: `limits_from`)."""
    group = parser.add_argument_group(
        "request limits", "a request above one is a 400 naming it (docs/security.md)"
    )
    add = group.add_argument
    for f in fields(RequestLimits):
        default = f"default {f.default}" if show_defaults else str(f.default)
        add(
            _flag(f.name),
            type=int,
            default=f.default if show_defaults else None,
            metavar="N",
            help=f"the most {f.metadata['help']} ({default})",
        )


LIMIT_NAMES = frozenset(f.name for f in fields(RequestLimits))


def limits_from(settings: dict[str, Any]) -> RequestLimits:
    """The limits that `settings` (flags, a config file) name; the others keep their defaults."""
    given = {k: v for k, v in settings.items() if k in LIMIT_NAMES and v is not None}
    return RequestLimits(**given)


class LimitExceededError(InvalidRequestError):
    def __init__(self, what: str, value: int, name: str, limit: int, param: str | None):
        super().__init__(
            f"{what} is {value}; the limit is {limit} ({_flag(name)})", param=param, code=LIMIT_CODE
        )


def _bound(value: int, name: str, limits: RequestLimits, what: str, param: str | None) -> None:
    limit = getattr(limits, name)
    if value > limit:
        raise LimitExceededError(what, value, name, limit, param)


def check_request_id(request_id: str, limits: RequestLimits) -> None:
    """400 for an `X-Request-Id` longer than the limit (ids are kept while a request runs)."""
    _bound(len(request_id), "max_request_id_chars", limits, "the length of X-Request-Id", None)


# -- the body --------------------------------------------------------------------------------------


def check_body(body: dict[str, Any], is_chat: bool, limits: RequestLimits) -> None:
    """400 (`LimitExceededError`) for the first limit `body`, a generation request, exceeds.
    Fields of the wrong type are left to the request models (they answer 400 themselves)."""
    _bound(len(body), "max_fields", limits, "the number of top-level fields", None)
    for name in ("n", "best_of"):
        if _is_int(value := body.get(name)):
            _bound(value, "max_n", limits, name, name)
    for name in ("logprobs", "top_logprobs") if not is_chat else ("top_logprobs",):
        if _is_int(value := body.get(name)):
            _bound(value, "max_logprobs", limits, name, name)
    for name in ("max_tokens", "max_completion_tokens"):
        if _is_int(value := body.get(name)):
            _bound(value, "max_tokens", limits, name, name)
    if isinstance(salt := body.get("cache_salt"), str):
        _bound(len(salt), "max_cache_salt_chars", limits, "the length of cache_salt", "cache_salt")
    _check_stop(body, limits)
    _check_specs(body, limits)
    if is_chat:
        _check_tools(body.get("tools"), limits)
        _check_messages(body.get("messages"), limits)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_stop(body: dict[str, Any], limits: RequestLimits) -> None:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    _bound(len(stops), "max_stop", limits, "the number of stop strings", "stop")
    for text in stops:
        if isinstance(text, str):
            _bound(len(text), "max_stop_chars", limits, "the length of a stop string", "stop")
    ids = body.get("stop_token_ids")
    if isinstance(ids, list):
        _bound(len(ids), "max_stop_token_ids", limits, "the number of stop_token_ids",
               "stop_token_ids")  # fmt: skip


# where a structured output's spec sits in a body: (field, key inside it or None)
_SPECS = (
    ("guided_json", None),
    ("guided_regex", None),
    ("guided_grammar", None),
    ("guided_choice", None),
    ("structured_outputs", "json"),
    ("structured_outputs", "regex"),
    ("structured_outputs", "grammar"),
    ("structured_outputs", "choice"),
    ("response_format", "json_schema"),
)


def _check_specs(body: dict[str, Any], limits: RequestLimits) -> None:
    for name, key in _SPECS:
        spec = body.get(name)
        if key is not None:
            spec = spec.get(key) if isinstance(spec, dict) else None
        if spec is None:
            continue
        param = name if key is None else f"{name}.{key}"
        if isinstance(spec, list):  # a choice
            _bound(len(spec), "max_choices", limits, f"the number of options of {param}", param)
        size = _json_size(spec)
        _bound(size, "max_spec_bytes", limits, f"the size of {param} in bytes", param)
        if isinstance(spec, str) and param in ("guided_json", "structured_outputs.json"):
            _check_text_depth(spec, limits, param)  # a schema given as JSON text


def _check_tools(tools: Any, limits: RequestLimits) -> None:
    if not isinstance(tools, list):
        return
    _bound(len(tools), "max_tools", limits, "the number of tools", "tools")
    _bound(_json_size(tools), "max_tools_bytes", limits, "the size of tools in bytes", "tools")


def _check_messages(messages: Any, limits: RequestLimits) -> None:
    """Tool-call arguments are JSON inside a string: the template gets them parsed."""
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                _check_text_depth(arguments, limits, param)


def _check_text_depth(text: str, limits: RequestLimits, param: str) -> None:
    depth = json_depth(text.encode("utf-8", "surrogatepass"))
    _bound(depth, "max_json_depth", limits, f"the nesting depth of {param}", param)


def _json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON (the body's depth is bounded, so this cannot recurse
    too deep); a string's own length in UTF-8."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"))  # fmt: skip


# -- JSON nesting, from the raw bytes ------------------------------------------------------------

_STRING = re.compile(rb'"[^"]*"')  # a JSON string once its escapes are gone
_NOT_SYNTAX = bytes(b for b in range(256) if b not in b'[]{}":')
_CODES = bytes.maketrans(b"[{]}:", b"\x01\x01\xff\xff\x00")  # +1 opens, -1 closes, 0 a colon


def json_shape(raw: bytes) -> tuple[int, int]:
    """(the deepest nesting of arrays and objects, the number of fields of the top-level
    object) of JSON text `raw`; brackets and colons inside strings do not count. Linear, in C:
    escaped backslashes and quotes go (a backslash left then escapes a letter or a slash), then
    all but brackets, colons and quotes, then the strings (by a regex, now short), and numpy
    sums the rest. Meant for text on its way to `json.loads`: malformed text gives some
    numbers, and the parser then reports the error."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    syntax = unescaped.translate(None, _NOT_SYNTAX)
    codes = np.frombuffer(_STRING.sub(b"", syntax).translate(_CODES), dtype=np.int8)
    if not codes.size:
        return 0, 0
    depth = np.cumsum(codes, dtype=np.int32)
    num_fields = int(np.count_nonzero((codes == 0) & (depth == 1)))
    return int(depth.max()), num_fields


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text `raw` (`json_shape`)."""
    return json_shape(raw)[0]


def loads_bounded(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)`, for JSON that no edge has bounded (a model's output, say): a
    ValueError, as for malformed JSON, where it nests deeper than `max_depth`."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") > max_depth and json_depth(raw) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth}")
    return json.loads(text)


def check_shape(raw: bytes, max_depth: int, max_fields: int | None = None) -> None:
    """400 if `raw`, a JSON body, nests deeper than `max_depth` or its object has more than
    `max_fields` fields: before it is parsed (a parse of 100,000 fields holds the event loop
    for a tenth of a second). Free where the brackets and colons cannot reach the limits."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth and (
        max_fields is None or raw.count(b":") <= max_fields
    ):
        return
    depth, num_fields = json_shape(raw)
    if depth > max_depth:
        raise LimitExceededError(
            "the nesting depth of the request body", depth, "max_json_depth", max_depth, None
        )
    if max_fields is not None and num_fields > max_fields:
        raise LimitExceededError(
            "the number of top-level fields", num_fields, "max_fields", max_fields, None
        )
