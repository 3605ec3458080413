"""Tool calling's pure parts (common/api/tools/): the output parsers, whole and streamed, the
schemas that force a tool choice, tool_choice's 400s, and a history rendered for a template
without tool support through the tiny tokenizer's ChatML template."""

from __future__ import annotations

import json
import random
import re

import pytest

from common.api.errors import InvalidRequestError
from common.api.protocol import ChatMessage, ChatTool
from common.api.tools import (
    PARSERS,
    ExtractedToolCalls,
    ToolCall,
    ToolChoice,
    ToolParser,
    check_tool_choice,
    get_parser,
    messages_for_template,
    named_tool_schema,
    required_tool_schema,
    template_supports_tools,
    tool_call_from_named,
    tool_calls_from_required,
)
from common.tokenizer import Tokenizer
from tests.tiny_tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"zone": "東京"}}
ID_FORMAT = re.compile(r"call_[A-Za-z0-9]{24}")


def hermes_block(call: dict, pad: str = "\n") -> str:
    return f"<tool_call>{pad}{json.dumps(call, ensure_ascii=False)}{pad}</tool_call>"


def calls_of(extracted: ExtractedToolCalls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls]


def named(call: dict) -> tuple[str, dict]:
    return call["name"], call["arguments"]


# --- hermes, whole output ---------------------------------------------------------------------


def test_hermes_one_call():
    extracted = get_parser("hermes").extract(hermes_block(WEATHER))
    assert extracted.content is None
    assert calls_of(extracted) == [named(WEATHER)]
    (call,) = extracted.tool_calls
    assert call.type == "function" and ID_FORMAT.fullmatch(call.id)


def test_hermes_several_calls_with_content_before():
    text = f"Let me look.\n{hermes_block(WEATHER)}\n{hermes_block(TIME, pad='')}\n"
    extracted = get_parser("hermes").extract(text)
    assert extracted.content == "Let me look.\n"
    assert calls_of(extracted) == [named(WEATHER), named(TIME)]
    assert len({call.id for call in extracted.tool_calls}) == 2


def test_hermes_unicode_arguments_stay_unescaped():
    extracted = get_parser("hermes").extract(hermes_block(TIME))
    assert extracted.tool_calls[0].function.arguments == '{"zone": "東京"}'


@pytest.mark.parametrize(
    "bad_block",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
    ],
)
def test_hermes_invalid_block_stays_in_content(bad_block):
    text = f"Hi. {bad_block} then {hermes_block(WEATHER)}"
    extracted = get_parser("hermes").extract(text)
    assert extracted.content == f"Hi. {bad_block} then "
    assert calls_of(extracted) == [named(WEATHER)]


def test_hermes_arguments_as_json_text_and_unterminated_last_block():
    as_text = {"name": "get_weather", "arguments": json.dumps(WEATHER["arguments"])}
    text = hermes_block(as_text) + "<tool_call>" + json.dumps(TIME)  # cut at `</tool_call>`
    assert calls_of(get_parser("hermes").extract(text)) == [named(WEATHER), named(TIME)]


def test_hermes_plain_text_and_whitespace():
    assert get_parser("hermes").extract("Just words < tool").content == "Just words < tool"
    assert get_parser("hermes").extract(f" \n{hermes_block(WEATHER)}\n\n").content is None


# --- llama3_json, whole output ----------------------------------------------------------------


def llama3(call: dict, key: str = "parameters") -> str:
    return json.dumps({"name": call["name"], key: call["arguments"]}, ensure_ascii=False)


@pytest.mark.parametrize(
    "text",
    [
        llama3(WEATHER),
        f"<|python_tag|>{llama3(WEATHER)}",
        f"  {llama3(WEATHER, key='arguments')}\n",
    ],
)
def test_llama3_json_one_call(text):
    extracted = get_parser("llama3_json").extract(text)
    assert extracted.content is None
    assert calls_of(extracted) == [named(WEATHER)]


def test_llama3_json_several_calls():
    text = f"{llama3(WEATHER)}; {llama3(TIME)};{llama3(WEATHER)}"
    assert calls_of(get_parser("llama3_json").extract(text)) == [
        named(WEATHER),
        named(TIME),
        named(WEATHER),
    ]


def test_llama3_json_semicolon_inside_arguments():
    call = {"name": "run", "arguments": {"code": "a = 1; b = 2"}}
    assert calls_of(get_parser("llama3_json").extract(llama3(call))) == [named(call)]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        f"{llama3(WEATHER)} and some words",
        f"{llama3(WEATHER)}; not json",
        '{"city": "Paris"}',  # JSON, but not a call
        f"Call: {llama3(WEATHER)}",
    ],
)
def test_llama3_json_anything_else_is_content(text):
    assert get_parser("llama3_json").extract(text) == ExtractedToolCalls(text, [])


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("mistral_v9")


# --- streaming: any split gives what extract gives --------------------------------------------

