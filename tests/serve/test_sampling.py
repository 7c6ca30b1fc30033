"""Sampling parameters decode would refuse are refused first, before prefill holds any KV."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from tests.harness import call, json_response, make_app, pd_config
from trio_pdrouter.ledger import output_tokens
from trio_pdrouter.serve import sampling


@pytest.mark.parametrize(
    ("changes", "param", "message"),
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
        ({"max_tokens": -1}, "max_tokens", "max_tokens must be at least 1, got -1."),
        ({"max_tokens": "8"}, "max_tokens", "max_tokens: Input should be a valid integer"),
        ({"max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 8.5}, "max_tokens", "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 0.0}, "max_tokens", "max_tokens must be at least 1, got 0."),
        ({"max_tokens": 2.0, "min_tokens": 3.0}, "min_tokens", "max_tokens=2, got 3."),
        ({"max_tokens": 2**64}, "max_tokens", "Input should be less than or equal to"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "must be at least 1"),
        ({"max_output_tokens": 0}, "max_output_tokens", "must be at least 1"),
        ({"min_tokens": -2}, "min_tokens", "greater than or equal to 0, got -2."),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens", "less than or equal to max_tokens=2"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only be defined when"),
        (
            {"stream": False, "stream_options": {}},
            "stream_options",
            "Stream options can only be defined when `stream=True`.",
        ),
    ],
)
def test_vllms_refusals(changes: dict[str, Any], param: str, message: str) -> None:
    error = sampling.refusal({"prompt": "x", **changes})
    assert error is not None and message in error.message
    assert (error.status, error.type, error.param) == (400, "BadRequestError", param)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x"},
        {"prompt": "x", "max_tokens": None, "stream": True, "stream_options": None},
        {"prompt": "x", "max_tokens": 1, "min_tokens": 1},
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "x", "max_tokens": 2**63 - 1},
        {"prompt": "x", "max_tokens": 8.0, "min_tokens": 2.0},  # integral floats, as vLLM
    ],
)
def test_what_vllm_accepts_passes(body: dict[str, Any]) -> None:
    assert sampling.refusal(body) is None


async def test_a_refused_request_touches_no_engine(background: trio.Nursery) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return json_response({})

    app, upstream = make_app(pd_config(), handler, background)
    ex = await call(app, "POST", "/v1/completions", {"prompt": "x" * 16000, "max_tokens": 0})
    assert ex.status == 400
    assert ex.json()["error"] == {
        "message": "max_tokens must be at least 1, got 0.",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    assert upstream.requests == []


def test_an_integral_float_cap_is_the_request_s_output_estimate() -> None:
    assert output_tokens({"max_tokens": 8.0}) == 8
    assert output_tokens({"max_tokens": 8.5}) == output_tokens({})
