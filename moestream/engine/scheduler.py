"""Continuous batching: up to `max_batch` sequences decode together, one token each per step, while new prompts
are prefilled a chunk per step between those steps, so a long prompt delays the others by a chunk at a time. A
prompt whose forward is a graph replays beside the decoding steps (engine/prefill.py) and joins them when it lands.

Running sequences hold the decoder's first batch slots, so the batch's graph (one per size) replays over the same
buffers whatever sequences they hold; the one prompt being prefilled holds the slot after them. A sequence that
ends leaves at once, and the last running one moves into its slot (its KV blocks handed over). A row's bits do not
depend on the batch (engine/decode.py), nor a prompt's chunks on what else runs, so a request's tokens are the
ones it gets alone. One sequence alone steps on its own, with drafts when speculation is on (several step
together without them); MTP drafting (the head keeps one sequence's cache) and the PLE tables' disk tier (their
rows staged per step on the host) run one sequence at a time.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moestream.engine.decode import Ahead
from moestream.engine.generate import Generation, Step
from moestream.engine.prefix_cache import host_snapshot
from moestream.layers.kv import blocks_for

STEP_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)  # seconds: upper bounds of the step times kept


@dataclass
class StepTimes:
    """Engine steps' wall time (to the readback of their tokens) counted in STEP_BUCKETS, the last count past them."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self.seconds += seconds


@dataclass
class Request:
    """A prompt waiting for a slot, then its generation; `steps` are its tokens not yet taken by its caller."""

    open: Callable[[int], Generation]  # its generation, started on the given slot's state
    cancelled: Callable[[], bool] | None = None
    prompt: tuple[int, ...] = ()  # its token ids: requests of one prompt share one prefill
    rows: int = 0  # the most positions it may fill (prompt, max_tokens, drafts): the KV blocks promised it
    promised: int = 0  # KV blocks promised while it holds a slot
    generation: Generation | None = None
    slot: int | None = None
    steps: deque[Step] = field(default_factory=deque)
    finished: bool = False
    finish_reason: str | None = None  # set when it ends: a step's reason, or "cancelled"

    def is_cancelled(self) -> bool:
        return self.cancelled is not None and self.cancelled()


