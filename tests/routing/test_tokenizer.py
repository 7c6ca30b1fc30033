"""``--kv-tokenizer-path``: the router's own token ids equal the engine's ``/tokenize`` answer
(the simulator encoding with the same files), and what it cannot tokenize goes to the engine."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from tests.routing.test_prompt_tokens import WORDS
from trio_pdrouter.cli import parse_config
from trio_pdrouter.http import LegClient
from trio_pdrouter.routing import (
    CUT_MARGIN_TOKENS,
    LocalTokenizer,
    PromptTokens,
    RoutingKey,
    tokenize_request,
)
from trio_pdrouter.routing import tokenizer as local_tokenizer
from trio_pdrouter_sim.requests import tokenize
from trio_pdrouter_sim.text_tokens import TextTokens
from trio_pdrouter_sim.tokenizer_files import write_model_dir

CORPUS = ["A shared document about prefix caching and routing, with ümlauts. " * 4, "q1 q2 q3"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "model", CORPUS, vocab_size=400)


def engine(model_dir: Path) -> TextTokens:
    """The simulator's tokenizer over the same files: what an engine's /tokenize answers."""
    return TextTokens(4, Tokenizer.from_file(str(model_dir / "tokenizer.json")))


CHAT = [
    {"role": "system", "content": "A shared document about prefix caching."},
    {"role": "user", "content": [{"type": "text", "text": "q1 "}, {"type": "text", "text": "é"}]},
]
BODIES: list[dict[str, Any]] = [
    {"prompt": "A shared document about routing"},
    {"prompt": ["one prompt in a batch of one"]},
    {"prompt": "no specials", "add_special_tokens": False},
    {"messages": CHAT},
    {"messages": CHAT, "add_generation_prompt": True},
]


@pytest.mark.parametrize("body", BODIES)
async def test_the_routers_ids_are_the_engines(model_dir: Path, body: dict[str, Any]) -> None:
    request = tokenize_request(body)
    assert request is not None
    local = await LocalTokenizer.load(str(model_dir)).ids(request)
    assert local == tuple(tokenize(request, engine(model_dir)))


async def test_special_tokens_as_vllm_adds_them(model_dir: Path) -> None:
    local = LocalTokenizer.load(str(model_dir))
    bos = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("<s>")
    text = await local.ids({"prompt": "routing"})
    chat = await local.ids({"messages": [{"role": "user", "content": "routing"}]})
    assert text is not None and text[0] == bos  # a completion gets BOS
    assert chat is not None and bos not in chat  # a chat's template writes its own
    plain = await local.ids({"prompt": "routing", "add_special_tokens": False})
    assert plain == text[1:]


async def test_the_requests_template_and_kwargs_are_rendered(model_dir: Path) -> None:
    local = LocalTokenizer.load(str(model_dir))
    messages = [{"role": "user", "content": "q1"}]
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ bos_token }}"
    ids = await local.ids(
        {
            "messages": messages,
            "chat_template": template,
            "chat_template_kwargs": {"greeting": "A "},
        }
    )
    expected = engine(model_dir).prompt("A q1<s>", special=False).ids
    assert ids == expected
    # Without the kwarg the rendered text differs, and so do the ids.
    assert await local.ids({"messages": messages, "chat_template": template}) != expected


async def test_what_cannot_be_rendered_here_is_declined(model_dir: Path, tmp_path: Path) -> None:
    local = LocalTokenizer.load(str(model_dir))
    chat: list[dict[str, Any]] = [{"role": "user", "content": "q1"}]
    refuses = "{{ raise_exception('no system message') }}"
    assert await local.ids({"messages": chat, "continue_final_message": True}) is None
    assert await local.ids({"messages": chat, "chat_template": refuses}) is None
    assert await local.ids({"messages": chat, "chat_template": "{% for %}"}) is None
    # A bare tokenizer.json has no chat template: chats are declined, text is not.
    bare = LocalTokenizer.load(str(model_dir / "tokenizer.json"))
    assert not bare.has_chat_template
    assert await bare.ids({"messages": chat}) is None
    assert await bare.ids({"prompt": "q1"}) is not None
    assert (local.declined, bare.declined) == (3, 1)


async def test_a_long_prompt_is_encoded_in_a_worker_thread(model_dir: Path) -> None:
    local = LocalTokenizer.load(str(model_dir))
    long = "routing " * (local_tokenizer.INLINE_CHARS // 8 + 1)
    ids = await local.ids({"prompt": long})
    assert local.threaded == 1
    assert ids == engine(model_dir).prompt(long, special=True).ids


async def test_prompt_tokens_ask_the_engine_only_for_what_is_declined(model_dir: Path) -> None:
    calls: list[dict[str, object]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(orjson.loads(request.content))
        return httpx.Response(200, json={"count": 2, "tokens": [7, 8]})

    client = LegClient(transport=httpx.MockTransport(handler))
    local = LocalTokenizer.load(str(model_dir))
    tokens = PromptTokens(client, lambda: ["http://e:1"], local=local)
    key = await tokens.key_with_tokens({"prompt": "routing"}, RoutingKey(text="routing"))
    assert key.tokens == engine(model_dir).prompt("routing", special=True).ids
    assert key.prompt_tokens == len(key.tokens)
    assert await tokens.count({"prompt": "routing"}) == len(key.tokens)
    assert calls == []
    declined = {"messages": [{"role": "user", "content": "q"}], "continue_final_message": True}
    assert (await tokens.key_with_tokens(declined, RoutingKey())).tokens == (7, 8)
    assert len(calls) == 1


def test_unreadable_files_stop_the_router_with_a_clear_message(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    bad_template = tmp_path / "bad-template"
    write_model_dir(bad_template, CORPUS, vocab_size=300)
    config = json.loads((bad_template / "tokenizer_config.json").read_text())
    (bad_template / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": "{% if %}"})
    )
    cases = [
        (tmp_path / "missing", "no tokenizer.json there"),
        (broken, "not a tokenizer.json"),
        (bad_template, "its chat template"),
    ]
    for path, message in cases:
        with pytest.raises(SystemExit) as exit_:
            parse_config(["--worker-urls", "http://127.0.0.1:9", "--kv-tokenizer-path", str(path)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--kv-tokenizer-path {path}" in err and message in err
    args = ["--worker-urls", "http://127.0.0.1:9", "--kv-tokenizer-path", str(model_dir)]
    assert parse_config(args).kv_events.tokenizer_path == str(model_dir)


async def test_named_templates_and_a_template_file_are_read(model_dir: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    chat = [{"role": "user", "content": "q1"}]
    expected = await LocalTokenizer.load(str(model_dir)).ids({"messages": chat})
    named = model_dir.parent / "named"
    write_model_dir(named, CORPUS, vocab_size=400)
    (named / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    listed = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": config["chat_template"]},
    ]
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": listed}))
    assert await LocalTokenizer.load(str(named)).ids({"messages": chat}) == expected
    filed = model_dir.parent / "filed"
    write_model_dir(filed, CORPUS, vocab_size=400)
    (filed / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    (filed / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (filed / "chat_template.jinja").write_text(config["chat_template"])
    assert await LocalTokenizer.load(str(filed)).ids({"messages": chat}) == expected


# Stitching: a shared start encoded once, the rest of each prompt from a word boundary.

_PIECES = st.sampled_from([*WORDS, " ", "  ", "\n", "\n\n", ", ", ". ", "42", "é", "\t"])


def _trained(
    directory: Path,
    pre: pre_tokenizers.PreTokenizer,
    *,
    normalizer: normalizers.Normalizer | None = None,
    template: str = "<s> $A",
) -> LocalTokenizer:
    """A small BPE tokenizer of the given make, loaded as the router loads one."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    corpus = [" ".join(random.Random(g).choices(WORDS, k=300)) for g in range(8)]
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template,
        pair="<s> $A $B",
        special_tokens=[
            ("<s>", tokenizer.token_to_id("<s>")),
            ("</s>", tokenizer.token_to_id("</s>")),
        ],
    )
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return LocalTokenizer.load(str(directory))


