"""Choosing endpoints and charging them, in one synchronous step.

:class:`Routing` asks the stage's policy (:mod:`.policies`: pure, no I/O, no clocks it was not
given) for an endpoint among the healthy candidates, reading the ledger's loads (and the other
replicas'), and charges it before any checkpoint. :func:`make_policy` builds a policy by name from
:data:`POLICIES`; :func:`routing_key` is what a request offers them. ``kv_aware`` routes on token
ids: :class:`PromptTokens` asks an engine's ``/tokenize`` or the router's own
:class:`LocalTokenizer`.

Contract: what is chosen is charged in the same step. May import the KV events, the ledger,
observation, HTTP and below.
"""

from __future__ import annotations

from .choose import NoHealthyEndpoint, Routing
from .policies import (
    POLICIES,
    POLICY_NAMES,
    CacheAware,
    KvAware,
    Lesson,
    Policy,
    PolicySettings,
    RoutingKey,
    make_policy,
    routing_key,
    utf8_size,
)
from .prompt_tokens import CUT_MARGIN_TOKENS, MIN_CUT_CHARS, PromptTokens, tokenize_request
from .tokenizer import LocalTokenizer, TokenizerFilesError

__all__ = [
    "CUT_MARGIN_TOKENS",
    "MIN_CUT_CHARS",
    "POLICIES",
    "POLICY_NAMES",
    "CacheAware",
    "KvAware",
    "Lesson",
    "LocalTokenizer",
    "NoHealthyEndpoint",
    "Policy",
    "PolicySettings",
    "PromptTokens",
    "Routing",
    "RoutingKey",
    "TokenizerFilesError",
    "make_policy",
    "routing_key",
    "tokenize_request",
    "utf8_size",
]
