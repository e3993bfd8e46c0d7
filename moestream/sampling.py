"""Sampling parameters and the sampler: penalties and a grammar's mask, then temperature, top-k and top-p; greedy at
0. Log probabilities are those of the logits the sampler sees before temperature: after the penalties and the mask."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # alternatives a token's log probability may come with (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """Checked when made: one line naming the field for a value out of range. `stop` may be one string; empty
    stop strings are dropped (they would stop before the first token)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] | str = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # each token's log probability and its `logprobs` likeliest alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache then)
    structure: Any = None  # an engine.grammar.Structure the answer must follow (it then runs no drafts)

    def __post_init__(self):
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        _need(all(isinstance(s, str) for s in stops), "stop", "must be a string or a list of strings")
        object.__setattr__(self, "stop", tuple(s for s in stops if s))
        self.validate()

    def validate(self) -> None:
        _need(_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens", "must be an integer >= 0")
        _need(_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0: off)")
        _need(_number(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        _need(_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be a number in (0, 1]")
        _need(_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              "must be a number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            _need(_number(getattr(self, name)), name, "must be a finite number")
        _need(self.seed is None or _int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed",
              f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        _need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _need(value is None or _int(value) and 0 <= value <= MAX_LOGPROBS, name,
                  f"must be an integer in [0, {MAX_LOGPROBS}] or None")


def _int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _need(ok: bool, field: str, what: str) -> None:
    if not ok:
        from moestream.errors import RequestError

        raise RequestError(f"{field} {what}")


GREEDY_BELOW = 1e-5  # a temperature below samples greedily (vLLM's rule): dividing by it would overflow to inf


@dataclass(frozen=True)
class Pick:
    """A sampled token, with its log probability and the likeliest alternatives [(id, logprob)] when asked for."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def logprobs_of(view: torch.Tensor, tokens: torch.Tensor, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """view [T, vocab], tokens [T] -> per row: the token's log probability and the k likeliest [(id, logprob)]."""
    lp = torch.log_softmax(view.float(), -1)
    chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()
    top = torch.topk(lp, k, -1) if k else None
    tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())] if k else [[]] * len(chosen)
    return list(zip(chosen, tops))


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device, constraint=None):
        """`constraint`: an engine.grammar.Constraint for `params.structure`, advanced by every `pick`."""
        self.p, self.constraint = params, constraint
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)

    @property
    def needs_history(self) -> bool:
        p = self.p
        return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)

    @property
    def greedy(self) -> bool:
        """Plain greedy: the token is the logits' argmax, whatever came before (no mask, no log probabilities)."""
        p = self.p
        return p.temperature < GREEDY_BELOW and not self.needs_history and self.constraint is None \
            and p.logprobs is None

    def __call__(self, logits: torch.Tensor, previous: list[int]) -> int:
        """logits [vocab] float32 -> the next token id; `previous` (the tokens so far) matters only to the
        penalties."""
        return self.pick(logits, previous).token

    def pick(self, logits: torch.Tensor, previous: list[int]) -> Pick:
        view = self.penalised(logits, previous)
        if self.constraint is not None:
            view = self.constraint.mask(view.clone() if view is logits else view)
        probs = self._distribution(view)
        token = int(torch.argmax(view)) if probs is None else int(torch.multinomial(probs, 1, generator=self.generator))
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.p.logprobs is None:
            return Pick(token)
        (logprob, top), = logprobs_of(view[None], torch.tensor([token], device=view.device), self.p.logprobs)
        return Pick(token, logprob, top)

    def penalised(self, logits: torch.Tensor, previous: list[int]) -> torch.Tensor:
        p = self.p
        if not previous or not self.needs_history:
            return logits
        logits = logits.clone()
        ids, counts = torch.unique(torch.tensor(previous, device=logits.device), return_counts=True)
        seen = logits[ids]
        if p.repetition_penalty != 1.0:
            seen = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        logits[ids] = seen - p.presence_penalty - p.frequency_penalty * counts.to(logits.dtype)
        return logits

    def distribution(self, logits: torch.Tensor, previous: list[int]) -> torch.Tensor | None:
        """What the next token is drawn from [vocab] (speculative sampling accepts against it); None when greedy."""
        if self.p.temperature < GREEDY_BELOW:
            return None
        return self._distribution(self.penalised(logits, previous))

    def _distribution(self, view: torch.Tensor) -> torch.Tensor | None:
        p = self.p
        if p.temperature < GREEDY_BELOW:
            return None
        logits = view / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
            logits[order[drop]] = float("-inf")
        return torch.softmax(logits, -1)
