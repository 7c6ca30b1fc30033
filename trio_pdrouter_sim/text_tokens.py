"""How the simulator turns prompt text into tokens.

By default a token is ``chars_per_token`` characters of text (an id from their hash), which is
enough for prefix caching and KV events. With ``--tokenizer PATH`` (a Hugging Face
``tokenizer.json``) the simulator encodes as a real engine would: a completion's text with the
tokenizer's special tokens, a chat's rendered text (``requests._chat_text``) without them,
so a router tokenizing with the same file (``--kv-tokenizer-path``) gets the ids the simulator
caches and publishes.
"""

from __future__ import annotations

from functools import lru_cache

import attrs
from tokenizers import Tokenizer

from .shapes import Prompt, prompt_from_text


@attrs.frozen
class TextTokens:
    """Prompt text to :class:`~.shapes.Prompt` (see the module doc)."""

    chars_per_token: int
    tokenizer: Tokenizer | None = None

    def prompt(self, text: str, *, special: bool) -> Prompt:
        """``text`` as tokens; ``special``: with the tokenizer's special tokens (BOS...)."""
        if self.tokenizer is None:
            return prompt_from_text(text, self.chars_per_token)
        encoding = self.tokenizer.encode(text, add_special_tokens=special)
        # Each token's text runs from its start to the next one's, so the pieces join to the
        # whole text (echo); a special token, at no place in the text, is an empty piece.
        starts = [0]
        for begin, _end in encoding.offsets[1:]:
            starts.append(max(begin, starts[-1]))
        ends = [*starts[1:], len(text)]
        pieces = tuple(text[a:b] for a, b in zip(starts, ends, strict=True))
        return Prompt(tokens=pieces, ids=tuple(encoding.ids))


@lru_cache(maxsize=4)
def text_tokens(chars_per_token: int, tokenizer: str | None) -> TextTokens:
    """The :class:`TextTokens` of a configuration, the tokenizer file read once."""
    if tokenizer is None:
        return TextTokens(chars_per_token)
    return TextTokens(chars_per_token, Tokenizer.from_file(tokenizer))
