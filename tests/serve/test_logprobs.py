from trio_pdrouter.serve.logprobs import merge, needs_merge


def test_needs_merge_only_for_prompt_side_fields() -> None:
    assert not needs_merge({"prompt": "x"})
    assert not needs_merge({"prompt": "x", "logprobs": 2})
    assert not needs_merge({"prompt": "x", "echo": True})
    assert needs_merge({"prompt": "x", "echo": True, "logprobs": 0})
    assert needs_merge({"prompt": "x", "prompt_logprobs": 1})


def test_echo_prepends_prompt_tokens_and_shifts_offsets() -> None:
    prefill = {
        "choices": [
            {
                "text": "ab c",
                "logprobs": {
                    "tokens": ["a", "b", " c"],
                    "token_logprobs": [None, -1.0, -0.5],
                    "top_logprobs": [None, {"b": -1.0}, {" c": -0.5}],
                    "text_offset": [0, 1, 2],
                },
            }
        ],
        "usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}},
    }
    decode = {
        "choices": [
            {
                "text": " x y",
                "logprobs": {
                    "tokens": [" x", " y"],
                    "token_logprobs": [-0.1, -0.2],
                    "top_logprobs": [{" x": -0.1}, {" y": -0.2}],
                    "text_offset": [0, 2],
                },
            }
        ],
        "usage": {"prompt_tokens": 2},
    }
    out = merge({"echo": True, "logprobs": 1}, prefill, decode)
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", " x", " y"]
    assert lp["token_logprobs"] == [None, -1.0, -0.1, -0.2]
    assert lp["top_logprobs"] == [None, {"b": -1.0}, {" x": -0.1}, {" y": -0.2}]
    assert lp["text_offset"] == [0, 1, 2, 4]
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_prompt_logprobs_copied_top_level_and_per_choice() -> None:
    prefill = {
        "prompt_logprobs": [None, {"1": {"logprob": -1}}],
        "choices": [{"prompt_logprobs": [None]}],
    }
    decode = {"prompt_logprobs": None, "choices": [{"prompt_logprobs": None}]}
    out = merge({"prompt_logprobs": 1}, prefill, decode)
    assert out["prompt_logprobs"] == prefill["prompt_logprobs"]
    assert out["choices"][0]["prompt_logprobs"] == [None]


def test_cached_tokens_kept_when_decode_reports_them() -> None:
    prefill = {"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}
    decode = {"usage": {"prompt_tokens_details": {"cached_tokens": 3}}}
    assert merge({}, prefill, decode)["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    decode = {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}
    assert merge({}, prefill, decode)["usage"]["prompt_tokens_details"]["cached_tokens"] == 5


def test_merge_tolerates_odd_shapes() -> None:
    assert merge({"echo": True, "logprobs": 1}, None, {"choices": None}) == {"choices": None}
    assert merge({"echo": True, "logprobs": 1}, {"choices": [1]}, {"choices": [2]}) == {
        "choices": [2]
    }


def test_echo_from_a_decode_that_already_echoed_is_not_doubled() -> None:
    prefill = {
        "choices": [
            {
                "logprobs": {
                    "tokens": ["a", "b", " c"],
                    "token_logprobs": [None, -1.0, -0.5],
                    "top_logprobs": [None, {"b": -1.0}, {" c": -0.5}],
                    "text_offset": [0, 1, 2],
                }
            }
        ]
    }
    decode = {
        "choices": [
            {
                "logprobs": {
                    "tokens": ["a", "b", " x"],
                    "token_logprobs": [None, None, -0.1],
                    "top_logprobs": [None, None, {" x": -0.1}],
                    "text_offset": [0, 1, 2],
                }
            }
        ]
    }
    lp = merge({"echo": True, "logprobs": 1}, prefill, decode)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", " x"]
    assert lp["token_logprobs"] == [None, -1.0, -0.1]
    assert lp["top_logprobs"] == [None, {"b": -1.0}, {" x": -0.1}]
    assert lp["text_offset"] == [0, 1, 2]
