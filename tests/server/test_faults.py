"""The server's own faults are 5xx and make /health say so; a stopping server answers 503; clients cannot cause a
500; fields not implemented are refused; slow or silent connections are closed."""

import os
import shutil
import socket
import time

import pytest

from tests.server.conftest import MODEL
from tests.server.test_bad_requests import GOOD, assert_error, assert_serves


@pytest.fixture
def store_copy(tiny, tmp_path):
    path = str(tmp_path / "store")
    shutil.copytree(tiny.store("qwen3_moe"), path)
    return path


def test_a_store_damaged_under_a_running_server_is_a_500_and_health_says_so(serve, store_copy):
    experts = os.path.join(store_copy, "experts.q4.bin")
    server = serve(store_copy, prefix_cache_mb=0)
    server.llm.close()  # a pool of two records: every other record is read from the file per request
    from moestream.engine.llm import LLM

    server.llm = LLM(store_copy, device="cpu", pool_gb=2 * 8192 / 1e9 * 1.0001, prefill_chunk=16)
    server.server.config.app.state.worker.llm = server.llm
    original = open(experts, "rb").read()
    with server.http() as http:
        assert_serves(http)
        with open(experts, "r+b") as f:
            f.truncate(len(original) // 2)
        error = assert_error(http.post("/v1/chat/completions", json=dict(GOOD, max_tokens=8)), 500)
        assert error["type"] == "server_error" and "shorter" in error["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "shorter" in health.json()["error"]
        with open(experts, "wb") as f:
            f.write(original)
        assert_serves(http)
        assert http.get("/health").status_code == 200


def test_a_stopping_server_answers_503(serve, tiny):
    server = serve(tiny.store("qwen3_moe"))
    server.server.config.app.state.worker.cancel_all()
    with server.http() as http:
        error = assert_error(http.post("/v1/chat/completions", json=GOOD), 503, code="shutting_down")
        assert error["type"] == "server_error"


@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800x"}], "max_tokens": 2}', "messages"),
    (b'{"model": "tiny", "prompt": "a\\udfffb", "max_tokens": 2}', "prompt"),
    (b'{"model": "tiny", "prompt": "ab", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
])
def test_invalid_unicode_is_a_400(serve, tiny, body, param):
    server = serve(tiny.store("qwen3_moe"))
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    with server.http() as http:
        assert_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400, param=param,
                     code="invalid_unicode")
        assert_serves(http)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_out_of_range_is_a_400(serve, tiny, seed):
    server = serve(tiny.store("qwen3_moe"))
    with server.http() as http:
        assert_error(http.post("/v1/chat/completions", json=dict(GOOD, temperature=1, seed=seed)), 400, param="seed")
        r = http.post("/v1/chat/completions", json=dict(GOOD, temperature=1, seed=2**64 - 1))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, value, param", [
    ("logit_bias", {"5": 10}, "logit_bias"), ("best_of", 2, "best_of"),
    ("tool_choice", "required", "tool_choice"), ("tools", [{"type": "function"}], "tools.0.function"),
])
def test_fields_not_implemented_or_malformed_are_refused(serve, tiny, field, value, param):
    server = serve(tiny.store("qwen3_moe"))
    with server.http() as http:
        assert_error(http.post("/v1/chat/completions", json=dict(GOOD, **{field: value})), 400, param=param)
        neutral = {"logit_bias": {}, "best_of": 1, "tool_choice": "none", "tools": []}[field]
        assert http.post("/v1/chat/completions", json=dict(GOOD, **{field: neutral})).status_code == 200


def test_idle_and_half_sent_connections_are_closed(serve, tiny):
    server = serve(tiny.store("qwen3_moe"), request_timeout_s=0.5)
    host, port = server.url.removeprefix("http://").split(":")
    partial_headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    partial_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                    b"content-length: 100\r\n\r\n{\"model\": ")
    for sent in (b"", partial_headers, partial_body):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(sent)
            sock.settimeout(5)
            start, answer = time.monotonic(), b""
            while chunk := sock.recv(4096):
                answer += chunk
            assert time.monotonic() - start < 4, sent
            if sent is partial_body:
                assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
            else:
                assert answer == b"", answer[:80]
    with server.http() as http:
        assert_serves(http)


def test_model_name_is_still_checked(serve, tiny):
    server = serve(tiny.store("qwen3_moe"))
    with server.http() as http:
        assert http.get(f"/v1/models/{MODEL}").status_code == 200
