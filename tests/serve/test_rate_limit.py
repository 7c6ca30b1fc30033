"""``--rate-limit-tokens-per-second``: a token bucket on arrivals, 429 with Retry-After."""

from __future__ import annotations

import httpx
import trio
import trio.testing

from tests.harness import PREFILL_ANSWER, REQUEST, call, json_response, make_app, pd_config
from trio_pdrouter.config import AdmissionSettings
from trio_pdrouter.serve import TokenBucket


def test_a_full_bucket_lets_a_burst_through_then_refills_at_its_rate() -> None:
    bucket = TokenBucket(capacity=3, rate=2.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [None, None, None]
    assert bucket.take(0.0) == 1  # the next token in 0.5 s: Retry-After rounds up to 1
    assert bucket.take(0.5) is None
    assert bucket.take(0.5) == 1
    assert [bucket.take(100.0) for _ in range(4)] == [None, None, None, 1]  # never above 3


def test_retry_after_is_the_wait_for_the_next_token() -> None:
    bucket = TokenBucket(capacity=1, rate=0.25, now=0.0)
    assert bucket.take(0.0) is None
    assert bucket.take(0.0) == 4
    assert bucket.take(3.0) == 1
    assert bucket.take(4.0) is None


async def test_requests_beyond_the_rate_get_429_with_retry_after(
    autojump_clock: trio.testing.MockClock, background: trio.Nursery
) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            return json_response(PREFILL_ANSWER)
        return json_response({"choices": []})

    admission = AdmissionSettings(max_concurrent_requests=2, rate_limit_tokens_per_second=1)
    app, upstream = make_app(pd_config(admission=admission), handler, background)
    body = {**REQUEST, "stream": False}
    del body["stream_options"]
    statuses = [(await call(app, "POST", "/v1/completions", body)).status for _ in range(2)]
    assert statuses == [200, 200]
    refused = await call(app, "POST", "/v1/completions", body)
    assert refused.status == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert len(upstream.requests) == 4, "a refused request reaches no engine"
    await trio.sleep(1.0)
    assert (await call(app, "POST", "/v1/completions", body)).status == 200
    metrics = bytes((await call(app, "GET", "/metrics")).body).decode()
    assert 'trio_pdrouter_admission_rejections_total{reason="rate_limited"} 1.0' in metrics
