"""HTTP plumbing the routes share: a request body read within its size and time limits, SSE responses that cancel
their jobs however they end, and the watch that cancels a turn when its client disconnects."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from moestream.server.protocol import APIError
from moestream.server.turns import Turn, cancel
from moestream.server.worker import Job

DRAIN_LIMIT = 64 << 20  # an oversize body up to this size is read to the end, so the client sees the 413


class JobStream(StreamingResponse):
    """An SSE response that cancels its jobs however it ends: finished, failed, or the client gone (Starlette
    then cancels the body iterator, perhaps before it started)."""

    def __init__(self, jobs: list[Job], content, **kwargs):
        super().__init__(content, **kwargs)
        self.jobs = jobs

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:  # the engine drops them before its next step; a no-op for finished jobs
            cancel(self.jobs)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_json(request: Request, settings):
    """The body as JSON (`settings`: ServerSettings); 413 past the size limit, 408 when it does not arrive in time, 400
    when it does not parse."""
    limit = settings.max_body_bytes
    declared = int(request.headers.get("content-length") or 0)
    if declared > DRAIN_LIMIT:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    body, size = bytearray(), 0
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    body += chunk
                elif size > DRAIN_LIMIT:
                    break
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {settings.request_timeout_s:g} s",
                       code="request_timeout") from None
    if size > limit:
        raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def cancel_on_disconnect(request: Request, turn: Turn) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    turn.cancel()
    turn.queue.put_nowait((None, "gone", None))
