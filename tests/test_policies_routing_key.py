from __future__ import annotations

from trio_pdrouter.policies import RoutingKey, routing_key
from trio_pdrouter.policies.routing_key import routing_text


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
    assert routing_key({"prompt": '"user": "sneaky"'}, {}) == RoutingKey('"user": "sneaky"', None)
