"""OpenAI-compatible request models (with vLLM's extensions) and their 400s.

Requests: `CompletionRequest`, `ChatCompletionRequest`. Parse a JSON body with
`parse_request(Model, body)`, or call `Model.model_validate(body)` and turn a
`pydantic.ValidationError` into a 400 with `validation_error_to_api_error` (validation.py,
re-exported here). Unknown fields are rejected (extra="forbid") inside the body, e.g.
"messages.0.bogus"; at its top level they are kept aside and ignored as vLLM ignores them
(`ignored_fields`; the server logs and counts them: common/api/ignored_fields.py), except
`NOT_IMPLEMENTED` ones set to a value that would change the answer, which are a 400 naming the
field. The error's `param` is the dotted location, e.g. "messages.0.content".
Ranges that the engine owns (temperature, top_p, ...) are checked by `to_sampling_params`, which
raises `InvalidRequestError` with `param` = the request's field name.

Responses live in `common.api.responses` (re-exported here; dump each with
`model_dump_json(exclude_none=True)`), logprob builders in `common.api.logprobs`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from common.api.errors import InvalidRequestError
from common.api.limits import MAX_LOGPROBS, RequestLimits
from common.api.logprobs import (  # noqa: F401 (re-exported)
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    TopLogprob,
    chat_logprobs,
    completion_logprobs,
)
from common.api.responses import (  # noqa: F401 (re-exported)
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from common.api.tools import (  # noqa: F401 (ChatTool, FunctionDefinition: re-exported)
    ChatTool,
    FunctionDefinition,
    ToolChoice,
    check_tool_choice,
    messages_for_template,
    named_tool_schema,
    required_tool_schema,
    template_supports_tools,
)
from common.api.validation import validation_error_to_api_error  # noqa: F401 (re-exported)
from common.engine.sampling_params import SamplingParams, StructuredOutputs

if TYPE_CHECKING:  # the proxy imports these models without torch or tokenizers
    from common.tokenizer import Tokenizer

# vLLM sets no limit; 43 characters of base64 hold the 256 random bits its docs ask for
MAX_CACHE_SALT_CHARS = RequestLimits().max_cache_salt_chars  # internal routes' bound
# on the answer to a request with `resume`: the worker continued it (one that ignores the field
# would start the answer again, and the proxy must not pass that on)
RESUMED_HEADER = "x-pdserve-resumed"
# chat_template_kwargs may not override what the request sets through its own fields
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})

RequestT = TypeVar("RequestT", bound=BaseModel)
# the request fields that constrain the output (structured outputs), at most one per request
_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _invalid(message: str, param: str | None = None) -> PydanticCustomError:
    """A validation error carrying its own message (and `param`, where the loc is not enough)."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Fields that vLLM's server implements and this one does not: set to anything but their inert
# value (None, False, empty) they would change the answer, so they are a 400, not ignored.
NOT_IMPLEMENTED = frozenset(
    {
        "allowed_token_ids",
        "audio",
        "bad_words",
        "echo",
        "function_call",
        "functions",
        "logit_bias",
        "logits_processors",
        "prompt_logprobs",
        "suffix",
        "truncate_prompt_tokens",
        "use_beam_search",
        "web_search_options",
    }
)


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's; ignored


