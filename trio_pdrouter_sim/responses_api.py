"""The Responses API (``POST /v1/responses``) as vLLM serves it: the response object, and the
typed events of its stream. Pure.

A stream is a run of ``event: <type>`` / ``data: <json>`` events, each with its
``sequence_number``: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per token, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` with
the whole response. Unlike the completions APIs there is no ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

import orjson

JSON = dict[str, Any]


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> JSON:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def message(item_id: str, text: str | None, status: str) -> JSON:
    """The output message; ``text`` None while its content part is not open yet."""
    content = [] if text is None else [output_text(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str) -> JSON:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response(
    *,
    response_id: str,
    created: int,
    model: str,
    status: str,
    output: list[JSON],
    usage: JSON | None,
    max_output_tokens: int | None,
    kv_transfer_params: JSON | None = None,
) -> JSON:
    """The response object; ``status`` ``incomplete`` when it stopped at the token limit."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": None,
        "max_output_tokens": max_output_tokens,
        "metadata": None,
        "output": output,
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "usage": usage,
        "kv_transfer_params": kv_transfer_params,
    }


def status_of(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class EventWriter:
    """Numbers and frames one stream's events."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def event(self, type: str, **fields: Any) -> bytes:
        doc = {"type": type, "sequence_number": self._next, **fields}
        self._next += 1
        return b"event: " + type.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"
