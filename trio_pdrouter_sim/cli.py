"""Command line of the simulator: ``trio-pdrouter-sim`` / ``python -m trio_pdrouter_sim``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from functools import partial

import trio

from .config import ROLES, SimConfig
from .faults import parse_faults
from .server import serve_sim

_DEFAULTS = SimConfig()

_EPILOG = """\
fault specs (--fault, header x-sim-fault, POST /sim/faults {"spec": SPEC, "count": N}):
  SPEC := FAULT[,FAULT...]   FAULT := KIND[:ARG[:ARG]][@prefill|@decode][~PROBABILITY]
  error:STATUS            answer STATUS (e.g. 503, 429) with a vLLM JSON error
  reset[:K]               abort the connection (RST) after K tokens; K=0 (default): on arrival
  stall[:K[:SECONDS]]     stop after K tokens (default 0) for SECONDS, or until disconnect
  slow-prefill:SECONDS    add SECONDS to the prefill time
  @prefill targets requests with kv_transfer_params.do_remote_decode=true, @decode the others.
  Examples: --fault 'error:503@prefill~0.1'  --fault 'reset:5@decode'  -H 'x-sim-fault: stall'

control and ground truth:
  GET /sim/stats, POST /sim/reset, GET|POST|DELETE /sim/faults,
  POST /sim/down {"seconds": S} (refuse connections for S seconds), POST /sim/kv/pull (NIXL).
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (every flag maps to the :class:`SimConfig` field of the same name)."""
    p = argparse.ArgumentParser(
        prog="trio-pdrouter-sim",
        description="A vLLM server simulator: OpenAI HTTP, DP engines, NIXL prefill/decode, "
        "a timing model, fault injection and ground-truth stats at /sim/stats.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = _DEFAULTS
    p.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    p.add_argument(
        "--port",
        type=int,
        default=d.port,
        help=f"port to listen on, 0 for any free port (default {d.port})",
    )
    p.add_argument(
        "--role",
        choices=ROLES,
        default=d.role,
        help="prefill, decode or both; a decode server counts requests without KV "
        "params as pd_missing (default both)",
    )
    p.add_argument(
        "--dp-size",
        type=int,
        default=d.dp_size,
        help="data-parallel engines in this server, chosen by the "
        f"X-data-parallel-rank header or least load (default {d.dp_size})",
    )
    p.add_argument("--model", default=d.model, help=f"served model name (default {d.model})")
    p.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served from the start (vLLM's spelling); more can be loaded at run"
        " time with POST /v1/load_lora_adapter",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help=f"prompt + max_tokens limit in tokens (default {d.max_model_len})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="requests running at once per engine; the rest wait in arrival order "
        f"(default {d.max_num_seqs})",
    )
    p.add_argument(
        "--prefill-base-s",
        type=float,
        default=d.prefill_base_s,
        help=f"fixed prefill time in seconds (default {d.prefill_base_s})",
    )
    p.add_argument(
        "--prefill-per-token-s",
        type=float,
        default=d.prefill_per_token_s,
        help=f"prefill seconds per uncached prompt token (default {d.prefill_per_token_s})",
    )
    p.add_argument(
        "--itl-base-s",
        type=float,
        default=d.itl_base_s,
        help=f"seconds per generated token on an idle engine (default {d.itl_base_s})",
    )
    p.add_argument(
        "--itl-per-running-s",
        type=float,
        default=d.itl_per_running_s,
        help="extra seconds per generated token for each running request "
        f"(default {d.itl_per_running_s})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help=f"tokens per KV block (default {d.block_size})",
    )
    p.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=d.prefix_cache_blocks,
        help=f"blocks the per-engine LRU prefix cache keeps (default {d.prefix_cache_blocks})",
    )
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=d.num_gpu_blocks,
        help="KV blocks per engine, the denominator of vllm:kv_cache_usage_perc "
        f"(default {d.num_gpu_blocks})",
    )
    p.add_argument(
        "--chars-per-token",
        type=int,
        default=d.chars_per_token,
        help=f"characters per prompt token (default {d.chars_per_token})",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a Hugging Face tokenizer.json to encode prompts with, as an engine does (default:"
        " --chars-per-token pieces)",
    )
    p.add_argument(
        "--kv-timeout",
        dest="kv_timeout_s",
        type=float,
        default=d.kv_timeout_s,
        help="seconds a prefill engine holds blocks for a decode pull before "
        f"freeing them as leaked; 0 holds forever (default {d.kv_timeout_s})",
    )
    p.add_argument(
        "--kv-pull-timeout",
        dest="kv_pull_timeout_s",
        type=float,
        default=d.kv_pull_timeout_s,
        help="seconds a decode server waits for a KV pull before prefilling "
        f"itself (default {d.kv_pull_timeout_s})",
    )
    p.add_argument(
        "--kv-transfer",
        dest="kv_transfer_s",
        type=float,
        default=d.kv_transfer_s,
        help="seconds a decode engine's KV read takes once the request is scheduled; the first"
        f" output comes after it (default {d.kv_transfer_s})",
    )
    p.add_argument(
        "--stop-rate",
        type=float,
        default=d.stop_rate,
        help="probability that a prefill request's one token is a stop: answer "
        f"finish_reason=stop and kv_transfer_params=null (default {d.stop_rate})",
    )
    p.add_argument(
        "--eos-rate",
        type=float,
        default=d.eos_rate,
        help="probability per generated token of an early EOS, after min_tokens "
        f"and unless ignore_eos (default {d.eos_rate})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the random choices (stop, eos, fault probabilities)",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault applied to every request (repeatable; syntax below)",
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=d.tp_size,
        help=f"tp_size reported in kv_transfer_params (default {d.tp_size})",
    )
    p.add_argument(
        "--backlog", type=int, default=d.backlog, help=f"listen backlog (default {d.backlog})"
    )
    p.add_argument(
        "--keep-alive-timeout",
        dest="keep_alive_timeout_s",
        type=float,
        default=d.keep_alive_timeout_s,
        help=f"idle keep-alive seconds (default {d.keep_alive_timeout_s})",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="zero every modelled latency (flags given explicitly still win)",
    )
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=["debug", "info", "warning", "error"],
        help=f"log level (default {d.log_level}); info also shows hypercorn's own log",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="publish vLLM's KV events: PUB port of DP rank 0, rank r on port+r, bound on"
        " --host (0: any free port per rank; default: off)",
    )
    p.add_argument(
        "--kv-events-connect",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish vLLM's KV events by connecting each rank's PUB to this endpoint, rank r"
        " on port+r (vLLM's way for an endpoint without '*': the router binds it)",
    )
    p.add_argument(
        "--kv-replay-port",
        type=int,
        default=None,
        help="replay ROUTER port of DP rank 0, rank r on port+r (default: no replay)",
    )
    p.add_argument(
        "--kv-events-layout",
        choices=("map", "array"),
        default=d.kv_events_layout,
        help="events as tagged maps (current vLLM) or positional arrays (vLLM <= 0.23)",
    )
    p.add_argument(
        "--kv-events-buffer",
        type=int,
        default=d.kv_events_buffer,
        help=f"batches kept for replay (vLLM's buffer_steps; default {d.kv_events_buffer})",
    )
    p.add_argument(
        "--kv-events-join-delay-s",
        type=float,
        default=d.kv_events_join_delay_s,
        help="seconds after start whose batches are not sent live (a slow joiner; default 0)",
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> SimConfig:
    """Parse ``argv`` into a :class:`SimConfig` (exits with a message on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = vars(args).copy()
    fast = values.pop("fast")
    values["faults"] = tuple(values.pop("fault"))
    values["lora_modules"] = tuple(values["lora_modules"])
    for spec in values["faults"]:
        try:
            parse_faults(spec)
        except ValueError as exc:
            parser.error(f"--fault {spec!r}: {exc}")
    if fast:
        given = list(argv if argv is not None else sys.argv[1:])
        for field in ("prefill_base_s", "prefill_per_token_s", "itl_base_s", "itl_per_running_s"):
            flag = "--" + field.replace("_", "-")
            if not any(arg == flag or arg.startswith(flag + "=") for arg in given):
                values[field] = 0.0
    try:
        config = SimConfig(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    try:
        config.text_tokens  # noqa: B018 - read the tokenizer file now, not at the first request
    except Exception as exc:  # tokenizers raises plain Exceptions for a bad file
        parser.error(f"--tokenizer {config.tokenizer}: {exc}")
    return config


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``trio-pdrouter-sim``."""
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_sim, config))
            print(
                f"trio-pdrouter-sim listening on {url} role={config.role} "
                f"dp_size={config.dp_size} model={config.model}",
                flush=True,
            )

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run)


__all__ = ["build_parser", "config_from_args", "main"]
