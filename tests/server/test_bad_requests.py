"""Bad requests get OpenAI-shaped 4xx errors, and the server serves the next good request normally."""

import json

import openai
import pytest

from tests.server.conftest import MODEL

KEY = "sk-test-key"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
LIMITS = dict(api_key=KEY, max_tokens_limit=64, max_body_bytes=20_000)


@pytest.fixture(scope="module")
def store(tiny):
    return tiny.store("qwen3_moe")


@pytest.fixture
def server(serve, store):
    return serve(store, **LIMITS)


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_serves(http) -> None:
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


BAD_BODIES = {  # name: (body, status, param)
    "malformed-json": (b'{"model": "tiny", "messages": [', 400, None),
    "not-an-object": (b"[1, 2, 3]", 400, None),
    "unknown-model": (dict(GOOD, model="gpt-9"), 404, "model"),
    "string-temperature": (dict(GOOD, temperature="hot"), 400, "temperature"),
    "string-max-tokens": (dict(GOOD, max_tokens="3"), 400, "max_tokens"),
    "messages-not-a-list": (dict(GOOD, messages="hello"), 400, "messages"),
    "number-content": (dict(GOOD, messages=[{"role": "user", "content": 5}]), 400, "messages"),
    "unknown-role": (dict(GOOD, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    "empty-messages": (dict(GOOD, messages=[]), 400, "messages"),
    "number-stops": (dict(GOOD, stop=[1, 2]), 400, "stop"),
    "huge-max-tokens": (dict(GOOD, max_tokens=10**9), 400, "max_tokens"),
    "zero-max-tokens": (dict(GOOD, max_tokens=0), 400, "max_tokens"),
    "zero-top-p": (dict(GOOD, top_p=0), 400, "top_p"),
    "n-0": (dict(GOOD, n=0), 400, "n"),
    "n-too-many": (dict(GOOD, n=65), 400, "n"),
    "no-messages": ({"model": MODEL}, 400, "messages"),
}


@pytest.mark.parametrize("body,status,param", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_chat_bodies(server, body, status, param):
    with server.http() as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
        assert_error(r, status, param)
        assert_serves(http)


def test_bad_completion_bodies(server):
    with server.http() as http:
        for body, param in [({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": 5}, "prompt"),
                            ({"prompt": [10**9]}, "prompt"), ({"prompt": ["a", ""]}, "prompt"),
                            ({"prompt": ["a"] * 33, "n": 2}, "prompt"),
                            ({"prompt": "hi", "logprobs": 21}, "logprobs"), ({"prompt": "hi", "echo": "yes"}, "echo")]:
            assert_error(http.post("/v1/completions", json=body), 400, param)
        assert_serves(http)


def test_oversize_body_is_413(server):
    with server.http() as http:
        big = dict(GOOD, messages=[{"role": "user", "content": "x" * 30_000}])
        assert_error(http.post("/v1/chat/completions", json=big), 413, code="request_too_large")
        assert_serves(http)


def test_api_key_is_required(server):
    for key in (None, "sk-wrong"):
        with server.http() as http:
            http.headers.pop("Authorization")
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for path in ("/v1/models", "/v1/stats", "/metrics"):
                assert_error(http.get(path, headers=headers), 401, code="invalid_api_key")
            assert_error(http.post("/v1/chat/completions", json=GOOD, headers=headers), 401)
            assert http.get("/health").status_code == 200
    with server.http() as http:
        assert_serves(http)


def test_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-wrong").models.list()
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=GOOD["messages"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=GOOD["messages"], max_tokens=65)
    assert "limit of 64" in e.value.message
    r = client.chat.completions.create(model=MODEL, messages=GOOD["messages"], max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_unknown_route_and_method(server):
    with server.http() as http:
        assert_error(http.get("/v1/nothing"), 404)
        assert_error(http.get("/v1/chat/completions"), 405)
        assert_serves(http)


def test_a_bounded_kv_cache_trims_a_default_max_tokens_and_refuses_an_explicit_one(serve, store):
    """With --kv-tokens, a chat request without max_tokens is answered within what the cache holds beside its prompt
    (as a default is trimmed to the model's context); an explicit max_tokens past it is a 400 naming --kv-tokens."""
    server = serve(store, kv_tokens=64, max_tokens_limit=4096)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there, how are you?"}]}
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 64
        error = assert_error(http.post("/v1/chat/completions", json={**body, "max_tokens": 60}), 400, "messages",
                             "context_length_exceeded")
        assert "--kv-tokens" in error["message"]
        assert_serves(http)
