"""Greedy steps launched one ahead of the host (Decoder.step_ahead): the tokens of steps read one by one, whatever
ends the sequence or joins it."""

import pytest

from moestream.cli.demo import DEMO_STORE
from moestream.engine.llm import LLM
from moestream.engine.speculation import Speculator
from moestream.sampling import SamplingParams
from tests.conftest import MODEL_TYPES
from tests.engine.runs import prompt_of

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams, ahead: bool) -> list[list[int]]:
    """Each prompt's tokens, one request after another, with steps ahead on or off."""
    kept, launches = llm.scheduler.ahead, llm.decoder.launches
    llm.scheduler.ahead = kept if ahead else None
    try:
        out = [llm.generate([p], params)[0].token_ids for p in prompts]
    finally:
        llm.scheduler.ahead = kept
    assert (llm.decoder.launches > launches) == ahead
    return out


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_steps_ahead_give_the_tokens_read_one_by_one(tiny, model_type):
    llm = LLM(tiny.store(model_type), device="cpu")
    try:
        prompts = [prompt_of(llm, 5 + 7 * i, seed=i) for i in range(3)]
        assert _tokens(llm, prompts, GREEDY, True) == _tokens(llm, prompts, GREEDY, False)
    finally:
        llm.close()


def test_a_sequence_ended_by_its_token_wastes_its_step_ahead_and_the_next_is_untouched(tiny, monkeypatch):
    llm = LLM(tiny.store("qwen3_next"), device="cpu")  # recurrent states: the wasted step writes them in place
    try:
        prompts = [prompt_of(llm, 9, seed=1), prompt_of(llm, 6, seed=2), prompt_of(llm, 9, seed=1)]
        eos = _tokens(llm, prompts[:1], GREEDY, False)[0][4]
        monkeypatch.setattr(LLM, "eos_ids", property(lambda self: {eos}))
        params = SamplingParams(max_tokens=12)
        ahead = _tokens(llm, prompts, params, True)
        assert len(ahead[0]) <= 5 and ahead[0][-1] == eos
        assert ahead == _tokens(llm, prompts, params, False)
    finally:
        llm.close()


def test_the_mtp_head_sees_the_rows_of_steps_taken_ahead(monkeypatch):
    """Plain steps (ahead) between drafting ones: the same tokens, and the head, fed their hidden rows, keeps its
    drafts as often (a drafting step lands one token later with steps ahead: the counts differ by position)."""
    pattern, calls = [0, 0, 2, 0, 1, 0, 0, 0, 3], [0]

    def drafts(self, limit: int) -> int:
        calls[0] += 1
        return min(pattern[calls[0] % len(pattern)], limit)

    monkeypatch.setattr(Speculator, "drafts", drafts)
    llm = LLM(DEMO_STORE, device="cpu", dtype="float32", speculation="mtp")
    try:
        prompt, runs = llm.tokenizer.encode("def parse(tokens):\n    stack = []\n    for token in tokens:\n"), []
        for on in (True, False):
            calls[0] = 0
            before = llm.stats()["speculation"]
            tokens = _tokens(llm, [prompt], SamplingParams(max_tokens=40, ignore_eos=True), on)
            after = llm.stats()["speculation"]
            kept, proposed = (after[k][0] - (before[k] or [0])[0] for k in ("accepted", "proposed"))
            runs.append((tokens, kept / proposed))
    finally:
        llm.close()
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] > 0.5 and runs[1][1] > 0.5, runs  # 2 in 3 either way; rows out of place: 1 in 9


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_batched_steps_ahead_give_each_row_its_tokens_as_rows_end(tiny, model_type, monkeypatch):
    """Four requests together, rows ending at their own tokens (the last running one moves into a freed slot while
    the next step is in flight): each gets the tokens of batched steps read one by one, and of its run alone."""
    llm = LLM(tiny.store(model_type), device="cpu")
    try:
        prompts = [prompt_of(llm, 4 + 3 * i, seed=10 + i) for i in range(4)]
        alone = _tokens(llm, prompts, GREEDY, False)
        eos = {alone[0][5], alone[2][8]}
        monkeypatch.setattr(LLM, "eos_ids", property(lambda self: eos))
        params = SamplingParams(max_tokens=12)
        launch, ahead = llm.decoder.step_batch_ahead, []
        llm.decoder.step_batch_ahead = lambda tokens, states: ahead.append(tokens is None) or launch(tokens, states)
        runs = []
        for on in (True, False):
            kept = llm.scheduler.ahead
            llm.scheduler.ahead = kept if on else None
            runs.append([out.token_ids for out in llm.generate(prompts, params)])
            llm.scheduler.ahead = kept
            assert max(llm.scheduler.batch_rows) == 4 and any(ahead) == on
            ahead.clear()
        assert runs[0] == runs[1] == _tokens(llm, prompts, params, False)
        assert any(len(tokens) < 12 for tokens in runs[0])
    finally:
        llm.close()
