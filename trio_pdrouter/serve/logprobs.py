"""Pure merge of prompt-side results from the prefill answer into the decode answer.

In PD serving only the prefill engine sees the prompt's logits, so ``prompt_logprobs`` and the
echoed prompt tokens of ``echo`` + ``logprobs`` exist only in the prefill answer. For a
non-streaming request the router buffers the decode answer and completes it from prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_ECHO_LISTS = ("tokens", "token_logprobs", "top_logprobs")


def needs_merge(body: Mapping[str, Any]) -> bool:
    """Whether the client asked for anything that only the prefill answer carries."""
    if body.get("prompt_logprobs") is not None:
        return True
    return _wants_echo_logprobs(body)


def merge(request: Mapping[str, Any], prefill: Any, decode: Any) -> Any:
    """Complete ``decode`` (a parsed answer; modified and returned) from ``prefill``."""
    if not isinstance(prefill, dict) or not isinstance(decode, dict):
        return decode
    if "prompt_logprobs" in prefill and decode.get("prompt_logprobs") is None:
        decode["prompt_logprobs"] = prefill["prompt_logprobs"]
    p_choices = _choices(prefill)
    d_choices = _choices(decode)
    echo = _wants_echo_logprobs(request)
    for p_choice, d_choice in zip(p_choices, d_choices, strict=False):
        if d_choice.get("prompt_logprobs") is None and "prompt_logprobs" in p_choice:
            d_choice["prompt_logprobs"] = p_choice["prompt_logprobs"]
        if echo:
            _prepend_prompt_tokens(p_choice, d_choice)
    _fill_cached_tokens(prefill, decode)
    return decode


def _wants_echo_logprobs(body: Mapping[str, Any]) -> bool:
    # Identity tests: ``logprobs: 0`` is a request for logprobs, and ``0 == False``.
    lp = body.get("logprobs")
    return bool(body.get("echo")) and lp is not None and lp is not False


def _choices(answer: dict[str, Any]) -> list[dict[str, Any]]:
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]


def _prepend_prompt_tokens(p_choice: dict[str, Any], d_choice: dict[str, Any]) -> None:
    p_lp = p_choice.get("logprobs")
    d_lp = d_choice.get("logprobs")
    if not isinstance(p_lp, dict) or not isinstance(d_lp, dict):
        return
    p_tokens = p_lp.get("tokens")
    d_tokens = d_lp.get("tokens")
    if not isinstance(p_tokens, list) or not p_tokens or not isinstance(d_tokens, list):
        return
    # The prefill's last token is the one it generated; decode generated its own.
    n_prompt = len(p_tokens) - 1
    if d_tokens[:n_prompt] == p_tokens[:n_prompt]:
        # This decode engine echoed the prompt itself; complete only what it could not know.
        for name in ("token_logprobs", "top_logprobs"):
            p_list, d_list = p_lp.get(name), d_lp.get(name)
            if isinstance(p_list, list) and isinstance(d_list, list):
                for i in range(min(n_prompt, len(d_list), len(p_list))):
                    if d_list[i] is None:
                        d_list[i] = p_list[i]
        return
    for name in _ECHO_LISTS:
        p_list = p_lp.get(name)
        d_list = d_lp.get(name)
        if isinstance(p_list, list) and isinstance(d_list, list):
            d_lp[name] = p_list[:n_prompt] + d_list
    p_offsets = p_lp.get("text_offset")
    d_offsets = d_lp.get("text_offset")
    if isinstance(p_offsets, list) and isinstance(d_offsets, list) and p_offsets:
        # Decode's first token must start where prefill's generated token started.
        shift = p_offsets[-1] - d_offsets[0] if d_offsets else 0
        d_lp["text_offset"] = p_offsets[:n_prompt] + [o + shift for o in d_offsets]


def _fill_cached_tokens(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    p_usage = prefill.get("usage")
    d_usage = decode.get("usage")
    if not isinstance(p_usage, dict) or not isinstance(d_usage, dict):
        return
    p_details = p_usage.get("prompt_tokens_details")
    if not isinstance(p_details, dict) or not isinstance(p_details.get("cached_tokens"), int):
        return
    d_details = d_usage.get("prompt_tokens_details")
    if not isinstance(d_details, dict):
        d_details = {}
        d_usage["prompt_tokens_details"] = d_details
    cached = d_details.get("cached_tokens")
    if not isinstance(cached, int) or cached < 0:
        d_details["cached_tokens"] = p_details["cached_tokens"]
