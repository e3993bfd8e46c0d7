"""While the model loads, the bound port answers: GET /health is 503 {"status": "loading"} (llama.cpp's server
does the same), every other path a 503 server error with Retry-After, so an orchestrator or client waits instead
of hanging on a connection nobody accepts. `while_loading(sock, load)` serves that on a duplicate of the socket
from a thread and stops once `load()` returns or raises; the real server then takes the same socket, whose
queued connections are kept."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import uvicorn

T = TypeVar("T")
RETRY_AFTER_S = 5


async def loading_app(scope, receive, send) -> None:
    """A bare ASGI app (FastAPI is not needed for two answers)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        body = {"status": "loading"}
    else:
        body = {"error": {"message": "the model is still loading; retry shortly", "type": "server_error",
                          "param": None, "code": "loading"}}
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": payload})


def while_loading(sock: socket.socket, load: Callable[[], T], log_level: str = "warning") -> T:
    """`load()`'s result, with the loading answers served on `sock` meanwhile."""
    server = uvicorn.Server(uvicorn.Config(loading_app, log_level=log_level, lifespan="on"))
    # closing the duplicate when the loading server stops leaves `sock` listening
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock.dup()]}, name="loading", daemon=True)
    thread.start()
    try:
        return load()
    finally:
        server.should_exit = True
        thread.join()
