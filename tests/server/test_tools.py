"""Tool calling: request checks, template messages (rendered with Qwen3's real template), and tool calls parsed
out of generated text in both Qwen formats, whole and streamed in any split."""

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.server.protocol import APIError
from moestream.server.tools import (
    ToolCallStream,
    ToolChoice,
    call_schema,
    check_tools,
    parse_tool_calls,
    template_messages,
)

TEMPLATE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_chat_template.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
        "metric": {"type": "boolean"}, "options": {"type": "object"}, "hours": {"type": "array"},
        "note": {"type": ["null", "string"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, CLOCK]


def json_block(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def xml_block(name: str, **params: str) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


def calls_of(text: str, tools=TOOLS) -> list[tuple[str, dict]]:
    _, calls = parse_tool_calls(text, tools)
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ---- parsing whole texts ----

def test_qwen3_json_call_with_text_before():
    content, calls = parse_tool_calls("Let me look.\n\n" + json_block("get_weather", {"city": "Paris"}), TOOLS)
    assert content == "Let me look."
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].arguments == '{"city": "Paris"}'
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29 and int(calls[0].id[5:], 16) >= 0


def test_qwen3_coder_xml_call_is_typed_by_the_schema():
    text = xml_block("get_weather", city="New York", days="3", scale="1.5", metric="true", options='{"a": [1]}',
                     hours="[9, 17]", note="null", limit="7")
    assert calls_of(text) == [("get_weather", {"city": "New York", "days": 3, "scale": 1.5, "metric": True,
                                               "options": {"a": [1]}, "hours": [9, 17], "note": None, "limit": 7})]


@pytest.mark.parametrize("key, raw, value", [
    ("city", "\n  two\nlines  \n", "\n  two\nlines  \n"),  # one newline each side stripped, no more
    ("city", "42", "42"), ("city", "null", "null"), ("days", "3.5", "3.5"), ("days", "many", "many"),
    ("days", "true", "true"), ("scale", "2", 2), ("scale", "NaN", "NaN"), ("scale", "1e999", "1e999"),
    ("metric", "False", False), ("metric", "yes", "yes"), ("options", "[1]", "[1]"), ("options", "{", "{"),
    ("hours", "{}", "{}"), ("note", "hi", "hi"), ("limit", "ten", "ten"), ("unknown", "3", "3"),
])
def test_xml_values_that_do_not_fit_their_type_stay_strings(key, raw, value):
    text = f"<tool_call>\n<function=get_weather>\n<parameter={key}>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(text) == [("get_weather", {key: value})]


def test_xml_parameter_left_unclosed_ends_at_the_next_one():
    text = "<tool_call><function=get_weather><parameter=city>Oslo<parameter=days>2</function></tool_call>"
    assert calls_of(text) == [("get_weather", {"city": "Oslo", "days": 2})]


def test_json_values_quoted_by_the_model_are_coerced_when_the_schema_says_so():
    arguments = {"city": "7", "days": "3", "scale": "0.5", "metric": "false", "limit": "9", "hours": "[1]",
                 "note": "5", "extra": "1", "options": {"deep": "2"}}
    coerced = dict(arguments, days=3, scale=0.5, metric=False)  # limit and note may be strings; hours is no scalar
    assert calls_of(json_block("get_weather", arguments)) == [("get_weather", coerced)]
    assert calls_of(json_block("get_weather", {"days": "three"})) == [("get_weather", {"days": "three"})]


def test_json_arguments_given_as_text_or_left_out():
    quoted = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    assert calls_of(quoted) == [("get_weather", {"city": "Rome"})]
    assert calls_of('<tool_call>{"name": "now"}</tool_call>') == [("now", {})]


def test_several_calls_in_order_with_text_between_and_after():
    text = ("a " + json_block("now", {}) + " b\n" + xml_block("get_weather", city="Lima") + "\n\n"
            + json_block("get_weather", {"city": "Quito", "days": 1}) + "  c  ")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "a  b\n\n\n  c"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("now", {}), ("get_weather", {"city": "Lima"}), ("get_weather", {"city": "Quito", "days": 1})]
    assert len({c.id for c in calls}) == 3


