"""A prompt too long for every engine that could serve it, refused before any engine is touched.

The prefill leg is sent with ``max_tokens: 1``, so a prompt that fits the prefill engine but not
prompt + ``max_tokens`` on decode is prefilled for nothing and refused by decode. The router
refuses it first, with vLLM's message (``serving_engine``'s input validation), in vLLM's error
shape: 400, ``BadRequestError``.

The rules:

* The bound is the largest ``max_model_len`` among the servers the request could be sent to
  now (the healthy decode servers, or regular workers, that serve its ``model``:
  :mod:`trio_pdrouter.fleet.served_models`): refused means no candidate would take it.
  While any candidate's limit is unknown, nothing is refused.
* The tokens counted are those vLLM counts: the prompt, plus the request's cap
  (``max_completion_tokens`` or else ``max_tokens`` for a chat; ``max_tokens``, by default 16,
  for a completion). A chat without a cap is refused when its prompt alone fills the context.
* A token-id prompt, or a text whose every id ``kv_aware`` had asked for, is counted exactly.
  A text prompt or a chat is otherwise first bounded cheaply: a
  token covers at least one byte, so its UTF-8 bytes plus :data:`TEMPLATE_SLACK` (special and
  chat-template tokens) are at least its tokens. Only when that bound does not fit is the engine
  asked (``POST /tokenize``, :meth:`~trio_pdrouter.routing.prompt_tokens.PromptTokens.count`), and
  the request is refused on the engine's count only, never on an estimate.
* Any failure of the check (no limit known, ``/tokenize`` failing or slow) lets the request
  through: the engine then refuses it itself and the stranded-KV release cleans up.
* Only ``/v1/completions`` and ``/v1/chat/completions`` are checked (the routes whose
  validation in vLLM is this one); a batch of several prompts is not.
* The check copies a huge prompt at most once (the ``/tokenize`` body, freed when the call
  ends); the byte bound walks the text in bounded slices.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..fleet import ServedModels
from ..http import RouterError
from ..routing import PromptTokens, RoutingKey, tokenize_request, utf8_size

#: Tokens a tokenizer or chat template may add to the text's own (BOS, role headers, ...).
TEMPLATE_SLACK = 256
#: vLLM's default ``max_tokens`` for a completion (its protocol model's default).
COMPLETION_DEFAULT_CAP = 16
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class ContextCheck:
    """Refuses prompts no candidate's context could hold (see the module doc).

    ``servers`` gives the URLs a generation may be sent to now; ``tokens`` asks an engine for a
    text's token count (None: text prompts are never refused).
    """

    def __init__(
        self,
        models: ServedModels,
        servers: Callable[[], Collection[str]],
        tokens: PromptTokens | None,
    ) -> None:
        #: Learnt by its own loop, which :func:`~trio_pdrouter.server.run_router` runs.
        self.models = models
        self._servers = servers
        self._tokens = tokens

    def bound(self, model: str | None = None) -> int | None:
        """The largest context among the candidates (those that serve ``model`` when it is
        given and some do), None if any is unknown (or none is)."""
        servers = list(self._servers())
        if model is not None:
            servers = [url for url in servers if self.models.may_serve(url, model)] or servers
        limits = [self.models.limit(url) for url in servers]
        if not limits or any(limit is None for limit in limits):
            return None
        return max(limit for limit in limits if limit is not None)

    async def refusal(
        self, path: str, body: Mapping[str, Any], key: RoutingKey
    ) -> RouterError | None:
        """vLLM's answer for a prompt that cannot fit, else None."""
        if path not in (CHAT, COMPLETIONS):
            return None
        bound = self.bound(key.model)
        if bound is None:
            return None
        cap = _cap(path, body)
        room = bound - (cap or 0)  # prompt tokens that fit (a chat without cap: fewer than bound)
        if key.tokens is not None and not key.partial_tokens:
            return (
                _too_long(bound, len(key.tokens), cap)
                if _over(len(key.tokens), room, cap)
                else None
            )
        if _over(utf8_size(key.text) + TEMPLATE_SLACK, room, cap) and self._tokens is not None:
            request = tokenize_request(body)
            counted = None if request is None else await self._tokens.count(request)
            if counted is not None and _over(counted, room, cap):
                return _too_long(bound, counted, cap)
        return None


def _cap(path: str, body: Mapping[str, Any]) -> int | None:
    if path == CHAT:
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        return cap if type(cap) is int else None
    cap = body.get("max_tokens")
    return cap if type(cap) is int else COMPLETION_DEFAULT_CAP


def _over(prompt: int, room: int, cap: int | None) -> bool:
    return prompt > room if cap is not None else prompt >= room


def _too_long(bound: int, prompt: int, cap: int | None) -> RouterError:
    if cap is None:
        message = (
            f"This model's maximum context length is {bound} tokens. However, you requested"
            f" {prompt} tokens in the messages, Please reduce the length of the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {bound} tokens. However, you requested"
            f" {prompt + cap} tokens ({prompt} in the messages, {cap} in the completion)."
            " Please reduce the length of the messages or completion."
        )
    return RouterError(400, message, "BadRequestError")
