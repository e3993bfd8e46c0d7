"""`response_format` through the server: 100 answers sampled at temperature 1 under a JSON schema all parse and
validate (and 8 of the demo model's), and json_object answers are JSON objects; the grammar is enforced while
sampling, not by retrying."""

import json

import pytest

from moestream.cli.demo import DEMO_STORE
from tests.server.conftest import MODEL

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "sleepy"]},
    "friends": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["name", "age", "mood", "friends"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Tell me about a girl called Lily, as JSON."}]


def valid(value) -> bool:
    """The schema above, checked by hand (no jsonschema dependency)."""
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["name"], str) and len(value["name"]) <= 10
            and isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
            and value["mood"] in ("happy", "sad", "sleepy")
            and isinstance(value["friends"], list) and len(value["friends"]) <= 2
            and all(isinstance(f, str) and len(f) <= 6 for f in value["friends"]))


@pytest.fixture(scope="module", params=["tiny", "demo"])
def server(request, tiny):
    """The random-weight tiny model (any token is as likely: the hardest to keep in the grammar) and the trained
    demo model."""
    from moestream.engine.llm import LLM
    from tests.server.conftest import CHUNK, RunningServer

    store = tiny.store("qwen3_moe") if request.param == "tiny" else DEMO_STORE
    llm = LLM(store, device="cpu", prefill_chunk=CHUNK)
    running = RunningServer(llm, max_tokens_limit=400)
    running.samples = 100 if request.param == "tiny" else 8  # the demo model costs ~10x a step on CPU
    yield running
    running.close()
    llm.close()


def test_samples_at_temperature_one_follow_the_schema(server):
    client, answers = server.client().with_options(timeout=600), []
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, n=server.samples // 2, seed=seed, max_tokens=400,
            response_format={"type": "json_schema", "json_schema": {"name": "girl", "schema": SCHEMA, "strict": True}})
        answers += [(c.message.content, c.finish_reason) for c in r.choices]
    assert len(answers) == server.samples
    for text, reason in answers:
        assert reason == "stop", text
        assert valid(json.loads(text)), text
    assert len({text for text, _ in answers}) > server.samples // 4  # sampled, not one answer repeated


def test_json_object_answers_are_objects_streaming_too(server):
    if server.samples < 100:
        pytest.skip("the tiny model's answers suffice here; the demo model's cost ~10x on CPU")
    client = server.client().with_options(timeout=600)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=3, n=4, max_tokens=400,
                                       response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, stream=True,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "girl", "schema": SCHEMA}})
    assert valid(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)))