class ResumeParams(_Request):
    """Internal (the proxy's, with the cluster token): continue choice `choice_index` of a
    request another worker started, after its `output_token_ids`, of whose text the client
    has exactly `num_sent_chars` characters (common/engine/request.py's `Resume`)."""

    choice_index: int = Field(ge=0)
    output_token_ids: list[int]
    num_sent_chars: int = Field(ge=0)


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs`: one of json (a schema), regex, choice, grammar, json_object."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    # vLLM's backend options, accepted and ignored: the grammar is the same either way
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @model_validator(mode="after")
    def _check_supported(self) -> StructuredOutputsParams:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise _invalid(f"structured_outputs.{name} is not supported", name)
        return self

    def spec(self) -> StructuredOutputs:
        return StructuredOutputs(
            json=_schema_text(self.json_),
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=None if self.choice is None else tuple(self.choice),
            grammar=self.grammar,
        )


class JsonSchemaFormat(_Request):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output follows the schema either way


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.schema_ is None
        ):
            raise _invalid(
                "response_format json_schema needs json_schema.schema", "response_format"
            )
        return self

    def spec(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputs(json=_schema_text(self.json_schema.schema_))
        return None


def _schema_text(schema: dict[str, Any] | bool | str | None) -> str | None:
    return schema if schema is None or isinstance(schema, str) else json.dumps(schema)


class _GenerationRequest(_Request):
    """Fields shared by both endpoints: sampling, streaming and vLLM's extensions."""

    model_config = ConfigDict(extra="allow")  # unknown top-level fields: see the module doc

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: StrictBool = False  # OpenAI's type; the proxy reads it the same way
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM: prompt_token_ids and token_ids in the response
    kv_transfer_params: dict[str, Any] | None = None  # opaque, for the KV connector
    resume: ResumeParams | None = None  # internal: a migrated stream (`ResumeParams`)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields; at most one of them (`structured`)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the prefix cache is shared only between requests with the same salt (or none)
    cache_salt: str | None = None

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _check_cache_salt(cls, salt: Any) -> Any:
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise _invalid("Parameter 'cache_salt' must be a non-empty string if provided.")
        return salt  # its length: --max-cache-salt-chars (common/api/limits.py)

    @model_validator(mode="after")
    def _check_stream_options(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options can only be set when stream is true", "stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in NOT_IMPLEMENTED and value not in (None, False, [], {}, ""):
                raise _invalid(f"{name} is not supported", name)
        return self

    @property
    def structured_param(self) -> str | None:
        """The one request field that constrains the output; None: none does (400: several)."""
        names = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None]
        if "response_format" in names and self.response_format.type == "text":
            names.remove("response_format")
        if len(names) > 1:
            raise InvalidRequestError(f"set one of {', '.join(names)}, not both", names[1])
        return names[0] if names else None

    def structured_spec(self) -> StructuredOutputs | None:
        """The constraint on the output that the request sets (400 if malformed)."""
        name = self.structured_param
        try:
            if name is None:
                return None
            if name in ("response_format", "structured_outputs"):
                return getattr(self, name).spec()
            value = getattr(self, name)
            if name == "guided_json":
                return StructuredOutputs(json=_schema_text(value))
            if name == "guided_choice":
                return StructuredOutputs(choice=tuple(value))
            return StructuredOutputs(**{name.removeprefix("guided_"): value})
        except ValueError as e:  # StructuredOutputs' own checks
            raise InvalidRequestError(f"{name}: {e}", param=name) from e

    @property
    def ignored_fields(self) -> list[str]:
        """The unknown top-level fields of the request, ignored."""
        return sorted(self.model_extra or {})

    def _sampling_params(
        self, max_tokens: int, logprobs: int | None, names: dict[str, str]
    ) -> SamplingParams:
        """SamplingParams with OpenAI defaults; `names` maps engine fields to request fields."""
        structured = self.structured_spec()
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                temperature=_or(self.temperature, 1.0),
                top_p=_or(self.top_p, 1.0),
                top_k=_or(self.top_k, 0),
                min_p=_or(self.min_p, 0.0),
                seed=self.seed,
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                structured=structured,
                cache_salt=self.cache_salt,
            )
        except ValueError as e:
            field, _, rest = str(e).partition(" ")
            param = names.get(field, field)
            raise InvalidRequestError(f"{param} {rest}", param=param) from e


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, str) or (isinstance(prompt, list) and _is_prompt_list(prompt)):
            batch = prompt if isinstance(prompt, list) and not _is_token_ids(prompt) else [prompt]
            if not batch or any(len(p) == 0 for p in batch):
                raise _invalid("prompt must not be empty")
            return prompt
        raise _invalid(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists"
        )

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise _invalid("echo is not supported", "echo")
        if self.suffix:
            raise _invalid("suffix is not supported", "suffix")
        if self.logit_bias:
            raise _invalid("logit_bias is not supported", "logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise _invalid(f"best_of must equal n ({self.n}) or be unset", "best_of")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids): a batch of one or more."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def to_sampling_params(self, max_tokens_limit: int) -> SamplingParams:
        """`max_tokens_limit`: the tokens left in the context after the prompt."""
        max_tokens = _max_tokens(self.max_tokens, max_tokens_limit, "max_tokens", "prompt")
        return self._sampling_params(max_tokens, self.logprobs, {})


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # so that an image part is named by its type

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # what OpenAI's client sends back with an assistant message it received; ignored
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _check_calls(cls, calls: Any) -> Any:
        for call in calls or []:
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _invalid("each tool call needs a 'function' object with a 'name' string")
            if not isinstance(function.get("arguments", ""), str | dict):
                raise _invalid("a tool call's 'function.arguments' must be a JSON string")
        return calls

    @field_validator("content")
    @classmethod
    def _check_parts(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else []:
            if part.type != "text":
                raise _invalid(f"content part type {part.type!r} is not supported (only 'text')")
            if part.text is None:
                raise _invalid("a content part of type 'text' needs a 'text' field")
        return content

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM does."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (tool_choice required)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise _invalid("messages must not be empty")
        return messages

    @model_validator(mode="after")
    def _check_options(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise _invalid(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise _invalid("continue_final_message needs a final assistant message", "messages")
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(self.chat_template_kwargs or {})
        if reserved:
            names = ", ".join(sorted(reserved))
            raise _invalid(f"chat_template_kwargs may not set {names}", "chat_template_kwargs")
        return self

    def to_sampling_params(self, max_tokens_limit: int) -> SamplingParams:
        """`max_tokens_limit`: the tokens left in the context after the prompt."""
        use_completion = self.max_completion_tokens is not None
        name = "max_completion_tokens" if use_completion else "max_tokens"
        requested = self.max_completion_tokens if use_completion else self.max_tokens
        max_tokens = _max_tokens(requested, max_tokens_limit, name, "messages")
        logprobs = _or(self.top_logprobs, 0) if self.logprobs else None
        names = {"max_tokens": name, "logprobs": "top_logprobs"}
        return self._sampling_params(max_tokens, logprobs, names)

    @property
    def tool_choice_mode(self) -> ToolChoice:
        """`tool_choice` checked against `tools` (400 naming tool_choice if it does not fit)."""
        return check_tool_choice(self.tools, self.tool_choice)

    @property
    def structured_param(self) -> str | None:
        if self.tool_choice_mode.mode in ("required", "named"):
            return "tool_choice"
        return super().structured_param

    def structured_spec(self) -> StructuredOutputs | None:
        """A forced tool choice is a JSON schema over the tools' parameters (vLLM's way), so
        the arguments always parse; it cannot be combined with another structured output."""
        choice = self.tool_choice_mode
        if choice.mode not in ("required", "named"):
            return super().structured_spec()
        other = super().structured_param
        if other is not None:
            raise InvalidRequestError(
                f"tool_choice {choice.mode!r} cannot be combined with {other}", "tool_choice"
            )
        if choice.mode == "required":
            schema = required_tool_schema(self.tools, self.parallel_tool_calls)
        else:
            schema = named_tool_schema(self.tools, choice.name)
        return StructuredOutputs(json=json.dumps(schema))

    def render_prompt(self, tokenizer: Tokenizer) -> str:
        """The prompt text: the chat template applied to the messages, tools and options. A
        template that knows no tools gets them, and past calls and results, as text."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []] or None
        messages: list = self.messages
        if tools or any(m.tool_calls or m.role == "tool" for m in self.messages):
            supports = template_supports_tools(tokenizer.chat_template or "")
            messages = messages_for_template(self.messages, self.tools, supports)
            tools = tools if supports else None
        try:
            prompt = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=self.add_generation_prompt,
                tools=tools,
                **(self.chat_template_kwargs or {}),
            )
        except ValueError as e:
            raise InvalidRequestError(str(e), param="messages") from e
        final = self.messages[-1].text
        if self.continue_final_message and final and final in prompt:
            prompt = prompt[: prompt.rindex(final) + len(final)]  # drop the end-of-turn marker
        return prompt


def parse_request(model: type[RequestT], body: dict[str, Any] | str | bytes) -> RequestT:
    """`model` validated from a JSON object (or its text); a 400 `InvalidRequestError` if bad."""
    try:
        if isinstance(body, dict):
            return model.model_validate(body)
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error_to_api_error(e) from e


def _is_prompt_list(prompt: list) -> bool:
    return all(isinstance(p, (str, list)) for p in prompt) or _is_token_ids(prompt)


def _is_token_ids(prompt: list) -> bool:
    return all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)


def _max_tokens(requested: int | None, limit: int, name: str, prompt_param: str) -> int:
    if limit < 1:
        raise InvalidRequestError(
            "the prompt fills the model's context: no room is left for completion tokens",
            param=prompt_param,
        )
    if requested is not None and requested > limit:
        raise InvalidRequestError(
            f"{name} is too large: {requested} > {limit}, the tokens the model's context "
            "has left after the prompt",
            param=name,
        )
    return limit if requested is None else requested


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
