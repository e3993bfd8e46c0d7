"""The OpenAI-compatible HTTP app: `create_app(llm, ServerSettings(...))` -> a FastAPI app.

Endpoints: GET /health (no key needed), GET /v1/models[/{id}], POST /v1/chat/completions,
POST /v1/completions (both streaming as SSE ending in `data: [DONE]`, or not), GET /v1/stats (JSON:
`engine` is exactly `llm.stats()`), GET /metrics (Prometheus text). Every error is OpenAI-shaped:
{"error": {"message", "type", "param", "code"}} with 400 (bad request), 401 (key), 404 (model or
route), 408 (a body that does not arrive), 413 (body too large), 429 (queue full), 500 (the server's own
fault), 503 (stopping). The app only calls the engine's public API,
through one engine thread (server/worker.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from moestream.errors import MoestreamError, RequestError
from moestream.sampling import SEED_RANGE
from moestream.server.gate import Gate
from moestream.server.metrics import ServerMetrics
from moestream.server.protocol import APIError, ChatRequest, CompletionRequest, Shapes, parse, usage
from moestream.server.worker import EngineWorker, Job, QueueFull, ShuttingDown

DRAIN_LIMIT = 64 << 20  # an oversize body up to this size is read to the end, so the client sees the 413


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int = 64  # requests waiting behind the running one
    max_tokens_limit: int = 4096
    max_body_bytes: int = 1_000_000
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat defaults to the limit
    request_timeout_s: float = 30.0  # a connection's request headers, and a request's body, must arrive within it


def create_app(llm, settings: ServerSettings) -> FastAPI:
    worker = EngineWorker(llm, settings.max_queue)
    metrics = ServerMetrics(llm, worker)
    started = time.time()
    counts = {"total": 0, "2xx": 0, "4xx": 0, "5xx": 0}
    tokens = {"prompt": 0, "generated": 0}
    context_length = llm.context_length

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="moestream", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Gate, api_key=settings.api_key, metrics=metrics, counts=counts)
    app.state.worker, app.state.settings = worker, settings

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        # a body that did not arrive leaves the connection mid-request: close it
        headers = {"Retry-After": "1"} if e.status == 429 else {"Connection": "close"} if e.status == 408 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404
                                     else None).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                            status_code=500)

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": int(started), "owned_by": "moestream",
                "max_model_len": context_length}

    @app.get("/health")
    async def health():
        """503 while the engine's last request failed by its own fault (a damaged store, a device error), so an
        orchestrator restarts it; a request that completes clears it."""
        if worker.fault is not None:
            return JSONResponse({"status": "error", "error": worker.fault}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(404, f"model '{name}' does not exist; this server serves '{settings.model_name}'",
                           param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatRequest, await _read_json(request, settings))
        messages = [m.as_template_message() for m in req.messages]
        return await complete(request, req, True, [lambda: llm.tokenizer.chat(messages)],
                              settings.max_tokens_limit)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await _read_json(request, settings))
        encoders = [(lambda p=p: llm.tokenizer.encode(p)) if isinstance(p, str) else (lambda p=p: list(p))
                    for p in req.prompts()]
        return await complete(request, req, False, encoders, settings.completion_default_max_tokens)

    async def complete(request: Request, req, chat: bool, encoders, default_max_tokens: int):
        """Every prompt's `n` choices as jobs of one request: choice i * n + j is prompt i's sample j."""
        check_model(req.model)
        req.refuse_unsupported()
        params = req.sampling_params(default_max_tokens, settings.max_tokens_limit)
        param = "messages" if chat else "prompt"
        explicit = bool(req.max_tokens or req.max_completion_tokens)
        prompts = []
        for encode in encoders:
            ids = await tokenize(encode, param)
            prompts.append((ids, fit_context(len(ids), params, explicit, param)))
        events, jobs = asyncio.Queue(), []
        try:
            for ids, p in prompts:
                for j in range(req.n or 1):
                    jobs.append(worker.submit(ids, p if p.seed is None else sample_seed(p, j), events, len(jobs)))
        except ShuttingDown:
            cancel(jobs)
            raise _engine_error(ShuttingDown("the server is shutting down")) from None
        except QueueFull:
            cancel(jobs)
            raise APIError(429, f"the server is busy ({settings.max_queue} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full") from None
        shapes = Shapes(chat, settings.model_name)
        endpoint = request.url.path
        if req.stream:
            return _JobStream(jobs, stream(jobs, events, shapes, req.stream_options, endpoint, req.n or 1),
                              media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                       "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(_cancel_on_disconnect(request, jobs, events))
        texts, outs = [[] for _ in jobs], [None] * len(jobs)
        try:
            while any(out is None for out in outs):
                index, kind, value = await events.get()
                if kind == "text":
                    texts[index].append(value[0])
                elif kind == "done":
                    outs[index] = value
                elif kind == "error":
                    raise _engine_error(value)
                else:  # the client went away
                    return Response(status_code=499)
        finally:
            watcher.cancel()
            cancel(jobs)
        use = record(jobs, outs, endpoint, req.n or 1)
        return shapes.response([("".join(t), out.finish_reason) for t, out in zip(texts, outs)], use)

    async def tokenize(encode, param: str) -> list[int]:
        try:
            ids = await run_in_threadpool(encode)
        except (MoestreamError, ValueError, TemplateError) as e:  # no chat template, or one refusing the messages
            raise APIError(400, f"cannot build the prompt: {e}", param=param) from None
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if any(not 0 <= i < llm.config.vocab_size for i in ids):
            raise APIError(400, f"token ids must be in [0, {llm.config.vocab_size})", param=param)
        return ids

    async def stream(jobs: list[Job], events: asyncio.Queue, shapes: Shapes, options, endpoint: str, n: int):
        include_usage, continuous_usage = bool(options and options.include_usage), bool(
            options and options.continuous_usage_stats)
        if shapes.chat:
            for job in jobs:
                yield _sse(shapes.chunk(job.index, "", first=True))
        outs, seen = [None] * len(jobs), set()
        while any(out is None for out in outs):
            index, kind, value = await events.get()
            if kind == "text":
                if index not in seen:
                    metrics.first_token.labels(endpoint).observe(time.monotonic() - jobs[index].submitted_at)
                    seen.add(index)
                piece, made = value
                chunk = shapes.chunk(index, piece)
                if continuous_usage:  # vLLM's extension: tokens so far on every chunk (a client's per-token timing)
                    chunk["usage"] = usage(len(jobs[index].prompt_ids), made, 0)
                yield _sse(chunk)
            elif kind == "done":
                outs[index] = value
                yield _sse(shapes.chunk(index, None, value.finish_reason))
            else:
                yield _sse(_engine_error(value).body())
                break
        else:
            use = record(jobs, outs, endpoint, n)
            if include_usage:
                yield _sse(shapes.usage_chunk(use))
        yield "data: [DONE]\n\n"

    def record(jobs: list[Job], outs: list, endpoint: str, n: int) -> dict:
        """Count the finished choices; their usage counts each prompt once."""
        now = time.monotonic()
        for job, out in zip(jobs, outs):
            metrics.latency.labels(endpoint).observe(now - job.submitted_at)
            metrics.queue_wait.observe((job.started_at or now) - job.submitted_at)
            metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            metrics.generated_tokens.inc(len(out.token_ids))
            tokens["prompt"] += len(out.prompt_token_ids)
            tokens["generated"] += len(out.token_ids)
        firsts = outs[::n]  # each prompt's first choice
        return usage(sum(len(o.prompt_token_ids) for o in firsts), sum(len(o.token_ids) for o in outs),
                     sum(o.stats["timings"]["cached_tokens"] for o in firsts))

    def fit_context(prompt_tokens: int, params, explicit: bool, param: str):
        """Refuse a prompt (plus explicit max_tokens) past the context; trim a default max_tokens to fit."""
        if context_length is None:
            return params
        room = context_length - prompt_tokens
        if room < 1 or (explicit and params.max_tokens > room):
            raise APIError(400, f"this model's context is {context_length} tokens; the prompt has {prompt_tokens} "
                           f"and {params.max_tokens} more were asked for", param=param, code="context_length_exceeded")
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))

    @app.get("/v1/stats")
    async def stats():
        engine = await asyncio.wrap_future(worker.call(llm.stats))
        return {"engine": engine, "server": server_stats(), "model": model_info()}

    def server_stats() -> dict:
        return {"uptime_seconds": time.time() - started, "requests": dict(counts, **worker.counts),
                "queue": {"waiting": worker.jobs.qsize(), "max_waiting": settings.max_queue,
                          "running": len(worker.active)},
                "tokens": dict(tokens), "engine_busy_seconds": worker.busy_seconds,
                "prefix_cache": llm.prefix_cache.stats() if llm.prefix_cache else None,
                "limits": {"max_tokens": settings.max_tokens_limit, "max_body_bytes": settings.max_body_bytes}}

    def model_info() -> dict:
        cfg, engine = llm.config, llm.engine_config
        return {"id": settings.model_name, "model_type": cfg.model_type, "num_hidden_layers": cfg.num_hidden_layers,
                "record_layers": cfg.num_record_layers, "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok, "precision": engine.expert.precision,
                "device": engine.device, "dtype": engine.dtype, "prefill_chunk": engine.prefill_chunk,
                "max_model_len": context_length}

    @app.get("/metrics")
    async def prometheus():
        body = await asyncio.wrap_future(worker.call(metrics.text))  # the engine's counters, between two steps
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class _JobStream(StreamingResponse):
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


def cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel.set()


def sample_seed(params, j: int):
    """Choice j's parameters: the request's seed moved on by j, so that n seeded samples differ and repeat."""
    low, high = SEED_RANGE
    return dataclasses.replace(params, seed=low + (params.seed - low + j) % (high - low + 1))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _engine_error(e: Exception) -> APIError:
    """The caller's mistakes are 400; a stopping server 503; anything else is the server's own fault, 500."""
    if isinstance(e, RequestError):
        return APIError(400, str(e))
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), type="server_error", code="shutting_down")
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


async def _read_json(request: Request, settings: ServerSettings):
    """The body as JSON; 413 past the size limit, 408 when it does not arrive in time, 400 when it does not parse."""
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


async def _cancel_on_disconnect(request: Request, jobs: list[Job], events: asyncio.Queue) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel(jobs)
    events.put_nowait((None, "gone", None))
