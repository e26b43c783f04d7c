"""Incremental detokenization: the text piece each new token adds, never splitting a UTF-8 character."""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, num_prompt_tokens: int):
        self.tokenizer = tokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.prefix_offset = self.read_offset = num_prompt_tokens
        self.text = ""
        self._states: list[tuple[int, int, int, int]] = []  # (tokens, prefix_offset, read_offset, len(text)) per step

    def truncate(self, num_tokens: int) -> None:
        """Back to the state it had when the sequence held `num_tokens` tokens (a rollback)."""
        while self._states and self._states[-1][0] > num_tokens:
            self._states.pop()
        # the offsets change only in a step that added text, so with no such step left they are the prompt's
        self.prefix_offset, self.read_offset, length = self._states[-1][1:] if self._states else (
            self.num_prompt_tokens, self.num_prompt_tokens, 0)
        self.text = self.text[:length]

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
        self._states.append((len(token_ids), self.prefix_offset, self.read_offset, len(self.text)))
        return piece

    def find_stop(self, stops: tuple[str, ...]) -> int:
        hits = [i for i in (self.text.find(s) for s in stops) if i >= 0]
        return min(hits) if hits else -1

    def final_text(self, stops: tuple[str, ...]) -> str:
        cut = self.find_stop(stops) if stops else -1
        return self.text if cut < 0 else self.text[:cut]
