"""Every input the Python API takes is checked where it enters, with one line naming it; what users of vLLM would
expect of a bare string or a single stop string holds."""

import math

import pytest
import torch

from moestream.engine.llm import LLM
from moestream.engine.stream import TextStream
from moestream.errors import ConfigError, RequestError
from moestream.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(tiny.store("qwen3_moe"), device="cpu", prefill_chunk=8)
    yield engine
    engine.close()


def test_a_bare_string_is_one_prompt(llm):
    outs = llm.generate("Hello world", SamplingParams(max_tokens=2))
    assert len(outs) == 1 and outs[0].prompt_token_ids == llm.tokenizer.encode("Hello world")
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=2))) == 1  # and one list of ids


def test_a_single_stop_string_is_one_stop_and_empty_ones_are_dropped():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["", "x"]).stop == ("x",)


def test_an_empty_stop_string_does_not_stop_at_once(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop=[""], ignore_eos=True))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("ids, message", [
    ([5, 10**6], "prompt token 1"), ([5, -1], "prompt token 1"), ([5.0, 6], "prompt token 0"),
    ([True], "prompt token 0"), ([], "empty"),
])
def test_bad_token_ids_are_refused_in_one_line(llm, ids, message):
    with pytest.raises(RequestError, match=message) as e:
        llm.generate([ids], SamplingParams(max_tokens=1))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", -1), ("top_p", math.nan), ("top_p", 0),
    ("repetition_penalty", math.nan), ("repetition_penalty", 0), ("presence_penalty", math.nan),
    ("frequency_penalty", math.inf), ("seed", 2**64), ("seed", 1.5), ("max_tokens", -1), ("max_tokens", 2.5),
    ("top_k", -1), ("stop", [5]),
])
def test_sampling_values_out_of_range_are_refused(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("options, message", [
    (dict(prefix_cache_mb=math.nan), "prefix_cache_mb"), (dict(host_gb=-5), "host-gb"),
    (dict(pool_gb=math.nan), "pool-gb"), (dict(device="tpu"), "device"), (dict(dtype="int8"), "dtype"),
])
def test_engine_options_out_of_range_are_refused(tiny, options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(tiny.store("qwen3_moe"), **options)


def test_a_store_that_is_not_a_path_is_refused():
    with pytest.raises(ConfigError, match="path"):
        LLM(None)


def test_a_prompt_past_the_context_is_refused_and_answers_stop_at_it(llm):
    context = llm.context_length
    with pytest.raises(RequestError, match="context"):
        llm.generate([[5] * context], SamplingParams(max_tokens=1))
    out = llm.generate([[5] * (context - 3)], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_a_long_prompt_can_be_cancelled_between_prefill_chunks(llm):
    chunks = []
    original = llm.model.forward

    def counting(ids, state, ctx=None):
        chunks.append(len(ids))
        return original(ids, state, ctx)

    llm.model.forward = counting
    try:
        stream = TextStream(llm, [5] * 40, SamplingParams(max_tokens=4), cancelled=lambda: len(chunks) >= 2)
        assert list(stream) == []
        assert stream.output().finish_reason == "cancelled" and chunks == [8, 8]
    finally:
        del llm.model.forward
    assert torch.is_tensor(llm.logits([5, 6]))
