"""A request's prompt token ids for ``kv_aware``, asked of an engine before routing.

KV events name blocks by their tokens, so ``kv_aware`` needs the tokens the engine will see. A
token-id prompt carries them (:func:`~.policies.routing_key.prompt_tokens`); a text prompt or a
chat goes to an engine's ``POST /tokenize`` (``{"prompt"}`` or ``{"messages", ...}`` with the
request's chat-template fields), which renders and tokenizes exactly as the engine will.

The rules:

* At most one call per request, to one healthy server of the stage that routes on tokens, taken
  in turn; only while a ``kv_aware`` stage exists (the caller decides). A request that names a
  ``model`` asks a server that serves it (``serving``; any server when none is known to), with
  the model in the body: vLLM checks the model as for a generation and tokenizes with that
  model's (or adapter's) tokenizer (``create_tokenize`` in
  vllm/entrypoints/openai/serving_tokenization.py, commit
  0492d792466c41a514f0aadc20138dbc88c7a254), and answers are cached per model. A local
  tokenizer is one model's: it serves every request alike.
* With a :class:`~trio_pdrouter.routing.tokenizer.LocalTokenizer` (``--kv-tokenizer-path``) the
  router tokenizes itself, and asks an engine only for what that declines.
* With ``cut_chars`` (``--kv-tokenize-cut-chars``, off by default), a text prompt whose start
  this router has already sent somewhere (``seen``: the estimated prefix tree's match, at least
  :data:`MIN_CUT_CHARS`) is tokenized up to that start only, cut at a multiple of ``cut_chars``
  characters, so that the prompts sharing it ask with the same text and every one after the
  first finds the answer cached: a workload of long shared starts (documents, system prompts,
  few-shot examples) costs a call per start instead of per request. The key then carries the
  start's ids less the last :data:`CUT_MARGIN_TOKENS` (``partial_tokens``): where the cut splits
  a word, the whole prompt's ids differ from the start's; further back they agree (tokenizers
  split text into words before merging, so a word is tokenized the same wherever the text ends).
  The prompt's count is the start's ids plus the rest's estimate from its length. A chat, a
  prompt with no such start and one sent whole before are tokenized whole, as the engine will
  see them.
* With a local tokenizer and ``cut_chars``, such a prompt keeps every id instead: the start is
  encoded once up to a word boundary some ids before the cut and cached
  (:meth:`~trio_pdrouter.routing.tokenizer.LocalTokenizer.start`), and each prompt's rest is encoded
  from that boundary (:meth:`~trio_pdrouter.routing.tokenizer.LocalTokenizer.stitched`, outcome
  ``stitched``): the ids of the whole prompt for the cost of encoding its end.
* Answers are cached, keyed by a digest of the exact JSON sent, so a repeated prompt (or start)
  costs no call; the cache holds at most ``cache_size`` answers and ``cache_tokens`` token ids,
  the least recently used dropped first.
* Any failure (no healthy server, an error status, a timeout, a malformed answer) leaves the
  key without tokens: the policy then uses its estimate. The request is never failed for it.
* Each lookup's outcome (``cached``, ``local``, ``stitched``, ``engine`` or ``failed``) goes to
  ``on_outcome`` (``trio_pdrouter_kv_tokenize_total``).
* This runs before routing (it awaits); routing itself stays synchronous.

:meth:`PromptTokens.count` asks the same servers for a prompt's token count alone (the context
length check of :mod:`trio_pdrouter.serve.context_length`). vLLM's answer starts with ``{"count": N,
...`` before the token list, so only the answer's first bytes are read and the connection is closed:
a huge prompt's token list never crosses to the router. An answer shaped otherwise counts as a
failure. A text prompt is sent in slices of :data:`SLICE_CHARS` characters (chunked), so the router
holds no whole copy of it. Counts are not cached (the key would be the whole prompt).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import attrs
import httpx
import orjson
import trio

from ..http import LegClient, post_capped
from ..ledger import prompt_tokens
from .policies import RoutingKey
from .tokenizer import LocalTokenizer, Start

__all__ = ["PromptTokens"]

log = logging.getLogger("trio_pdrouter.kv_events")

T = TypeVar("T")

#: Chat fields that change the rendered prompt (vLLM's /tokenize accepts each of them).
_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
)


#: The largest ``/tokenize`` answer read for token ids (~7 bytes of JSON per token).
MAX_ANSWER_BYTES = 32 * 1024 * 1024
#: How much of a ``/tokenize`` answer :meth:`PromptTokens.count` reads to find the count.
COUNT_HEAD_BYTES = 256
#: Characters of a text prompt encoded at a time for :meth:`PromptTokens.count`.
SLICE_CHARS = 256 * 1024
_COUNT = re.compile(rb'\s*\{\s*"count"\s*:\s*([0-9]+)\s*[,}]')
#: The shortest start of a prompt tokenized on its own (module doc); shorter, the whole prompt.
MIN_CUT_CHARS = 512
#: Cuts looked up for a cached start, the prompt's own and those before it
#: (:meth:`PromptTokens._starts`).
START_LOOKBACK = 4
#: Ids dropped from the end of a start's: a word the cut splits is tokenized differently in
#: the whole prompt, and a tokenizer may end a text with special ids.
CUT_MARGIN_TOKENS = 8


def tokenize_request(body: Mapping[str, object]) -> dict[str, object] | None:
    """The ``/tokenize`` body for a request body, or None when it has no prompt to tokenize."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    model = body.get("model")
    named: dict[str, object] = {"model": model} if isinstance(model, str) else {}
    if isinstance(prompt, str) and prompt:
        return {**named, "prompt": prompt}
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        out: dict[str, object] = {**named, "messages": messages}
        out.update({f: body[f] for f in _CHAT_FIELDS if f in body})
        return out
    return None


