"""A request-body fuzz against the running server: 1,000 generated bodies, well-formed and not, none answered 5xx,
and the server answers correctly afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moestream.engine.llm import LLM
from tests.server.conftest import MODEL, RunningServer
from tests.server.test_bad_requests import GOOD, assert_serves

FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens", "stop",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "stream", "stream_options",
          "ignore_eos", "logprobs", "top_logprobs", "echo", "suffix", "tools", "tool_choice", "response_format",
          "logit_bias", "best_of", "parallel_tool_calls", "user"]
# JSON values with the edges: huge and negative ints, NaN and infinities (Python's json writes and reads them),
# lone surrogates, nesting
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, 2, 8, -1, 2**64])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["tiny", "", "\ud800", "hi\udfff", "text", "none", "auto"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
                                 "content": values | st.text(max_size=20)})
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), values, max_size=6)
chat_bodies = st.tuples(bodies, st.lists(message, max_size=3) | values).map(lambda b: b[0] | {"messages": b[1]})
prompt = st.text(max_size=30) | st.lists(st.integers(-5, 400), max_size=6) | values
completion_bodies = st.tuples(bodies, prompt).map(lambda b: b[0] | {"prompt": b[1]})


@pytest.fixture(scope="module")
def http(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    server = RunningServer(llm, max_tokens_limit=4, request_timeout_s=5)
    client = httpx.Client(base_url=server.url, timeout=60)
    yield client
    client.close()
    server.close()
    llm.close()


def _send(http, path: str, body) -> None:
    content = json.dumps(body, allow_nan=True, ensure_ascii=True)  # surrogates travel as \ud800 escapes
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400 and "text/event-stream" not in r.headers.get("content-type", ""):
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=chat_bodies)
def test_chat_bodies_never_get_a_5xx(http, body):
    _send(http, "/v1/chat/completions", body)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=completion_bodies)
def test_completion_bodies_never_get_a_5xx(http, body):
    _send(http, "/v1/completions", body)


def test_the_server_still_answers(http):
    assert_serves(http)
    assert http.get("/health").status_code == 200
    assert http.post("/v1/chat/completions", json=dict(GOOD, model=MODEL)).status_code == 200
