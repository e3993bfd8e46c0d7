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

from moestream.engine.drafting import FusedDrafts, HeadDrafts
from moestream.engine.lookup import PromptLookup
from moestream.sampling import Sampler


def accept(sampler: Sampler, logits: torch.Tensor, drafts: list[int], previous: list[int],
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """logits [k+1, vocab] (row i follows the i drafts before it), `drafts` (k), their distributions [k, vocab]
    or None -> the tokens to append: the kept drafts and one drawn token (1 to k+1 of them)."""
    if sampler.greedy:  # every row's argmax in one read
        best = logits.argmax(-1).tolist()
        kept = next((i for i, d in enumerate(drafts) if best[i] != d), len(drafts))
        return best[: kept + 1]
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
                "step_ms": {k: 1e3 * s / self.steps_at[k] for k, s in sorted(self.seconds.items())},
                "steps_at": dict(sorted(self.steps_at.items()))}


ROW_FLOOR = 0.02  # the least a verify row costs, relative to a one-row step
# drafts whose first is kept at least 1 in 2 stop only when their best depth yields under this share of plain
# decode's tokens a second: acceptance decayed over ~10 steps is too noisy to judge a thin margin, and a depth
# fallen to 0 climbs back slowly
STOP_BELOW = 0.85
OUTLIER = 2.0  # a step timed past this multiple of its depth's smoothed cost counts as this multiple
REPRICE = 0.05  # a plain step's cost moved by this share since the depth was chosen: choose again


