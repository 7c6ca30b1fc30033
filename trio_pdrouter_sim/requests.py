"""Parsing and validation of generation requests, with vLLM's 400 messages. Pure."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

import attrs

from .shapes import Prompt, prompt_from_ids
from .text_tokens import TextTokens

Kind = Literal["completions", "chat", "responses"]

#: vLLM's default ``--max-logprobs``.
MAX_LOGPROBS = 20
#: Default ``max_tokens`` when a request does not say (vLLM's completions default).
DEFAULT_MAX_TOKENS = 16


class BadRequest(Exception):
    """A request vLLM would refuse: ``status`` (400 unless said), message and ``param``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


@attrs.frozen
class RemotePrefill:
    """Valid decode-side ``kv_transfer_params`` (the blocks to pull)."""

    host: str
    port: int
    engine_id: str
    block_ids: tuple[int, ...]
    request_id: str | None


@attrs.frozen
class GenRequest:
    """A validated completions or chat request."""

    kind: Kind
    model: str
    prompt: Prompt
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    echo: bool
    prompt_logprobs: int | None
    #: The request asks to be a NIXL prefill (``do_remote_decode``).
    remote_decode: bool
    #: The request carries blocks to pull (``do_remote_prefill``); None if absent or invalid.
    remote_prefill: RemotePrefill | None
    #: ``kv_transfer_params`` asked for a remote prefill but were unusable.
    remote_prefill_invalid: bool


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{key}: Input should be a valid boolean", param=key)
    return value


def _int_or_none(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key}: Input should be a valid integer", param=key)
    return value


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: Field required (a non-empty list)", param="messages")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("messages: each message needs a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            text = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        elif content is None or isinstance(content, str):
            text = content or ""
        else:
            raise BadRequest("messages: content must be a string or a list", param="messages")
        # A stand-in chat template: role markers make shared conversation prefixes real
        # shared token prefixes, as a real template does.
        parts.append(f"<|{message['role']}|>\n{text}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _responses_text(given: Any, instructions: Any) -> str:
    """The Responses API's ``input`` (a string, or messages) as chat text."""
    if isinstance(given, str) and given:
        messages: list[Any] = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        messages = list(given)
    else:
        raise BadRequest("input: Field required (a string or a list of messages)", param="input")
    if isinstance(instructions, str) and instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    return _chat_text(messages)


def _completion_prompt(prompt: Any, text: TextTokens) -> Prompt:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("Prompt cannot be empty", param="prompt")
        return text.prompt(prompt, special=True)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return prompt_from_ids(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("the simulator accepts one prompt per request", param="prompt")
    raise BadRequest(
        "prompt: Input should be a string, a list of token ids, or a list of one of them",
        param="prompt",
    )


def _kv(body: dict[str, Any]) -> tuple[bool, RemotePrefill | None, bool]:
    kv = body.get("kv_transfer_params")
    if kv is None:
        return False, None, False
    if not isinstance(kv, dict):
        raise BadRequest(
            "kv_transfer_params: Input should be an object", param="kv_transfer_params"
        )
    remote_decode = kv.get("do_remote_decode") is True
    if kv.get("do_remote_prefill") is not True:
        return remote_decode, None, False
    host, port = kv.get("remote_host"), kv.get("remote_port")
    engine_id, block_ids = kv.get("remote_engine_id"), kv.get("remote_block_ids")
    request_id = kv.get("remote_request_id")
    valid = (
        isinstance(host, str)
        and host != ""
        and isinstance(port, int)
        and not isinstance(port, bool)
        and 0 < port < 65536
        and isinstance(engine_id, str)
        and isinstance(block_ids, list)
        and all(isinstance(b, int) for b in block_ids)
        and (request_id is None or isinstance(request_id, str))
    )
    if not valid:
        return remote_decode, None, True
    assert isinstance(host, str) and isinstance(port, int) and isinstance(engine_id, str)
    assert isinstance(block_ids, list)
    remote = RemotePrefill(
        host=host,
        port=port,
        engine_id=engine_id,
        block_ids=tuple(block_ids),
        request_id=request_id if isinstance(request_id, str) else None,
    )
    return remote_decode, remote, False


def parse_request(
    kind: Kind,
    body: Any,
    *,
    served_model: str,
    text: TextTokens,
    max_model_len: int,
    adapters: Collection[str] = (),
) -> GenRequest:
    """Validate a decoded JSON body as vLLM would. Raises :class:`BadRequest`.

    ``model`` may name the served model or one of its LoRA ``adapters``; the answer names the
    model asked for, as vLLM's does."""
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model and model not in adapters:
        raise BadRequest(f"The model `{model}` does not exist.", param="model", status=404)
    if kind == "completions":
        if "prompt" not in body:
            raise BadRequest("prompt: Field required", param="prompt")
        prompt = _completion_prompt(body["prompt"], text)
    elif kind == "responses":
        chat = _responses_text(body.get("input"), body.get("instructions"))
        prompt = text.prompt(chat, special=False)
    else:
        prompt = text.prompt(_chat_text(body.get("messages")), special=False)

    n = _int_or_none(body, "n")
    if n is not None and n != 1:
        raise BadRequest("the simulator supports n=1 only", param="n")

    max_tokens = _int_or_none(body, "max_tokens")
    if kind == "responses":
        max_tokens = _int_or_none(body, "max_output_tokens")
    elif kind == "chat":
        max_tokens = _int_or_none(body, "max_completion_tokens") or max_tokens
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if len(prompt) + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            param="max_tokens",
        )
    min_tokens = _int_or_none(body, "min_tokens") or 0
    if min_tokens < 0:
        raise BadRequest(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )

    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise BadRequest(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        if not isinstance(options, dict):
            raise BadRequest("stream_options: Input should be an object", param="stream_options")
        include_usage = options.get("include_usage") is True
        continuous = include_usage and options.get("continuous_usage_stats") is True

    logprobs: int | None
    if kind == "responses":
        logprobs = None
    elif kind == "completions":
        logprobs = _int_or_none(body, "logprobs")
    else:
        top = _int_or_none(body, "top_logprobs")
        if _bool(body, "logprobs"):
            logprobs = top or 0
        elif top:
            raise BadRequest(
                "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
            )
        else:
            logprobs = None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}"
            if logprobs > 0
            else "logprobs must be a non-negative value.",
            param="logprobs",
        )
    prompt_logprobs = _int_or_none(body, "prompt_logprobs")
    if prompt_logprobs is not None:
        if stream:
            raise BadRequest(
                "`prompt_logprobs` are not available when `stream=True`.",
                param="prompt_logprobs",
            )
        if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise BadRequest(
                f"Requested prompt logprobs of {prompt_logprobs}, which is greater than max "
                f"allowed: {MAX_LOGPROBS}",
                param="prompt_logprobs",
            )
    echo = kind == "completions" and _bool(body, "echo")
    remote_decode, remote_prefill, invalid = _kv(body)
    return GenRequest(
        kind=kind,
        model=model if isinstance(model, str) else served_model,
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=logprobs,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        remote_decode=remote_decode,
        remote_prefill=remote_prefill,
        remote_prefill_invalid=invalid,
    )


def tokenize(body: Any, text: TextTokens) -> list[int]:
    """``POST /tokenize``: the token ids a completion ``prompt`` or chat ``messages`` become,
    the same ids the engine caches (and publishes in its KV events) for that request."""
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    if "messages" in body:
        return list(text.prompt(_chat_text(body["messages"]), special=False).ids)
    if "prompt" in body:
        return list(_completion_prompt(body["prompt"], text).ids)
    raise BadRequest("prompt or messages: Field required", param="prompt")
