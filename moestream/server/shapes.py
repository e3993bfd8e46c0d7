"""OpenAI response objects of one request (chat or text completion), whole or as stream chunks: text, tool calls
(`tool_calls`, finish reason "tool_calls") and log probabilities in each API's own form (chat: `logprobs.content`
entries with bytes and alternatives; completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moestream.server.protocol import new_id

Entry = tuple[float | None, list[tuple[int, float]]]  # a token's logprob (None: a prompt's first) and alternatives


@dataclass
class Finished:
    """One finished choice: its text (after an echoed prompt), tool calls, finish reason, and the log probabilities
    of its tokens (`tokens`, `entries`: the echoed prompt's first, when echoed)."""

    text: str
    reason: str | None
    calls: list = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    entries: list[Entry] | None = None
    out: Any = None  # the engine's RequestOutput


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(out) -> dict:
    """One choice's usage (a RequestOutput's)."""
    return usage(len(out.prompt_token_ids), len(out.token_ids), out.stats["timings"]["cached_tokens"])


def finish_reason(reason: str | None, calls: bool = False) -> str | None:
    if calls:
        return "tool_calls"
    return {"stop": "stop", "length": "length"}.get(reason, reason)


class Shapes:
    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str]):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # completions: a streamed choice's text offset so far

    def _object(self, kind: str, choices: list, use: dict | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if use is not None:
            out["usage"] = use
        return out

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def response(self, choices: list[Finished], use: dict) -> dict:
        out = []
        for i, c in enumerate(choices):
            reason = finish_reason(c.reason, bool(c.calls))
            logprobs = self.logprobs(c.tokens, c.entries) if c.entries is not None else None
            if not self.chat:
                out.append({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": reason})
                continue
            message = {"role": "assistant", "content": c.text if c.text or not c.calls else None}
            if c.calls:
                message["tool_calls"] = [tool_call_dict(call) for call in c.calls]
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return self._object("chat.completion" if self.chat else "text_completion", out, use)

    def first(self, index: int) -> dict:
        return self._object(self._chunk_kind, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}])

    def text(self, index: int, piece: str, tokens: list[int] = (), entries: list[Entry] | None = None) -> dict:
        """A chunk of text, with the log probabilities of the tokens it ends (when asked for)."""
        logprobs = self.logprobs(tokens, entries, self.offsets.get(index, 0)) if entries is not None else None
        self.offsets[index] = self.offsets.get(index, 0) + len(piece)
        if not self.chat:
            return self._object(self._chunk_kind, [{"index": index, "text": piece, "logprobs": logprobs,
                                                    "finish_reason": None}])
        return self._object(self._chunk_kind, [{"index": index, "delta": {"content": piece}, "logprobs": logprobs,
                                                "finish_reason": None}])

    def call(self, index: int, position: int, call) -> dict:
        """Chat: tool call `position` of choice `index`, whole in one delta."""
        delta = {"tool_calls": [{"index": position, **tool_call_dict(call)}]}
        return self._object(self._chunk_kind, [{"index": index, "delta": delta, "logprobs": None,
                                                "finish_reason": None}])

    def end(self, index: int, reason: str | None, calls: bool) -> dict:
        choice = {"index": index, "logprobs": None, "finish_reason": finish_reason(reason, calls)}
        choice |= {"delta": {}} if self.chat else {"text": ""}
        return self._object(self._chunk_kind, [choice])

    def usage_chunk(self, use: dict) -> dict:
        return self._object(self._chunk_kind, [], use)

    def logprobs(self, tokens: list[int], entries: list[Entry], offset: int = 0) -> dict:
        """The API's log-probability object for `tokens` and their entries."""
        texts = [self.token_text(t) for t in tokens]
        if self.chat:
            return {"content": [{**_named(text, lp), "top_logprobs": [_named(self.token_text(i), v)
                                                                       for i, v in top]}
                                for text, (lp, top) in zip(texts, entries)]}
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [None if lp is None else {self.token_text(i): v for i, v in top}
                                 for lp, top in entries],
                "text_offset": offsets}


def _named(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def tool_call_dict(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