def test_non_ascii_arguments_are_written_as_they_are():
    _, calls = parse_tool_calls(xml_block("get_weather", city="Zürich 東京"), TOOLS)
    assert calls[0].arguments == '{"city": "Zürich 東京"}'


MALFORMED = [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",  # bad JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": ["now"], "arguments": {}}</tool_call>',
    json_block("delete_everything", {}),  # not among the tools
    xml_block("delete_everything", city="x"),
    '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "now", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
    '<tool_call>["now"]</tool_call>',
    "<tool_call>now()</tool_call>",
    "<tool_call></tool_call>",
    "<tool_call><function=get_weather><parameter=city>x</parameter></tool_call>",  # no </function>
    "<tool_call><function=get_weather>junk<parameter=city>x</parameter></function></tool_call>",
    "<tool_call>" + "[" * 100_000 + "</tool_call>",  # deeper than json can recurse
    '<tool_call>{"name": "now", "arguments": {}}',  # never closed
    "<tool_call>",
]


@pytest.mark.parametrize("block", MALFORMED)
def test_malformed_blocks_stay_in_the_content_verbatim(block):
    assert parse_tool_calls("before " + block, TOOLS) == ("before " + block, [])
    if "</tool_call>" in block:  # a good call after a closed bad block is still a call
        content, calls = parse_tool_calls("before " + block + " " + json_block("now", {}), TOOLS)
        assert content == "before " + block and [c.name for c in calls] == ["now"]


def test_a_block_ends_at_the_first_close_tag():
    text = "<tool_call>x <tool_call>" + '{"name": "now", "arguments": {}}</tool_call></tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, [])
    assert parse_tool_calls("</tool_call> plain", TOOLS) == ("</tool_call> plain", [])


def test_without_tools_nothing_is_a_call():
    text = json_block("now", {})
    assert parse_tool_calls(text, []) == (text, []) and parse_tool_calls(" hi ", TOOLS) == ("hi", [])


# ---- streaming ----

def stream(pieces: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    s, events = ToolCallStream(tools), []
    for piece in pieces:
        events += s.feed(piece)
    events += s.close()
    assert all(kind in ("text", "call") and (kind == "call" or value) for kind, value in events)
    text = "".join(v for kind, v in events if kind == "text")
    return text, [(v.name, json.loads(v.arguments)) for kind, v in events if kind == "call"]


def test_stream_holds_back_only_what_may_begin_a_tool_call():
    s = ToolCallStream(TOOLS)
    assert s.feed("Hello <to") == [("text", "Hello ")]
    assert s.feed("y") == [("text", "<toy")]
    assert s.feed(" <tool_call>\n{\"name\": \"now\",") == [("text", " ")]
    events = s.feed(' "arguments": {}}\n</tool_call> done <')
    assert [e[0] for e in events] == ["call", "text"] and events[0][1].name == "now" and events[1] == ("text", " done ")
    assert s.close() == [("text", "<")] and s.close() == []


def test_stream_gives_an_invalid_or_unclosed_block_as_text():
    s = ToolCallStream(TOOLS)
    assert s.feed("<tool_call>{oops}</tool_call><tool_call>{") == [("text", "<tool_call>{oops}</tool_call>")]
    assert s.close() == [("text", "<tool_call>{")]


FRAGMENTS = [
    json_block("get_weather", {"city": "Paris", "days": "2"}), json_block("now", {}), json_block("nope", {}),
    xml_block("get_weather", city="Lyon", metric="true"), xml_block("now"), *MALFORMED[:14],
    "<tool_call>", "</tool_call>", "<tool_", "<", "</", "tool_call>", "\n", " ", "{", "}",
]
pieces_of_text = st.lists(st.sampled_from(FRAGMENTS) | st.text("ab<>/_\n {}=", max_size=6), max_size=8)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_split_of_the_stream_gives_what_parsing_the_whole_text_gives(data):
    text = "".join(data.draw(pieces_of_text))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = parse_tool_calls(text, TOOLS)
    streamed_text, streamed_calls = stream(pieces)
    assert streamed_text.strip() == content
    assert streamed_calls == [(c.name, json.loads(c.arguments)) for c in calls]
    assert stream(list(text)) == (streamed_text, streamed_calls)  # one character at a time


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_any_text_parses_without_raising(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert stream([text]) == (stream(list(text))[0], [(c.name, json.loads(c.arguments)) for c in calls])


# ---- the request ----

def test_template_messages_convert_roles_content_and_tool_calls():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "x"}]},
        {"role": "assistant", "content": "Sunny.", "tool_calls": []},
    ]
    assert template_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "tool", "content": "x", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "Sunny."},
    ]


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"text"', "null", "", '{"x": NaN}', None, {"a": 1}])
def test_template_messages_refuse_arguments_that_are_not_an_object_text(arguments):
    ok = {"id": "a", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    bad = {"id": "b", "type": "function", "function": {"name": "now", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [ok, bad]}]
    with pytest.raises(APIError) as e:
        template_messages(messages)
    assert e.value.status == 400 and e.value.param == "messages.1.tool_calls.1.function.arguments"


def test_the_real_qwen3_template_renders_tools_calls_and_results():
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    messages = template_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ])
    prompts, _ = render([messages], tools=TOOLS, chat_template=TEMPLATE.read_text(), add_generation_prompt=True)
    prompt = prompts[0]
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" + json.dumps(CLOCK) + "\n</tools>" in prompt
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + block + "<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # what the template writes for a call is what the parser reads back
    assert calls_of(block) == [("get_weather", {"city": "Paris", "days": 3})]


