"""While the model loads, `moestream serve`'s port answers 503 (/health: {"status": "loading"}) and keeps the
connections that arrive; a failed load stops the loading answers and raises."""

import socket

import httpx
import pytest

from moestream.cli.serve import listen
from moestream.server.loading import while_loading


def test_loading_answers_then_hands_the_socket_on():
    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def load():
        health = httpx.get(f"{url}/health", timeout=10)
        models = httpx.get(f"{url}/v1/models", timeout=10)
        return health, models

    try:
        health, models = while_loading(sock, load)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert models.status_code == 503 and models.headers["retry-after"] == "5"
        assert models.json()["error"]["code"] == "loading"
        with socket.create_connection(sock.getsockname(), timeout=5):  # still listening, for the real server
            pass
    finally:
        sock.close()


def test_a_failed_load_raises_and_stops_answering():
    def load():
        raise ValueError("bad store")

    sock = listen("127.0.0.1", 0)
    try:
        with pytest.raises(ValueError, match="bad store"):
            while_loading(sock, load)
        with pytest.raises(httpx.TimeoutException):  # queued, unanswered: the loading server has stopped
            httpx.get(f"http://127.0.0.1:{sock.getsockname()[1]}/health", timeout=0.5)
    finally:
        sock.close()
