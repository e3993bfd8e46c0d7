"""One sequence's generation: chunked prefill, then one token per step until a stop, or with speculation, a drafted
run of them verified in one step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moestream.engine.speculation import Speculator, accept
from moestream.models.base import CausalLM, SequenceState
from moestream.sampling import Pick, Sampler, SamplingParams, logprobs_of

LOGIT_ROWS = 128  # prompt rows turned into log probabilities at a time ([rows, vocab] float32 each)


@dataclass
class Timings:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        fresh = self.prompt_tokens - self.cached_tokens
        d["prefill_tok_s"] = fresh / self.prefill_seconds if self.prefill_seconds else 0
        d["decode_tok_s"] = self.generated_tokens / self.decode_seconds if self.decode_seconds else 0
        return d


@dataclass
class Step:
    token: int
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    logprob: float | None = None  # with SamplingParams.logprobs: the token's, and the likeliest [(id, logprob)]
    top: list[tuple[int, float]] | None = None


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    state: SequenceState
    generated: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    # with SamplingParams.prompt_logprobs: per prompt token after the first, (logprob, likeliest [(id, logprob)])
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


def chunk_end(length: int, total: int, chunk: int) -> int:
    """Where the prefill chunk after `length` of `total` prompt tokens ends: at the next multiple of `chunk` counted
    from the sequence start, so that a state restored at one continues with exactly the forwards of an uncached
    run."""
    return min(total, (length // chunk + 1) * chunk)


@torch.inference_mode()
def prefill(model: CausalLM, ids: list[int], state: SequenceState, chunk: int, device: torch.device) -> torch.Tensor:
    """Feed `ids` (the tokens after `state.length`) through the model in chunks; returns the last position's logits
    [vocab]."""
    prompt = state.tokens + list(ids)
    while state.length < len(prompt):
        stop = chunk_end(state.length, len(prompt), chunk)
        hidden = model(torch.tensor(prompt[state.length: stop], dtype=torch.long, device=device), state)
    return model.logits(hidden[-1:])[0]


class Generation:
    """One sequence's generation, stepped by the scheduler (engine/scheduler.py): its prompt a chunk at a time
    (`launch`, then `land`), then its tokens one per step, alone (`step_alone`, with drafts verified in the same step
    when there is a `speculator`) or as one row of a batched step (`take`). `land` and those return the new `Step`s;
    the last one carries the finish reason."""

    def __init__(self, model: CausalLM, seq: Sequence, eos: set[int], chunk: int, device: torch.device,
                 on_boundary=None, speculator: Speculator | None = None, constraint=None, forward=None):
        """`constraint`: the grammar `seq.params.structure` asks for (engine/grammar.py). A constrained sequence, or
        one whose log probabilities are asked for, runs no drafts. `forward(ids, state, whole, aside)` feeds a
        prompt chunk (engine/prefill.py's Prefiller, told whether it is the whole prompt and may run beside decoding
        steps), returning its hidden rows or their Landing; default the eager forward."""
        self.model, self.seq, self.eos, self.chunk, self.device = model, seq, eos, chunk, device
        self.forward = forward or (lambda ids, state, whole, aside: model(torch.tensor(ids, device=device), state))
        self.on_boundary = on_boundary
        self.speculator = speculator if constraint is None and seq.params.logprobs is None else None
        self.sampler = Sampler(seq.params, device, constraint)
        self.last: int | None = None  # the token the next step feeds
        self.finish_reason: str | None = None
        self.prompt_logits: torch.Tensor | None = None  # the prompt's last logits, once prefilled (for `fork`)
        self._decode_start = self._prefill_start = 0.0
        self._chunk: tuple | None = None  # a launched chunk: (start, stop, its hidden rows or their Landing)
        self.ahead = None  # a step launched before the last one's token was read (engine/decode.py Ahead)

    @property
    def prefilled(self) -> bool:
        return self.last is not None

    def _history(self) -> list[int]:
        return self.seq.prompt + self.seq.generated if self.sampler.needs_history else []

    @torch.inference_mode()
    def launch(self, aside: bool = False) -> None:
        """Start feeding the prompt up to its next chunk boundary (`chunk_end`); `aside`: beside decoding steps,
        when it can (engine/prefill.py). `land` takes its rows once `landed`; after the prompt's last chunk, the
        first token."""
        seq, state = self.seq, self.seq.state
        self._prefill_start = time.perf_counter()
        start, stop = state.length, chunk_end(state.length, len(seq.prompt), self.chunk)
        self._chunk = start, stop, self.forward(seq.prompt[start: stop], state, start == 0 and stop == len(seq.prompt),
                                                aside)

    @property
    def launched(self) -> bool:
        return self._chunk is not None

    @property
    def landed(self) -> bool:
        """Whether the launched chunk's rows are there (one launched aside, once the GPU has run it)."""
        return self._chunk is not None and (isinstance(self._chunk[2], torch.Tensor) or self._chunk[2].ready())

    def settle(self) -> None:
        """Wait for a chunk launched aside or a step launched ahead (its sequence ends: its KV blocks may go to
        another only after it)."""
        if self._chunk is not None and not isinstance(self._chunk[2], torch.Tensor):
            self._chunk = (*self._chunk[:2], self._chunk[2].hidden())  # later steps' work waits for it
        if self.ahead is not None:
            self.ahead.read()
            self.ahead = None

    @torch.inference_mode()
    def land(self) -> list[Step]:
        """The launched chunk's rows used; after the prompt's last, its first token."""
        seq, state, t = self.seq, self.seq.state, self.seq.timings
        (start, stop, hidden), self._chunk, tic = self._chunk, None, self._prefill_start
        if not isinstance(hidden, torch.Tensor):
            hidden = hidden.hidden()
        if seq.params.prompt_logprobs is not None:
            self._prompt_logprobs(hidden, seq.prompt[start + 1: stop + 1])
        if self.speculator is not None:
            self.speculator.prefilled(hidden)
        if self.on_boundary is not None and stop % self.chunk == 0:
            self.on_boundary(state)
        if stop < len(seq.prompt):
            t.prefill_seconds += time.perf_counter() - tic
            return []
        self.prompt_logits = self.model.logits(hidden[-1:])[0]  # the last row alone: its bits whatever came with it
        t.prompt_tokens = len(seq.prompt)
        steps = self._first()
        t.prefill_seconds += self._decode_start - tic  # the first pick reads its token back: the GPU's work is in
        return steps

    @property
    def can_fork(self) -> bool:
        """Whether this sequence's prefill may be another's: not with prompt log probabilities (every row's logits)
        nor with an MTP head (it waits on the prompt's last hidden row)."""
        return self.seq.params.prompt_logprobs is None and (self.speculator is None or self.speculator.head is None)

    def fork(self, state: SequenceState, logits: torch.Tensor) -> list[Step]:
        """Start from another sequence's prefill of the same prompt, with no forward: `state` a snapshot of its state
        at the prompt's end, `logits` its `prompt_logits`. The bits are those of a prefill of its own."""
        self.seq.state.load(state)
        self.seq.timings.prompt_tokens = self.seq.timings.cached_tokens = len(self.seq.prompt)
        self.prompt_logits = logits
        return self._first()

    def _first(self) -> list[Step]:
        pick = self.sampler.pick(self.prompt_logits, self._history())
        self._decode_start = time.perf_counter()
        return self._take([pick])

    def _prompt_logprobs(self, hidden: torch.Tensor, following: list[int]) -> None:
        """The log probabilities of the prompt tokens `following` the chunk's rows (hidden [T, H]; the last row's
        follower is not a prompt token on the final chunk)."""
        k = self.seq.params.prompt_logprobs
        for start in range(0, len(following), LOGIT_ROWS):
            rows = following[start: start + LOGIT_ROWS]
            logits = self.model.logits(hidden[start: start + len(rows)])
            self.seq.prompt_logprobs += logprobs_of(logits, torch.tensor(rows, device=logits.device), k)

    def take(self, logits: torch.Tensor) -> list[Step]:
        """After a batched step that fed `last`: the next token from its row's logits [vocab]."""
        return self._take([self.sampler.pick(logits, self._history())])

    def land_ahead(self) -> list[Step]:
        """The step launched ahead, read (before a step of another kind)."""
        if self.ahead is None:
            return []
        this, self.ahead = self.ahead, None
        return self._read(this, time.perf_counter(), timed=False)

    @torch.inference_mode()
    def step_alone(self, step, verify, ahead=None) -> list[Step]:
        """One step of this sequence alone: `step(token, state) -> logits`, or with the speculator, `verify(tokens,
        state) -> (hidden [T, H], logits [T, vocab])` over the last token and its drafts, of which `accept` keeps a
        prefix; the speculator sees the hidden states of the kept rows. With `ahead` (Decoder.step_ahead), a greedy
        step without drafts launches the next one before its own token is read, so that the GPU runs it while the
        host takes this one's (a token that ends the sequence wastes it)."""
        seq, speculator, tic = self.seq, self.speculator, time.perf_counter()
        k = speculator.drafts(seq.params.max_tokens - len(seq.generated) - 1) if speculator is not None else 0
        if ahead is not None and not k and self.sampler.greedy:
            keep = speculator is not None and speculator.head is not None
            this = self.ahead or ahead(self.last, seq.state, keep)
            more = len(seq.generated) + 1 < seq.params.max_tokens  # else this step's token is the last
            self.ahead = ahead(None, seq.state, keep) if more else None
            return self._read(this, tic)
        landed = self.land_ahead()  # drafts follow the tokens read
        if landed and landed[-1].finish_reason:
            return landed
        last, tic = self.last, time.perf_counter()
        if speculator is None:
            return landed + self._take([self.sampler.pick(step(last, seq.state), self._history())])
        k = min(k, seq.params.max_tokens - len(seq.generated) - 1)
        drafts = []
        if k:  # a plain step skips the drafter's calls: every step pays their host work when drafts never pay
            if (fused := speculator.fused_step(self.sampler, seq.generated, seq.state, k)) is not None:
                tokens, primed = fused  # a step that first fed the head skipped rows is no measure of k's cost
                speculator.record(k, len(tokens) - 1, time.perf_counter() - tic, timed=not primed)
                return landed + self._take(tokens)
            drafts = speculator.propose(seq.generated, k)
        if drafts:
            hidden, rows = verify([last, *drafts], seq.state)
            pending = accept(self.sampler, rows, drafts, seq.prompt + seq.generated)
            seq.state.accept([last, *pending[:-1]], len(drafts) + 1)
            hidden = hidden[:len(pending)]
        else:  # the same step, with its hidden state for the drafter
            hidden, rows = verify([last], seq.state)
            seq.state.advance([last])
            pending = [self.sampler.pick(rows[0], self._history())]
        speculator.decoded(hidden)
        speculator.record(len(drafts), len(pending) - 1, time.perf_counter() - tic)
        return landed + self._take(pending)

    def _read(self, step, tic: float, timed: bool = True) -> list[Step]:
        """A step launched ahead, its token read; `tic`: when the step began (`timed`: its time is its depth's)."""
        token, = step.read()
        if self.speculator is not None:
            self.speculator.decoded(step.hidden)
            self.speculator.record(0, 0, time.perf_counter() - tic, timed)
        return self.take_ahead(token)

    def take_ahead(self, token: int) -> list[Step]:
        """After a step launched ahead that fed `last` (its state not yet advanced), its token."""
        self.seq.state.advance([self.last])
        return self._take([token])

    def _take(self, tokens: list[int | Pick]) -> list[Step]:
        p, t, out = self.seq.params, self.seq.timings, []
        # a grammar allows only the end once it is complete: EOS ends it even with ignore_eos
        ends = not p.ignore_eos or self.sampler.constraint is not None
        for each in tokens:
            pick = each if isinstance(each, Pick) else Pick(each)
            self.seq.generated.append(pick.token)
            t.generated_tokens += 1
            if pick.token in self.eos and ends:
                self.finish_reason = "stop"
            elif len(self.seq.generated) == p.max_tokens:
                self.finish_reason = "length"
            out.append(Step(pick.token, self.finish_reason, pick.logprob, pick.top))
            if self.finish_reason:
                break
        t.decode_seconds = time.perf_counter() - self._decode_start
        self.last = out[-1].token
        return out
