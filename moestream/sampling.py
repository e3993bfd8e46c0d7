"""Sampling parameters and the sampler: penalties, then temperature, top-k and top-p; greedy at 0."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


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


def _int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _need(ok: bool, field: str, what: str) -> None:
    if not ok:
        from moestream.errors import RequestError

        raise RequestError(f"{field} {what}")


GREEDY_BELOW = 1e-5  # a temperature below samples greedily (vLLM's rule): dividing by it would overflow to inf


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.p = params
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
        """Plain greedy: the token is the logits' argmax, whatever came before."""
        return self.p.temperature < GREEDY_BELOW and not self.needs_history

    def __call__(self, logits: torch.Tensor, previous: list[int]) -> int:
        """logits [vocab] float32 -> the next token id; `previous` (the tokens so far) matters only to the
        penalties."""
        probs = self.distribution(logits, previous)
        if probs is None:
            return int(torch.argmax(self.penalised(logits, previous)))
        return int(torch.multinomial(probs, 1, generator=self.generator))

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
        p = self.p
        if p.temperature < GREEDY_BELOW:
            return None
        logits = self.penalised(logits, previous) / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
            logits[order[drop]] = float("-inf")
        return torch.softmax(logits, -1)
