"""Structured answers: a JSON object (any, or valid against a JSON schema) or Qwen3-style tool calls, as token masks.

Contract: a `Structure` says what an answer must be and is checked when made (a schema the grammar library refuses
is a RequestError naming `response_format`). `Grammars` wraps one tokenizer, once per engine (a tokenizer the library
cannot read is a RequestError too), and gives each sequence a fresh `Constraint`. `Constraint.mask(logits)` sets to
-inf, in place and on the logits' device, every token the grammar forbids, the padded rows past the tokenizer's
entries included; `accept(token)` advances it (a forbidden token is a MoestreamError); once `finished`, the mask
allows only the tokenizer's EOS. JSON whitespace between tokens is one space, or a newline and up to 8 spaces or tabs
of indent: a model at temperature 1 (the demo model likes whitespace) cannot pad an answer to its length limit.
With a tokenizer that has `<tool_call>` as an added token (Qwen3: id 151657) the tags are that one token, as the
model emits them; otherwise they are spelled in text.

Library: llguidance, measured against xgrammar 0.2.9 and outlines-core 0.2.14 on the Qwen3 tokenizer (vocab 151936,
a 2-core CPU): compiling a nested schema took 4 ms (xgrammar 49 ms, outlines-core 6.6 s), any JSON object 0.7 ms
(41 ms, 92 s); the next mask 85-150 us a token over 200-token answers (xgrammar 32-230 us). It needs no other package
(xgrammar pulls in triton) and refuses a word-level tokenizer with a message (xgrammar gives an empty mask).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy
import torch

from moestream.errors import MoestreamError, RequestError

KINDS = ("json", "tool_calls")
JSON_OPTIONS = {"whitespace_pattern": r"(\x20|\x0A[\x20\x09]{0,8})?"}
TOOL_TAGS = ("<tool_call>", "</tool_call>")
CACHED_GRAMMARS = 256


@dataclass(frozen=True)
class Structure:
    """What a response must be. kind: "json" (any JSON object when schema is None, else valid against `schema`),
    or "tool_calls" (one or more `<tool_call>\\n{json matching schema}\\n</tool_call>` blocks, separated by a newline,
    and nothing else)."""

    kind: str
    schema: dict | None = None  # a JSON schema (already parsed)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RequestError(f"response_format: the answer must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.schema is not None and not isinstance(self.schema, dict):
            raise RequestError("response_format: the JSON schema must be an object")
        try:
            _refuse(llguidance.LLMatcher.validate_grammar(grammar_text(self, special_tags=False)))
        except (ValueError, TypeError) as e:  # a schema that does not serialize to JSON (NaN, a set)
            _refuse(str(e))


def grammar_text(structure: Structure, special_tags: bool) -> str:
    """The llguidance grammar for `structure`; `special_tags` writes the tool-call tags as special tokens."""
    # our whitespace bound replaces any "x-guidance" options the schema brought
    schema = {**(structure.schema or {"type": "object"}), "x-guidance": JSON_OPTIONS}
    if structure.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    open_tag, close_tag = TOOL_TAGS if special_tags else (json.dumps(tag) for tag in TOOL_TAGS)
    lark = (f'start: call ("\\n" call)*\n'
            f'call: {open_tag} "\\n" %json {json.dumps(schema)} "\\n" {close_tag}\n')
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _refuse(error: str) -> None:
    """A RequestError with the library's first line, if it gave one (the rest is a dump of its state)."""
    if error:
        raise RequestError(f"response_format: the schema cannot be followed: {error.strip().splitlines()[0]}")


class Grammars:
    """Compiles Structures for one tokenizer (built once per engine; caches compiled grammars by their JSON text)."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        try:  # the rows past the tokenizer's entries (vocab padding) are never allowed
            self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        except ValueError as e:
            raise RequestError(f"response_format: this model's tokenizer cannot be constrained ({e})") from None
        # llguidance reads every added token as a special one, which a text literal cannot match
        added = hf_tokenizer.get_added_vocab()
        self.special_tags = all(tag in added and self.tokenizer.is_special_token(added[tag]) for tag in TOOL_TAGS)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def constraint(self, structure: Structure) -> Constraint:
        """A fresh matcher for one sequence."""
        text = grammar_text(structure, self.special_tags)
        matcher = self._compiled.get(text)
        if matcher is None:
            matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            _refuse(matcher.get_error() if matcher.is_error() else "")
            if len(self._compiled) >= CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            self._compiled[text] = matcher
        self._compiled.move_to_end(text)
        return Constraint(matcher.deep_copy(), self.vocab_size)


class Constraint:
    """One sequence's place in its grammar: mask the next logits, then accept the token sampled from them."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        # [1, ceil(vocab / 32)] int32, bit i of word w allows token 32 * w + i
        self.bitmask = torch.from_numpy(llguidance.numpy.allocate_token_bitmask(1, vocab_size))
        self._device_bitmask: torch.Tensor | None = None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] float32 (CPU or CUDA): forbidden tokens set to -inf in place; returns logits."""
        if self.matcher.is_error():
            raise MoestreamError(f"the response's grammar failed: {self._error()}")
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask.numpy())
        if logits.device.type == "cpu":  # numpy's op: llguidance.torch's is torch.compile'd (12 s the first time)
            llguidance.numpy.apply_token_bitmask_inplace(logits.numpy(), self.bitmask.numpy())
            return logits
        from llguidance.torch import apply_token_bitmask_inplace  # imports torch._dynamo (seconds): only for a GPU

        if self._device_bitmask is None:
            self._device_bitmask = torch.empty_like(self.bitmask, device=logits.device)
        self._device_bitmask.copy_(self.bitmask)  # synchronous: the next fill rewrites the host buffer
        apply_token_bitmask_inplace(logits, self._device_bitmask)
        return logits

    def accept(self, token: int) -> None:
        """Advance past `token`; a token the grammar forbids is a MoestreamError."""
        if not self.matcher.consume_token(token):
            raise MoestreamError(f"token {token} does not follow the response's grammar: {self._error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: only the end (EOS) may follow (tool calls may always add one: they end at EOS)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def _error(self) -> str:
        error = self.matcher.get_error().strip()
        return error.splitlines()[0] if error else "no token may follow"
