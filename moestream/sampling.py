"""Sampling parameters and the sampler: penalties, then temperature, top-k and top-p; greedy at 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        from moestream.errors import MoestreamError

        if self.max_tokens < 0:
            raise MoestreamError("max_tokens must be >= 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise MoestreamError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0, repetition_penalty > 0")


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

    def __call__(self, logits: torch.Tensor, previous: list[int]) -> int:
        """logits [vocab] float32 -> the next token id; `previous` (the tokens so far) matters only to the
        penalties."""
        p = self.p
        if previous and self.needs_history:
            logits = logits.clone()
            ids, counts = torch.unique(torch.tensor(previous, device=logits.device), return_counts=True)
            seen = logits[ids]
            if p.repetition_penalty != 1.0:
                seen = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
            logits[ids] = seen - p.presence_penalty - p.frequency_penalty * counts.to(logits.dtype)
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
            logits[order[drop]] = float("-inf")
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
