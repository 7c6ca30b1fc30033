"""The contract every routing policy keeps.

A policy is pure: no I/O, no awaits, no clocks it did not receive. The router calls
:meth:`Policy.choose` and charges the returned endpoint in the same synchronous step, so the loads
a policy sees are exactly the ledger's at that instant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs

from ...endpoints import Endpoint


@attrs.frozen
class RoutingKey:
    """What a request offers the policies to route on.

    ``text`` is the request's routing text (the prompt, or the chat messages' text; never the
    serialised JSON with sampling parameters). ``hash_key`` is the session identity that
    ``consistent_hash`` uses (from ``X-Session-ID``/``X-User-ID``/``X-Tenant-ID`` headers, then the
    body's ``session_id``/``user``); ``None`` when the request carries none.
    ``prompt_tokens`` and ``output_tokens`` are the request's token estimates (see
    :mod:`trio_pdrouter.ledger.cost`), from which routing computes the token weight it charges.
    :func:`trio_pdrouter.routing.policies.routing_key` builds one from a parsed body and its
    headers. ``tokens`` are the prompt's token ids as the engine sees them, when known (a token-id
    prompt, or the engine's ``/tokenize`` answer when ``kv_aware`` asked for it); ``None``
    otherwise. With ``partial_tokens`` they are the ids of the prompt's start only (the rest counted
    in ``prompt_tokens`` by estimate: :mod:`trio_pdrouter.routing.prompt_tokens`).
    ``model`` is the body's ``model`` (a base model or a LoRA adapter), None when it names none:
    routing sends the request only to servers that serve it, and prefix state is kept per model.
    ``adapter``: that model is a LoRA adapter on some server; vLLM hashes an adapter's KV blocks
    apart from its base model's, so ``kv_aware`` does not look its token ids up in the index of
    base-model blocks (docs/models.md).
    """

    text: str = ""
    hash_key: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens: tuple[int, ...] | None = None
    partial_tokens: bool = False
    model: str | None = None
    adapter: bool = False


@attrs.frozen(eq=False)
class Lesson:
    """What one choice taught a policy, and how to take it back.

    ``cache_aware`` inserts the routing text under the endpoint it chose, so that concurrent
    requests with that prefix follow; when that endpoint's engine then refuses the request, its
    cache never held the text and :attr:`unlearn` takes the insert back (the router calls it:
    :meth:`~trio_pdrouter.routing.choose.Routing.lessons`).
    """

    unlearn: Callable[[], None]


#: Told ``(stage, reason)`` for every decision of a policy that has reasons (the router counts
#: them in ``trio_pdrouter_policy_decisions_total``).
DecisionObserver = Callable[[str, str], None]


class Policy(Protocol):
    """A routing policy for one stage (prefill, decode or regular)."""

    name: str

    def choose(
        self,
        candidates: Sequence[Endpoint],
        loads: Mapping[Endpoint, int],
        key: RoutingKey,
    ) -> Endpoint:
        """Pick one of ``candidates`` (non-empty, all healthy and admitted by their breakers).

        ``loads`` holds every candidate's load in the stage's metric: the ledger's count, or
        (``--load-metric tokens``) its token weight with this request's weight added. Ties must
        not always go to the first candidate.
        """
        ...

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Tell the policy every endpoint of its stage, healthy or not; forget removed ones."""
        ...

    def maintain(self) -> bool:
        """One bounded slice of periodic housekeeping (``cache_aware`` evicts here); return True
        while more remains. Called from a background task, which checkpoints between slices."""
        ...
