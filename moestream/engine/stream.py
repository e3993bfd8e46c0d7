"""Text streaming over the token loop: incremental detokenisation and stop strings.

Pieces never contain any part of a stop string (text that might begin one is held back until it
cannot), nor an incomplete UTF-8 character; the pieces joined equal `output().text`. `cancelled`, when
given, is polled before every engine step (a prefill chunk, a token), so a caller on another thread can end the
generation early."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from moestream.engine.generate import Timings
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
    # with SamplingParams.logprobs, per token: (logprob, likeliest [(id, logprob)]); prompt_logprobs: per prompt
    # token after the first
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    stop_string: str | None = None  # the stop string the text ended at


class TextStream:
    """Iterate to get text pieces as tokens arrive; `output()` afterwards gives the whole result. Several streams
    run together by `start`, then `pieces` after each engine step until `done`, then `close`."""

    def __init__(self, llm, prompt_ids: list[int], params: SamplingParams, cancelled: Callable[[], bool] | None = None,
                 pieces: bool = True):
        """`pieces`: decode the text as tokens arrive (else once, in `output`: a caller that wants only the result
        and has no stop string to watch for saves ~45 us a token of the engine thread's time)."""
        self.llm, self.prompt_ids, self.params, self.cancelled = llm, list(prompt_ids), params, cancelled
        self.incremental = pieces or bool(params.stop)
        self.tokens: list[int] = []
        self.logprobs: list[tuple[float, list]] = []  # the tokens' (logprob, alternatives), when asked for
        self.stop_string: str | None = None
        self.text, self.finish_reason, self.request = "", None, None
        self.stopped = False  # at a stop string
        # incremental decoding: the text of tokens[:_read] is _settled; tokens[_context:_read] decode to _context_text
        self._context = self._read = 0
        self._settled = self._context_text = ""

    def start(self) -> None:
        """Queue the request; a bad one is refused here."""
        self._before = self.llm.provider.totals()
        self.request = self.llm._submit(self.prompt_ids, self.params, self.cancelled)

    @property
    def done(self) -> bool:
        return self.stopped or (self.request.finished and not self.request.steps)

    def __iter__(self) -> Iterator[str]:
        self.start()
        for step in self.llm._steps(self.request):
            if piece := self._feed(step):
                yield piece
            if self.stopped:
                break
        self._settle()

    def pieces(self) -> list[str]:
        """The text of the tokens its request made since the last call (the engine stepped in between)."""
        out = []
        while self.request.steps and not self.stopped:
            if piece := self._feed(self.request.steps.popleft()):
                out.append(piece)
        if self.done:
            self._settle()
        return out

    def close(self) -> None:
        """End the request if it still runs (its caller has gone)."""
        if self.request is not None:
            self.llm.scheduler.cancel(self.request)

    def _feed(self, step) -> str:
        self.tokens.append(step.token)
        if step.logprob is not None:
            self.logprobs.append((step.logprob, step.top))
        self.finish_reason = step.finish_reason
        if not self.incremental:
            return ""
        full = self._decoded()
        cut, stop = min(((full.find(s), s) for s in self.params.stop if s in full), default=(-1, None))
        if cut >= 0:
            full, self.finish_reason, self.stopped, self.stop_string = full[:cut], "stop", True, stop
            self.llm.scheduler.cancel(self.request, "stop")
        elif not step.finish_reason:
            full = full[: len(full) - _held_back(full, self.params.stop)]
        piece, self.text = full[len(self.text):], full
        return piece

    def _decoded(self) -> str:
        """The answer's text so far, decoding only the tokens since the text last ended on a whole character, after
        the tokens of the piece before them as context (a word's leading space, a clean-up across the seam): each
        token costs a window's decode, not the whole answer's. A tokenizer whose window text does not begin with its
        context's is decoded whole."""
        window = self.llm._text(self.tokens[self._context:])
        if not window.startswith(self._context_text):
            self._context = self._read = 0
            self._settled = self._context_text = ""
            window = self.llm._text(self.tokens)
        full = self._settled + window[len(self._context_text):]
        if not full.endswith("\ufffd"):  # whole characters: the next window starts after these tokens
            self._context, self._read, self._settled = self._read, len(self.tokens), full
            while True:  # context that decodes to something (skipped special tokens give the seam no space)
                self._context_text = self.llm._text(self.tokens[self._context: self._read])
                if self._context_text or self._context == 0:
                    break
                self._context -= 1
        return full

    def _settle(self) -> None:
        if not self.stopped and self.request.finish_reason == "cancelled":
            self.finish_reason = "cancelled"  # between two tokens, or between two prefill chunks

    def output(self):
        if not self.incremental:
            self.text = self.llm._text(self.tokens)
        g = self.request.generation
        stats = {"timings": (g.seq.timings if g is not None else Timings()).as_dict(),
                 "experts": delta(self._before, self.llm.provider.totals())}
        logprobs = self.logprobs if self.params.logprobs is not None else None
        prompt_logprobs = g.seq.prompt_logprobs if g is not None and self.params.prompt_logprobs is not None else None
        return RequestOutput(self.text, self.tokens, self.prompt_ids, self.finish_reason, stats, logprobs,
                             prompt_logprobs, self.stop_string)
