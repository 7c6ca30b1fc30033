"""A prompt's token ids computed in the router, from the engines' own tokenizer files.

``--kv-tokenizer-path`` names a Hugging Face ``tokenizer.json``, or a model directory holding
one beside ``tokenizer_config.json`` (its ``chat_template`` and special tokens) or
``chat_template.jinja``. With it, :class:`~.prompt_tokens.PromptTokens` asks an engine's
``POST /tokenize`` only for what this module declines.

The rules, as vLLM's ``/tokenize`` applies them:

* A text prompt is encoded with the tokenizer's special tokens (``add_special_tokens``
  defaults to true); a chat is rendered by its chat template (the request's ``chat_template``,
  else the model's), with ``add_generation_prompt`` (default true), ``tools``, the model's
  ``bos_token``/``eos_token`` and the request's ``chat_template_kwargs``, then encoded without
  them (default false: the template writes them).
* Declined (the engine is asked instead): a chat when no template is known,
  ``continue_final_message`` (the engine cuts the rendered text at the last message), and a
  template that fails to render.
* Templates run in jinja2's immutable sandbox (the request may bring its own); each distinct
  one is compiled once, the last :data:`TEMPLATES_KEPT` kept.
* Encoding is Rust (``tokenizers``) and releases the GIL: prompts up to :data:`INLINE_CHARS`
  are encoded in the router's thread (a thread hop would cost more), longer ones in a worker
  thread, so a long prompt never stalls every stream of the process.
* A text prompt whose start is shared with earlier prompts can be encoded in two parts
  (:meth:`LocalTokenizer.start` once per start, :meth:`LocalTokenizer.stitched` per prompt):
  the start's ids up to a word boundary some ids before its end, and the rest of the prompt
  from that boundary. Tokenizers split text into words before merging, so from the start of a
  word the text encodes the same whether or not what comes before is given; each start checks
  this on itself (its tail re-encoded from the boundary must give its own tail ids); where
  that fails (no word boundary, a normalizer that prepends to every text) the prompt is
  encoded whole. The special tokens the tokenizer adds around a text (``<s>``...) are found
  once, by encoding a probe with and without them, and put around the stitched ids; a
  tokenizer whose text ids are not found among them does not stitch
  (:attr:`LocalTokenizer.stitches`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import attrs
import jinja2
import trio
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["INLINE_CHARS", "LocalTokenizer", "Start", "TokenizerFilesError"]

_A = TypeVar("_A")
_R = TypeVar("_R")

#: Characters of prompt encoded in the router's own thread; longer prompts go to a worker thread.
INLINE_CHARS = 8 * 1024
#: Compiled chat templates kept (the model's and those requests brought).
TEMPLATES_KEPT = 16


#: Text encoded with and without special tokens to find those the tokenizer adds around a text.
_PROBE = "the probe"


@attrs.frozen
class Start:
    """A prompt start encoded once: its ids (no special tokens) before character ``chars``, a
    word boundary from which the rest of any prompt with this start is encoded."""

    ids: tuple[int, ...]
    chars: int


#: A start with no usable boundary: the prompt is encoded whole.
WHOLE = Start((), 0)


class TokenizerFilesError(ValueError):
    """The tokenizer files cannot be read (the message says which and why)."""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _special(config: Mapping[str, Any], name: str) -> str:
    """A special token of ``tokenizer_config.json``: a string, or ``{"content": ...}``."""
    value = config.get(name)
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _chat_template(config: Mapping[str, Any], directory: Path | None) -> str | None:
    if directory is not None and (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: vLLM renders with the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class LocalTokenizer:
    """Token ids for ``/tokenize`` bodies (:func:`~.prompt_tokens.tokenize_request`)."""

    def __init__(
        self, tokenizer: Tokenizer, chat_template: str | None, specials: Mapping[str, str]
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._specials = dict(specials)
        self._env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        self._env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        self._env.globals["raise_exception"] = _raise
        self._templates: OrderedDict[str, jinja2.Template] = OrderedDict()
        #: Bodies declined (the engine was asked) and encodings done in a worker thread.
        self.declined = 0
        self.threaded = 0
        self._around = self._specials_around()

    def _specials_around(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The ids the tokenizer adds before and after a text's own, or None if a text's own
        ids are not found among those it gets with special tokens."""
        framed = self._tokenizer.encode(_PROBE, add_special_tokens=True).ids
        bare = self._tokenizer.encode(_PROBE, add_special_tokens=False).ids
        for i in range(len(framed) - len(bare) + 1):
            if framed[i : i + len(bare)] == bare:
                return tuple(framed[:i]), tuple(framed[i + len(bare) :])
        return None

    @staticmethod
    @lru_cache(maxsize=4)
    def load(path: str) -> LocalTokenizer:
        """The tokenizer at ``path`` (see the module doc); :class:`TokenizerFilesError` if not.

        Cached per path: the setting's check and the router load it once between them.
        """
        given = Path(path)
        directory = given if given.is_dir() else None
        file = given / "tokenizer.json" if directory is not None else given
        if not file.is_file():
            raise TokenizerFilesError(f"{path}: no tokenizer.json there")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exceptions for a bad file
            raise TokenizerFilesError(f"{file}: not a tokenizer.json ({exc})") from None
        config: Mapping[str, Any] = {}
        if directory is not None and (directory / "tokenizer_config.json").is_file():
            try:
                loaded = json.loads((directory / "tokenizer_config.json").read_text())
            except ValueError as exc:
                raise TokenizerFilesError(f"{directory}/tokenizer_config.json: {exc}") from None
            config = loaded if isinstance(loaded, Mapping) else {}
        specials = {name: _special(config, name) for name in ("bos_token", "eos_token")}
        local = LocalTokenizer(tokenizer, _chat_template(config, directory), specials)
        if local._chat_template is not None:
            try:
                local._template(local._chat_template)
            except jinja2.TemplateError as exc:
                raise TokenizerFilesError(f"{path}: its chat template: {exc}") from None
        return local

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    async def ids(self, request: Mapping[str, object]) -> tuple[int, ...] | None:
        """The token ids the engine gives ``request``, or None where the engine must say."""
        found = self._text(request)
        if found is None:
            self.declined += 1
            return None
        text, special = found
        return await self._off_loop(self._encode, text, special)

    async def _off_loop(self, work: Callable[[str, _A], _R], text: str, arg: _A) -> _R:
        """``work(text, arg)``: here for a ``text`` of up to :data:`INLINE_CHARS` characters (a
        thread hop would cost more), else in a worker thread (module doc)."""
        if len(text) <= INLINE_CHARS:
            return work(text, arg)
        self.threaded += 1
        return await trio.to_thread.run_sync(work, text, arg)

    def _encode(self, text: str, special: bool) -> tuple[int, ...]:
        # The batch call releases the GIL (a single encode holds it), and "fast" skips offsets.
        (encoding,) = self._tokenizer.encode_batch_fast([text], add_special_tokens=special)
        return tuple(encoding.ids)

    @property
    def stitches(self) -> bool:
        """Whether :meth:`start` and :meth:`stitched` may be used: the special tokens this
        tokenizer puts around a text are known (module doc)."""
        return self._around is not None

    async def start(self, text: str, margin: int) -> Start:
        """``text`` as a shared start (module doc): its ids up to the last word boundary at
        least ``margin`` ids before its end, or :data:`WHOLE` (the prompt encoded whole) where
        this text has none that passes the check. Only where :attr:`stitches`."""
        return await self._off_loop(self._start, text, margin)

    def _start(self, text: str, margin: int) -> Start:
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=False)
        ids, words = encoding.ids, encoding.word_ids
        k = min(len(ids) - margin, len(ids) - 1)
        while k > 0 and (words[k] is None or words[k] == words[k - 1]):
            k -= 1
        if k <= 0:
            return WHOLE
        chars = encoding.offsets[k][0]
        if self._encode(text[chars:], False) != tuple(ids[k:]):
            return WHOLE
        return Start(tuple(ids[:k]), chars)

    async def stitched(self, start: Start, prompt: str) -> tuple[int, ...]:
        """The ids the engine gives ``prompt`` (a text completion, special tokens added),
        which begins with the text ``start`` came from."""
        assert self._around is not None  # only where it stitches
        head, tail = self._around
        rest = prompt[start.chars :]
        return head + start.ids + await self._off_loop(self._encode, rest, False) + tail

    def _text(self, request: Mapping[str, object]) -> tuple[str, bool] | None:
        """The text to encode and whether special tokens are added, or None (declined)."""
        prompt = request.get("prompt")
        if isinstance(prompt, str):
            return prompt, request.get("add_special_tokens", True) is not False
        messages = request.get("messages")
        source = request.get("chat_template", self._chat_template)
        if not isinstance(messages, list) or not isinstance(source, str):
            return None
        if request.get("continue_final_message"):
            return None
        kwargs = request.get("chat_template_kwargs")
        context: dict[str, object] = {
            **self._specials,
            **(kwargs if isinstance(kwargs, Mapping) else {}),
            "messages": messages,
            "add_generation_prompt": request.get("add_generation_prompt", True) is not False,
        }
        if request.get("tools") is not None:
            context["tools"] = request["tools"]
        try:
            text = self._template(source).render(context)
        except Exception:  # a template raising (raise_exception) or failing on these messages
            return None
        return text, request.get("add_special_tokens", False) is True

    def _template(self, source: str) -> jinja2.Template:
        template = self._templates.get(source)
        if template is None:
            template = self._templates[source] = self._env.from_string(source)
            if len(self._templates) > TEMPLATES_KEPT:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(source)
        return template