class Scheduler:
    def __init__(self, decoder, max_batch: int, prefill_tokens: int, ahead=None):
        """`max_batch`: the most sequences that run at once (1 with MTP drafts, or a PLE table on disk);
        `prefill_tokens`: the prompt tokens a step feeds, a chunk of one prompt or several short prompts whole;
        while others decode, a prompt that would take the step past them waits for the next. `ahead`: the
        decoder's `step_ahead` where greedy steps may run one ahead of the host (engine/decode.py)."""
        self.decoder, self.max_batch, self.prefill_tokens, self.ahead = decoder, max_batch, prefill_tokens, ahead
        self.flight: tuple[list[Request], Ahead] | None = None  # the rows of a batched step launched ahead, and it
        self.waiting: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.running: list[Request] = []  # in slot order: running[i] holds slot i
        self.batch_rows: dict[int, int] = {}  # rows a decode step had -> how many such steps
        # steps that fed prompt tokens (a prompt's delay to the decoding ones shows there) and steps that only decoded
        self.step_times = {"prompt": StepTimes(), "decode": StepTimes()}
        self.promised = 0  # KV blocks promised to the sequences in slots (a bounded cache admits within them)
        # (prompt, host snapshot of the state at its end, its last logits) of a prefill that waiting requests of the
        # same prompt start from (n choices of one request), so that a prompt is prefilled once
        self.forked: tuple | None = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def prompts(self) -> bool:
        """Whether a prompt waits or is being prefilled (a step may launch its forward)."""
        return bool(self.waiting or self.prefilling)

    def rows_in_use(self) -> int:
        """Positions the sequences in slots hold (each a row of every attention layer's cache)."""
        held = [*self.running, *([self.prefilling] if self.prefilling else [])]
        return sum(r.generation.seq.state.length for r in held if r.generation is not None)

    def submit(self, request: Request) -> Request:
        self.waiting.append(request)
        return request

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """End `request` now, wherever it is (its caller stopped it, e.g. at a stop string)."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, reason)

    def fail_all(self) -> list[Request]:
        """After a step failed: every request in flight ends (the caller reports the error); returns them."""
        failed = [*self.running, *([self.prefilling] if self.prefilling else []), *self.waiting]
        self.waiting.clear()
        self.flight = None
        for request in failed:
            self._finish(request, "error")
        return failed

    def step(self) -> None:
        """One engine step: cancelled requests leave, waiting prompts take free slots and are prefilled up to the
        step's prompt tokens (a chunk at a time, one prompt after another), and every running sequence gets one
        token."""
        tic = time.perf_counter()
        for request in [*self.waiting, *self.running, *([self.prefilling] if self.prefilling else [])]:
            if request.is_cancelled():
                self.cancel(request)
        if self.forked is not None and not self._awaited(self.forked[0]):
            self._drop_forked()
        if self.prompts:  # a step may be in flight: read before slots and graphs change
            self._land()
        spent = 0  # prompt tokens this step fed
        # prompts run aside only beside sequences that were decoding: into an idle engine, a burst comes in at once
        decoding = bool(self.running)
        while spent < self.prefill_tokens:
            if self.prefilling is None:
                if not self.waiting or len(self.running) >= self.max_batch or not self._fits(self.waiting[0]):
                    break
                if spent and self.running and spent + len(self.waiting[0].prompt) > self.prefill_tokens:
                    break  # the decoding sequences wait for at most a step's prompt tokens, not one prompt more
                request = self.prefilling = self.waiting.popleft()
                request.promised = blocks_for(request.rows)
                self.promised += request.promised
                request.slot = len(self.running)
                request.generation = request.open(request.slot)
                if self._fork(request):
                    continue
            request, g = self.prefilling, self.prefilling.generation
            if not g.launched:  # else it was launched aside in an earlier step
                before = g.seq.state.length
                g.launch(aside=decoding)
                spent += g.seq.state.length - before
            if not g.landed and self.running and not self._grows():
                break  # the running ones step meanwhile
            self._deliver(request, g.land())
            if g.prefilled:
                self._keep_for_forks(request)
                if not request.finished:
                    self.prefilling = None
                    self._join(request)
        decoded, fed = bool(self.running), spent > 0
        if decoded:
            self._decode()
        if fed or decoded:
            self.step_times["prompt" if fed else "decode"].observe(time.perf_counter() - tic)

    def _grows(self) -> bool:
        """Whether the running sequences' next step may grow the KV pool (moving the stores a chunk aside writes)."""
        kv = self.decoder.kv
        return kv is not None and not kv.bounded and len(kv.free) < 2 * len(self.running)  # <= 1 block a row run

    def _fits(self, request: Request) -> bool:
        """Whether a bounded KV cache can promise `request` every block it may fill, beside the running ones' (so
        a running sequence never meets a full cache: a new one waits instead)."""
        kv = self.decoder.kv
        return kv is None or not kv.bounded or self.promised + blocks_for(request.rows) <= kv.blocks

    def _awaited(self, prompt: tuple[int, ...]) -> bool:
        return any(r.prompt == prompt for r in self.waiting)

    def _keep_for_forks(self, request: Request) -> None:
        """A prompt just prefilled that waiting requests repeat: its state and logits, for them to start from."""
        g = request.generation
        if request.prompt and g.can_fork and self._awaited(request.prompt):
            state = g.seq.state  # its KV rows stay in the pool's blocks, held until the last fork took them
            self.forked = request.prompt, host_snapshot(state, state.keeps_rows_in(self.decoder.kv))[0], g.prompt_logits
        g.prompt_logits = None

    def _fork(self, request: Request) -> bool:
        """Start `request` from the kept prefill of its prompt, if there is one; it joins the running ones."""
        if self.forked is None or request.prompt != self.forked[0] or not request.generation.can_fork:
            return False
        self._deliver(request, request.generation.fork(*self.forked[1:]))
        request.generation.prompt_logits = None
        if not self._awaited(request.prompt):
            self._drop_forked()
        if not request.finished:
            self.prefilling = None
            self._join(request)
        return True

    def _drop_forked(self) -> None:
        if blocks := self.forked[1].snapshot_blocks():
            self.decoder.kv.give(blocks)
        self.forked = None

    def _join(self, request: Request) -> None:
        """A prefilled sequence joins the running ones, in the slot after theirs."""
        target = len(self.running)
        if request.slot != target:  # a running one ended while it was prefilled
            request.generation.seq.state = self.decoder.move(request.slot, target)
            request.slot = target
        self.running.append(request)

    def _land(self) -> None:
        """Read the steps launched ahead: a batched one's rows, a sequence alone's."""
        if self.flight is not None:
            (requests, step), self.flight = self.flight, None
            for request, token in zip(requests, step.read()):
                if not request.finished:  # else its row was wasted
                    self._deliver(request, request.generation.take_ahead(token))
        for request in list(self.running):
            self._deliver(request, request.generation.land_ahead())

    def _decode(self) -> None:
        if self.flight is not None and not _same(self.flight[0], self.running):  # rows ended: the batch changes
            self._land()
        running = list(self.running)
        rows = len(running)
        if not rows:
            return
        self.batch_rows[rows] = self.batch_rows.get(rows, 0) + 1
        if rows == 1:
            g = running[0].generation
            ahead = None if self.prompts else self.ahead  # else read again at the next step's start
            self._deliver(running[0], g.step_alone(self.decoder.step, self.decoder.forward, ahead))
            return
        gens = [r.generation for r in running]
        if not all(g.sampler.greedy for g in gens):
            logits = self.decoder.step_batch([g.last for g in gens], [g.seq.state for g in gens])
            for request, row in zip(running, logits):
                self._deliver(request, request.generation.take(row))
            return
        states = [g.seq.state for g in gens]
        this = self.flight[1] if self.flight is not None else \
            self.decoder.step_batch_ahead([g.last for g in gens], states)
        self.flight = None
        if self.ahead is not None and not self.prompts and all(  # else a row's next token is its last
                len(g.seq.generated) + 1 < g.seq.params.max_tokens for g in gens):
            self.flight = running, self.decoder.step_batch_ahead(None, states)
        for request, token in zip(running, this.read()):  # every row's token in one read
            self._deliver(request, request.generation.take_ahead(token))

    def _deliver(self, request: Request, steps: list[Step]) -> None:
        request.steps.extend(steps)
        if steps and steps[-1].finish_reason:
            self._finish(request, steps[-1].finish_reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finished, request.finish_reason = True, reason
        if request.generation is not None:  # it held a slot: its KV blocks go back
            request.generation.settle()
            request.generation.seq.state.release()
        self.promised -= request.promised
        request.promised = 0
        if request is self.prefilling:
            self.prefilling = None
        elif request in self.running:
            i = self.running.index(request)
            last = self.running.pop()
            if last is not request:  # the last running sequence takes the freed slot
                last.generation.seq.state = self.decoder.move(last.slot, i)
                last.slot = i
                self.running[i] = last


def _same(a: list[Request], b: list[Request]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
