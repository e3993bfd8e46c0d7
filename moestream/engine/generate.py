"""The generation loop for one sequence: chunked prefill, then one token per step until a stop, or with
speculation, a drafted run of them verified in one step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moestream.engine.speculation import Speculator, accept
from moestream.models.base import CausalLM, SequenceState
from moestream.sampling import Sampler, SamplingParams


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


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    state: SequenceState
    generated: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model: CausalLM, ids: list[int], state: SequenceState, chunk: int, device: torch.device,
            on_boundary=None, cancelled=None, on_hidden=None) -> torch.Tensor | None:
    """Feed `ids` (the tokens after `state.length`) through the model; returns the last position's logits [vocab],
    or None when `cancelled()` said so between two chunks.

    Chunks end at multiples of `chunk` counted from the sequence start, so a state restored at such a
    boundary continues with exactly the forwards of an uncached run; `on_hidden(hidden)` sees each chunk's final
    hidden states, then `on_boundary(state)` runs at each boundary."""
    hidden, start = None, state.length
    done, end = start, start + len(ids)
    while done < end:
        if cancelled is not None and done > start and cancelled():
            return None
        stop = min(end, (done // chunk + 1) * chunk)
        piece = torch.tensor(ids[done - start: stop - start], dtype=torch.long, device=device)
        hidden = model(piece, state)
        if on_hidden is not None:
            on_hidden(hidden)
        if on_boundary is not None and stop % chunk == 0:
            on_boundary(state)
        done = stop
    return model.logits(hidden[-1:])[0]


@torch.inference_mode()
def run(model: CausalLM, seq: Sequence, eos: set[int], chunk: int, device: torch.device,
        step, on_boundary=None, cancelled=None, verify=None,
        speculator: Speculator | None = None) -> Iterator[Step]:
    """Yield generated tokens; `step(token, state) -> logits` is the decode step (engine/decode.py);
    `on_boundary(state)` sees the state at each prefill chunk boundary (the prefix cache keeps it). With a
    `speculator`, a step may feed drafts after the token as well: `verify(tokens, state) -> (hidden [T, H], logits
    [T, vocab])`, of which `accept` keeps a prefix; the speculator sees the hidden states of the prompt and of the
    kept rows."""
    p, t = seq.params, seq.timings
    sampler = Sampler(p, device)
    start = time.perf_counter()
    logits = prefill(model, seq.prompt[seq.state.length:], seq.state, chunk, device, on_boundary, cancelled,
                     speculator.hidden if speculator is not None else None)
    if logits is None:  # cancelled during the prompt: no token
        return
    sync(device)
    t.prompt_tokens = len(seq.prompt)
    t.prefill_seconds += time.perf_counter() - start
    start = time.perf_counter()
    history = (lambda: seq.prompt + seq.generated) if sampler.needs_history else (lambda: [])
    pending = [sampler(logits, history())]
    while True:
        for token in pending:
            seq.generated.append(token)
            t.generated_tokens += 1
            done = None
            if token in eos and not p.ignore_eos:
                done = "stop"
            elif len(seq.generated) == p.max_tokens:
                done = "length"
            t.decode_seconds = time.perf_counter() - start
            yield Step(token, done)
            if done:
                return
        last, tic = pending[-1], time.perf_counter()
        drafts = speculator.propose(seq.generated, p.max_tokens - len(seq.generated) - 1) \
            if speculator is not None else []
        if drafts:
            hidden, rows = verify([last, *drafts], seq.state)
            pending = accept(sampler, rows, drafts, seq.prompt + seq.generated)
            seq.state.accept([last, *pending[:-1]], len(drafts) + 1)
        elif speculator is not None:  # the same step, with its hidden state for the drafter
            hidden, rows = verify([last], seq.state)
            seq.state.advance([last])
            pending = [sampler(rows[0], history())]
        else:
            pending = [sampler(step(last, seq.state), history())]
        if speculator is not None:
            speculator.hidden(hidden[:len(pending)])
            speculator.record(len(drafts), len(pending) - 1, time.perf_counter() - tic)
