"""The Anthropic Messages shapes (server/anthropic.py) without a server: request checks, the translation to the
OpenAI chat form, and responses and stream events proven against the `anthropic` client's own types and parsers."""

import json
from dataclasses import dataclass

import pytest

from moestream.server.anthropic import (
    MessageStream,
    error_body,
    message,
    new_message_id,
    parse_request,
    stop_reason_of,
    to_chat,
    tool_use_id,
)
from moestream.server.protocol import APIError, ChatRequest, parse

try:
    import anthropic
    import httpx2
    from pydantic import TypeAdapter
except ImportError:
    anthropic = None
needs_client = pytest.mark.skipif(anthropic is None, reason="the anthropic client is not installed")

GOOD = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
WEATHER = {"name": "weather", "description": "Today's weather", "input_schema": {"type": "object", "properties":
                                                                                  {"city": {"type": "string"}}}}


@dataclass(frozen=True)
class Call:  # the duck type of tools.ToolCall
    id: str
    name: str
    arguments: str


def request(**fields) -> dict:
    return {k: v for k, v in {**GOOD, **fields}.items() if v is not None}


def user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


@pytest.mark.parametrize("fields, param, words", [
    (dict(max_tokens=None), "max_tokens", "required"),
    (dict(max_tokens=0), "max_tokens", "greater than"),
    (dict(max_tokens="8"), "max_tokens", "integer"),
    (dict(model=None), "model", "required"),
    (dict(messages=[]), "messages", "at least 1"),
    (dict(temperature=2), "temperature", "less than or equal to 1"),
    (dict(top_p=0), "top_p", "greater than 0"),
    (dict(top_k=-1), "top_k", "greater than or equal to 0"),
    (dict(stream="yes"), "stream", "boolean"),
    (dict(stop_sequences="END"), "stop_sequences", "list"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages", "'user' or 'assistant'"),
    (dict(messages=[{"role": "user", "content": 5}]), "messages", "a string or a list of content blocks"),
    (dict(messages=user({"type": "video"})), "messages", "'video'"),
    (dict(messages=user({"text": "no type"})), "messages", "discriminator 'type'"),
    (dict(messages=user({"type": "image", "source": {"type": "base64"}})), "messages", "image blocks are not"),
    (dict(messages=user({"type": "document", "source": {}})), "messages", "document blocks are not"),
    (dict(messages=user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]})),
     "messages", "image blocks are not"),
    (dict(messages=user({"type": "tool_use", "id": "t", "name": "f", "input": {}})), "messages", "assistant"),
    (dict(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]),
     "messages", "user messages"),
    (dict(system=[{"type": "text"}]), "system", "text"),
    (dict(tools=[{"name": "f"}]), "tools", "input_schema"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools", "web_search_20250305"),
    (dict(tools=[WEATHER], tool_choice={"type": "tool"}), "tool_choice", "name"),
    (dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "clock"}), "tool_choice", "clock"),
    (dict(tool_choice={"type": "any"}), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "sometimes"}), "tool_choice", "'auto'"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking", "not supported"),
    (dict(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}]), "mcp_servers", "not supported"),
    (dict(output_config={"format": {"type": "json_schema", "schema": {}}}), "output_config", "not supported"),
])
def test_bad_requests_name_their_field(fields, param, words):
    with pytest.raises(APIError) as e:
        parse_request(request(**fields))
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert words in e.value.message, e.value.message


def test_good_requests_and_ignored_fields():
    req = parse_request(request(metadata={"user_id": "u"}, thinking={"type": "disabled"}, temperature=1,
                                service_tier="auto", output_config={"effort": "low"},
                                system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]))
    assert req.temperature == 1.0 and req.thinking.type == "disabled"


def test_chat_form_defaults_keep_the_servers_greedy_rule():
    chat = to_chat(parse_request(GOOD))
    assert chat == {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "tools": None,
                    "tool_choice": None, "parallel_tool_calls": None, "max_tokens": 8, "temperature": None,
                    "top_p": None, "top_k": None, "stop": [], "stream": False}
    chat = to_chat(parse_request(request(temperature=0.7, top_p=0.9, top_k=40, stop_sequences=["END"], stream=True)))
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["stop"], chat["stream"]) == (
        0.7, 0.9, 40, ["END"], True)


def test_system_blocks_and_text_blocks_join():
    chat = to_chat(parse_request(request(
        system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French."}],
        messages=user({"type": "text", "text": "One."}, {"type": "text", "text": "Two."}))))
    assert chat["messages"] == [{"role": "system", "content": "You are terse.\nAnswer in French."},
                                {"role": "user", "content": "One.\nTwo."}]
    assert to_chat(parse_request(request(system="")))["messages"][0]["role"] == "user"


def test_tool_use_and_results_round_trip():
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no station"}]},
            {"type": "text", "text": "Thanks."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
    ]
    chat = to_chat(parse_request(request(messages=messages, tools=[WEATHER, {"name": "clock", "input_schema": {}}],
                                         tool_choice={"type": "auto", "disable_parallel_tool_use": True})))
    call = lambda i, args: {"id": f"toolu_{i}", "type": "function",  # noqa: E731
                            "function": {"name": "weather", "arguments": json.dumps(args)}}
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call(1, {"city": "Paris"}),
                                                                      call(2, {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "", "tool_calls": [call(3, {})]},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Today's weather", "parameters": WEATHER["input_schema"]}},
        {"type": "function", "function": {"name": "clock", "parameters": {}}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("auto", False)
    assert parse(ChatRequest, chat).messages[1].role == "assistant"  # a form the OpenAI path's model takes


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}})])
def test_tool_choice_modes(choice, expected):
    chat = to_chat(parse_request(request(tools=[WEATHER], tool_choice=choice)))
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == (expected, None)


