"""The `anthropic` client against /v1/messages: a message, a stream, and a tool-use round trip, with its
x-api-key auth; the text equals the OpenAI chat path's for the same conversation."""

import json

import pytest

from moestream.cli.demo import DEMO_STORE
from tests.server.conftest import MODEL

anthropic = pytest.importorskip("anthropic")
KEY = "secret"
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False}}


@pytest.fixture
def server(serve):
    return serve(DEMO_STORE, api_key=KEY)


def client(server, key=KEY):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def test_a_message_and_its_stream(server):
    c = client(server)
    m = c.messages.create(model=MODEL, max_tokens=12, system="You tell stories.",
                          messages=[{"role": "user", "content": "Once upon a time"}])
    assert m.role == "assistant" and m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens")
    openai_text = server.client(KEY).chat.completions.create(
        model=MODEL, max_tokens=12, messages=[{"role": "system", "content": "You tell stories."},
                                              {"role": "user", "content": "Once upon a time"}]).choices[0].message
    assert m.content[0].text == openai_text.content
    with c.messages.stream(model=MODEL, max_tokens=12, system="You tell stories.",
                           messages=[{"role": "user", "content": "Once upon a time"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.usage.output_tokens == m.usage.output_tokens
    stopped = c.messages.create(model=MODEL, max_tokens=40, stop_sequences=[" "],
                                messages=[{"role": "user", "content": "Once upon a time"}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " "


def test_a_tool_use_round_trip(server):
    c = client(server)
    question = {"role": "user", "content": "Weather in Paris?"}
    m = c.messages.create(model=MODEL, max_tokens=80, tools=[TOOL], tool_choice={"type": "any"}, messages=[question])
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    reply = [question, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
    final = c.messages.create(model=MODEL, max_tokens=12, tools=[TOOL], tool_choice={"type": "none"}, messages=reply)
    assert final.content[0].type == "text" and final.content[0].text
    forced = {"type": "tool", "name": "get_weather"}
    with c.messages.stream(model=MODEL, max_tokens=80, tools=[TOOL], tool_choice=forced, messages=[question]) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]


def test_errors_are_anthropic_shaped(server):
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong").messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 3},
                                       messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and "temperature" in json.dumps(e.value.body)


def test_a_final_assistant_message_is_continued(server):
    from moestream.engine.llm import LLM
    from moestream.sampling import SamplingParams

    conversation = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    m = client(server).messages.create(model=MODEL, max_tokens=8, messages=conversation)
    llm = LLM(DEMO_STORE, device="cpu")
    try:
        ids = llm.tokenizer.chat(conversation, continue_final=True)
        assert llm.tokenizer.decode(ids).endswith("Once upon")  # the prefill, not a closed turn
        want = llm.generate([ids], SamplingParams(max_tokens=8))[0].text
    finally:
        llm.close()
    assert m.content[0].text == want
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        client(server).messages.create(model=MODEL, max_tokens=8, messages=[conversation[0], {
            "role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "x", "input": {}}]}])
