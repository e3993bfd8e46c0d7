"""One engine thread behind a bounded queue: concurrent clients, disconnects that free the engine, 429s."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moestream.sampling import SamplingParams
from tests.server.conftest import MODEL

LONG = 4000  # tokens an abandoned request asks for: seconds of decoding on CPU


@pytest.fixture(scope="module")
def store(tiny):
    return tiny.store("qwen3_moe")


class LongStream:
    """A long streaming completion, opened and read for `first_chunks` SSE events (0: only the headers)."""

    def __init__(self, http: httpx.Client, first_chunks: int):
        body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        self.request = http.stream("POST", "/v1/completions", json=body)
        response = self.request.__enter__()
        assert response.status_code == 200
        self.lines = response.iter_lines()  # kept: dropping the iterator would close the connection
        for _ in range(first_chunks):
            while not next(self.lines).startswith("data: "):
                pass

    def leave(self) -> None:
        self.request.__exit__(None, None, None)


def test_eight_concurrent_streaming_clients(serve, reference, store):
    server = serve(store, prefix_cache_mb=20)
    prompts = [f"Client {i} asks about expert {i * 7}" for i in range(8)]
    llm = reference(store)
    expected = [llm.chat([{"role": "user", "content": p}], SamplingParams(max_tokens=8)).text for p in prompts]

    def ask(prompt: str) -> str:
        stream = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == expected
    assert server.stats()["server"]["requests"]["completed"] == 8


def test_disconnected_clients_free_the_engine(serve, reference, store):
    server = serve(store)
    timings = reference(store).generate(["warm up"], SamplingParams(max_tokens=64, ignore_eos=True))[0].stats["timings"]
    abandoned_would_take = LONG * timings["decode_seconds"] / 64  # a lower bound: later tokens cost more
    with server.http() as http:
        LongStream(http, first_chunks=3).leave()  # a streaming client leaves
        start = time.monotonic()
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 4})
        assert r.status_code == 200
        next_took = time.monotonic() - start
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client gives up
            http.post("/v1/completions", json={"model": MODEL, "prompt": "slow", "max_tokens": LONG,
                                               "ignore_eos": True}, timeout=0.5)
        server.wait_idle(timeout=abandoned_would_take / 4)
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 4}).status_code == 200
    print(f"next request {next_took:.3f} s; the abandoned one would take >= {abandoned_would_take:.1f} s")
    assert next_took < abandoned_would_take / 10, (next_took, abandoned_would_take)
    assert server.stats()["server"]["requests"]["cancelled"] == 2


def test_full_queue_answers_429_at_once(serve, store):
    server = serve(store, max_queue=1, max_batch=1)  # one request runs, one waits
    with server.http() as http:
        running = LongStream(http, first_chunks=1)
        with server.http() as other:
            waiting = LongStream(other, first_chunks=0)
            assert server.stats()["server"]["queue"] == {"waiting": 1, "max_waiting": 1, "running": 1}
            start = time.monotonic()
            with server.http() as third:
                r = third.post("/v1/completions", json={"model": MODEL, "prompt": "me too", "max_tokens": 4})
            assert time.monotonic() - start < 2
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            waiting.leave()  # leaves while still queued: skipped, never run
        running.leave()
        server.wait_idle()
        again = http.post("/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 4})
        assert again.status_code == 200
    counts = server.stats()["server"]["requests"]
    assert (counts["rejected"], counts["cancelled"], counts["completed"]) == (1, 2, 1)


def test_metrics_and_stats_answer_while_requests_decode(serve, store):
    """The engine's counters are read on its own thread between two steps: scrapes during a batch of streams all
    answer (read from another thread they raced with the step: 'dictionary keys changed during iteration')."""
    server = serve(store)
    with server.http() as http:
        streams = [LongStream(http, first_chunks=1) for _ in range(3)]
        for _ in range(10):
            assert http.get("/metrics").status_code == 200
            assert http.get("/v1/stats").json()["server"]["queue"]["running"] == 3
        text = http.get("/metrics").text
        assert "moestream_sequences_decoding 3.0" in text and 'moestream_decode_steps_total{batch="3"}' in text
        assert 'moestream_engine_step_seconds_count{prompt="yes"}' in text
        assert 'moestream_engine_step_seconds_bucket{le="+Inf",prompt="no"}' in text
        for stream in streams:
            stream.leave()


def test_a_scrape_while_the_engine_is_inside_a_step_answers_from_the_last_reading(serve, store):
    """While requests decode, /metrics serves the engine's counters as read between two steps under a second ago,
    without waiting for the step in flight (here one held until the scrape has answered)."""
    server = serve(store)
    step, inside, release = server.llm.step, threading.Event(), threading.Event()

    def held_step():
        inside.set()
        release.wait(30)
        step()

    with server.http() as http:
        stream = LongStream(http, first_chunks=1)
        assert "moestream_sequences_decoding 1.0" in http.get("/metrics").text  # a fresh reading, between steps
        server.llm.step = held_step
        assert inside.wait(30)
        try:
            assert "moestream_sequences_decoding 1.0" in http.get("/metrics", timeout=10).text
        finally:
            release.set()
            server.llm.step = step
        stream.leave()
