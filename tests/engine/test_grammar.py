"""Structured answers (engine/grammar.py): random continuations at temperature 1 under the mask always parse and
follow their schema, on the tiny byte-level tokenizer and on Qwen3's; bad schemas and forbidden tokens are errors."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from moestream.engine.grammar import Grammars, Structure
from moestream.errors import MoestreamError, RequestError
from moestream.tiny import make_tiny_tokenizer

QWEN3_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", ".device", "qwen3-tokenizer")
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},  # random bytes close a free string one time in ~200
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                    "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}
CALL = {"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# the shape server/tools.py's call_schema gives, with a bounded string: random bytes end its answers sooner
BOUNDED_CALL = {**CALL, "additionalProperties": False, "properties": {**CALL["properties"], "arguments": {
    **CALL["properties"]["arguments"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 12}}}}}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}


def check(value, schema: dict, where: str = "$") -> None:
    """The few JSON-schema keywords these tests use (jsonschema is not a dependency)."""
    if "type" in schema:
        assert isinstance(value, TYPES[schema["type"]]) and (schema["type"] == "boolean") == isinstance(value, bool), \
            (where, value)
    assert "enum" not in schema or value in schema["enum"], (where, value)
    assert "const" not in schema or value == schema["const"], (where, value)
    if isinstance(value, int | float):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (where, value)
    if isinstance(value, str):
        assert len(value) <= schema.get("maxLength", len(value)), (where, value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= value.keys(), (where, value)
        assert schema.get("additionalProperties", True) or value.keys() <= props.keys(), (where, value)
        for key, item in value.items():
            check(item, props.get(key, {}), f"{where}.{key}")
    if isinstance(value, list):
        for i, item in enumerate(value):
            check(item, schema.get("items", {}), f"{where}[{i}]")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-tokenizer"))
    make_tiny_tokenizer(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok, Grammars(tok, len(tok) + 16)  # 16 padded rows the grammar must never allow


def multinomial(logits: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def gumbel_max(logits: torch.Tensor, generator: torch.Generator) -> int:
    """The same draw as `multinomial`, which took 30 ms a draw over Qwen3's 151936 logits on a 2-core CPU."""
    return int(torch.argmax(logits - torch.empty_like(logits).exponential_(generator=generator).log()))


def sample(grammars: Grammars, structure: Structure, tok, generator: torch.Generator, draw=multinomial,
           max_tokens: int = 20000) -> list[int]:
    """Tokens drawn from random logits under the mask until EOS (accepted, but not in the list)."""
    constraint, out, eos = grammars.constraint(structure), [], tok.eos_token_id
    for _ in range(max_tokens):
        logits = constraint.mask(torch.randn(grammars.vocab_size, generator=generator))
        assert torch.isinf(logits[len(tok):]).all(), "a padded row was allowed"
        if constraint.finished:
            assert torch.isfinite(logits).nonzero().flatten().tolist() == [eos]
        token = draw(logits, generator)
        constraint.accept(token)
        if token == eos:
            assert constraint.finished
            return out
        out.append(token)
    raise AssertionError(f"no EOS after {max_tokens} tokens")


def tool_calls(text: str) -> list[dict]:
    """The calls of an answer that must be `<tool_call>\\n{json}\\n</tool_call>` blocks joined by newlines."""
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
    assert blocks and "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) == text, repr(text)
    return [json.loads(b) for b in blocks]


def test_schema_answers_parse_and_validate(tiny):
    tok, grammars = tiny
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        text = tok.decode(sample(grammars, Structure("json", PERSON), tok, g))
        check(json.loads(text), PERSON)


def test_any_json_object(tiny):
    tok, grammars = tiny
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        assert isinstance(json.loads(tok.decode(sample(grammars, Structure("json"), tok, g))), dict)


@pytest.mark.parametrize("schema", [BOUNDED_CALL, pytest.param(CALL, marks=pytest.mark.slow)], ids=["bounded", "open"])
def test_tool_calls_are_tagged_blocks_whose_json_validates(tiny, schema):
    tok, grammars = tiny
    g = torch.Generator().manual_seed(2)
    counts = []
    for _ in range(30):
        calls = tool_calls(tok.decode(sample(grammars, Structure("tool_calls", schema), tok, g)))
        for call in calls:
            check(call, schema)
        counts.append(len(calls))
    assert max(counts) > 1, "never more than one call in 30 answers"