class PromptTokens:
    """Asks the servers given by ``servers`` (healthy URLs, called per request) to tokenize,
    those of them ``serving`` a request's model when it names one; ``seen`` gives how much of a
    text this router has routed before (module doc)."""

    def __init__(
        self,
        client: LegClient,
        servers: Callable[[], Sequence[str]],
        *,
        timeout_s: float = 2.0,
        cache_size: int = 4096,
        cache_tokens: int = 1_000_000,
        api_key: str | None = None,
        local: LocalTokenizer | None = None,
        seen: Callable[[str], int] | None = None,
        cut_chars: int = 0,
        on_outcome: Callable[[str], None] = lambda _outcome: None,
        serving: Callable[[str, str], bool] | None = None,
    ) -> None:
        self._client = client
        self._serving = serving
        self._local = local
        self._servers = servers
        self._timeout_s = timeout_s
        #: Answers by digest of the JSON asked, and a local tokenizer's starts by digest of
        #: their text (module doc).
        self._cache: OrderedDict[bytes, tuple[int, ...] | Start] = OrderedDict()
        self._cache_size = cache_size
        self._cache_tokens = cache_tokens
        #: Token ids held in the cache.
        self.cached_tokens = 0
        self._seen = seen if cut_chars > 0 else None
        self._cut_chars = cut_chars
        self._on_outcome = on_outcome
        self._turn = 0
        # One set of headers for both calls (httpx takes them as bytes too).
        self._headers = {b"content-type": b"application/json"}
        if api_key:
            self._headers[b"authorization"] = f"Bearer {api_key}".encode("latin-1")
        self.calls = 0
        self.failures = 0

    async def key_with_tokens(self, body: Mapping[str, object], key: RoutingKey) -> RoutingKey:
        """``key`` with the prompt's token ids, or its start's, when they can be had (see the
        module doc)."""
        if key.tokens is not None:
            return key
        request = tokenize_request(body)
        if request is None:
            return key
        prompt = request.get("prompt")
        if isinstance(prompt, str) and (cut := self._cut(prompt)):
            if self._local is not None and self._local.stitches:
                ids = await self._stitched(self._local, prompt, cut)
                return attrs.evolve(key, tokens=ids, prompt_tokens=len(ids))
            named = {"model": request["model"]} if "model" in request else {}
            start = await self._tokens({**named, "prompt": prompt[:cut]})
            if start is None or len(start) <= CUT_MARGIN_TOKENS:
                return key
            rest = prompt_tokens(prompt[cut:])
            return attrs.evolve(
                key,
                tokens=start[:-CUT_MARGIN_TOKENS],
                prompt_tokens=len(start) + rest,
                partial_tokens=True,
            )
        tokens = await self._tokens(request)
        if tokens is None:
            return key
        # The engine's count replaces the estimate from the text (the token weight uses it).
        return attrs.evolve(key, tokens=tokens, prompt_tokens=len(tokens))

    def _cut(self, prompt: str) -> int:
        """Where to cut ``prompt`` (module doc), 0 to tokenize it whole."""
        if self._seen is None:
            return 0
        shared = self._seen(prompt)
        if shared >= len(prompt):
            return 0  # sent whole before: its whole answer may be cached
        cut = shared - shared % self._cut_chars
        return cut if cut >= MIN_CUT_CHARS else 0

    async def _stitched(self, local: LocalTokenizer, prompt: str, cut: int) -> tuple[int, ...]:
        """A text prompt's ids from the local tokenizer: its start's, cached (cut at ``cut``,
        or at one of the cuts before it: :meth:`_starts`), and the rest's
        (:meth:`~trio_pdrouter.routing.tokenizer.LocalTokenizer.stitched`)."""
        starts = self._starts(prompt, cut)
        for digest in starts:
            start = self._cache.get(digest)
            if isinstance(start, Start):
                self._cache.move_to_end(digest)
                break
        else:
            start = await local.start(prompt[:cut], CUT_MARGIN_TOKENS)
            self._keep(starts[0], start)
        self._on_outcome("stitched" if start.ids else "local")  # no boundary: encoded whole
        return await local.stitched(start, prompt)

    def _starts(self, prompt: str, cut: int) -> list[bytes]:
        """The cache keys of ``prompt``'s starts at ``cut`` and the cuts before it
        (:data:`START_LOOKBACK` in all, ``cut`` first): where a prompt happens to share a few
        more characters with an earlier one (a question's first word), its cut falls a step
        later than its group's, and the group's start serves it as well (any start of the
        prompt stitches to the same ids). Each character is hashed once."""
        step = self._cut_chars
        cuts = range(cut, max(cut - START_LOOKBACK * step, MIN_CUT_CHARS - 1), -step)
        digest = hashlib.blake2b(digest_size=16, person=b"start")
        keys, done = [], 0
        for at in reversed(cuts):
            digest.update(prompt[done:at].encode())
            keys.append(digest.copy().digest())
            done = at
        return keys[::-1]

    async def _tokens(self, request: Mapping[str, object]) -> tuple[int, ...] | None:
        """The ids of one ``/tokenize`` body: cached, else encoded here or asked."""
        raw = orjson.dumps(request)
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        cached = self._cache.get(digest)
        if isinstance(cached, tuple):
            self._cache.move_to_end(digest)
            self._on_outcome("cached")
            return cached
        tokens = await self._local.ids(request) if self._local is not None else None
        outcome = "local"
        if tokens is None:
            tokens = await self._ask(raw, _model_of(request))
            outcome = "engine" if tokens is not None else "failed"
        self._on_outcome(outcome)
        if tokens is not None:
            self._keep(digest, tokens)
        return tokens

    def _keep(self, digest: bytes, value: tuple[int, ...] | Start) -> None:
        """Cache ``value``, then drop the least recently used beyond the cache's bounds."""
        size = _ids_in(value)
        if size > self._cache_tokens:
            return
        self._cache[digest] = value
        self.cached_tokens += size
        while len(self._cache) > self._cache_size or self.cached_tokens > self._cache_tokens:
            self.cached_tokens -= _ids_in(self._cache.popitem(last=False)[1])

    async def count(self, request: Mapping[str, object]) -> int | None:
        """The engine's token count for a ``/tokenize`` body (:func:`tokenize_request`), None
        on any failure (see the module doc); counted here with a local tokenizer that takes it."""
        if self._local is not None:
            tokens = await self._local.ids(request)
            if tokens is not None:
                return len(tokens)

        async def exchange(url: str) -> int | None:
            # A body in slices: httpx's own request path, which streams it.
            async with self._client.stream(
                "POST", url, content=_json_in_slices(request), headers=self._headers
            ) as resp:
                return await _read_count(resp) if resp.status_code == 200 else None

        return await self._post(exchange, _model_of(request))

    async def _ask(self, raw: bytes, model: str | None) -> tuple[int, ...] | None:
        async def exchange(url: str) -> tuple[int, ...] | None:
            # Straight to the transport (LegClient.open_post), as the legs go: this call runs
            # for every request that kv_aware routes.
            answer = await post_capped(
                self._client, url, content=raw, headers=self._headers, cap=MAX_ANSWER_BYTES
            )
            return _tokens_in(answer.content) if answer.status_code == 200 else None

        return await self._post(exchange, model)

    async def _post(
        self, exchange: Callable[[str], Awaitable[T | None]], model: str | None
    ) -> T | None:
        """Run ``exchange`` with the next server's ``/tokenize`` URL (one serving ``model``
        when one is known to); None (counted in ``failures``) on anything but an answer: any
        failure lets the request through."""
        servers = self._servers()
        if model is not None and self._serving is not None:
            serving = self._serving
            servers = [url for url in servers if serving(url, model)] or servers
        if not servers:
            return None
        self._turn = (self._turn + 1) % len(servers)
        url = servers[self._turn] + "/tokenize"
        self.calls += 1
        answer: T | None = None
        try:
            with trio.fail_after(self._timeout_s):
                answer = await exchange(url)
        except Exception as exc:  # the engine, the network, a timeout, a malformed answer
            log.debug("tokenize at %s failed: %r", url, exc)
        if answer is None:
            self.failures += 1
        return answer


