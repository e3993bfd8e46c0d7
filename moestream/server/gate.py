"""ASGI middleware in front of every route: the key check and per-request counters.

Every path but /health needs `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) when a key is
set (401 otherwise: OpenAI-shaped, Anthropic-shaped on /v1/messages). Each answered request is counted by
endpoint and status in Prometheus and in `counts`."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse

from moestream.server.anthropic import error_body
from moestream.server.metrics import ServerMetrics
from moestream.server.protocol import APIError


class Gate:
    """ASGI middleware: the bearer-key check (all paths but /health) and per-request counters."""

    ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models", "/v1/sessions",
                 "/v1/stats", "/metrics", "/health", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, counts: dict):
        self.app, self.api_key, self.metrics, self.counts = app, api_key, metrics, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_see(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.api_key and scope["path"] != "/health" and not self._authorised(scope):
                error = APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY' or "
                                 "'x-api-key: KEY'", code="invalid_api_key")
                body = error_body(401, error.message) if scope["path"] == "/v1/messages" else error.body()
                await JSONResponse(body, status_code=401)(scope, receive, send_and_see)
            else:
                await self.app(scope, receive, send_and_see)
        finally:
            path = scope["path"]
            endpoint = path if path in self.ENDPOINTS else next(
                (p for p in ("/v1/models", "/v1/sessions") if path.startswith(p + "/")), "other")
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.counts["total"] += 1
            self.counts[f"{status // 100}xx"] = self.counts.get(f"{status // 100}xx", 0) + 1

    def _authorised(self, scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else headers.get(b"x-api-key", b"").decode("latin-1")
        return bool(key) and secrets.compare_digest(key.encode(), self.api_key.encode())
