"""The checkpoint's tokenizer and chat template (via transformers), loaded from the store folder."""

from __future__ import annotations

import os

from moestream.errors import StoreError


class Tokenizer:
    def __init__(self, store_path: str):
        from transformers import AutoTokenizer

        if not any(os.path.isfile(os.path.join(store_path, f)) for f in ("tokenizer.json", "tokenizer.model")):
            raise StoreError(f"{store_path} has no tokenizer files (tokenizer.json); pack a checkpoint that has them")
        self.tok = AutoTokenizer.from_pretrained(store_path)
        self.eos_ids = {i for i in (self.tok.eos_token_id,) if i is not None}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, continue_final: bool = False) -> list[int]:
        """The checkpoint's chat template over `messages` (and `tools`, OpenAI's function list), ready for the
        assistant's answer; with `continue_final`, ready to continue the final (assistant) message's text instead."""
        if not self.tok.chat_template:
            raise StoreError("this model has no chat template; use a raw prompt")
        text = self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=not continue_final,
                                            continue_final_message=continue_final, enable_thinking=False)
        return self.encode(text)

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens included), as log probabilities name it."""
        return self.tok.decode([token], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