def _model_of(request: Mapping[str, object]) -> str | None:
    model = request.get("model")
    return model if isinstance(model, str) else None


def _ids_in(value: tuple[int, ...] | Start) -> int:
    return len(value.ids) if isinstance(value, Start) else len(value)


async def _read_count(resp: httpx.Response) -> int | None:
    """The ``count`` at the head of a ``/tokenize`` answer; the rest is not read."""
    head = b""
    async for chunk in resp.aiter_bytes():
        head += chunk
        if len(head) >= COUNT_HEAD_BYTES:
            break
    found = _COUNT.match(head)
    return None if found is None else int(found[1])


def _tokens_in(body: bytes) -> tuple[int, ...] | None:
    """The token ids of a ``/tokenize`` answer."""
    answer = orjson.loads(body)
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return None
    return tuple(tokens)


async def _json_in_slices(request: Mapping[str, object]) -> AsyncIterator[bytes]:
    """``orjson.dumps(request)``, a text prompt's slices encoded one at a time (a JSON string
    escapes character by character, so its slices' escapes join into the whole's)."""
    prompt = request.get("prompt")
    model = request.get("model")
    named = isinstance(model, str) and len(request) == 2
    if not isinstance(prompt, str) or (len(request) != 1 and not named):
        yield orjson.dumps(request)
        return
    yield b'{"model":' + orjson.dumps(model) + b',"prompt":"' if named else b'{"prompt":"'
    for start in range(0, len(prompt), SLICE_CHARS):
        yield orjson.dumps(prompt[start : start + SLICE_CHARS])[1:-1]
    yield b'"}'
