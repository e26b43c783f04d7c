"""Incremental detokenization: the text piece each new token adds, never splitting a UTF-8 character."""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, num_prompt_tokens: int):
        self.tokenizer = tokenizer
        self.prefix_offset = self.read_offset = num_prompt_tokens
        self.text = ""

    def step(self, token_ids: list[int]) -> str:
        """Text added by `token_ids[-1]`; "" while it ends inside a multi-byte character."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        piece = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += piece
        return piece

    def find_stop(self, stops: tuple[str, ...]) -> int:
        hits = [i for i in (self.text.find(s) for s in stops) if i >= 0]
        return min(hits) if hits else -1

    def final_text(self, stops: tuple[str, ...]) -> str:
        cut = self.find_stop(stops) if stops else -1
        return self.text if cut < 0 else self.text[:cut]
