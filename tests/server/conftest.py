"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread, over a tiny store on CPU."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from moestream.engine.llm import LLM
from moestream.server import Server, ServerSettings, create_app

MODEL = "tiny"
CHUNK = 16  # prefill chunk: small, so that short prompts cross prefix-cache boundaries


class RunningServer:
    def __init__(self, llm: LLM, **settings):
        self.llm = llm
        self.settings = ServerSettings(model_name=MODEL, **settings)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = Server(create_app(llm, self.settings), log_level="warning", timeout_graceful_shutdown=1)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.settings.api_key or "none",
                             max_retries=0, timeout=60)

    def http(self, api_key: str | None = None) -> httpx.Client:
        key = api_key or self.settings.api_key
        return httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {key}"} if key else {})

    def stats(self) -> dict:
        with self.http() as h:
            return h.get("/v1/stats").raise_for_status().json()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine runs nothing and nothing waits."""
        deadline = time.monotonic() + timeout
        while (q := self.stats()["server"]["queue"])["running"] or q["waiting"]:
            assert time.monotonic() < deadline, f"the engine is still busy: {q}"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning OpenMP
    threads slow every op a hundredfold; the engine thread runs best alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def serve():
    """serve(store, server settings..., llm options...) -> a RunningServer, closed after the test."""
    servers = []

    def start(store: str, *, prefix_cache_mb: float = 0.0, max_batch: int = 16, kv_tokens: int | None = None,
              **settings) -> RunningServer:
        llm = LLM(store, device="cpu", prefill_chunk=CHUNK, prefix_cache_mb=prefix_cache_mb, max_batch=max_batch,
                  kv_tokens=kv_tokens)
        servers.append(RunningServer(llm, **settings))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
        s.llm.close()


@pytest.fixture
def reference():
    """reference(store) -> an uncached LLM with the server's prefill chunk: the expected outputs."""
    llms = {}

    def get(store: str) -> LLM:
        if store not in llms:
            llms[store] = LLM(store, device="cpu", prefill_chunk=CHUNK)
        return llms[store]

    yield get
    for llm in llms.values():
        llm.close()
