"""Token weights: what one request costs an endpoint, estimated before it is routed.

Rules of this module (pure and synchronous: weights are known before choose-and-charge):

* The estimates are made once per request, from its parsed body and routing text, and travel on
  its :class:`~trio_pdrouter.routing.policies.RoutingKey` (``prompt_tokens``, ``output_tokens``).
* Prompt tokens: the exact count when the prompt is given as token ids; otherwise
  ``ceil(chars / CHARS_PER_TOKEN)`` of the routing text (the chat template and the tokenizer
  are the engine's, so this is an estimate: 4 characters a token is what the simulator charges
  and the usual rate of English text in GPT- and Llama-style tokenizers).
* Output tokens: the request's cap (the smallest of ``max_tokens``, ``max_completion_tokens``,
  ``max_output_tokens``), else :data:`DEFAULT_OUTPUT_TOKENS`.
* The weight charged on a prefill endpoint is the prompt's tokens that endpoint is not expected
  to hold, as the stage's policy credits them: ``cache_aware``'s tree, through :func:`uncached`
  from the characters of routing text it says the endpoint holds; ``kv_aware``'s KV index, the
  tokens past the blocks it credits; the whole prompt under any other policy. On a decode or
  regular endpoint it is prompt + output, the KV footprint the sequence grows to.
* :data:`~trio_pdrouter.config.LOAD_METRICS` names what policies compare: request counts or
  these weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

CHARS_PER_TOKEN = 4
#: Generated tokens assumed for a request that sets no cap.
DEFAULT_OUTPUT_TOKENS = 256
#: Marks routing text made of token ids, one character each (see policies.routing_key).
TOKEN_MARK = "\x02"
#: The body fields that cap a request's output, as vLLM's OpenAI server reads them.
CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def prompt_tokens(text: str) -> int:
    """Tokens of a routing text: exact for token ids, else estimated from its length."""
    if text.startswith(TOKEN_MARK):
        # one character per id, each list of ids marked (batches are joined with newlines)
        return len(text) - 2 * text.count(TOKEN_MARK) + 1
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def token_count(value: object) -> int | None:
    """A token count as vLLM's request models read one: an integer, or a float with no
    fractional part (``8.0``); None for anything else (``True`` included)."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


def output_tokens(body: Mapping[str, object]) -> int:
    caps = [v for name in CAPS if (v := token_count(body.get(name))) is not None and v > 0]
    return min(caps) if caps else DEFAULT_OUTPUT_TOKENS


def uncached(prompt: int, held_chars: int, text_chars: int) -> int:
    """The prompt tokens left to compute where ``held_chars`` of its ``text_chars`` characters
    of routing text are cached (rounded up, in integers)."""
    if text_chars <= 0:
        return prompt
    left = text_chars - min(max(held_chars, 0), text_chars)
    return -(-prompt * left // text_chars)
