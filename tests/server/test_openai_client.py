"""The real `openai` client against the server: the same text and token counts as the engine's API."""

import pytest

from moestream.sampling import SamplingParams
from tests.server.conftest import MODEL

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name an expert."}]
PROMPT = "The expert pool holds"


@pytest.fixture(scope="module")
def store(tiny):
    return tiny.store("qwen3_moe")


@pytest.fixture
def server(serve, store):
    return serve(store)


def streamed_chat(client, **kw) -> tuple[str, str, object]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and len(reasons) == 1
    return text, reasons[0], chunks[-1].usage


def test_chat_streaming_and_not_equal_llm_chat(server, reference, store):
    ref = reference(store).chat(MESSAGES, SamplingParams(max_tokens=12))
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    text, reason, use = streamed_chat(client, messages=MESSAGES, max_completion_tokens=12)
    assert (text, reason) == (ref.text, ref.finish_reason)
    assert use.completion_tokens == len(ref.token_ids)


def test_text_completions_equal_llm_generate(server, reference, store):
    llm = reference(store)
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=10))[0]
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    ids = llm.tokenizer.encode("Token ids work too")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    assert by_ids.choices[0].text == llm.generate([ids], SamplingParams(max_tokens=6))[0].text
    assert client.completions.create(model=MODEL, prompt=PROMPT).usage.completion_tokens <= 16  # OpenAI's default


def test_seeded_sampling_and_penalties_equal_the_engine(server, reference, store):
    fields = dict(temperature=0.9, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3)
    extensions = dict(top_k=20, repetition_penalty=1.2)
    ref = reference(store).generate([PROMPT], SamplingParams(max_tokens=10, **fields, **extensions))[0]
    client = server.client()
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, extra_body=extensions, **fields)
        assert r.choices[0].text == ref.text


def test_stop_strings_end_the_text_before_them(server, reference, store):
    ref = reference(store).generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    stop = next(c for c in ref[1:] if c.isascii() and c.isprintable())  # the first plain character after the start
    expected = ref[: ref.find(stop)]
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop, "never"],
                                  extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_models_lists_the_served_model(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_n_choices_and_several_prompts(server, reference, store):
    """n = 4 seeded samples (chat, streaming and not) and a 4-prompt completion request, choice i * n + j being
    prompt i's sample j; the greedy prompts answer as the engine does alone."""
    llm, client = reference(store), server.client()
    sampled = dict(temperature=1.0, seed=5, max_tokens=8)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, **sampled)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and len(set(texts)) > 1  # seeds 5, 6, 7, 8
    assert 4 <= r.usage.completion_tokens <= 32
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, stream=True, **sampled)
    streamed = ["", "", "", ""]
    for chunk in again:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    prompts = [PROMPT, "Experts stream", "The ring", "Four"]
    expected = [out.text for out in llm.generate(prompts, SamplingParams(max_tokens=6))]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    assert r.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in prompts)
    r = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=6, n=2)
    assert [c.text for c in r.choices] == [expected[0], expected[0], expected[1], expected[1]]
