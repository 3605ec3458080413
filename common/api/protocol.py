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
from common.api.validation import validation_error_to_api_error  # noqa: F401 (re-exported)
from common.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the proxy imports these models without torch or tokenizers
    from common.tokenizer import Tokenizer

MAX_LOGPROBS = 20
# on the answer to a request with `resume`: the worker continued it (one that ignores the field
# would start the answer again, and the proxy must not pass that on)
RESUMED_HEADER = "x-pdserve-resumed"
# chat_template_kwargs may not override what the request sets through its own fields
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})

RequestT = TypeVar("RequestT", bound=BaseModel)


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
        "guided_choice",
        "guided_grammar",
        "guided_json",
        "guided_regex",
        "logit_bias",
        "logits_processors",
        "prompt_logprobs",
        "structured_outputs",
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

    @model_validator(mode="after")
    def _check_stream_options(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options can only be set when stream is true", "stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in NOT_IMPLEMENTED and value not in (None, False, [], {}, ""):
                raise _invalid(f"{name} is not supported", name)
        return self

    @property
    def ignored_fields(self) -> list[str]:
        """The unknown top-level fields of the request, ignored."""
        return sorted(self.model_extra or {})

    def _sampling_params(
        self, max_tokens: int, logprobs: int | None, names: dict[str, str]
    ) -> SamplingParams:
        """SamplingParams with OpenAI defaults; `names` maps engine fields to request fields."""
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


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # ignored: no tool-call parsing
    response_format: ResponseFormat | None = None
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
        if self.tool_choice not in (None, "none", "auto"):
            raise _invalid(f"tool_choice {self.tool_choice!r} is not supported", "tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            kind = self.response_format.type
            raise _invalid(f"response_format {kind!r} is not supported", "response_format")
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

    def render_prompt(self, tokenizer: Tokenizer) -> str:
        """The prompt text: the chat template applied to the messages, tools and options."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []] or None
        try:
            prompt = tokenizer.apply_chat_template(
                self.messages,
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