def test_call_schema_for_one_tool_or_any():
    assert call_schema(TOOLS, "now") == {
        "type": "object", "properties": {"name": {"const": "now"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}
    both = call_schema(TOOLS)
    assert [s["properties"]["name"]["const"] for s in both["anyOf"]] == ["get_weather", "now"]
    assert both["anyOf"][0]["properties"]["arguments"] is WEATHER["function"]["parameters"]
    with pytest.raises(APIError) as e:
        call_schema(TOOLS, "nope")
    assert e.value.status == 400 and e.value.param == "tool_choice"


@pytest.mark.parametrize("tools, tool_choice, expected", [
    (None, None, ToolChoice("none")), ([], "none", ToolChoice("none")), (TOOLS, None, ToolChoice("auto")),
    (TOOLS, "none", ToolChoice("none")), (TOOLS, "auto", ToolChoice("auto")),
    (TOOLS, "required", ToolChoice("required")),
    (TOOLS, {"type": "function", "function": {"name": "now"}}, ToolChoice("named", "now")),
    ([{"type": "function", "function": {"name": "a-B_9", "description": None, "parameters": {}, "strict": True}}],
     None, ToolChoice("auto")),
])
def test_check_tools_gives_the_mode(tools, tool_choice, expected):
    assert check_tools(tools, tool_choice) == expected


def fn(**function) -> list[dict]:
    return [{"type": "function", "function": function}]


@pytest.mark.parametrize("tools, tool_choice, param", [
    ({"type": "function"}, None, "tools"),
    (["now"], None, "tools.0.type"),
    ([{"type": "code_interpreter"}], None, "tools.0.type"),
    ([WEATHER, {"type": "function"}], None, "tools.1.function"),
    (fn(), None, "tools.0.function.name"),
    (fn(name="get weather"), None, "tools.0.function.name"),
    (fn(name="x" * 65), None, "tools.0.function.name"),
    (fn(name="ok\n"), None, "tools.0.function.name"),
    ([CLOCK, CLOCK], None, "tools.1.function.name"),
    (fn(name="f", description=3), None, "tools.0.function.description"),
    (fn(name="f", parameters="{}"), None, "tools.0.function.parameters"),
    (fn(name="f", parameters={"type": "object", "properties": {"a": "int"}}), None,
     "tools.0.function.parameters.properties"),
    (fn(name="f", strict="yes"), None, "tools.0.function.strict"),
    (None, "auto", "tool_choice"), (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "now"}}, "tool_choice"),
    (TOOLS, "any", "tool_choice"), (TOOLS, 1, "tool_choice"),
    (TOOLS, {"type": "allowed_tools"}, "tool_choice.type"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
])
def test_check_tools_errors_name_their_field(tools, tool_choice, param):
    with pytest.raises(APIError) as e:
        check_tools(tools, tool_choice)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param + ":")

