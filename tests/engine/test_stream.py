"""Incremental detokenisation: the text a stream builds token by token equals the whole answer decoded, for a
byte-level tokenizer (characters split over tokens, stray bytes) and a word-level one (spaces joined in, and a
clean-up across words)."""

import random

import pytest

from moestream.engine.stream import TextStream
from moestream.engine.tokenizer import Tokenizer
from moestream.sampling import SamplingParams
from moestream.tiny import make_tiny_tokenizer


class _Decoder:
    """What a stream asks of the engine to decode."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


@pytest.mark.parametrize("words", [False, True])
def test_incremental_text_equals_the_whole_decode(tmp_path, words):
    make_tiny_tokenizer(str(tmp_path), words)
    tokenizer = Tokenizer(str(tmp_path))
    vocab, rng = len(tokenizer.tok), random.Random(0)
    for _ in range(40):
        stream = TextStream(_Decoder(tokenizer), [1], SamplingParams())
        for _ in range(80):
            stream.tokens.append(rng.randrange(vocab))
            assert stream._decoded() == tokenizer.decode(stream.tokens)