class Depth:
    """How many drafts to verify next: the k that maximises expected tokens per second, 1 + a_1 + a_1 a_2 + ... +
    a_1...a_k over the measured cost of a (k+1)-row step, with a_i the recent acceptance of draft i given draft i-1
    kept (per position: an MTP head's chained drafts are kept far less often than its first). It falls to 0 when
    drafts stop paying, and tries one draft after `probe` plain steps to notice when they pay again, waiting twice
    as long after each probe that did not make them pay (up to 32x). A probe the step could not time (it first fed
    the MTP head the rows it skipped) is followed by a timed one, and a lower cost replaces, not smooths, one
    measured before a run of other steps: else one slow first measure kept drafts off for good (a demo run, 0.94x).
    Drafting, it tries one draft more every `probe` steps: else a position judged unlucky early is never judged
    again, and the depth stays below its best. A plain step runs once drafts have run, so that their measured cost
    is what judges them (without one, the prior priced drafts for good: kept 7 in 10 on an offloaded 30B they took
    decode to 0.58x, simulated). Between plain steps the choice stands while the plain cost it was priced on holds
    (within REPRICE): a plain step's host work is what every step pays when drafts never pay."""

    def __init__(self, max_drafts: int, fixed: int | None = None, decay: float = 0.9, probe: int = 32,
                 cost_prior: float = 0.1):
        self.max_drafts, self.fixed, self.decay, self.probe = max_drafts, fixed, decay, probe
        # per draft position, decayed counts of drafts kept / drafts judged; the first's start at 1 in 2, a prior
        # that fades with the evidence (a fixed one kept every rejected draft's estimate above 1 in 12)
        self.hits, self.trials = [1.0] + [0.0] * (max_drafts - 1), [2.0] + [0.0] * (max_drafts - 1)
        self.cost = {k: 1.0 + cost_prior * k for k in range(max_drafts + 1)}  # relative to a 1-row step
        self.measured: dict[int, float] = {}  # depth -> smoothed seconds
        self.since_drafts, self.wait = 0, probe
        self.since_deeper = 0  # steps at a depth > 0 since one draft more was tried
        self.choice: int | None = None  # the best depth, while no new evidence came
        self.priced_at = 0.0  # the plain step's seconds when it was chosen
        self.steps, self.timed_at = 0, {}  # steps seen; depth -> the step its cost was last measured at
        self.confirm = 0  # the depth of an untimed drafting step, to run again timed

    def update(self, drafts: int, kept: int, seconds: float | None) -> None:
        """A step of `drafts` kept `kept` of them in `seconds` (None: a step whose time says nothing of its depth's,
        such as one that first fed the MTP head the rows it skipped)."""
        if drafts:
            for i in range(min(kept + 1, drafts)):  # a draft after the first rejected one is not judged
                self.hits[i] = self.decay * self.hits[i] + (i < kept)
                self.trials[i] = self.decay * self.trials[i] + 1
            self.since_drafts = 0
        else:
            self.since_drafts += 1
        self.steps += 1
        if seconds is not None:
            old = self.measured.get(drafts)
            stale = drafts > 0 and self.steps - self.timed_at.get(drafts, 0) > self.probe  # before a run of others
            if old is not None and not (stale and seconds < old):  # a stalled step (a GC pause) is not its cost
                seconds = self.decay * old + (1 - self.decay) * min(seconds, OUTLIER * old)
            self.measured[drafts], self.timed_at[drafts] = seconds, self.steps
            if drafts == 0 and abs(self.measured[0] - self.priced_at) > REPRICE * self.priced_at:
                self.choice = None
        elif drafts:
            self.confirm = drafts
            return
        if drafts:  # back to the first pace only once drafts pay; a kept draft that costs more than it yields waits
            self.choice = self._best()
            self.wait = self.probe if self.choice else min(2 * self.wait, 32 * self.probe)

    def _price(self) -> None:
        """Each depth's cost relative to a plain step, from the measured ones."""
        if 0 not in self.measured:
            return
        for k in range(1, self.max_drafts + 1):  # a row is never free: else one slow plain step makes drafts free
            if k in self.measured:
                ratio = self.measured[k] / self.measured[0]
            else:  # rows cost what the rows below them did (a deeper depth looked nearly free)
                ratio = self.cost[k] if k == 1 else self.cost[k - 1] + (self.cost[k - 1] - 1) / (k - 1)
            self.cost[k] = max(ratio, self.cost[k - 1] + ROW_FLOOR)

    def expected_tokens(self, k: int) -> float:
        """The tokens a step of k drafts yields on average."""
        total, kept, rate = 1.0, 1.0, self.hits[0] / self.trials[0]
        for i in range(k):
            if i:  # two steps' worth of prior: the acceptance of the draft before
                rate = (self.hits[i] + 2 * rate) / (self.trials[i] + 2)
            kept *= rate
            total += kept
        return total

    def _best(self) -> int:
        self._price()
        self.priced_at = self.measured.get(0, 0.0)
        yields = [self.expected_tokens(k) / self.cost[k] for k in range(self.max_drafts + 1)]
        best = max(range(self.max_drafts + 1), key=yields.__getitem__)
        if best == 0 and self.since_drafts == 0 and 2 * self.hits[0] >= self.trials[0]:  # first kept >= 1 in 2
            known = [k for k in self.measured if k]  # depths whose cost was measured, not guessed
            drafting = max(known, key=yields.__getitem__, default=0)
            return drafting if drafting and yields[drafting] >= STOP_BELOW else 0
        return best

    def next(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.confirm:
            self.confirm, k = 0, self.confirm
            return k
        if self.measured and 0 not in self.measured:
            return 0
        if self.choice is None:
            self.choice = self._best()
        best = self.choice
        if best == 0:
            return 1 if self.max_drafts and self.since_drafts >= self.wait else 0
        self.since_deeper += 1
        if best < self.max_drafts and self.since_deeper >= self.probe:
            self.since_deeper = 0
            return best + 1
        return best


class Speculator:
    """One sequence's drafts: prompt lookup over its tokens so far, or the MTP head's (`head`, engine/drafting.py),
    at the depth `depth` chooses (the engine's, so that what drafts earned on earlier requests carries over); each
    step's outcome goes to the depth and to the engine's `stats`. Greedy MTP steps run whole as `fused`'s graphs
    where they can."""

    def __init__(self, depth: Depth, stats: SpecStats, prompt: list[int], head: HeadDrafts | None = None,
                 fused: FusedDrafts | None = None):
        self.depth, self.stats, self.prompt, self.head, self.fused = depth, stats, prompt, head, fused
        self.lookup = PromptLookup()
        self.lookup.reset(prompt)

    def prefilled(self, rows: torch.Tensor) -> None:
        """A prefill chunk's final hidden states: the MTP head sees those whose next token the prompt holds now, the
        rest when drafts are next wanted."""
        if self.head is not None:
            self.head.extend(rows)
            self.head.catch_up(self.prompt)

    def decoded(self, rows: torch.Tensor) -> None:
        """A decode step's kept rows, for the MTP head once drafts are next wanted (past the prompt: none to feed
        now)."""
        if self.head is not None:
            self.head.extend(rows)

    def drafts(self, limit: int) -> int:
        """How many drafts this step verifies, at most `limit`."""
        return min(self.depth.next(), limit)

    def fused_step(self, sampler: Sampler, generated: list[int], state, k: int) -> tuple[list[int], bool] | None:
        """A greedy MTP step of `k` (> 0) drafts, verification and the head's next draft in one (`fused`): (the tokens
        to append, whether it first fed the head rows it had skipped), the states advanced; None where it cannot run
        so (then `propose` and a verify step)."""
        if self.fused is None or not sampler.greedy:
            return None
        out = self.fused.step(self.head, self.prompt, generated, state, k)
        return None if out is None else (out, self.fused.primed)

    def propose(self, generated: list[int], k: int) -> list[int]:
        """Up to `k` (> 0) drafts to follow the prompt and `generated`. A plain step (k = 0) calls neither this nor
        `fused_step`: it costs what it costs without speculation."""
        if self.head is not None:
            return self.head.propose(self.prompt + generated, k)
        self.lookup.extend(generated[len(self.lookup.tokens) - len(self.prompt):])
        return self.lookup.propose(k)

    def record(self, drafts: int, kept: int, seconds: float, timed: bool = True) -> None:
        """A step's outcome; one not `timed` counts in the stats but leaves its depth's cost alone."""
        self.depth.update(drafts, kept, seconds if timed else None)
        self.stats.record(drafts, kept, seconds)
