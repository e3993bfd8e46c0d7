"""Continuous batching: a request's tokens do not depend on what else runs with it (engine/scheduler.py)."""

import pytest
import torch

from moestream.engine.llm import LLM
from moestream.errors import RequestError
from moestream.sampling import SamplingParams
from tests.conftest import MODEL_TYPES
from tests.engine.runs import prompt_of

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _prompts(llm: LLM, n: int = 8) -> list[list[int]]:
    return [prompt_of(llm, 3 + 5 * i, seed=i) for i in range(n)]  # 3..38 tokens: they join the batch apart


def _arriving(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The tokens of `prompts` that arrive while the first decodes (each after it launched aside, where it can)."""
    requests = [llm._submit(prompts[0], GREEDY)]
    llm.step()
    requests += [llm._submit(p, GREEDY) for p in prompts[1:]]
    while llm.scheduler.busy:
        llm.step()
    return [[s.token for s in r.steps] for r in requests]


def _quarter_pool(store: str) -> dict:
    llm = LLM(store, device="cpu", max_batch=1)
    try:
        pool = llm.provider.pool
        return dict(pool_gb=pool.stride * llm.provider.geometry.num_records / 4e9, host_gb=1.0)
    finally:
        llm.close()


@pytest.mark.parametrize("tier", ["resident", "25% pool + host"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_eight_requests_together_get_the_tokens_each_gets_alone(tiny, model_type, tier):
    store = tiny.store(model_type)
    llm = LLM(store, device="cpu", **({} if tier == "resident" else _quarter_pool(store)))
    try:
        prompts = _prompts(llm)
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        together = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        batches = llm.scheduler.batch_rows
    finally:
        llm.close()
    assert together == alone
    assert max(batches) == 8, batches  # all eight ran in one step


def test_batched_rows_have_the_bits_of_single_steps(tiny):
    """The decoder level: logits of one batched step equal those of each sequence's own step, bit for bit."""
    llm = LLM(tiny.store("qwen4_exp"), device="cpu")
    try:
        prompts = _prompts(llm, 4)
        states = [llm.decoder.new_state(i) for i in range(4)]
        with torch.inference_mode():
            for p, state in zip(prompts, states):
                llm.model(torch.tensor(p), state)
            snapshots = [s.snapshot() for s in states]
            batched = llm.decoder.step_batch([5, 6, 7, 8], states)
            alone = []
            for token, state, snapshot in zip([5, 6, 7, 8], states, snapshots):
                state.load(snapshot)
                alone.append(llm.decoder.step(token, state))
        assert torch.equal(batched, torch.stack(alone))
    finally:
        llm.close()


def test_sequences_leave_and_join_a_running_batch(tiny):
    """Different lengths: the batch shrinks as each ends (the last one moves into the freed slot); a request
    submitted while others decode joins them; each gets its own tokens."""
    llm = LLM(tiny.store("qwen3_next"), device="cpu")
    try:
        prompts = _prompts(llm, 6)
        params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
        alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
        requests = [llm._submit(p, q) for p, q in zip(prompts[:5], params[:5])]
        for _ in range(3):
            llm.step()
        requests.append(llm._submit(prompts[5], params[5]))
        while llm.scheduler.busy:
            llm.step()
        assert [[s.token for s in r.steps] for r in requests] == alone
        assert llm.scheduler.running == [] and llm.scheduler.prefilling is None
    finally:
        llm.close()


def test_a_cancelled_request_leaves_before_the_next_step(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    try:
        stop = {"now": False}
        prompts = _prompts(llm, 3)
        alone = llm.generate([prompts[1]], GREEDY)[0].token_ids
        requests = [llm._submit(p, GREEDY, cancelled=(lambda: stop["now"]) if i == 0 else None)
                    for i, p in enumerate(prompts)]
        for _ in range(3):
            llm.step()
        assert len(llm.scheduler.running) == 3
        stop["now"] = True
        llm.step()
        assert requests[0].finished and requests[0].finish_reason == "cancelled"
        assert len(llm.scheduler.running) == 2
        while llm.scheduler.busy:
            llm.step()
        assert [s.token for s in requests[1].steps] == alone
    finally:
        llm.close()


class _Aside:
    """The Prefiller, whose whole prompts launched aside land only after `polls` checks (as a replay on the GPU's side
    stream would, while the running sequences step)."""

    def __init__(self, prefiller, polls: int):
        self.prefiller, self.polls, self.landings = prefiller, polls, []

    def __getattr__(self, name):
        return getattr(self.prefiller, name)

    def __call__(self, ids, state, whole=True, aside=False):
        hidden = self.prefiller(ids, state, whole)
        if not aside:
            return hidden
        self.landings.append(landing := _Landing(hidden, self.polls))
        return landing


class _Landing:
    def __init__(self, rows: torch.Tensor, polls: int):
        self.rows, self.polls, self.landed = rows, polls, False

    def ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def hidden(self) -> torch.Tensor:
        self.landed = True
        return self.rows


def _aside_after_alone(tiny) -> tuple[LLM, list, list, _Aside]:
    """An engine, four prompts, their tokens each alone, and then whole prompts landing 3 checks after launch."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    prompts = _prompts(llm, 4)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    llm.prefiller = aside = _Aside(llm.prefiller, polls=3)
    return llm, prompts, alone, aside


def test_a_prompt_launched_aside_joins_when_it_lands_and_the_others_step_meanwhile(tiny):
    llm, prompts, alone, aside = _aside_after_alone(tiny)
    try:
        requests = [llm._submit(prompts[0], GREEDY)]
        llm.step()  # the first prompt alone, into an idle engine
        requests += [llm._submit(p, GREEDY) for p in prompts[1:]]
        llm.step()  # the second launched aside (a check)
        assert len(llm.scheduler.running) == 1 and llm.scheduler.prefilling is requests[1]
        for _ in range(2):
            llm.step()
            assert len(llm.scheduler.running) == 1 and not aside.landings[0].landed
        llm.step()
        assert len(llm.scheduler.running) == 2
        while llm.scheduler.busy:
            llm.step()
    finally:
        llm.close()
    assert [[s.token for s in r.steps] for r in requests] == alone
    assert len(aside.landings) == 3 and all(landing.landed for landing in aside.landings)


def test_a_burst_into_an_idle_engine_is_prefilled_in_one_step_none_aside(tiny):
    llm, prompts, alone, aside = _aside_after_alone(tiny)
    try:
        requests = [llm._submit(p, GREEDY) for p in prompts]
        llm.step()
        assert len(llm.scheduler.running) == 4 and not aside.landings
        while llm.scheduler.busy:
            llm.step()
        assert [[s.token for s in r.steps] for r in requests] == alone
        assert _arriving(llm, prompts) == alone and len(aside.landings) == 3  # the later ones while the first decodes
    finally:
        llm.close()


def test_a_request_cancelled_while_its_prompt_runs_aside_waits_for_it_before_its_blocks_go_back(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    try:
        llm.prefiller = aside = _Aside(llm.prefiller, polls=100)
        stop = {"now": False}
        prompts = _prompts(llm, 2)
        requests = [llm._submit(prompts[0], GREEDY)]
        llm.step()
        requests.append(llm._submit(prompts[1], GREEDY, cancelled=lambda: stop["now"]))
        llm.step()
        assert llm.scheduler.prefilling is requests[1] and not aside.landings[0].landed
        stop["now"] = True
        llm.step()
        assert requests[1].finish_reason == "cancelled" and aside.landings[0].landed
        assert llm.scheduler.prefilling is None and len(llm.scheduler.running) == 1
    finally:
        llm.close()


def test_seeded_sampling_is_the_same_in_a_batch(tiny):
    llm = LLM(tiny.store("qwen3_moe"), device="cpu")
    try:
        prompts = _prompts(llm, 4)
        params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        assert [out.token_ids for out in llm.generate(prompts, params)] == alone
    finally:
        llm.close()


def test_short_prompts_are_prefilled_together_in_one_step(tiny):
    """The step's prompt-token budget (a prefill chunk) takes several short prompts whole."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=64)
    try:
        requests = [llm._submit(p, GREEDY) for p in _prompts(llm, 4)]  # 3 + 8 + 13 + 18 tokens
        llm.step()
        assert len(llm.scheduler.running) == 4 and all(len(r.steps) == 2 for r in requests)
    finally:
        llm.close()


def test_steps_are_timed_apart_by_whether_they_fed_prompt_tokens(tiny):
    """The wall time a prompt adds to the decoding sequences' step shows in `stats()["steps"]` (and /metrics)."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=8)
    try:
        for prompt in _prompts(llm, 3):  # 3, 8 and 13 tokens: the last in two chunks
            llm._submit(prompt, GREEDY)
        taken = 0
        while llm.scheduler.busy:
            llm.step()
            taken += 1
        steps = llm.stats()["steps"]
    finally:
        llm.close()
    prompt, decode = sum(steps["prompt"]["counts"]), sum(steps["decode"]["counts"])
    assert prompt >= 2 and decode >= GREEDY.max_tokens - 3 and prompt + decode == taken
    assert steps["prompt"]["seconds"] > 0 and steps["decode"]["seconds"] > 0


def test_while_others_decode_a_prompt_past_the_steps_budget_waits_a_step(tiny):
    """Each decoding sequence waits at most a step's prompt tokens (a prefill chunk): a prompt that would take the
    step past them is prefilled in the next one."""
    llm = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=32)
    try:
        llm._submit(prompt_of(llm, 5, seed=0), GREEDY)
        llm.step()  # it decodes from here on
        later = [llm._submit(prompt_of(llm, 20, seed=i), GREEDY) for i in (1, 2)]  # 40 tokens past 32
        llm.step()
        assert len(llm.scheduler.running) == 2 and later[0].steps and not later[1].steps
        llm.step()
        assert len(llm.scheduler.running) == 3
    finally:
        llm.close()


def test_lookup_drafts_alone_and_plain_rows_in_a_batch(tiny):
    """With --spec lookup a sequence alone verifies drafts; several run as plain batched rows. Greedy tokens stay
    those of speculation off either way."""
    store = tiny.store("qwen3_5_moe")
    plain = LLM(store, device="cpu")
    try:
        prompts = [p * 3 for p in _prompts(plain, 4)]  # repeats: lookup finds drafts
        want = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]
    finally:
        plain.close()
    llm = LLM(store, device="cpu", speculation="lookup", drafts=2)
    try:
        assert llm.max_batch == 16
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        assert sum(llm.stats()["speculation"]["proposed"]) > 0
        together = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        assert max(llm.scheduler.batch_rows) == 4
    finally:
        llm.close()
    assert alone == want and together == want


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next", "qwen4_exp"])
def test_requests_of_one_prompt_share_its_prefill(tiny, model_type):
    """n choices of one prompt: the first is prefilled, the others start from its state at the prompt's end (its KV
    blocks shared, recurrent and PLE states copied) with its last logits, and each gets the tokens it gets alone."""
    llm = LLM(tiny.store(model_type), device="cpu", prefill_chunk=16)  # the prompt in 3 chunks
    try:
        prompt, other = prompt_of(llm, 40), prompt_of(llm, 12, seed=1)
        for params in (GREEDY, SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)):
            alone = llm.generate([prompt], params)[0].token_ids
            outs = llm.generate([prompt, other, prompt, prompt], params)
            assert [o.token_ids for o in outs[::2]] == [alone, alone] and outs[3].token_ids == alone
            assert [o.stats["timings"]["cached_tokens"] for o in (outs[0], outs[2], outs[3])] == [0, 40, 40]
        assert llm.scheduler.forked is None  # nothing kept once no waiting request wants it
        assert llm.decoder.kv.used == 0  # the forks held the first one's KV blocks (not copies), and let them go
    finally:
        llm.close()


def test_a_bounded_kv_cache_makes_requests_wait_and_never_fails_a_running_one(tiny):
    """6 blocks of KV for requests that may fill 1-3 each: they wait for blocks, get the tokens each gets alone, and
    give every block back; a request that could never fit is refused in one line."""
    llm = LLM(tiny.store("qwen3_next"), device="cpu", kv_tokens=96)
    try:
        prompts = _prompts(llm, 6)
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        llm.scheduler.batch_rows.clear()
        together = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        kv, rows = llm.stats()["memory"]["kv_cache"], max(llm.scheduler.batch_rows)
        with pytest.raises(RequestError, match="KV positions") as e:
            llm.generate([prompt_of(llm, 90)], GREEDY)
        assert "\n" not in str(e.value)
    finally:
        llm.close()
    assert together == alone
    assert rows < 6  # some waited for blocks
    assert kv == dict(blocks=6, blocks_in_use=0, block_positions=16, bounded=True, promised_blocks=0)
