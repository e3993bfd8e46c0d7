"""Tool calling with the `openai` client: a call, its result, the final answer, streaming and not, on the trained
demo model and on a tiny Qwen3 model with Qwen3's own chat template. A forced call (tool_choice required or
named) is a grammar the answer follows, so even a model that never learnt tools makes a valid call."""

import json
import os
import shutil

import pytest

from moestream.cli.demo import DEMO_STORE
from tests.server.conftest import MODEL

TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "qwen3_chat_template.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def qwen3_store(tiny, tmp_path_factory):
    """A tiny qwen3_moe store whose tokenizer carries Qwen3's real chat template."""
    store = str(tmp_path_factory.mktemp("qwen3") / "store")
    shutil.copytree(tiny.store("qwen3_moe"), store)
    path = os.path.join(store, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(TEMPLATE) as f:
        config["chat_template"] = f.read()
    with open(path, "w") as f:
        json.dump(config, f)
    return store


@pytest.fixture
def client(request, serve, qwen3_store):
    """The server of the model the test is parametrized with (the demo model costs ~10x the tiny one on CPU)."""
    store = DEMO_STORE if request.node.callspec.params["model"] == "demo" else qwen3_store
    return serve(store).client()


def streamed(client, **kw):
    """(content, tool calls as dicts, finish reason) read from a stream's deltas."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    assert name == "get_weather" and set(args) == {"city", "days"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 12 and 1 <= args["days"] <= 7
    return args


@pytest.mark.parametrize("model,choice", [("demo", "required"), ("qwen3", "required"),
                                          ("qwen3", {"type": "function", "function": {"name": "get_weather"}})])
def test_a_tool_round_trip(client, model, choice):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                       max_tokens=500)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls
    call = message.tool_calls[0]
    check_call(call.function.name, call.function.arguments)
    history = QUESTION + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=16)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("model", ["demo", "qwen3"])
def test_a_streamed_tool_round_trip(client, model):
    content, calls, reason = streamed(client, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=500)
    assert reason == "tool_calls" and calls and calls[0]["id"].startswith("call_")
    check_call(calls[0]["name"], calls[0]["arguments"])
    made = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]
    history = QUESTION + [
        {"role": "assistant", "content": content or None, "tool_calls": made},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Sunny, 21 C"}]
    text, more, reason = streamed(client, messages=history, tools=TOOLS, max_tokens=16)
    assert reason in ("stop", "length", "tool_calls") and (text or more)


@pytest.mark.parametrize("model", ["qwen3"])
def test_a_streamed_call_equals_the_whole_answers_call(client, model):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=500).choices[0].message.tool_calls
    _, calls, _ = streamed(client, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=500)
    assert [(c.function.name, c.function.arguments) for c in whole] == [(c["name"], c["arguments"]) for c in calls]
