from __future__ import annotations

from trio_pdrouter.ledger import DEFAULT_OUTPUT_TOKENS
from trio_pdrouter.routing.policies import RoutingKey, routing_key
from trio_pdrouter.routing.policies.routing_key import routing_text


def test_prompt_forms() -> None:
    assert routing_text({"prompt": "hello", "temperature": 0.5}) == "hello"
    assert routing_text({"prompt": ["a", "b"]}) == "a\nb"
    tokens = routing_text({"prompt": [1, 2, 3]})
    assert tokens.startswith("\x02") and len(tokens) == 4
    assert routing_text({"prompt": [1, 2, 3, 4]}).startswith(tokens)  # token prefix = text prefix
    assert routing_text({"prompt": [70000, 0xD800, 2]}).isprintable() is False  # no crash
    assert routing_text({"prompt": [[5, 6], [7]]}) == "\x02\x05\x06\n\x02\x07"
    assert routing_text({"prompt": [-1]}) == ""
    assert routing_text({"prompt": None}) == routing_text({}) == ""
    assert routing_text({"prompt": [True]}) == ""


def test_messages_text_with_roles_and_parts() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": " this?"},
                ],
            },
        ],
        "max_tokens": 5,
    }
    text = routing_text(body)
    assert text == "<|system|>Be brief.<|user|>What is this?"
    swapped = {"messages": [{"role": "user", "content": "Be brief."}]}
    assert routing_text(swapped) != routing_text({"messages": [body["messages"][0]]})  # type: ignore[index]
    assert routing_text({"messages": "nope"}) == ""


def test_hash_key_order() -> None:
    body = {"prompt": "p", "session_id": "sess", "user": "usr"}
    assert routing_key(body, {"X-User-Id": "u", "x-tenant-id": "t"}).hash_key == "u"
    assert routing_key(body, {"X-SESSION-ID": "s", "X-User-ID": "u"}).hash_key == "s"
    assert routing_key(body, {"X-Tenant-ID": "t"}).hash_key == "t"
    assert routing_key(body, {"X-Session-ID": " "}).hash_key == "sess"
    assert routing_key({"user": "usr"}, {}).hash_key == "usr"
    assert routing_key({"session_id": 42, "user": "usr"}, {}).hash_key == "42"
    assert routing_key({"user": {"id": 1}}, {}).hash_key is None
    sneaky = routing_key({"prompt": '"user": "sneaky"'}, {})
    assert (sneaky.text, sneaky.hash_key) == ('"user": "sneaky"', None)


def test_token_estimates_are_exact_for_ids_and_chars_over_four_for_text() -> None:
    assert routing_key({"prompt": [5, 6, 7], "max_tokens": 9}, {}).prompt_tokens == 3
    batch = routing_key({"prompt": [[5, 6], [10, 11, 12]]}, {})
    assert batch.prompt_tokens == 5 and batch.output_tokens == DEFAULT_OUTPUT_TOKENS
    assert routing_key({"prompt": "x" * 4001}, {}).prompt_tokens == 1001
    caps = {"messages": [], "max_tokens": 90, "max_completion_tokens": 30}
    assert routing_key(caps, {}).output_tokens == 30
    assert routing_key({"prompt": "", "max_tokens": True}, {}) == RoutingKey(
        "", None, 0, DEFAULT_OUTPUT_TOKENS
    )