HERMES_TEXTS = [
    "No tools needed, 2 < 3 and <tool is not a tag.",
    hermes_block(WEATHER),
    f"Let me look.\n{hermes_block(WEATHER)}\n{hermes_block(TIME, pad='')}\n",
    f"Hi. <tool_call>\nnot json\n</tool_call> then {hermes_block(TIME)} after",
    f"  \n{hermes_block(WEATHER)}  \n",
    f"{hermes_block(WEATHER)}<tool_call>{json.dumps(TIME)}",
    "text that ends in <tool_ca",
    "<tool_call>",
    "   ",
]
LLAMA3_TEXTS = [
    llama3(WEATHER),
    f"<|python_tag|>{llama3(WEATHER)}; {llama3(TIME)}",
    "  The weather is fine {not a call}.",
    f"{llama3(WEATHER)}; not json",
    "<|python",
    "<|pythonista",
    "  \n",
]
CASES = [("hermes", text) for text in HERMES_TEXTS] + [("llama3_json", t) for t in LLAMA3_TEXTS]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    calls = [call for delta in deltas for call in delta.tool_calls]
    assert [call.index for call in calls] == list(range(len(calls)))
    assert all(ID_FORMAT.fullmatch(call.id) and call.type == "function" for call in calls)
    content = "".join(delta.content for delta in deltas)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def expected(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, dict]]]:
    extracted = parser.extract(text)
    return extracted.content or "", calls_of(extracted)


@pytest.mark.parametrize(("name", "text"), CASES)
def test_stream_every_split_point(name, text):
    parser = get_parser(name)
    want = expected(parser, text)
    assert streamed(parser, [text]) == want
    assert streamed(parser, list(text)) == want  # one character per delta
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == want, cut


@pytest.mark.parametrize(("name", "text"), CASES)
def test_stream_random_splits(name, text):
    parser = get_parser(name)
    want = expected(parser, text)
    rng = random.Random(text)  # a str seed is the same in every process
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(parser, pieces) == want, pieces


def test_hermes_stream_passes_content_on_early():
    stream = get_parser("hermes").stream()
    assert stream.feed("Let me check <tool").content == "Let me check "
    assert stream.feed("_ca").content == ""  # still maybe a tag
    assert stream.feed("rpet> x").content == "<tool_carpet> x"
    delta = stream.feed(hermes_block(WEATHER))
    assert delta.content == "" and [c.function.name for c in delta.tool_calls] == ["get_weather"]
    assert stream.feed(" ").content == ""  # whitespace right after a call is dropped
    assert stream.feed(" ok").content == "ok"


def test_hermes_stream_emits_each_call_when_it_closes():
    stream = get_parser("hermes").stream()
    first, second = hermes_block(WEATHER), hermes_block(TIME)
    assert stream.feed(first[:-1]).tool_calls == []
    (call,) = stream.feed(first[-1] + second[:5]).tool_calls
    assert call.index == 0 and json.loads(call.function.arguments) == WEATHER["arguments"]
    (call,) = stream.feed(second[5:]).tool_calls
    assert call.index == 1 and call.function.name == "get_time"
    assert stream.finish().tool_calls == []


def test_llama3_stream_passes_plain_text_on_at_once():
    stream = get_parser("llama3_json").stream()
    assert stream.feed("  ").content == ""
    assert stream.feed("The").content == "  The"
    assert stream.feed(" end").content == " end"
    stream = get_parser("llama3_json").stream()
    assert stream.feed('{"name": "get_weather", ').content == ""  # may be a call: held


def test_every_parser_is_streamed_in_the_property_tests():
    assert {name for name, _ in CASES} == set(PARSERS)


# --- forced tool choice -----------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    ChatTool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
    ),
    ChatTool.model_validate({"type": "function", "function": {"name": "get_time"}}),
]


def is_valid(schema: dict, value: object) -> bool:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema checks the schemas")
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_tool_schema(TOOLS, parallel_tool_calls=None)
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    time = {"name": "get_time", "parameters": {"anything": 1}}
    assert is_valid(schema, [weather]) and is_valid(schema, [weather, time])
    assert not is_valid(schema, [])
    assert not is_valid(schema, [{"name": "get_weather", "parameters": {}}])  # city required
    assert not is_valid(schema, [{"name": "delete_all", "parameters": {}}])
    assert not is_valid(schema, [{"name": "get_time"}])
    assert not is_valid(schema, [{**time, "extra": 1}])
    assert not is_valid(schema, [{"name": "get_time", "parameters": "x"}])


def test_required_schema_without_parallel_calls_allows_one():
    one = [{"name": "get_time", "parameters": {}}]
    assert is_valid(required_tool_schema(TOOLS, parallel_tool_calls=False), one)
    assert not is_valid(required_tool_schema(TOOLS, parallel_tool_calls=False), one * 2)
    assert is_valid(required_tool_schema(TOOLS, parallel_tool_calls=True), one * 2)


