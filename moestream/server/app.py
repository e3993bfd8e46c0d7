"""The OpenAI- and Anthropic-compatible HTTP app: `create_app(llm, ServerSettings(...))` -> a FastAPI app.

Endpoints: GET /health (no key needed), GET /v1/models[/{id}], POST /v1/chat/completions (tools, logprobs,
response_format, `session_id`), POST /v1/completions (logprobs, echo), POST /v1/messages (Anthropic's), all
streaming as SSE or not; POST/GET/DELETE /v1/sessions[/{id}] (server/sessions.py), POST /tokenize and /detokenize
(vLLM's), GET /v1/stats (JSON: `engine` is exactly `llm.stats()`), GET /metrics (Prometheus text). Every error is
OpenAI-shaped, {"error": {"message", "type", "param", "code"}} (Anthropic's shape on /v1/messages), with 400 (bad
request), 401 (key), 404 (model, session or route), 408 (a body that does not arrive), 409 (a session's turn already
running), 413 (body too large), 429 (queue full), 500 (the server's own fault), 503 (stopping). The app only calls
the engine's public API, through one engine thread (server/worker.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from moestream.engine.grammar import Structure
from moestream.errors import MoestreamError, RequestError
from moestream.server import anthropic
from moestream.server.gate import Gate
from moestream.server.metrics import ServerMetrics
from moestream.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from moestream.server.sessions import SessionRequest, Sessions
from moestream.server.shapes import Finished, Shapes, tool_call_dict, usage, usage_of
from moestream.server.tools import call_schema, check_tools, template_messages
from moestream.server.transport import JobStream, cancel_on_disconnect, read_json, sse
from moestream.server.turns import Plan, Turn
from moestream.server.worker import EngineWorker

MESSAGES = "/v1/messages"  # Anthropic's API: its errors in its own shape
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int = 64  # requests waiting behind the running one
    max_tokens_limit: int = 4096
    max_body_bytes: int = 1_000_000
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat defaults to the limit
    request_timeout_s: float = 30.0  # a connection's request headers, and a request's body, must arrive within it
    max_sessions: int = 64
    session_budget_bytes: int = 16 << 20  # the committed messages of every session together
    session_idle_s: float = 900.0


def create_app(llm, settings: ServerSettings) -> FastAPI:
    worker = EngineWorker(llm, settings.max_queue)
    metrics = ServerMetrics(llm, worker)
    started = time.time()
    counts = {"total": 0, "2xx": 0, "4xx": 0, "5xx": 0}
    tokens = {"prompt": 0, "generated": 0}
    context_length = llm.context_length
    sessions = Sessions(settings.max_sessions, settings.session_budget_bytes, settings.session_idle_s)

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
        body = anthropic.error_body(e.status, e.message) if request.url.path == MESSAGES else e.body()
        return JSONResponse(body, status_code=e.status, headers=headers)

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
        data, session = await read_json(request, settings), None
        if isinstance(data, dict) and data.get("session_id") is not None:
            if not isinstance(data["session_id"], str):
                raise APIError(400, "session_id: must be a string", param="session_id")
            session, data = sessions.begin(data["session_id"], data)
        try:
            return await chat_turn(request, data, session)
        except BaseException:
            if session is not None:
                sessions.end(session)
            raise

    async def chat_turn(request: Request, data, session):
        """A chat completion; in a session, its new messages and answer are committed when it completes, and the
        session is free again when it ends (the stream's end, when streaming)."""
        req = parse(ChatRequest, data)
        check_model(req.model)
        req.refuse_unsupported()
        choice = check_tools(req.tools, req.tool_choice)
        params = req.sampling_params(settings.max_tokens_limit, settings.max_tokens_limit)
        params = dataclasses.replace(params, logprobs=req.logprobs_wanted())
        plan = await chat_plan(req.raw_messages(), req.tools, choice, req.structure(), params,
                               bool(req.max_tokens or req.max_completion_tokens), req.n or 1)
        plan.single_call = req.parallel_tool_calls is False
        on_done = None
        if session is not None:
            new = req.raw_messages()[len(session.messages):]

            def on_done(choices):
                c = choices and choices[0]
                if c and c.reason in ("stop", "length"):
                    answer = {"role": "assistant", "content": c.text}
                    if c.calls:
                        answer["tool_calls"] = [tool_call_dict(call) for call in c.calls]
                    sessions.commit(session, new, answer, usage_of(c.out))
                sessions.end(session)
        return await run(request, Turn(worker, plan, settings.max_queue), True, req.stream, req.stream_options,
                         on_done)

    async def chat_plan(messages: list[dict], tools, choice, structure, params, explicit: bool, n: int,
                        continue_final: bool = False) -> Plan:
        """A chat request's plan: its messages through the chat template with the tools it offers (or, with
        `continue_final`, up to the final message's text, which the answer continues); a call the request forces
        (tool_choice required or named) is a grammar the answer must follow."""
        offered = tools if choice.mode != "none" else None
        template = template_messages(messages)
        ids = await tokenize(lambda: llm.tokenizer.chat(template, offered, continue_final), "messages")
        if choice.mode in ("required", "named"):
            if structure is not None:
                raise APIError(400, "response_format cannot be combined with a forced tool call", param="tool_choice")
            structure = Structure("tool_calls", call_schema(tools, choice.name))
        if structure is not None:  # compiled now (and cached): a schema the grammar library refuses is a 400
            try:
                await run_in_threadpool(llm.grammars.constraint, structure)
            except RequestError as e:
                raise APIError(400, str(e), param="response_format" if choice.mode in ("none", "auto")
                               else "tool_choice") from None
        params = dataclasses.replace(params, structure=structure)
        return Plan([(ids, fit_context(len(ids), params, explicit, "messages"))], n, tools=offered)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request, settings))
        check_model(req.model)
        req.refuse_unsupported()
        params = req.sampling_params(settings.completion_default_max_tokens, settings.max_tokens_limit)
        echo = bool(req.echo)
        if echo and req.logprobs is not None and req.stream:  # the prompt's log probabilities come whole, at the end
            raise APIError(400, "echo with logprobs is answered whole, not streamed: leave out stream", param="stream")
        params = dataclasses.replace(params, logprobs=req.logprobs,
                                     prompt_logprobs=req.logprobs if echo and req.logprobs is not None else None)
        explicit, prompts, texts = bool(req.max_tokens), [], []
        for p in req.prompts():
            encode = (lambda p=p: llm.tokenizer.encode(p)) if isinstance(p, str) else (lambda p=p: list(p))
            ids = await tokenize(encode, "prompt")
            prompts.append((ids, fit_context(len(ids), params, explicit, "prompt")))
            if echo:
                texts.append(p if isinstance(p, str) else await run_in_threadpool(llm.tokenizer.decode, ids))
        plan = Plan(prompts, req.n or 1, echo=texts if echo else None)
        return await run(request, Turn(worker, plan, settings.max_queue), False, req.stream, req.stream_options)

    @app.post(MESSAGES)
    async def messages(request: Request):
        req = anthropic.parse_request(await read_json(request, settings))
        check_model(req.model)
        chat = parse(ChatRequest, {k: v for k, v in anthropic.to_chat(req).items() if v is not None})
        choice = check_tools(chat.tools, chat.tool_choice)
        params = chat.sampling_params(settings.max_tokens_limit, settings.max_tokens_limit)
        plan = await chat_plan(chat.raw_messages(), chat.tools, choice, None, params, True, 1,
                               anthropic.is_prefill(req))
        plan.single_call = chat.parallel_tool_calls is False
        turn = Turn(worker, plan, settings.max_queue)
        ms = anthropic.MessageStream(anthropic.new_message_id(), req.model)
        if req.stream:
            return JobStream(turn.jobs, message_events(turn, ms), media_type="text/event-stream",
                              headers=SSE_HEADERS)
        choices = await collected(request, turn)
        if choices is None:
            return Response(status_code=499)
        c = choices[0]
        record(turn, [c.out], MESSAGES)
        reason = anthropic.stop_reason_of(c.reason, c.out.stop_string, bool(c.calls))
        return anthropic.message(ms.id, req.model, c.text, c.calls, reason, c.out.stop_string,
                                 len(c.out.prompt_token_ids), len(c.out.token_ids),
                                 c.out.stats["timings"]["cached_tokens"])

    async def message_events(turn: Turn, ms):
        yield ms.start(len(turn.jobs[0].prompt_ids))
        calls = []
        try:
            async for _, kind, value in turn.events():
                if kind == "text":
                    yield ms.text(value[0])
                elif kind == "call" and not (turn.plan.single_call and calls):
                    calls.append(value)
                    yield ms.call(value)
                elif kind == "done":
                    record(turn, [value], MESSAGES)
                    reason = anthropic.stop_reason_of(value.finish_reason, value.stop_string, bool(calls))
                    yield ms.finish(reason, value.stop_string, len(value.token_ids))
        except APIError as e:
            yield ms.error(e.status, e.message)

    @app.post("/v1/sessions")
    async def new_session(request: Request):
        req = parse(SessionRequest, await read_json(request, settings))
        check_model(req.model)
        return sessions.create(req).card(sessions.idle_s)

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        return sessions.get(session_id).card(sessions.idle_s)

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str):
        sessions.delete(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    async def run(request: Request, turn: Turn, chat: bool, streaming: bool | None, options, on_done=None):
        """The response: the choices whole, or their stream. `on_done(choices or None)` runs once it has ended."""
        shapes = Shapes(chat, settings.model_name, llm.tokenizer.token_text)
        endpoint = request.url.path
        if streaming:
            return JobStream(turn.jobs, stream(turn, shapes, options, endpoint, on_done),
                              media_type="text/event-stream", headers=SSE_HEADERS)
        choices = None
        try:
            choices = await collected(request, turn)
        finally:
            if on_done is not None:
                on_done(choices)
        if choices is None:  # the client went away
            return Response(status_code=499)
        return shapes.response(choices, record(turn, [c.out for c in choices], endpoint))

    async def collected(request: Request, turn: Turn):
        watcher = asyncio.create_task(cancel_on_disconnect(request, turn))
        try:
            return await turn.collect()
        finally:
            watcher.cancel()
            turn.cancel()

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

    async def stream(turn: Turn, shapes: Shapes, options, endpoint: str, on_done=None):
        include_usage, continuous_usage = bool(options and options.include_usage), bool(
            options and options.continuous_usage_stats)
        jobs = turn.jobs
        if shapes.chat:
            for job in jobs:
                yield sse(shapes.first(job.index))
        elif turn.plan.echo:
            for job in jobs:
                yield sse(shapes.text(job.index, turn.echoed(job.index)))
        outs, calls, seen = [None] * len(jobs), [[] for _ in jobs], set()
        texts = [[] for _ in jobs]
        try:
            async for index, kind, value in turn.events():
                if kind == "text":
                    if index not in seen:
                        metrics.first_token.labels(endpoint).observe(time.monotonic() - jobs[index].submitted_at)
                        seen.add(index)
                    piece, tokens, entries = value
                    texts[index].append(piece)
                    chunk = shapes.text(index, piece, tokens, entries)
                    if continuous_usage:  # vLLM's extension: tokens so far on every chunk (a client's per-token timing)
                        chunk["usage"] = usage(len(jobs[index].prompt_ids), jobs[index].sent, 0)
                    yield sse(chunk)
                elif kind == "call":
                    if not (turn.plan.single_call and calls[index]):
                        yield sse(shapes.call(index, len(calls[index]), value))
                        calls[index].append(value)
                else:
                    outs[index] = value
                    yield sse(shapes.end(index, value.finish_reason, bool(calls[index])))
        except APIError as e:
            yield sse(e.body())
        else:
            if all(out is not None for out in outs):
                use = record(turn, outs, endpoint)
                if include_usage:
                    yield sse(shapes.usage_chunk(use))
        finally:
            if on_done is not None:
                done = all(out is not None for out in outs)
                on_done([Finished("".join(t).strip(), o.finish_reason, c, out=o)
                         for t, c, o in zip(texts, calls, outs)] if done else None)
        yield "data: [DONE]\n\n"

    def record(turn: Turn, outs: list, endpoint: str) -> dict:
        """Count the finished choices; their usage counts each prompt once."""
        now, n = time.monotonic(), turn.plan.n
        for job, out in zip(turn.jobs, outs):
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
        """Refuse a prompt (plus explicit max_tokens) past the context or the KV cache; trim a default max_tokens to
        fit."""
        if (limit := llm.room(prompt_tokens)) is None:
            return params
        room, why = limit
        if room < 1 or (explicit and params.max_tokens > room):
            raise APIError(400, f"{why}; the prompt has {prompt_tokens} and {params.max_tokens} more were asked for",
                           param=param, code="context_length_exceeded")
        return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))

    @app.post("/tokenize")
    async def tokenize_text(request: Request):
        req = parse(TokenizeRequest, await read_json(request, settings))
        check_model(req.model)
        req.check()
        if req.prompt is not None:
            ids = await tokenize(lambda: llm.tokenizer.encode(req.prompt), "prompt")
        else:
            check_tools(req.tools, None)
            template = template_messages([m.model_dump(exclude_none=True) for m in req.messages])
            ids = await tokenize(lambda: llm.tokenizer.chat(template, req.tools), "messages")
        return {"count": len(ids), "max_model_len": context_length, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await read_json(request, settings))
        check_model(req.model)
        if any(not 0 <= i < llm.config.vocab_size for i in req.tokens):
            raise APIError(400, f"token ids must be in [0, {llm.config.vocab_size})", param="tokens")
        return {"prompt": await run_in_threadpool(llm.tokenizer.decode, req.tokens)}

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
        # the engine's counters are read between two steps: while it steps, a reading under a second old serves at
        # once (the next one asked for); otherwise, or idle, the scrape waits for a fresh one
        reading = metrics.engine.request()
        if not (worker.active and metrics.engine.age() < 1.0):
            await asyncio.wrap_future(reading)
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
