"""Extract a request's :class:`RoutingKey` from its parsed JSON body and headers.

The routing text is what an engine's prefix cache sees first: the ``prompt`` of a completion, or
the chat ``messages`` in order. Sampling parameters, ``model`` and other fields are left out, so
two requests that share a prompt share a key whatever their settings.

* ``prompt`` as a string is used as is; a list of strings is joined with newlines; token ids
  (a list of ints, or a list of such lists) become one character per token (``chr`` of the id,
  shifted past the surrogate range), which keeps token prefixes as text prefixes at one character
  per token. Token prompts start with ``\\x02`` so they never match a text prompt.
* ``messages``: each message contributes ``<|role|>`` followed by its string content, or by the
  ``text`` of its ``{"type": "text"}`` parts; other parts (images, audio) are skipped.
* ``prompt_tokens``, ``output_tokens``: the token estimates of :mod:`trio_pdrouter.ledger.cost`.
* ``hash_key``: the first non-empty header of ``X-Session-ID``, ``X-User-ID``, ``X-Tenant-ID``
  (any case), then the body's ``session_id`` (string or integer), then ``user`` (string only).

* ``tokens``: a token-id prompt's ids (``prompt`` or ``token_ids``, a batch of one included).

Fields are read from the parsed body; the raw JSON is never searched.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...ledger import TOKEN_MARK, output_tokens, prompt_tokens
from ._base import RoutingKey

__all__ = ["HASH_KEY_HEADERS", "prompt_token_ids", "routing_key", "routing_text"]

HASH_KEY_HEADERS = ("x-session-id", "x-user-id", "x-tenant-id")

_SURROGATES = 0xD800
_SURROGATE_SPAN = 0x800
_MAX_TOKEN = 0x10FFFF - _SURROGATE_SPAN


def _token_text(tokens: list[object]) -> str | None:
    """Render token ids compactly, or ``None`` if this is not a list of token ids."""
    chars: list[str] = []
    for tok in tokens:
        if type(tok) is not int or not 0 <= tok <= _MAX_TOKEN:
            return None
        chars.append(chr(tok if tok < _SURROGATES else tok + _SURROGATE_SPAN))
    return TOKEN_MARK + "".join(chars)


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        return ""
    if all(isinstance(p, str) for p in prompt):
        return "\n".join(p for p in prompt if isinstance(p, str))
    if all(type(p) is int for p in prompt):
        return _token_text(prompt) or ""
    if all(isinstance(p, list) for p in prompt):
        parts = [_token_text(p) for p in prompt if isinstance(p, list)]
        return "\n".join(p for p in parts if p is not None)
    return ""


def _messages_text(messages: object) -> str:
    if not isinstance(messages, list):
        return ""
    out: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        out.append(f"<|{role if isinstance(role, str) else ''}|>")
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                    text = part.get("text")
                    if isinstance(text, str):
                        out.append(text)
    return "".join(out)


def routing_text(body: Mapping[str, object]) -> str:
    """The routing text of a completion or chat request body ("" when it has neither)."""
    if "prompt" in body:
        return _prompt_text(body["prompt"])
    if "token_ids" in body:  # /inference/v1/generate
        return _prompt_text(body["token_ids"])
    if "input" in body:  # the Responses API: a string, or messages
        given = body["input"]
        return given if isinstance(given, str) else _messages_text(given)
    return _messages_text(body.get("messages"))


def _hash_key(body: Mapping[str, object], headers: Mapping[str, str]) -> str | None:
    lowered = {name.lower(): value for name, value in headers.items()}
    for name in HASH_KEY_HEADERS:
        value = lowered.get(name, "").strip()
        if value:
            return value
    session = body.get("session_id")
    if isinstance(session, str) and session:
        return session
    if type(session) is int:
        return str(session)
    user = body.get("user")
    if isinstance(user, str) and user:
        return user
    return None


def _int_tokens(given: object) -> tuple[int, ...] | None:
    if isinstance(given, list) and len(given) == 1 and isinstance(given[0], list):
        given = given[0]  # a batch of one
    if isinstance(given, list) and given and all(type(t) is int and t >= 0 for t in given):
        return tuple(given)
    return None


def prompt_token_ids(body: Mapping[str, object]) -> tuple[int, ...] | None:
    """The token ids of a token-id prompt (``prompt`` or ``token_ids``), else ``None``."""
    if "prompt" in body:
        return _int_tokens(body["prompt"])
    if "token_ids" in body:
        return _int_tokens(body["token_ids"])
    return None


def routing_key(body: Mapping[str, object], headers: Mapping[str, str]) -> RoutingKey:
    """The :class:`RoutingKey` of a parsed request body and its headers (see the module doc).

    >>> routing_key({"prompt": "hi", "user": "u1"}, {"X-Session-ID": "s9"})
    RoutingKey(text='hi', hash_key='s9', prompt_tokens=1, output_tokens=256, tokens=None,
    partial_tokens=False, model=None, adapter=False)
    """
    text = routing_text(body)
    model = body.get("model")
    return RoutingKey(
        text=text,
        hash_key=_hash_key(body, headers),
        prompt_tokens=prompt_tokens(text),
        output_tokens=output_tokens(body),
        tokens=prompt_token_ids(body),
        model=model if isinstance(model, str) else None,
    )
