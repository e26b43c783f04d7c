"""A prompt (text, chat messages or token ids) as token ids, optionally cut off once it is known to exceed the
context: a 4 MB prompt used to be tokenized in full (8 s, 600 MB) before the context check refused it."""
from __future__ import annotations


def encode_prompt(tokenizer, prompt: str | list, raw: bool = False, limit: int | None = None) -> list[int]:
    """Token ids of a string (`raw`: as is; else as one user message), of chat messages (the tokenizer's chat
    template with the generation prompt), or token ids themselves. ValueError names the field."""
    if isinstance(prompt, str):
        if raw:
            return encode_within(tokenizer, prompt, limit)
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        for i, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: needs string 'role' and 'content'")
        if limit is not None:  # NOTE: what apply_chat_template(tokenize=True) does, with the cut-off
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return encode_within(tokenizer, text, limit)
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    raise ValueError("prompt: expected a string, a list of chat messages or a list of token ids")


def encode_within(tokenizer, text: str, limit: int | None) -> list[int]:
    """`text`'s token ids; with `limit`, ValueError (saying by how much) once a prefix of it is clearly over
    `limit` tokens: prefixes of 4 characters per token of the limit, doubled until the whole text or a refusal,
    tokenize at most about twice what the limit holds. NOTE: a prefix refuses only past 1.25 x the limit + 16
    (the token at its cut may merge differently in the whole text); nearer, the whole text decides, exactly."""
    if limit is None:
        return tokenizer.encode(text, add_special_tokens=False)
    n = 4 * limit
    while True:
        ids = tokenizer.encode(text[:n], add_special_tokens=False)
        if n >= len(text):
            return ids
        if len(ids) > limit * 1.25 + 16:
            raise ValueError(f"prompt: more than {limit} tokens (tokenizing stopped there): its first {n} of "
                             f"{len(text)} characters are already {len(ids)} tokens, {len(ids) - limit + 1} too "
                             f"many: this engine's models hold {limit} tokens in all, prompt and output")
        n *= 2
