"""Pure builders of vLLM's OpenAI-compatible JSON shapes, and the simulator's fake tokens.

Nothing here waits or keeps state. Shapes follow vLLM's OpenAI server:

* errors: ``{"error": {"message", "type", "param", "code"}}`` (vLLM >= 0.10);
* completions: ``text_completion`` objects, ``logprobs`` as ``{"text_offset", "token_logprobs",
  "tokens", "top_logprobs"}``, ``echo`` prepending the prompt;
* chat: ``chat.completion`` / ``chat.completion.chunk``, ``logprobs.content`` entries
  ``{"token", "logprob", "bytes", "top_logprobs"}``;
* ``prompt_logprobs``: a list with ``null`` for the first prompt token, then
  ``{token_id: {"logprob", "rank", "decoded_token"}}``;
* ``usage`` with ``prompt_tokens_details.cached_tokens``.

Generated text is the words `` tok0`` `` tok1`` ... (one token each), so a client can check
which token positions it received.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import attrs

JSON = dict[str, Any]

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, *, param: str | None = None) -> JSON:
    """vLLM's error document for ``status``."""
    err_type = _ERROR_TYPES.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError"
    )
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


@attrs.frozen
class Prompt:
    """A prompt as the engine sees it: token texts and token ids (same length, never empty)."""

    tokens: tuple[str, ...]
    ids: tuple[int, ...]

    @property
    def text(self) -> str:
        """The prompt text, as echoed back."""
        return "".join(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)


def _token_id(token: str) -> int:
    return zlib.crc32(token.encode()) % 100_000 + 1_000


def prompt_from_text(text: str, chars_per_token: int) -> Prompt:
    """Split ``text`` into ``chars_per_token``-character tokens (approximates a tokenizer)."""
    pieces = tuple(text[i : i + chars_per_token] for i in range(0, len(text), chars_per_token))
    return Prompt(tokens=pieces, ids=tuple(_token_id(p) for p in pieces))


def prompt_from_ids(ids: Sequence[int]) -> Prompt:
    """A prompt given as token ids; each id decodes to the text `` t<id>``."""
    return Prompt(tokens=tuple(f" t{i}" for i in ids), ids=tuple(ids))


def gen_token(index: int) -> str:
    """Text of the ``index``-th generated token."""
    return f" tok{index}"


def gen_token_id(index: int) -> int:
    """Token id of the ``index``-th generated token."""
    return 100 + index


def _logprob(position: int, salt: int = 0) -> float:
    # Deterministic, negative, varied: a client can compare prefill and decode answers.
    return -round(0.01 + ((position * 7 + salt * 3) % 13) / 10.0, 4)


def _alternatives(token: str, position: int, k: int) -> list[tuple[str, float]]:
    """``k`` top candidates at ``position``; the sampled ``token`` is the first."""
    best = _logprob(position)
    out = [(token, best)]
    for j in range(1, k):
        out.append((f"{token}~{j}", round(best - 0.5 * j, 4)))
    return out


def completion_logprobs(
    tokens: Sequence[str], *, start_position: int, start_offset: int, k: int, first_null: bool
) -> JSON:
    """A completions ``logprobs`` object for ``tokens`` (``first_null``: prompt start in echo)."""
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = start_offset
    for n, token in enumerate(tokens):
        position = start_position + n
        offsets.append(offset)
        offset += len(token)
        if first_null and n == 0:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_logprob(position))
        top.append(dict(_alternatives(token, position, max(k, 1))))
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": list(tokens),
        "top_logprobs": top,
    }


def chat_logprobs_content(tokens: Sequence[str], *, start_position: int, k: int) -> list[JSON]:
    """Chat ``logprobs.content`` entries for ``tokens``."""
    out: list[JSON] = []
    for n, token in enumerate(tokens):
        position = start_position + n
        out.append(
            {
                "token": token,
                "logprob": _logprob(position),
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for t, lp in _alternatives(token, position, k)
                ],
            }
        )
    return out


def prompt_logprobs(prompt: Prompt, k: int) -> list[dict[str, JSON] | None]:
    """vLLM's ``prompt_logprobs``: null first, then the prompt token plus ``k`` alternatives."""
    out: list[dict[str, JSON] | None] = [None]
    for position in range(1, len(prompt)):
        token, token_id = prompt.tokens[position], prompt.ids[position]
        best = _logprob(position, salt=1)
        entry: dict[str, JSON] = {
            str(token_id): {"logprob": best, "rank": 1, "decoded_token": token}
        }
        for j in range(1, k + 1):
            alt_id = token_id + 100_000 * j
            if str(alt_id) in entry:
                continue
            entry[str(alt_id)] = {
                "logprob": round(best - 0.5 * j, 4),
                "rank": j + 1,
                "decoded_token": f"{token}~{j}",
            }
        out.append(entry)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> JSON:
    """vLLM's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def tokens_for_chars(chars: int, chars_per_token: int) -> int:
    """``ceil(chars / chars_per_token)``."""
    return math.ceil(chars / chars_per_token)


# -- completions ------------------------------------------------------------------------------


def completion_response(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    logprobs: JSON | None,
    finish_reason: str | None,
    prompt_logprobs: list[dict[str, JSON] | None] | None,
    usage: JSON,
    kv_transfer_params: JSON | None,
) -> JSON:
    """A non-streaming ``text_completion``."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": prompt_logprobs,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "kv_transfer_params": kv_transfer_params,
    }


def completion_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    logprobs: JSON | None,
    finish_reason: str | None,
    usage: JSON | None,
) -> JSON:
    """One streaming ``text_completion`` event (``usage`` is null unless continuous stats)."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": usage,
    }


def completion_usage_chunk(*, request_id: str, created: int, model: str, usage: JSON) -> JSON:
    """The ``include_usage`` event of a completions stream."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


# -- chat -------------------------------------------------------------------------------------


def chat_response(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    logprobs: JSON | None,
    finish_reason: str | None,
    prompt_logprobs: list[dict[str, JSON] | None] | None,
    usage: JSON,
    kv_transfer_params: JSON | None,
) -> JSON:
    """A non-streaming ``chat.completion``."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "prompt_logprobs": prompt_logprobs,
        "kv_transfer_params": kv_transfer_params,
    }


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    delta: JSON,
    logprobs: JSON | None,
    finish_reason: str | None,
    usage: JSON | None = None,
) -> JSON:
    """One ``chat.completion.chunk``. Like vLLM, ``usage`` appears only when it is set."""
    choice: JSON = {
        "index": 0,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    chunk: JSON = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_usage_chunk(*, request_id: str, created: int, model: str, usage: JSON) -> JSON:
    """The ``include_usage`` event of a chat stream."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def models_list(
    model: str, created: int, max_model_len: int, adapters: dict[str, str] | None = None
) -> JSON:
    """``GET /v1/models``: the base model, then one card per LoRA adapter (``adapters``: name ->
    path), whose ``parent`` is the base model and which has no ``max_model_len``, as vLLM's
    ``show_available_models`` (vllm/entrypoints/openai/serving_models.py, commit
    075e9ba825513f0e50ae1a5185d6db0ee405f84e)."""
    card = {"object": "model", "created": created, "owned_by": "vllm", "permission": []}
    base = {"id": model, **card, "root": model, "parent": None, "max_model_len": max_model_len}
    loras = [
        {"id": name, **card, "root": path, "parent": model, "max_model_len": None}
        for name, path in (adapters or {}).items()
    ]
    return {"object": "list", "data": [base, *loras]}
