"""Text streaming over the token loop: incremental detokenisation and stop strings."""

from __future__ import annotations

from collections.abc import Iterator

from moestream.engine import generate as gen
from moestream.sampling import SamplingParams


class TextStream:
    """Iterate to get text pieces as tokens arrive; `output()` afterwards gives the whole result."""

    def __init__(self, llm, prompt_ids: list[int], params: SamplingParams):
        self.llm, self.prompt_ids, self.params = llm, list(prompt_ids), params
        self.tokens: list[int] = []
        self.text, self.finish_reason, self.seq = "", None, None

    def __iter__(self) -> Iterator[str]:
        llm, params = self.llm, self.params
        before = llm.provider.stats.snapshot()["totals"]
        params.validate()
        self.seq = gen.Sequence(self.prompt_ids, params, llm.model.new_state(llm.dtype, llm.device))
        self._before = before
        for step in gen.run(llm.model, self.seq, llm.eos_ids, llm.engine_config.prefill_chunk, llm.device,
                            step=llm._step()):
            self.tokens.append(step.token)
            self.finish_reason = step.finish_reason
            full = llm._text(self.tokens)
            if full.endswith("\ufffd") and not step.finish_reason:
                continue  # an incomplete UTF-8 sequence: wait for the next token
            cut = min((full.find(s) for s in params.stop if s in full), default=-1)
            if cut >= 0:
                full, self.finish_reason = full[:cut], "stop"
            piece, self.text = full[len(self.text):], full
            if piece:
                yield piece
            if cut >= 0:
                return

    def output(self):
        from moestream.engine.llm import RequestOutput, _delta

        stats = {"timings": self.seq.timings.as_dict(),
                 "experts": _delta(self._before, self.llm.provider.stats.snapshot()["totals"])}
        return RequestOutput(self.text, self.tokens, self.prompt_ids, self.finish_reason, stats)
