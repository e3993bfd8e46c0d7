"""Every field the agent APIs added, given a wrong type or value, answers a 400 whose `param` names it (OpenAI's
error shape; Anthropic's on /v1/messages, its message naming the field)."""

import pytest

from tests.server.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CHAT = [  # (body fields, the param named)
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [TOOL, TOOL]}, "tools.1.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"session_id": 7}, "session_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages"),
]
COMPLETIONS = [({"logprobs": -1}, "logprobs"), ({"logprobs": "2"}, "logprobs"), ({"echo": "yes"}, "echo")]
ANTHROPIC = [({"max_tokens": 0}, "max_tokens"), ({"stop_sequences": "x"}, "stop_sequences"),
             ({"tools": [{"name": "f"}]}, "tools"), ({"tool_choice": {"type": "tool"}}, "tool_choice"),
             ({"system": 5}, "system"), ({"top_k": -1}, "top_k"),
             ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages")]


@pytest.fixture(scope="module")
def server(tiny):
    from moestream.engine.llm import LLM
    from tests.server.conftest import CHUNK, RunningServer

    llm = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=CHUNK)
    running = RunningServer(llm)
    yield running
    running.close()
    llm.close()


@pytest.mark.parametrize("fields,param", CHAT)
def test_chat_fields(server, fields, param):
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    named = r.json()["error"]["param"]
    assert named == param or named.startswith(param + "."), r.json()  # the field, or the path into it


@pytest.mark.parametrize("fields,param", COMPLETIONS)
def test_completion_fields(server, fields, param):
    with server.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("fields,param", ANTHROPIC)
def test_anthropic_fields(server, fields, param):
    with server.http() as h:
        r = h.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": USER, **fields})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(param), body


def test_tokenize_fields(server):
    with server.http() as h:
        assert h.post("/tokenize", json={"prompt": 5}).json()["error"]["param"] == "prompt"
        assert h.post("/tokenize", json={}).json()["error"]["param"] == "prompt"
        assert h.post("/detokenize", json={"tokens": ["a"]}).json()["error"]["param"] == "tokens"
        assert h.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == "tokens"
        ids = h.post("/tokenize", json={"prompt": "hello"}).json()
        assert ids["count"] == len(ids["tokens"]) and h.post("/detokenize", json=ids).json()["prompt"] == "hello"
        chat = h.post("/tokenize", json={"messages": USER}).json()
        assert chat["count"] > ids["count"]
