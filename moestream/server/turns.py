"""A request's choices run on the engine thread and read back, the part every generating endpoint shares: `Turn`
submits each prompt's `n` choices as jobs (choice i * n + j is prompt i's sample j), then either collects them
(`collect`) or yields their events as they come (`events`), tool calls parsed out of the text when the request
offered tools. An engine failure becomes an APIError (400 for the caller's mistakes, 503 stopping, else 500)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from moestream.errors import RequestError
from moestream.sampling import SEED_RANGE, SamplingParams
from moestream.server.protocol import APIError
from moestream.server.shapes import Finished
from moestream.server.tools import ToolCallStream, parse_tool_calls
from moestream.server.worker import EngineWorker, Job, QueueFull, ShuttingDown


@dataclass
class Plan:
    """What a request runs: (prompt ids, params) per prompt, `n` choices each; `tools` (OpenAI's list) when tool
    calls are parsed out of the answers; `echo`: each prompt's text, put before its answers."""

    prompts: list[tuple[list[int], SamplingParams]]
    n: int = 1
    tools: list[dict] | None = None
    echo: list[str] | None = None
    single_call: bool = False  # parallel_tool_calls false: an answer's first call only


class Turn:
    def __init__(self, worker: EngineWorker, plan: Plan, max_queue: int):
        self.plan, self.queue, self.jobs = plan, asyncio.Queue(), []
        try:
            for ids, params in plan.prompts:
                for j in range(plan.n):
                    choice = params if params.seed is None else sample_seed(params, j)
                    self.jobs.append(worker.submit(ids, choice, self.queue, len(self.jobs)))
        except ShuttingDown:
            self.cancel()
            raise engine_error(ShuttingDown("the server is shutting down")) from None
        except QueueFull:
            self.cancel()
            raise APIError(429, f"the server is busy ({max_queue} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full") from None

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel.set()

    def echoed(self, index: int) -> str:
        return self.plan.echo[index // self.plan.n] if self.plan.echo else ""

    async def events(self, parse: bool = True):
        """(index, kind, value) as they come: ("text", (piece, tokens, logprob entries or None)), ("call", ToolCall)
        when `parse` and the plan has tools, ("done", RequestOutput); raises the engine's error as an APIError. Ends
        when every choice is done, or early when the client went away."""
        parsers = [ToolCallStream(self.plan.tools) if parse and self.plan.tools else None for _ in self.jobs]
        done = 0
        while done < len(self.jobs):
            index, kind, value = await self.queue.get()
            if kind == "error":
                raise engine_error(value)
            if kind == "gone":
                return
            parser = parsers[index]
            if kind == "text":
                piece, _, tokens, entries = value
                found = parser.feed(piece) if parser else [("text", piece)]
            else:
                found, tokens, entries = parser.close() if parser else [], [], None
            attached = False  # the tokens' log probabilities go with the first text they end
            for what, item in found:
                if what == "call":
                    yield index, "call", item
                elif item:
                    yield index, "text", (item, [] if attached else tokens, entries if not attached or entries is None
                                          else [])
                    attached = True
            if not attached and entries:
                yield index, "text", ("", tokens, entries)
            if kind == "done":
                done += 1
                yield index, "done", value

    async def collect(self) -> list[Finished] | None:
        """Every choice finished, in index order, its tool calls parsed from its whole text; None when the client
        went away."""
        outs = [None] * len(self.jobs)
        async for index, kind, value in self.events(parse=False):
            if kind == "done":
                outs[index] = value
        if any(out is None for out in outs):
            return None
        return [self.finished(i, out) for i, out in enumerate(outs)]

    def finished(self, index: int, out) -> Finished:
        params, text, calls = self.jobs[index].params, out.text, []
        if self.plan.tools:
            text, calls = parse_tool_calls(text, self.plan.tools)
            calls = calls[:1] if self.plan.single_call else calls
        tokens, entries = list(out.token_ids), out.logprobs
        if params.prompt_logprobs is not None:  # echoed: the prompt's tokens first, its first without a logprob
            tokens = out.prompt_token_ids + tokens
            entries = [(None, []), *(out.prompt_logprobs or []), *(entries or [])]
        return Finished(self.echoed(index) + text, out.finish_reason, calls, tokens, entries, out)


def sample_seed(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j's parameters: the request's seed moved on by j, so that n seeded samples differ and repeat."""
    low, high = SEED_RANGE
    return dataclasses.replace(params, seed=low + (params.seed - low + j) % (high - low + 1))


def engine_error(e: Exception) -> APIError:
    """The caller's mistakes are 400; a stopping server 503; anything else is the server's own fault, 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestError):
        return APIError(400, str(e))
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), type="server_error", code="shutting_down")
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


def cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel.set()
