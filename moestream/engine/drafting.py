"""Drafts from the checkpoint's MTP head (models/mtp.py, or the model's own: qwen4_exp's) for speculative decoding.

The head steps behind the trunk: its row at position t pairs the trunk's hidden state h[t] with the token x[t+1],
so it sees position t once x[t+1] is known. `HeadDrafts` keeps the trunk's rows the head has not seen and feeds
them when their next tokens are known: a prefill chunk's at once (the head's prefill), a decode step's when
drafts are next wanted, as one static step of up to `max_rows` rows. After a run of plain steps (drafts did not
pay) only the last `max_rows` are fed and the older ones skipped, their cache rows zeroed: a head step per
token would cost more than the drafts that stopped paying. The last row fed gives the first draft; each
further draft is one more head step on the head's own output and the draft before it (chaining), at positions
that the next real rows overwrite, so a rejection needs no rollback: the head's length counts real rows only.
A draft is the head's argmax, a point mass to the acceptance rule (speculation.py), which keeps sampling exact
with it too.
"""

from __future__ import annotations

import torch

from moestream.engine.decode import Decoder, StepInputs
from moestream.layers.context import StepContext
from moestream.models.base import SequenceState


class HeadDecoder(Decoder):
    """The MTP head's static steps over its own state, a CUDA graph per row count (engine/decode.py's machinery):
    `forward(tokens, state, hidden, start)` with tokens x[t+1] and the trunk's hidden h[t]."""

    def _inputs(self, rows: int, batched: bool) -> StepInputs:
        inputs = super()._inputs(rows, batched)
        if inputs.hidden is None:
            inputs.hidden = torch.zeros(rows, self.model.hidden_width, dtype=self.dtype, device=self.device)
        return inputs

    def _load(self, inputs: StepInputs, tokens: list[int], state: SequenceState, hidden: torch.Tensor) -> None:
        inputs.tokens.copy_(torch.tensor(tokens))
        inputs.hidden.copy_(hidden)

    def _forward(self, inputs: StepInputs, state: SequenceState, ctx: StepContext) -> torch.Tensor:
        return self.model.draft(inputs.hidden, inputs.tokens, state, ctx)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.draft_logits(hidden)

    def _new_state(self) -> SequenceState:
        return self.model.mtp.new_state(self.dtype, self.device)


class HeadDrafts:
    """One sequence's MTP drafts; `state` is the head's (the sequence state's `draft`). Called inside the generation
    loop's inference mode: entering it again costs a plain step ~10% on a small model."""

    def __init__(self, head: HeadDecoder, state: SequenceState):
        self.head, self.state = head, state
        self.unseen: list[torch.Tensor] = []  # the trunk's rows from position state.length on
        self.unseen_rows = 0

    def extend(self, hidden: torch.Tensor) -> None:
        """The trunk's final hidden states [T, hidden_width] of its next T positions."""
        self.unseen.append(hidden)
        self.unseen_rows += hidden.shape[0]

    def catch_up(self, tokens: list[int], skip: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed the head every unseen row whose next token `tokens` (the sequence so far) holds, in one eager
        forward, or with `skip` the last `max_rows` in one static step; returns the last row's output [1, H] and
        logits [1, vocab], or None when no row was fed."""
        start = self.state.length
        n = min(self.unseen_rows, len(tokens) - 1 - start)
        if n <= 0:
            return None
        hidden = torch.cat(self.unseen)
        rows, rest = hidden[:n], hidden[n:]
        self.unseen, self.unseen_rows = ([rest] if len(rest) else []), len(rest)
        ids = tokens[start + 1: start + 1 + n]
        if not skip:
            model = self.head.model
            out = model.draft(rows, torch.tensor(ids, device=self.head.device), self.state)[-1:]  # advances
            return out, model.draft_logits(out)
        if (skipped := n - self.head.max_rows) > 0:
            for layer in self.state.layers:
                layer.clear(start, start + skipped)
            self.state.advance(ids[:skipped])
            rows, ids = rows[skipped:], ids[skipped:]
        out, logits = self.head.forward(ids, self.state, rows)
        self.state.advance(ids)
        return out[-1:], logits[-1:]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` drafts to follow `tokens`, whose last one the trunk has not been fed."""
        caught = self.catch_up(tokens, skip=True)
        if caught is None:
            return []
        out, logits = caught
        drafts, start = [int(logits[0].argmax())], self.state.length
        while len(drafts) < k:
            out, logits = self.head.forward(drafts[-1:], self.state, out, start=start + len(drafts) - 1)
            drafts.append(int(logits[0].argmax()))
        return drafts
