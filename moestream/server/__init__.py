"""OpenAI-compatible HTTP server over the engine's public API (FastAPI + uvicorn).

`create_app(llm, ServerSettings(model_name=...))` builds the app; `Server(app, ...)` (uvicorn's, stopping
the engine's jobs first on shutdown) runs it, as `moestream serve` does. The
engine knows nothing about HTTP: one engine thread owns the `LLM` (worker.py), the app (app.py) turns
requests into jobs, and protocol.py holds the OpenAI shapes."""

from moestream.server.app import ServerSettings, create_app
from moestream.server.runner import Server

__all__ = ["Server", "ServerSettings", "create_app"]
