import attrs

from trio_pdrouter.config import RouterConfig
from trio_pdrouter.endpoints import Endpoint, Role
from trio_pdrouter.serve import bodies as pd

BODY = {
    "model": "m",
    "prompt": "hello",
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 50,
    "min_tokens": 5,
    "temperature": 0.5,
}


def test_prefill_body_asks_for_one_token_and_kv_params() -> None:
    out = pd.prefill_body(BODY, "/v1/completions")
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert out["stream"] is False
    assert "stream_options" not in out
    assert out["max_tokens"] == 1
    assert "min_tokens" not in out
    assert out["temperature"] == 0.5 and out["prompt"] == "hello"
    # Never add fields the client did not send.
    assert set(out) == set(BODY) - {"stream_options", "min_tokens"} | {"kv_transfer_params"}
    assert BODY["max_tokens"] == 50, "the client's body is not modified"


def test_prefill_body_caps_every_token_budget_the_client_sent() -> None:
    chat = {"messages": [], "max_completion_tokens": 9, "min_completion_tokens": 2}
    out = pd.prefill_body(chat, "/v1/chat/completions")
    assert out["max_completion_tokens"] == 1 and out["max_tokens"] == 1
    assert "min_completion_tokens" not in out


def test_prefill_body_of_the_responses_api_caps_max_output_tokens_only() -> None:
    for body in ({"input": "x", "max_output_tokens": 7}, {"input": "x"}):
        out = pd.prefill_body(body, "/v1/responses")
        assert out["max_output_tokens"] == 1 and "max_tokens" not in out
        assert out["stream"] is False and out["kv_transfer_params"]["do_remote_decode"] is True


def test_prefill_body_of_generate_caps_the_nested_sampling_params() -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 9, "min_tokens": 3, "top_p": 1}}
    out = pd.prefill_body(body, "/inference/v1/generate")
    assert out["sampling_params"] == {"max_tokens": 1, "top_p": 1}
    assert "max_tokens" not in out and body["sampling_params"]["max_tokens"] == 9


def test_decode_body_is_the_client_body_plus_params_verbatim() -> None:
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 5600}
    out = pd.decode_body(BODY, params)
    assert out["kv_transfer_params"] is params
    assert {k: v for k, v in out.items() if k != "kv_transfer_params"} == BODY


def test_decode_body_without_params_leaves_the_field_out() -> None:
    assert "kv_transfer_params" not in pd.decode_body(BODY, None)


def test_headers_forward_auth_trace_and_rank_but_nothing_hop_by_hop() -> None:
    client = {
        "authorization": "Bearer c",
        "traceparent": "00-abc-def-01",
        "tracestate": "x=1",
        "baggage": "k=v",
        "connection": "keep-alive",
        "keep-alive": "timeout=5",
        "transfer-encoding": "chunked",
        "host": "router",
        "x-other": "1",
    }
    ep = Endpoint("http://d:1", Role.DECODE, 3)
    out = pd.upstream_headers(client, "rid", ep)
    assert out == {
        b"content-type": b"application/json",
        b"x-request-id": b"rid",
        b"accept-encoding": b"identity",  # a compressed stream would reach the client undecoded
        b"authorization": b"Bearer c",
        b"traceparent": b"00-abc-def-01",
        b"tracestate": b"x=1",
        b"baggage": b"k=v",
        b"x-data-parallel-rank": b"3",
    }
    replaced = pd.upstream_headers(client, "rid", Endpoint("http://d:1", Role.DECODE), "up")
    assert replaced[b"authorization"] == b"Bearer up"
    assert b"x-data-parallel-rank" not in replaced


def test_request_id_prefers_the_clients() -> None:
    names = attrs.fields(RouterConfig).request_id_headers.default
    assert pd.request_id({"x-request-id": "abc"}, names) == "abc"
    assert pd.request_id({"x-trace-id": "t"}, ["x-trace-id"]) == "t"
    generated = pd.request_id({}, names)
    assert len(generated) == 32 and generated != pd.request_id({}, names)


def test_p2p_nccl_request_id_names_both_peers() -> None:
    rid = pd.p2p_nccl_request_id(
        Endpoint("http://10.0.0.1:8100", Role.PREFILL),
        Endpoint("http://10.0.0.2:8200", Role.DECODE),
    )
    prefix = "___prefill_addr_10.0.0.1:8100___decode_addr_10.0.0.2:8200_"
    assert rid.startswith(prefix)
    assert len(rid) == len(prefix) + 32


def test_the_stranded_kv_pull_is_capped_at_one_token_like_the_prefill() -> None:
    for cap, path in (
        ("max_tokens", "/v1/completions"),
        ("max_completion_tokens", "/v1/chat/completions"),
        ("max_output_tokens", "/v1/responses"),
    ):
        body = {"model": "m", "prompt": "x", cap: 50, "min_tokens": 5, "stream_options": {}}
        kv = {"remote_block_ids": [1]}
        out = pd.stranded_decode_body(body, kv, path)
        assert out[cap] == 1 and pd.prefill_body(body, path)[cap] == 1
        assert out["kv_transfer_params"] == kv and out["stream"] is True
        assert "min_tokens" not in out and "stream_options" not in out
