"""The token counts of an answer, read from its ``usage`` object for the access log.

vLLM puts ``usage`` near the end of an answer: after ``choices`` in a JSON answer, and in the
last event before ``data: [DONE]`` of a stream asked for with ``stream_options.include_usage``
(``vllm/entrypoints/openai/serving_completion.py`` and ``serving_chat.py``, vLLM 0.11). The
Responses API names the counts ``input_tokens`` and ``output_tokens``
(``vllm/entrypoints/openai/protocol.py``, ``ResponseUsage``). So the last bytes the client was
sent are enough: :func:`usage_of` looks for the last ``"usage"`` there and reads the counts after
it, without parsing the answer.
"""

from __future__ import annotations

import re

_PROMPT = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')


def usage_of(tail: bytes) -> tuple[int | None, int | None]:
    """(prompt tokens, completion tokens) from the last ``usage`` object in ``tail``; None for
    a count it does not hold."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None, None
    rest = tail[at:]
    prompt = _PROMPT.search(rest)
    completion = _COMPLETION.search(rest)
    return (
        int(prompt.group(1)) if prompt else None,
        int(completion.group(1)) if completion else None,
    )
