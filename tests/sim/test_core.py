"""Pure parts of the simulator: fault specs, shapes, request validation, the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing
from tokenizers import Tokenizer

from trio_pdrouter_sim import shapes
from trio_pdrouter_sim.cli import build_parser, config_from_args
from trio_pdrouter_sim.config import SimConfig
from trio_pdrouter_sim.engine import Engine, PrefixCache, block_hashes
from trio_pdrouter_sim.faults import Fault, FaultBook, parse_faults, plan_for
from trio_pdrouter_sim.requests import BadRequest, parse_request
from trio_pdrouter_sim.text_tokens import TextTokens
from trio_pdrouter_sim.tokenizer_files import write_model_dir


def test_parse_faults_all_kinds() -> None:
    faults = parse_faults("error:503@prefill, reset:3, stall, stall:2:1.5~0.5, slow-prefill:0.2")
    assert faults == (
        Fault("error", status=503, role="prefill"),
        Fault("reset", after_tokens=3),
        Fault("stall", after_tokens=0, seconds=None),
        Fault("stall", after_tokens=2, seconds=1.5, probability=0.5),
        Fault("slow-prefill", seconds=0.2),
    )
    assert parse_faults("reset") == (Fault("reset", after_tokens=0),)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "boom",
        "error",
        "error:200",
        "error:abc",
        "reset:-1",
        "stall:1:2:3",
        "reset@x",
        "slow-prefill",
        "error:503~2",
    ],
)
def test_parse_faults_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_faults(spec)


def test_fault_book_roles_and_counts() -> None:
    book = FaultBook(["slow-prefill:1@decode"])
    assert book.faults_for("prefill", None) == []
    assert [f.kind for f in book.faults_for("decode", "error:500")] == ["slow-prefill", "error"]
    book.arm("error:429@prefill", 2)
    assert book.faults_for("decode", None)[-1].kind == "slow-prefill"  # not consumed
    assert book.faults_for("prefill", None)[0].status == 429
    assert book.faults_for("prefill", None)[0].status == 429
    assert book.faults_for("prefill", None) == []
    book.arm("reset", None)
    for _ in range(5):
        assert book.faults_for("prefill", None)[0].kind == "reset"
    book.disarm()
    assert book.faults_for("prefill", None) == []


def test_plan_merges() -> None:
    rng = random.Random(0)
    plan = plan_for(parse_faults("slow-prefill:1,slow-prefill:2,stall:3,reset:4"), rng)
    assert plan.extra_prefill_s == 3 and plan.stall_after == 3 and plan.reset_after == 4
    assert plan_for(parse_faults("error:503~0"), rng).empty


def test_prefix_cache_lru() -> None:
    cache = PrefixCache(capacity_blocks=3)
    cache.insert([1, 2, 3])
    assert cache.match([1, 2, 9]) == 2
    cache.insert([4])  # evicts 3, the least recently used
    assert cache.match([1, 2, 3]) == 2
    assert len(cache) == 3


def test_prefix_cache_evicts_a_prompts_tail_before_its_start() -> None:
    cache = PrefixCache(capacity_blocks=4)
    cache.insert([1, 2, 3])
    cache.insert([7, 8])  # one block must go: the first prompt's last, as vLLM frees it first
    assert cache.match([1, 2, 3]) == 2
    assert cache.match([7, 8]) == 2


def test_block_hashes_chain() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    c = block_hashes([7, *range(1, 40)], 16)
    assert len(a) == 2 and a == b[:2]
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every hash


async def test_engine_fifo_and_limit() -> None:
    engine = Engine(0, SimConfig.fast(max_num_seqs=2))
    order: list[int] = []

    async def one(i: int, release: trio.Event) -> None:
        await engine.acquire()
        order.append(i)
        await release.wait()
        engine.release(completed=True, blocks=0)

    releases = [trio.Event() for _ in range(4)]
    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i, releases[i])
            await trio.testing.wait_all_tasks_blocked()
        assert (engine.running, engine.waiting, order) == (2, 2, [0, 1])
        releases[1].set()
        await trio.testing.wait_all_tasks_blocked()
        assert order == [0, 1, 2] and engine.running == 2
        for r in releases:
            r.set()
    assert engine.running == 0 and engine.counters.completed == 4
    assert engine.counters.peak_running == 2


async def test_engine_cancelled_waiter_leaves_queue() -> None:
    engine = Engine(0, SimConfig.fast(max_num_seqs=1))
    await engine.acquire()
    with trio.move_on_after(0.01):
        await engine.acquire()
    assert engine.waiting == 0 and engine.running == 1
    engine.release(completed=False, blocks=0)
    assert engine.running == 0 and engine.counters.aborted == 1


def _parse(kind: str, body: object) -> object:
    return parse_request(
        kind,  # type: ignore[arg-type]
        body,
        served_model="m",
        text=TextTokens(4),
        max_model_len=1000,
    )


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completions", {}, "prompt"),
        ("completions", [], None),
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": 2000}, "max_tokens"),
        (
            "completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
        ("completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ("completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "n": 2}, "n"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {}, "messages"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
    ],
)
def test_bad_requests(kind: str, body: object, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        _parse(kind, body)
    assert info.value.status == 400 and info.value.param == param


def test_wrong_model_is_404() -> None:
    with pytest.raises(BadRequest) as info:
        _parse("completions", {"prompt": "x", "model": "other"})
    assert info.value.status == 404


def test_prompt_forms() -> None:
    req = _parse("completions", {"prompt": [[5, 6, 7]], "max_completion_tokens": 9})
    assert req.prompt.ids == (5, 6, 7)  # type: ignore[attr-defined]
    assert req.max_tokens == 16  # type: ignore[attr-defined]  # completions ignore it
    chat = _parse(
        "chat",
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert chat.max_tokens == 9 and chat.logprobs == 3  # type: ignore[attr-defined]


def test_kv_params_parsing() -> None:
    good = {
        "do_remote_prefill": True,
        "remote_host": "h",
        "remote_port": 1,
        "remote_engine_id": "e",
        "remote_block_ids": [1],
        "remote_request_id": "r",
    }
    req = _parse("completions", {"prompt": "x", "kv_transfer_params": good})
    assert req.remote_prefill is not None  # type: ignore[attr-defined]
    bad = {**good, "remote_port": None}
    req = _parse("completions", {"prompt": "x", "kv_transfer_params": bad})
    assert req.remote_prefill is None and req.remote_prefill_invalid  # type: ignore[attr-defined]


def test_shapes_logprobs() -> None:
    lp = shapes.completion_logprobs(
        [" a", " bc"], start_position=0, start_offset=5, k=2, first_null=True
    )
    assert lp["text_offset"] == [5, 7] and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2
    prompt = shapes.prompt_from_text("abcdefgh", 4)
    plp = shapes.prompt_logprobs(prompt, 1)
    assert plp[0] is None and len(plp) == 2
    entry = next(iter(plp[1].values()))  # type: ignore[union-attr]
    assert set(entry) == {"logprob", "rank", "decoded_token"}
    err = shapes.error_body(400, "bad")
    assert err == {
        "error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}
    }


def test_cli_flags_map_to_config() -> None:
    cfg = config_from_args(
        [
            "--port",
            "0",
            "--role",
            "decode",
            "--dp-size",
            "4",
            "--model",
            "x",
            "--fast",
            "--itl-base-s",
            "0.5",
            "--kv-timeout",
            "3",
            "--stop-rate",
            "0.5",
            "--fault",
            "error:503@prefill",
            "--max-num-seqs",
            "7",
        ]
    )
    assert (cfg.port, cfg.role, cfg.dp_size, cfg.model) == (0, "decode", 4, "x")
    assert cfg.itl_base_s == 0.5 and cfg.prefill_base_s == 0.0
    assert cfg.kv_timeout_s == 3 and cfg.stop_rate == 0.5 and cfg.max_num_seqs == 7
    assert cfg.faults == ("error:503@prefill",)
    help_text = build_parser().format_help()
    for flag in (
        "--port",
        "--role",
        "--dp-size",
        "--model",
        "--host",
        "--kv-timeout",
        "--stop-rate",
        "--fault",
        "--max-num-seqs",
        "slow-prefill",
    ):
        assert flag in help_text
    with pytest.raises(SystemExit):
        config_from_args(["--fault", "nope"])
    with pytest.raises(SystemExit):
        config_from_args(["--dp-size", "0"])


async def test_timing_model_slows_busy_engines() -> None:
    engine = Engine(0, SimConfig())
    idle = engine.token_seconds()
    for _ in range(100):
        await engine.acquire()
    assert engine.token_seconds() > idle
    assert engine.prefill_seconds(1000) > engine.prefill_seconds(10)
    # A 100-token stream on an idle engine with default settings: about 0.5-1 s.
    assert 0.5 <= engine.prefill_seconds(100) + 100 * idle <= 1.0


def test_a_tokenizer_file_gives_prompts_its_tokens(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "m", ["routing and caching " * 8], vocab_size=300)
    cfg = config_from_args(["--tokenizer", str(model / "tokenizer.json")])
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = "routing and caching"
    req = parse_request(
        "completions",
        {"prompt": text},
        served_model=cfg.model,
        text=cfg.text_tokens,
        max_model_len=99,
    )
    assert req.prompt.ids == tuple(tokenizer.encode(text).ids)  # with its BOS
    assert "".join(req.prompt.tokens) == text  # echo gives the text back
    chat = parse_request(
        "chat",
        {"messages": [{"role": "user", "content": text}]},
        served_model=cfg.model,
        text=cfg.text_tokens,
        max_model_len=99,
    )
    rendered = f"<|user|>\n{text}\n<|assistant|>\n"
    assert chat.prompt.ids == tuple(tokenizer.encode(rendered, add_special_tokens=False).ids)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit):
        config_from_args(["--tokenizer", str(tmp_path / "bad.json")])
