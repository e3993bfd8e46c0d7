"""Speculative decoding's host side: which drafts a verify step accepts, how many drafts to ask for next, and the
counts `stats` reports. The verify step itself (k drafts as k+1 rows) is the decoder's.

Acceptance is the standard rule (Leviathan et al. 2023; Chen et al. 2023): a draft d drawn from q is kept with
probability min(1, p(d) / q(d)) against the target p the sampler would draw from; at the first rejection the
token is drawn from max(p - q, 0), renormalised, and when every draft is kept, one more from the last row's p.
The output is then distributed exactly as without speculation. A draft with no distribution (prompt lookup) has
q a point mass. Greedy keeps a draft while it is the argmax, so its tokens are the non-speculative ones, given
a verify step whose rows have the bits of single decode steps (engine/decode.py).
"""

from __future__ import annotations

import dataclasses

import torch

from moestream.engine.lookup import PromptLookup
from moestream.sampling import Sampler


def accept(sampler: Sampler, logits: torch.Tensor, drafts: list[int], previous: list[int],
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """logits [k+1, vocab] (row i follows the i drafts before it), `drafts` (k), their distributions [k, vocab]
    or None -> the tokens to append: the kept drafts and one drawn token (1 to k+1 of them)."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        context = previous + out
        p = sampler.distribution(logits[i], context)
        if p is None:
            token = int(torch.argmax(sampler.penalised(logits[i], context)))
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                return out
            continue
        if i == len(drafts):
            out.append(int(torch.multinomial(p, 1, generator=sampler.generator)))
            return out
        d = drafts[i]
        q = draft_probs[i] if draft_probs is not None else None
        q_d = float(q[d]) if q is not None else 1.0
        u = float(torch.rand((), generator=sampler.generator, device=p.device))
        if q_d > 0 and u * q_d < float(p[d]):  # u < p(d) / q(d), without dividing by a tiny q
            out.append(d)
            continue
        if q is not None:
            residual = (p - q).clamp_(min=0)
        else:  # q a point mass on d
            residual = p.clone().index_fill_(0, torch.tensor([d], device=p.device), 0.0)
        total = float(residual.sum())
        out.append(int(torch.multinomial(residual / total if total > 0 else p, 1, generator=sampler.generator)))
        return out
    return out


@dataclasses.dataclass
class SpecStats:
    """Drafts proposed and accepted per draft position, verify steps and their tokens, and seconds per depth."""

    proposed: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # depth -> summed step seconds
    steps_at: dict[int, int] = dataclasses.field(default_factory=dict)  # depth -> steps

    def record(self, drafts: int, kept: int, seconds: float) -> None:
        for at in range(drafts):
            if at == len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[at] += 1
            self.accepted[at] += at < kept
        self.steps += 1
        self.tokens += kept + 1
        self.seconds[drafts] = self.seconds.get(drafts, 0.0) + seconds
        self.steps_at[drafts] = self.steps_at.get(drafts, 0) + 1

    def as_dict(self) -> dict:
        return {"proposed": list(self.proposed), "accepted": list(self.accepted),
                "acceptance": [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)],
                "steps": self.steps, "tokens_per_step": self.tokens / self.steps if self.steps else 0.0,
                "step_ms": {k: 1e3 * s / self.steps_at[k] for k, s in sorted(self.seconds.items())}}


ROW_FLOOR = 0.02  # the least a verify row costs, relative to a one-row step


class Depth:
    """How many drafts to verify next: the k that maximises expected tokens per second, (1 - a^(k+1)) / (1 - a)
    over the measured cost of a (k+1)-row step, with `a` the recent per-draft acceptance. It falls to 0 when drafts
    stop paying, and tries one draft after `probe` plain steps to notice when they pay again, waiting twice as long
    after each probe that kept nothing (up to 32x)."""

    def __init__(self, max_drafts: int, fixed: int | None = None, decay: float = 0.9, probe: int = 32,
                 cost_prior: float = 0.1):
        self.max_drafts, self.fixed, self.decay, self.probe = max_drafts, fixed, decay, probe
        self.hits, self.trials = 1.0, 2.0  # decayed counts of drafts kept / drafts judged; a prior of 1 in 2
        self.cost = {k: 1.0 + cost_prior * k for k in range(max_drafts + 1)}  # relative to a 1-row step
        self.measured: dict[int, float] = {}  # depth -> smoothed seconds
        self.since_drafts, self.wait = 0, probe

    def update(self, drafts: int, kept: int, seconds: float) -> None:
        if drafts:  # a draft after the first rejected one is not judged
            self.hits = self.decay * self.hits + kept
            self.trials = self.decay * self.trials + min(kept + 1, drafts)
            self.since_drafts = 0
            self.wait = self.probe if kept else min(2 * self.wait, 32 * self.probe)
        else:
            self.since_drafts += 1
        old = self.measured.get(drafts)
        self.measured[drafts] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        if 0 in self.measured:  # a row is never free: else one slow plain step makes drafts look free for good
            for k in range(1, self.max_drafts + 1):
                ratio = self.measured[k] / self.measured[0] if k in self.measured else self.cost[k]
                self.cost[k] = max(ratio, self.cost[k - 1] + ROW_FLOOR)

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials

    def next(self) -> int:
        if self.fixed is not None:
            return self.fixed
        a = min(self.acceptance, 0.999)
        best = max(range(self.max_drafts + 1), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / self.cost[k])
        if best == 0 and self.max_drafts and self.since_drafts >= self.wait:
            return 1
        return best


class Speculator:
    """One sequence's drafts: prompt lookup over its tokens so far, at the depth `depth` chooses (the engine's, so
    that what drafts earned on earlier requests carries over); each step's outcome goes to the depth and to the
    engine's `stats`."""

    def __init__(self, depth: Depth, stats: SpecStats, prompt: list[int]):
        self.depth, self.stats, self.prompt = depth, stats, len(prompt)
        self.lookup = PromptLookup()
        self.lookup.reset(prompt)

    def propose(self, generated: list[int], limit: int) -> list[int]:
        """Up to `limit` drafts to follow the prompt and `generated`; none without a host pass over the tokens
        while the depth is 0, so that a plain step costs what it costs without speculation."""
        k = min(self.depth.next(), limit)
        if k <= 0:
            return []
        self.lookup.extend(generated[len(self.lookup.tokens) - self.prompt:])
        return self.lookup.propose(k)

    def record(self, drafts: int, kept: int, seconds: float) -> None:
        self.depth.update(drafts, kept, seconds)
        self.stats.record(drafts, kept, seconds)