@pytest.fixture(scope="module")
def makes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalTokenizer]:
    """Tokenizers built the ways real ones are: byte-level (GPT-2, Llama 3, Qwen), with a
    prefix space added and an end token, SentencePiece-like (Metaspace), and one whose
    normalizer prepends a character (Llama 2's tokenizer.json)."""
    root = tmp_path_factory.mktemp("makes")
    return {
        "byte-level": _trained(root / "a", pre_tokenizers.ByteLevel(add_prefix_space=False)),
        "prefix space, end token": _trained(
            root / "b", pre_tokenizers.ByteLevel(add_prefix_space=True), template="<s> $A </s>"
        ),
        "metaspace": _trained(root / "c", pre_tokenizers.Metaspace()),
        "prepending normalizer": _trained(
            root / "d",
            pre_tokenizers.Metaspace(prepend_scheme="never", split=False),
            normalizer=normalizers.Sequence(
                [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            ),
        ),
    }


@given(st.lists(_PIECES, min_size=30, max_size=200), st.floats(0.2, 1.0))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_stitched_prompt_has_the_ids_of_the_whole(
    makes: dict[str, LocalTokenizer], pieces: list[str], where: float
) -> None:
    prompt = "".join(pieces)
    shared = prompt[: int(len(prompt) * where)]
    for make, local in makes.items():
        assert local.stitches, make
        start = trio.run(local.start, shared, CUT_MARGIN_TOKENS)
        stitched = trio.run(local.stitched, start, prompt)
        whole = trio.run(local.ids, {"prompt": prompt})
        assert stitched == whole, make


def test_a_start_is_cut_at_a_word_where_the_words_are_split_alike(
    makes: dict[str, LocalTokenizer],
) -> None:
    doc = "the prefix cache holds blocks of tokens, routing engines answer. " * 20
    for make, local in makes.items():
        start = trio.run(local.start, doc, CUT_MARGIN_TOKENS)
        if make == "prepending normalizer":  # one word, whatever the text: encoded whole
            assert start == local_tokenizer.WHOLE
            continue
        assert len(doc) - 60 < start.chars < len(doc), make
        assert doc[start.chars - 1] in " ," or doc[start.chars] == " ", make
        # One word: a longer prompt may merge its end differently, so no cut inside it.
        word = "routingengines" * 50
        assert trio.run(local.start, word, CUT_MARGIN_TOKENS) == local_tokenizer.WHOLE, make


async def test_prompts_sharing_a_start_are_stitched_with_every_id(model_dir: Path) -> None:
    calls: list[dict[str, object]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(orjson.loads(request.content))
        return httpx.Response(500)

    outcomes: list[str] = []
    doc = "A shared document about prefix caching and routing, with ümlauts. " * 12
    shared = {"chars": len(doc)}  # 792: cut at 768
    tokens = PromptTokens(
        LegClient(transport=httpx.MockTransport(handler)),
        lambda: ["http://e:1"],
        local=LocalTokenizer.load(str(model_dir)),
        seen=lambda text: shared["chars"] if text.startswith(doc) else 0,
        cut_chars=32,
        on_outcome=outcomes.append,
    )
    held = 0
    for i in range(4):
        prompt = doc + f"question {i}: q1 q2, and more words than the cut takes?"
        # The last prompts share more with the earlier ones (their cut is 800 or 832): the
        # start cut at 768 serves them too.
        shared["chars"] = len(doc) + (0, 0, 33, 50)[i]
        key = await tokens.key_with_tokens({"prompt": prompt}, RoutingKey(text=prompt))
        assert key.tokens == engine(model_dir).prompt(prompt, special=True).ids
        assert key.prompt_tokens == len(key.tokens) and not key.partial_tokens
        if i == 0:
            held = tokens.cached_tokens
    assert outcomes == ["stitched"] * 4 and calls == []
    # One start cached (its ids short of the cut), not the prompts.
    assert 0 < tokens.cached_tokens == held < len(engine(model_dir).prompt(doc, special=True).ids)


def test_starts_are_stitched_by_default_where_the_router_tokenizes(model_dir: Path) -> None:
    pd = ["--vllm-pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"]
    local = ["--kv-tokenizer-path", str(model_dir)]
    assert parse_config(pd).kv_events.cut_chars() == 0  # the engine's /tokenize: whole
    assert parse_config([*pd, *local]).kv_events.cut_chars() == 32
    given = [*local, "--kv-tokenize-cut-chars", "0"]
    assert parse_config([*pd, *given]).kv_events.cut_chars() == 0
