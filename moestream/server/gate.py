"""ASGI middleware in front of every route: the bearer-key check and per-request counters.

Every path but /health needs `Authorization: Bearer KEY` when a key is set (401, OpenAI-shaped,
otherwise). Each answered request is counted by endpoint and status in Prometheus and in `counts`."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse

from moestream.server.metrics import ServerMetrics
from moestream.server.protocol import APIError


class Gate:
    """ASGI middleware: the bearer-key check (all paths but /health) and per-request counters."""

    ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/stats", "/metrics", "/health")

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
                error = APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                                 code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send_and_see)
            else:
                await self.app(scope, receive, send_and_see)
        finally:
            path = scope["path"]
            endpoint = path if path in self.ENDPOINTS else "/v1/models" if path.startswith("/v1/models") else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.counts["total"] += 1
            self.counts[f"{status // 100}xx"] = self.counts.get(f"{status // 100}xx", 0) + 1

    def _authorised(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())
