"""Settings of one simulated vLLM server (:class:`SimConfig`).

Every field has a command-line flag of the same name (``max_num_seqs`` is ``--max-num-seqs``);
see ``python -m trio_pdrouter_sim --help``. The defaults make a 100-token stream last about
0.6 s on an idle engine, like a mid-sized model on one GPU; :meth:`SimConfig.fast` gives a
configuration with no modelled latency at all, for benchmarks of the router itself.
"""

from __future__ import annotations

from typing import Literal

import attrs

from .text_tokens import TextTokens, text_tokens

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")


def _non_negative(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


def _probability(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be within [0, 1], got {value!r}")


def _role(_inst: object, _attribute: attrs.Attribute[str], value: str) -> None:
    if value not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {value!r}")


@attrs.frozen
class SimConfig:
    """Everything one simulated server needs. Immutable; build a new one with ``attrs.evolve``.

    Timing model, per engine (one engine per data-parallel rank):

    * at most ``max_num_seqs`` requests run at once; the others wait in arrival order;
    * prefill lasts ``prefill_base_s + prefill_per_token_s * uncached_prompt_tokens``, where
      cached tokens come from the engine's prefix cache (``block_size``-token blocks, LRU,
      at most ``prefix_cache_blocks`` blocks);
    * every generated token takes ``itl_base_s + itl_per_running_s * running`` seconds, so a
      busy engine really is slower.

    Prompt length in tokens is approximated as ``ceil(characters / chars_per_token)``, or
    given by ``tokenizer`` (:mod:`.text_tokens`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    role: Role = attrs.field(default="both", validator=_role)
    dp_size: int = attrs.field(default=1, validator=_positive)
    model: str = "sim-model"
    #: LoRA adapters served from the start, as vLLM's ``--lora-modules name=path`` (a bare
    #: name: its path is the name); more are loaded at run time (``/v1/load_lora_adapter``).
    lora_modules: tuple[str, ...] = ()
    max_model_len: int = attrs.field(default=32768, validator=_positive)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    prefill_base_s: float = attrs.field(default=0.010, validator=_non_negative)
    prefill_per_token_s: float = attrs.field(default=0.00005, validator=_non_negative)
    itl_base_s: float = attrs.field(default=0.006, validator=_non_negative)
    itl_per_running_s: float = attrs.field(default=0.00002, validator=_non_negative)
    block_size: int = attrs.field(default=16, validator=_positive)
    prefix_cache_blocks: int = attrs.field(default=8192, validator=_positive)
    num_gpu_blocks: int = attrs.field(default=16384, validator=_positive)
    chars_per_token: int = attrs.field(default=4, validator=_positive)
    #: A Hugging Face tokenizer.json to encode prompts with (else chars_per_token pieces).
    tokenizer: str | None = None
    kv_timeout_s: float = attrs.field(default=30.0, validator=_non_negative)
    kv_pull_timeout_s: float = attrs.field(default=5.0, validator=_non_negative)
    #: Decode side: seconds a KV read takes once the request is scheduled (the NIXL transfer).
    kv_transfer_s: float = attrs.field(default=0.0, validator=_non_negative)
    stop_rate: float = attrs.field(default=0.0, validator=_probability)
    eos_rate: float = attrs.field(default=0.0, validator=_probability)
    seed: int | None = None
    faults: tuple[str, ...] = ()
    tp_size: int = attrs.field(default=1, validator=_positive)
    backlog: int = attrs.field(default=2048, validator=_positive)
    keep_alive_timeout_s: float = attrs.field(default=5.0, validator=_non_negative)
    series_window_s: float = attrs.field(default=600.0, validator=_non_negative)
    log_level: str = "warning"
    #: KV events (:mod:`.kv_events`): PUB port of rank 0 (rank r: +r; 0: any free port per
    #: rank; None: no events), replay ROUTER port likewise, payload layout, batches kept for
    #: replay, and seconds after start whose batches are not sent live (the slow joiner).
    kv_events_port: int | None = None
    #: Or connect each rank's PUB to this endpoint (rank r: port + r), as vLLM does for an
    #: endpoint without ``*``: the router binds it.
    kv_events_connect: str | None = None
    kv_replay_port: int | None = None
    kv_events_layout: str = attrs.field(
        default="map", validator=attrs.validators.in_(("map", "array"))
    )
    kv_events_buffer: int = attrs.field(default=10_000, validator=_positive)
    kv_events_join_delay_s: float = attrs.field(default=0.0, validator=_non_negative)

    @property
    def text_tokens(self) -> TextTokens:
        """How prompt text becomes tokens (the tokenizer file read once per process)."""
        return text_tokens(self.chars_per_token, self.tokenizer)

    @classmethod
    def fast(cls, **overrides: object) -> SimConfig:
        """A configuration with every modelled latency at zero (for benchmarks and tests)."""
        base: dict[str, object] = {
            "prefill_base_s": 0.0,
            "prefill_per_token_s": 0.0,
            "itl_base_s": 0.0,
            "itl_per_running_s": 0.0,
        }
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]
