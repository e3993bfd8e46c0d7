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


class FusedDrafts:
    """Greedy MTP speculation's whole step as one CUDA graph per draft count k: the head's chained drafts, the
    trunk's k+1 verify rows, each row's argmax and the count kept, then the head fed every verified row (those past
    the kept ones at positions the next real rows overwrite), which leaves the next step's first draft on the
    device. The host reads the tokens and the count once a step: on a small model a separate head step and two reads
    back cost more than the drafts earn (docs/performance.md). On the CPU the same step runs eagerly."""

    def __init__(self, trunk: Decoder, head: HeadDecoder):
        self.trunk, self.head, device = trunk, head, trunk.device
        self.draft = torch.zeros(1, dtype=torch.long, device=device)  # the next step's first draft
        self.draft_out = torch.zeros(1, head.model.hidden_width, dtype=head.dtype, device=device)  # the head's row
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # the token the step feeds first
        self.owner: HeadDrafts | None = None  # the sequence whose next draft `draft` is
        self.primed = False  # whether the last step first fed the head rows it had skipped
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # k -> its graph, what it is over
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # k -> [best k+1 | kept], chain's routing

    def step(self, drafts: HeadDrafts, prompt: list[int], generated: list[int], state: SequenceState,
             k: int) -> list[int] | None:
        """One step of `k` drafts after `prompt` and `generated` (the trunk has not been fed the last token) on the
        decoders' own states: the tokens to append (the kept drafts and the trunk's next), the states advanced past
        them; None where the step cannot run as one (records on disk, eager decode, another state)."""
        trunk, head, head_state = self.trunk, self.head, drafts.state
        cuda = trunk.device.type == "cuda"
        addresses = trunk.provider.address_table() if trunk.mode == "graph" or not cuda else None
        if (cuda and addresses is None) or not (trunk._own([state]) and head._own([head_state])):
            return None
        self.primed = self.owner is not drafts or drafts.unseen_rows > 0
        if self.primed:
            caught = drafts.catch_up(prompt + generated, skip=True)  # the whole sequence only when priming
            if caught is None:
                return None
            self.draft_out.copy_(caught[0])
            torch.argmax(caught[1], -1, out=self.draft)
            self.owner = drafts
        start = state.length
        if head_state.length != start:  # the head not level with the trunk: the separate steps sort it out
            self.owner = None
            return None
        over = self._over(state, head_state, start + k + 1)
        last = generated[-1]
        self.token.fill_(last)
        trunk.position.fill_(start)
        result, chain = self._outputs(k)
        captured = self.graphs.get(k)
        if captured is not None and captured[1][0] is state and captured[1][1] is head_state \
                and captured[1][2:] == over[2:]:
            captured[0].replay()
        else:  # run once (compiled, allocated), then captured for the next steps
            self._run(k, state, head_state, addresses)
            if cuda:
                self._capture(k, state, head_state, addresses, over)
        if addresses is not None:  # the graph's lookups, counted as the decoders' replays count theirs
            for routed in (*chain, trunk._inputs(k + 1, False).routed, head._inputs(k + 1, False).routed):
                trunk.provider.note_addressed(routed)
        *best, kept = result.tolist()
        out = best[:kept + 1]
        state.accept([last, *out[:-1]], k + 1)
        head_state.advance(out)
        return out

    def warm(self) -> None:
        """Capture every k's step at load over the decoders' own states (the next `new_state` resets them), as the
        decoders capture theirs (whose warm-up compiled every kernel it runs): no request pays for a capture."""
        trunk, head = self.trunk, self.head
        addresses = trunk.provider.address_table() if trunk.device.type == "cuda" and trunk.mode == "graph" else None
        if addresses is None:
            return
        state, head_state = trunk.state, head.new_state()
        with torch.inference_mode():
            trunk.position.fill_(0)
            for k in range(1, head.max_rows):
                self._outputs(k)
                self._capture(k, state, head_state, addresses, self._over(state, head_state, k + 1))

    def _over(self, state: SequenceState, head_state: SequenceState, end: int) -> tuple:
        """What a graph is over, with room up to `end`: these states' buffers (the same objects, capacities)."""
        trunk, head = self.trunk, self.head
        return (state, head_state, trunk._make_room(state, end), head._make_room(head_state, end), trunk._grown(),
                head._grown())

    def _outputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k not in self.outputs:
            device, routed = self.trunk.device, self.head._inputs(1, False).routed
            self.outputs[k] = (torch.zeros(k + 2, dtype=torch.long, device=device),
                               torch.zeros(max(k - 1, 0), *routed.shape, dtype=torch.long, device=device))
        return self.outputs[k]

    def _capture(self, k: int, state: SequenceState, head_state: SequenceState, addresses, over: tuple) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._run(k, state, head_state, addresses)
        self.graphs[k] = graph, over

    def _run(self, k: int, state: SequenceState, head_state: SequenceState, addresses) -> None:
        trunk, head = self.trunk, self.head
        one, verify, catch = head._inputs(1, False), trunk._inputs(k + 1, False), head._inputs(k + 1, False)
        result, chain = self.outputs[k]
        drafts, out = [self.draft], self.draft_out
        for j in range(k - 1):  # draft j+2 from the head's own output and draft j+1, at position start + j
            torch.add(trunk.position, j, out=head.position)
            one.tokens.copy_(drafts[-1])
            one.hidden.copy_(out)
            out, logits = head._run((1, False), head_state, addresses)
            chain[j].copy_(one.routed)
            drafts.append(logits.argmax(-1))
        verify.tokens[:1].copy_(self.token)
        verify.tokens[1:].copy_(torch.cat(drafts))
        hidden, logits = trunk._run((k + 1, False), state, addresses)
        best = logits.argmax(-1)
        kept = (best[:k] == verify.tokens[1:]).long().cumprod(0).sum(0, keepdim=True)
        head.position.copy_(trunk.position)
        catch.tokens.copy_(best)
        catch.hidden.copy_(hidden)
        out, logits = head._run((k + 1, False), head_state, addresses)
        torch.argmax(logits.index_select(0, kept), -1, out=self.draft)
        self.draft_out.copy_(out.index_select(0, kept))
        result[:k + 1].copy_(best)
        result[k + 1:].copy_(kept)
