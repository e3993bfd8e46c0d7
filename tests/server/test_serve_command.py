"""`moestream serve` as a user runs it: a subprocess on 127.0.0.1, the openai client, one-line errors."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from moestream.engine.llm import LLM
from moestream.sampling import SamplingParams

ENV = dict(os.environ, OMP_NUM_THREADS="1")  # see conftest.one_torch_thread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moestream", "serve", *args, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("moestream serve did not come up")


def test_serve_answers_the_openai_client_like_llm_chat(tiny):
    store = tiny.store("qwen3_moe")
    port = free_port()
    proc = serve(store, "--device", "cpu", "--port", str(port), "--api-key", "sk-local", "--model-name", "tiny-moe")
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-local", max_retries=0)
        messages = [{"role": "user", "content": "The expert pool holds"}]
        llm = LLM(store, device="cpu")
        want = llm.chat(messages, SamplingParams(max_tokens=10))
        llm.close()
        r = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=10)
        assert r.choices[0].message.content == want.text and r.usage.completion_tokens == len(want.token_ids)
        stream = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=10, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == want.text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-other", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"serving 'tiny-moe' at http://127.0.0.1:{port}/v1" in err


def test_port_in_use_and_bad_store_end_in_one_line(tiny, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = serve(tiny.store("qwen3_moe"), "--device", "cpu", "--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip() == f"error: cannot listen on 127.0.0.1:{port}: the port is in use"
    proc = serve(str(tmp_path / "no-store"), "--device", "cpu", "--port", str(free_port()))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
