"""Sampling parameters a decode engine would refuse, refused before any engine is touched.

The prefill leg is sent with one token and no streaming, so it succeeds for requests that the
decode engine then refuses for their own parameters (``max_tokens: 0``, ``stream_options``
without ``stream``, ...). By then the prefill engine holds the prompt's KV blocks for a decode
that will never pull them. So the router applies vLLM's own checks of those parameters first and
answers as vLLM would: 400, vLLM's message, in vLLM's error shape.

The checks are vLLM's (``SamplingParams`` and the OpenAI protocol models), for the fields the
router changes on the prefill leg; everything else the engines check themselves.
"""

from __future__ import annotations

from typing import Any

from ..http import RouterError
from ..ledger import CAPS, token_count

#: The largest token count vLLM accepts (a signed 64-bit integer).
MAX_TOKENS = 2**63 - 1
#: The fields that cap the generated tokens, by API: completions/chat, chat, Responses.
MINIMUMS = ("min_tokens", "min_completion_tokens")


def refusal(body: dict[str, Any]) -> RouterError | None:
    """What vLLM's decode engine would answer ``body`` with, if it would refuse it; else None."""
    caps: list[int] = []
    for name in CAPS:
        given = body.get(name)
        if given is None:
            continue
        value = token_count(given)  # 8.0 passes, as vLLM's request models read it
        if value is None:
            return _bad(f"{name}: Input should be a valid integer", name)
        if value < 1:
            return _bad(f"max_tokens must be at least 1, got {value}.", name)
        if value > MAX_TOKENS:
            return _bad(f"{name}: Input should be less than or equal to {MAX_TOKENS}", name)
        caps.append(value)
    for name in MINIMUMS:
        given = body.get(name)
        if given is None:
            continue
        value = token_count(given)
        if value is None:
            return _bad(f"{name}: Input should be a valid integer", name)
        if value < 0:
            return _bad(f"min_tokens must be greater than or equal to 0, got {value}.", name)
        if caps and value > min(caps):
            return _bad(
                f"min_tokens must be less than or equal to max_tokens={min(caps)}, got {value}.",
                name,
            )
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    return None


def _bad(message: str, param: str) -> RouterError:
    # vLLM's error type name, so clients that match on it see what the engine would have sent.
    return RouterError(400, message, "BadRequestError", param)
