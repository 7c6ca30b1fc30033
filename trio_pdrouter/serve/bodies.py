"""Pure request shaping for the two legs of vLLM's NIXL prefill/decode handshake (docs/design.md,
"The wire contract with vLLM").

The prefill leg asks for one token and for ``kv_transfer_params`` to hand to decode; the decode
leg is the client's request as sent plus those params, copied verbatim. Nothing here adds a field
the client did not send, and nothing rewrites ``remote_host``/``remote_port``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from ..endpoints import Endpoint
from ..http import GENERATE, RESPONSES

# Fields vLLM reads to run a remote-decode prefill; values per the NIXL connector protocol.
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Client headers passed on to both legs (lower-case, as ASGI gives them).
FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate", "baggage")


def prefill_body(body: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The prefill leg's JSON for a request to ``path``: one token, no streaming, and a request
    for KV transfer params."""
    out = _one_token(body, path)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    return out


def _one_token(body: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``body`` capped at one generated token, in every field the API of ``path`` spells that
    cap with."""
    out = dict(body)
    out.pop("stream_options", None)  # vLLM rejects it without streaming; nothing to report
    # A minimum above one token would contradict the cap; decode restores them.
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    if path == RESPONSES:
        out["max_output_tokens"] = 1
    elif path == GENERATE:  # token-in/token-out: the sampling parameters are nested
        given = out.get("sampling_params")
        sampling = dict(given) if isinstance(given, Mapping) else {}
        sampling["max_tokens"] = 1
        sampling.pop("min_tokens", None)
        out["sampling_params"] = sampling
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The decode leg's JSON: the client's body as sent, plus the prefill's params verbatim.

    ``kv_transfer_params`` is ``None`` when the prefill's one token was a stop: decode then
    recomputes the prompt itself, and the field is left out rather than sent as ``null``.
    """
    out = dict(body)
    if kv_transfer_params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def request_id(headers: Mapping[str, str], names: Iterable[str]) -> str:
    """The client's request id from the first header present among ``names`` (the
    ``--request-id-headers``), else a new one."""
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return uuid.uuid4().hex


def p2p_nccl_request_id(prefill: Endpoint, decode: Endpoint) -> str:
    """vLLM's P2P-NCCL connector finds its peers from the request id itself."""
    return (
        f"___prefill_addr_{_host_port(prefill.url)}___decode_addr_{_host_port(decode.url)}"
        f"_{uuid.uuid4().hex}"
    )


def _host_port(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


def upstream_headers(
    client_headers: Mapping[str, str],
    rid: str,
    endpoint: Endpoint,
    upstream_api_key: str | None = None,
) -> dict[bytes, bytes]:
    """Headers for one leg: content type, the shared request id, auth, trace context, DP rank.

    Only these are forwarded, so hop-by-hop headers (``Connection``, ``Keep-Alive``, ``TE``,
    ``Transfer-Encoding``, ``Upgrade``, ...) and the client's ``Host`` never reach an engine.
    Values are bytes: a client's header goes on exactly as it arrived (ASGI decoded it as
    latin-1), even where it is not ASCII, which httpx would refuse to encode from ``str``.
    """
    out = {
        b"content-type": b"application/json",
        b"x-request-id": rid.encode("latin-1", "replace"),
        # Streams are relayed as they come: a compressed one would reach the client undecoded.
        b"accept-encoding": b"identity",
    }
    for name in FORWARDED_HEADERS:
        value = client_headers.get(name)
        if value is not None:
            out[name.encode()] = value.encode("latin-1")
    if upstream_api_key is not None:
        out[b"authorization"] = f"Bearer {upstream_api_key}".encode("latin-1", "replace")
    if endpoint.rank is not None:
        out[b"x-data-parallel-rank"] = str(endpoint.rank).encode()
    return out


def stranded_decode_body(
    body: Mapping[str, Any], kv_transfer_params: Any, path: str
) -> dict[str, Any]:
    """A one-token decode that pulls a prefill's KV blocks for a client that already left.

    The prefill engine holds the blocks until decode pulls them or vLLM's KV timeout expires;
    pulling them at once frees that memory for requests that still have a client.
    """
    out = _one_token(decode_body(body, kv_transfer_params), path)
    out["stream"] = True
    return out
