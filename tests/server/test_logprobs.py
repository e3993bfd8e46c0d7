"""Log probabilities through the server: chat `logprobs`/`top_logprobs`, completions `logprobs` and `echo` (the
prompt's own, as lm-evaluation-harness's local-completions asks for them), each equal to the engine's."""

import math

import pytest
import torch

from moestream.sampling import SamplingParams
from tests.server.conftest import MODEL

PROMPT = "The expert pool holds"


@pytest.fixture(scope="module")
def store(tiny):
    return tiny.store("qwen3_moe")


@pytest.fixture
def server(serve, store):
    return serve(store, prefix_cache_mb=64)


def test_chat_logprobs_are_the_engines(server, reference, store):
    messages = [{"role": "user", "content": "Name an expert."}]
    ref = reference(store).chat(messages, SamplingParams(max_tokens=8, logprobs=3))
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, logprobs=True,
                                                top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == r.usage.completion_tokens
    for entry, (logprob, _) in zip(content, ref.logprobs):
        assert entry.logprob == logprob and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == logprob  # greedy: the likeliest token
        assert entry.bytes == list(entry.token.encode())
    chunks = list(server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                          logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]


def test_echo_gives_the_prompts_log_probabilities(server, reference, store):
    llm = reference(store)
    ids = llm.tokenizer.encode(PROMPT + " and the ring streams the rest of them")
    expected = torch.log_softmax(llm.logits(ids).float(), -1)
    with server.http() as h:  # the request lm-eval's local-completions makes
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "max_tokens": 1, "temperature": 0,
                                            "logprobs": 1, "echo": True}).raise_for_status().json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    for i, (got, top) in enumerate(zip(lp["token_logprobs"][1:len(ids)], lp["top_logprobs"][1:len(ids)])):
        assert len(top) == 1 and max(top.values()) >= got - 1e-6
        assert math.isclose(got, float(expected[i, ids[i + 1]]), abs_tol=1e-4)
    assert r["choices"][0]["text"].startswith(llm.tokenizer.decode(ids))
    # the same request twice: the second restores no cached prefix in place of the prompt's log probabilities
    with server.http() as h:
        again = h.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "max_tokens": 1, "logprobs": 1,
                                                "echo": True}).raise_for_status().json()
    assert again["choices"][0]["logprobs"] == lp
    with server.http() as h:  # they come whole at the end: a stream asking for them is refused, naming stream
        refused = h.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "max_tokens": 1, "logprobs": 1,
                                                  "echo": True, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_completion_logprobs_without_echo(server, reference, store):
    ref = reference(store).generate([PROMPT], SamplingParams(max_tokens=6, logprobs=2))[0]
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [logprob for logprob, _ in ref.logprobs]
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert len(lp.tokens) == r.usage.completion_tokens
