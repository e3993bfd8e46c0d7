"""Text streaming over the token loop: incremental detokenisation and stop strings.

Pieces never contain any part of a stop string (text that might begin one is held back until it
cannot), nor an incomplete UTF-8 character; the pieces joined equal `output().text`. `cancelled`, when
given, is polled between prefill chunks and after every token, so a caller on another thread can end the
generation early."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from moestream.sampling import SamplingParams
from moestream.stats.counters import delta


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may still change: an incomplete character, and before it
    the longest tail that begins a stop string."""
    complete = text.rstrip("\ufffd")
    tail = max((n for s in stops for n in range(min(len(s) - 1, len(complete)), 0, -1) if complete.endswith(s[:n])),
               default=0)
    return len(text) - len(complete) + tail


@dataclass
class RequestOutput:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    stats: dict = field(default_factory=dict)


class TextStream:
    """Iterate to get text pieces as tokens arrive; `output()` afterwards gives the whole result."""

    def __init__(self, llm, prompt_ids: list[int], params: SamplingParams, cancelled: Callable[[], bool] | None = None):
        self.llm, self.prompt_ids, self.params, self.cancelled = llm, list(prompt_ids), params, cancelled
        self.tokens: list[int] = []
        self.text, self.finish_reason, self.seq = "", None, None

    def __iter__(self) -> Iterator[str]:
        llm, params = self.llm, self.params
        self._before = llm.provider.totals()
        self.seq = llm._sequence(self.prompt_ids, params)
        for step in llm._run(self.seq, self.cancelled):
            self.tokens.append(step.token)
            self.finish_reason = step.finish_reason
            full = llm._text(self.tokens)
            cut = min((full.find(s) for s in params.stop if s in full), default=-1)
            if cut >= 0:
                full, self.finish_reason = full[:cut], "stop"
            elif not step.finish_reason:
                full = full[: len(full) - _held_back(full, params.stop)]
            piece, self.text = full[len(self.text):], full
            if piece:
                yield piece
            if cut >= 0:
                return
            if self.cancelled is not None and self.cancelled():
                self.finish_reason = "cancelled"
                return
        if self.finish_reason is None and self.cancelled is not None and self.cancelled():
            self.finish_reason = "cancelled"  # during the prompt, between two prefill chunks

    def output(self):
        stats = {"timings": self.seq.timings.as_dict(),
                 "experts": delta(self._before, self.llm.provider.totals())}
        return RequestOutput(self.text, self.tokens, self.prompt_ids, self.finish_reason, stats)