def test_named_schema_is_the_tools_parameters():
    assert named_tool_schema(TOOLS, "get_weather") == WEATHER_PARAMS
    assert named_tool_schema(TOOLS, "get_time") == {"type": "object"}
    with pytest.raises(InvalidRequestError) as error:
        named_tool_schema(TOOLS, "delete_all")
    assert error.value.status_code == 400 and error.value.param == "tool_choice"
    assert "delete_all" in error.value.message


def test_calls_read_back_from_forced_outputs():
    weather = '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
    text = f'[{weather}, {{"name": "get_time", "parameters": {{}}}}]'
    calls = tool_calls_from_required(text)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Zürich"}'),
        ("get_time", "{}"),
    ]
    assert tool_calls_from_required('[{"name": "get_weather", "parameters": {"ci') == []  # cut
    assert tool_calls_from_required(f'[{weather}, {{"parameters": {{}}}}]') == []  # no name
    assert tool_calls_from_required(weather) == []  # not an array
    call = tool_call_from_named("get_weather", '{"city":"Zürich"}')
    assert isinstance(call, ToolCall) and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Zürich"}
    assert tool_call_from_named("get_weather", '{"ci').function.arguments == '{"ci'


@pytest.mark.parametrize(
    ("tools", "tool_choice", "want"),
    [
        (None, None, ToolChoice("none")),
        (TOOLS, None, ToolChoice("auto")),
        (TOOLS, "auto", ToolChoice("auto")),
        (None, "auto", ToolChoice("none")),
        (TOOLS, "none", ToolChoice("none")),
        (None, "none", ToolChoice("none")),
        (TOOLS, "required", ToolChoice("required")),
        (
            TOOLS,
            {"type": "function", "function": {"name": "get_time"}},
            ToolChoice("named", "get_time"),
        ),
    ],
)
def test_tool_choice_accepted(tools, tool_choice, want):
    assert check_tool_choice(tools, tool_choice) == want


@pytest.mark.parametrize(
    ("tools", "tool_choice", "words"),
    [
        (TOOLS, "any", "'any'"),
        (None, "required", "needs tools"),
        ([], "required", "needs tools"),
        (None, {"type": "function", "function": {"name": "get_time"}}, "no tools"),
        (TOOLS, {"type": "function", "function": {"name": "delete_all"}}, "'delete_all'"),
        (TOOLS, {"type": "function", "function": {}}, "function"),
        (TOOLS, {"type": "function", "function": "get_time"}, "function"),
        (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "function"),
        (TOOLS, {"function": {"name": "get_time"}}, "function"),
    ],
)
def test_tool_choice_refused(tools, tool_choice, words):
    with pytest.raises(InvalidRequestError) as error:
        check_tool_choice(tools, tool_choice)
    assert error.value.status_code == 400 and error.value.param == "tool_choice"
    assert words in error.value.message


# --- rendering --------------------------------------------------------------------------------

QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{ tool | tojson }}"
    "{%- endfor %}{%- endif %}"
)


def test_template_supports_tools():
    assert template_supports_tools(QWEN_LIKE)
    assert template_supports_tools("{% if message.tool_calls %}{{ message.content }}{% endif %}")
    assert not template_supports_tools(CHATML_TEMPLATE)
    assert not template_supports_tools("You can use tools. {{ messages[0]['content'] }}")


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def history() -> list[ChatMessage]:
    return [ChatMessage.model_validate(message) for message in HISTORY]


def test_messages_for_a_template_with_tools_parse_arguments():
    plain = messages_for_template(history(), TOOLS, supports_tools=True)
    assert [message["role"] for message in plain] == ["system", "user", "assistant", "tool"]
    assert plain[2]["content"] == ""
    assert plain[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}
    assert plain[3]["tool_call_id"] == "call_1"
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'


def test_messages_for_a_template_without_tools():
    plain = messages_for_template(history(), TOOLS, supports_tools=False)
    assert [message["role"] for message in plain] == ["system", "user", "assistant", "tool"]
    assert all(isinstance(message["content"], str) for message in plain)
    assert plain[0]["content"].startswith("Be brief.\n\n") and "<tools>" in plain[0]["content"]
    block = get_parser("hermes").extract(plain[2]["content"])
    assert block.content is None and calls_of(block) == [("get_weather", {"city": "Zürich"})]
    assert plain[3]["content"] == '<tool_response>\n{"temp_c": 21}\n</tool_response>'
    without_system = messages_for_template(history()[1:], TOOLS, supports_tools=False)
    assert without_system[0]["role"] == "system" and "get_time" in without_system[0]["content"]
    assert messages_for_template(history()[1:2], None, False) == [
        {"role": "user", "content": "Weather in Zürich?"}
    ]


def test_history_with_tools_renders_through_chatml(tmp_path):
    write_tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert not template_supports_tools(tokenizer.chat_template)
    with pytest.raises(ValueError):  # the raw history: a None content breaks the template
        tokenizer.apply_chat_template(history())
    messages = messages_for_template(history(), TOOLS, supports_tools=False)
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt
    result = '<|im_start|>tool\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>'
    assert result in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