def test_ids_and_stop_reasons():
    assert new_message_id().startswith("msg_") and len(new_message_id()) == 4 + 24
    assert int(new_message_id()[4:], 16) >= 0 and new_message_id() != new_message_id()
    assert [tool_use_id(i) for i in ("call_ab12", "toolu_x", "ab12")] == ["toolu_ab12", "toolu_x", "toolu_ab12"]
    assert stop_reason_of("stop", None, True) == "tool_use"
    assert stop_reason_of("stop", "END", False) == "stop_sequence"
    assert stop_reason_of("length", None, False) == "max_tokens"
    assert stop_reason_of("stop", None, False) == stop_reason_of(None, None, False) == "end_turn"


CALLS = [Call("call_1", "weather", '{"city": "Paris"}'), Call("call_2", "clock", "{}")]


def test_message_shape():
    out = message("msg_1", "tiny", "Checking.", CALLS, "tool_use", None, 20, 9, cached_tokens=16)
    assert out == {"id": "msg_1", "type": "message", "role": "assistant", "model": "tiny", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "clock", "input": {}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 9, "cache_read_input_tokens": 16,
                  "cache_creation_input_tokens": 0}}
    assert message("msg_2", "tiny", "", [], "end_turn", None, 3, 1)["content"] == []
    with pytest.raises(ValueError, match="JSON object"):
        message("msg_3", "tiny", "", [Call("call_3", "f", "[1]")], "tool_use", None, 3, 1)
    stream = MessageStream("msg_3", "tiny")
    with pytest.raises(ValueError, match="JSON object"):
        stream.call(Call("call_3", "f", "[1]"))
    assert stream.blocks == 0  # nothing half-sent: the next block is still index 0


def events(sse: str) -> list[tuple[str, dict]]:
    out = []
    for frame in sse.split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def stream_text() -> str:
    s = MessageStream("msg_1", "tiny")
    return (s.start(20, cached_tokens=16) + s.text("Check") + s.text("") + s.text("ing.") + s.call(CALLS[0])
            + s.call(CALLS[1]) + s.text("Done.") + s.finish("end_turn", None, 9))


def test_stream_event_sequence():
    got = events(stream_text())
    assert [name for name, _ in got] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in got)
    start = got[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]["input_tokens"]) == ([], None, 4)
    assert [d["index"] for n, d in got if n.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert got[6][1]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    assert json.loads(got[7][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert got[-2][1] == {"type": "message_delta", "usage": {"output_tokens": 9},
                          "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    assert events(MessageStream("msg_1", "tiny").error(503, "stopping")) == [
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "stopping"}})]


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (408, "timeout_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error")])
def test_error_bodies(status, kind):
    assert error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}
    if anthropic is not None and status != 413:  # the API's request_too_large is missing from the client's types
        anthropic.types.shared.ErrorResponse.model_validate(error_body(status, "why"))


# ---- against the real client: its types, and its parsers over a mock transport ----

def client(status: int, body: str, content_type: str):
    def reply(request):
        return httpx2.Response(status, content=body.encode(), headers={"content-type": content_type})
    return anthropic.Anthropic(api_key="none", base_url="http://test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(reply)))


@needs_client
def test_message_parses_as_the_clients_message():
    out = message("msg_1", "tiny", "Checking.", CALLS, "tool_use", None, 20, 9, cached_tokens=16)
    parsed = anthropic.types.Message.model_validate(out)
    assert [b.type for b in parsed.content] == ["text", "tool_use", "tool_use"]
    got = client(200, json.dumps(out), "application/json").messages.create(**GOOD)
    assert got.content[1].input == {"city": "Paris"} and got.usage.cache_read_input_tokens == 16


@needs_client
def test_stream_events_parse_and_accumulate_in_the_client():
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for name, data in events(stream_text()):
        if name != "ping":
            assert adapter.validate_python(data).type == name
    with client(200, stream_text(), "text/event-stream").messages.stream(**GOOD) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use", "text"]
    assert final.content[0].text == "Checking." and final.content[3].text == "Done."
    assert (final.content[1].id, final.content[1].input, final.content[2].input) == ("toolu_1", {"city": "Paris"}, {})
    assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == ("end_turn", 9, 4)


@needs_client
def test_errors_raise_the_clients_exceptions():
    s = MessageStream("msg_1", "tiny")
    broken = s.start(3) + s.text("par") + s.error(500, "generation failed")
    with pytest.raises(anthropic.APIStatusError, match="generation failed"):
        with client(200, broken, "text/event-stream").messages.stream(**GOOD) as stream:
            stream.get_final_message()
    for status, error in ((400, anthropic.BadRequestError), (429, anthropic.RateLimitError),
                          (413, anthropic.APIStatusError), (503, anthropic.InternalServerError)):
        with pytest.raises(error) as e:
            client(status, json.dumps(error_body(status, "no")), "application/json").messages.create(**GOOD)
        assert e.value.status_code == status and e.value.body["error"]["message"] == "no"
