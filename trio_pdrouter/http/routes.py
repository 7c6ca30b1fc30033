"""The POST routes the router serves to clients, and what each means for the PD split.

A *generation* route produces tokens, so in PD mode it is split: a prefill leg that computes
the prompt's KV cache, then a decode leg that pulls it. Every other route (tokenizing, pooling,
embeddings, scoring, reranking) generates nothing, so there is no KV to hand over and nothing to
split: it goes, whole, to one server — in PD mode a decode server, chosen and charged like any
request — and its answer comes back unchanged. (vllm-router sends them through the prefill
leg; a rerank with ``max_tokens=1`` and ``kv_transfer_params`` only costs a second request.)
In regular mode every route goes to one worker.

    path                       split in PD   body must have      a stream ends with
    -------------------------  -----------   -----------------   ---------------------------
    /v1/completions            yes           prompt              data: [DONE]
    /v1/chat/completions       yes           messages            data: [DONE]
    /v1/responses              yes           input               the response.completed event
    /inference/v1/generate     yes           token_ids           data: [DONE]
    /v1/rerank, /rerank        no            query, documents    (not streamed)
    /tokenize, /detokenize, /v1/embeddings, /pooling, /score, /v1/score, /classify
                               no            (a JSON object)     (not streamed)
"""

from __future__ import annotations

import attrs

RESPONSES = "/v1/responses"
GENERATE = "/inference/v1/generate"


@attrs.frozen
class Route:
    """One POST route of the table above."""

    path: str
    #: Generation: prefill and decode legs in PD mode. Else one leg to one server.
    split: bool
    #: Body fields that must be present and not empty.
    required: tuple[str, ...] = ()
    #: A stream's last event is ``data: [DONE]``; a stream that ends without it was cut short.
    ends_with_done: bool = True


ROUTES: dict[str, Route] = {
    route.path: route
    for route in (
        Route("/v1/completions", True, ("prompt",)),
        Route("/v1/chat/completions", True, ("messages",)),
        Route(RESPONSES, True, ("input",), ends_with_done=False),
        Route(GENERATE, True, ("token_ids",)),
        Route("/v1/rerank", False, ("query", "documents")),
        Route("/rerank", False, ("query", "documents")),
        *(
            Route(path, False)
            for path in (
                "/tokenize",
                "/detokenize",
                "/v1/embeddings",
                "/pooling",
                "/score",
                "/v1/score",
                "/classify",
            )
        ),
    )
}