def test_whitespace_runs_are_bounded(tiny):
    tok, grammars = tiny
    constraint = grammars.constraint(Structure("json"))
    for token in tok.encode("{\n" + " " * 8, add_special_tokens=False):  # a newline and the indent allowed
        constraint.accept(token)
    with pytest.raises(MoestreamError):
        constraint.accept(tok.convert_tokens_to_ids("Ġ"))  # the byte-level space: one past the bound


@pytest.mark.parametrize("kind, schema", [("json", {"type": 5}), ("tool_calls", {"type": "object", "not": {}}),
                                          ("json", [1]), ("xml", None), ("json", {"type": "number", "maximum": 1e999})])
def test_bad_structures_are_request_errors(kind, schema):
    with pytest.raises(RequestError, match="response_format") as e:
        Structure(kind, schema)
    assert "\n" not in str(e.value)


def test_forbidden_token_is_an_error(tiny):
    tok, grammars = tiny
    constraint = grammars.constraint(Structure("json", PERSON))
    with pytest.raises(MoestreamError, match="grammar"):
        constraint.accept(tok.eos_token_id)  # an empty answer is no object
    constraint = grammars.constraint(Structure("json", PERSON))
    for token in tok.encode('{"name":"x","age":', add_special_tokens=False):
        constraint.accept(token)
    with pytest.raises(MoestreamError):
        constraint.accept(tok.convert_tokens_to_ids("-"))  # minimum 0


def test_compiled_grammars_are_cached_but_constraints_fresh(tiny):
    tok, grammars = tiny
    a, b = grammars.constraint(Structure("json", PERSON)), grammars.constraint(Structure("json", PERSON))
    assert len([k for k in grammars._compiled if "minimum" in k]) == 1
    a.accept(tok.convert_tokens_to_ids("{"))
    b.accept(tok.convert_tokens_to_ids("{"))  # b did not see a's token


def test_word_level_tokenizer_is_refused_clearly(tmp_path):
    from transformers import AutoTokenizer

    make_tiny_tokenizer(str(tmp_path), words=True)
    with pytest.raises(RequestError, match="response_format: this model's tokenizer cannot be constrained"):
        Grammars(AutoTokenizer.from_pretrained(str(tmp_path)), 320)


@pytest.mark.slow
def test_qwen3_tool_calls_use_its_tag_token():
    if not os.path.isfile(os.path.join(QWEN3_TOKENIZER, "tokenizer.json")):
        pytest.skip("the Qwen3 tokenizer is not here (.device/qwen3-tokenizer is not in git)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    grammars = Grammars(tok, 151936)
    open_tag = tok.convert_tokens_to_ids("<tool_call>")
    assert open_tag == 151657 and grammars.special_tags
    constraint = grammars.constraint(Structure("tool_calls", CALL))
    logits = constraint.mask(torch.zeros(151936))
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [open_tag]
    assert torch.isinf(logits[len(tok):]).all()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for token in tok.encode(text, add_special_tokens=False):  # the model's own spelling: one token for each tag
        constraint.mask(torch.zeros(151936))
        constraint.accept(token)
    assert torch.isfinite(constraint.mask(torch.zeros(151936))).nonzero().flatten().tolist() == [198, tok.eos_token_id]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = sample(grammars, Structure("tool_calls", BOUNDED_CALL), tok, g, gumbel_max)
        assert ids[0] == open_tag and tok.convert_tokens_to_ids("</tool_call>") in ids
        for call in tool_calls(tok.decode(ids, skip_special_tokens=False)):
            check(call, BOUNDED_CALL)


@pytest.mark.gpu
def test_cuda_mask_matches_cpu(tiny):
    tok, grammars = tiny
    constraint = grammars.constraint(Structure("json", PERSON))
    for token in tok.encode('{"name":"', add_special_tokens=False):
        constraint.accept(token)
    logits = torch.randn(grammars.vocab_size)
    on_gpu = constraint.mask(logits.cuda()).cpu()
    assert torch.equal(on_gpu, constraint.mask(logits))
