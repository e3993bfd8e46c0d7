"""Prompt lookup: drafts for speculative decoding from the sequence itself, no weights (llama.cpp's lookup decoding,
vLLM's n-gram proposer). The draft is what followed the latest earlier occurrence of the sequence's last n tokens,
the longest n from `max_ngram` down to `min_ngram` that occurred before. It wins where an answer repeats its
context: edits of a given text, code, retrieved passages.

An index from every n-gram to where it last ended is kept up to date as tokens arrive, so a proposal costs
O(max_ngram) dictionary lookups however long the sequence is.
"""

from __future__ import annotations


class PromptLookup:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token, latest occurrence
        self.pending: dict[tuple[int, ...], int] = {}  # the n-grams ending at the last token, indexed once it moves on

    def reset(self, tokens: list[int]) -> None:
        self.tokens, self.last_end, self.pending = [], {}, {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append `tokens`; every n-gram that now has a token after it is indexed."""
        for t in tokens:
            self.last_end.update(self.pending)  # they end before the new token: it can follow them
            self.tokens.append(t)
            end = len(self.tokens) - 1
            self.pending = {tuple(self.tokens[end + 1 - n:]): end
                            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1)}

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the sequence's suffix ([] if none)."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            end = self.last_end.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return tokens[end + 1: end + 1 + k]
        return []
