"""vllm-router features trio-pdrouter does not implement (yet), declared so that their flags parse.

A vllm-router launch command carrying one of these flags must not die in argparse with
"unrecognized arguments": each flag is declared here, with vllm-router 0.1.17's spelling and
default, on the field it will set once the feature exists, and ``refused=`` saying why it is
refused and what to use instead (see :mod:`trio_pdrouter.config.flags`). Given with a value other
than its default, the router exits 2 with one message naming every such flag.

Kubernetes discovery, KV events and the ``sticky_least_loaded`` policy were refused here until
implemented; they live in :mod:`trio_pdrouter.config.discovery`, :mod:`trio_pdrouter.kv.sources`
and :mod:`trio_pdrouter.routing.policies.sticky_least_loaded`.
"""

from __future__ import annotations

import attrs

from .flags import Flag, Group, as_tuple, setting

ZMQ_DISCOVERY = (
    "vLLM's ZMQ service discovery is not implemented; list the servers with --prefill/--decode,"
    " or add them at run time with POST /workers"
)
OTHER_CONNECTORS = (
    "only the nixl and p2p_nccl KV connectors are implemented; use --kv-connector nixl"
)
PROGRAM_SCHEDULING = (
    "program-level scheduling is not implemented; requests are scheduled one by one"
)
IGW = (
    "vllm-router's IGW router manager (regular and PD routers side by side over one worker"
    " registry, workers registered with a model_id, type, priority, cost and policy) is not"
    " implemented; several models and LoRA adapters behind one router need no flag here (each"
    " server's models are learnt from its GET /v1/models and requests routed by model:"
    " docs/models.md): leave --enable-igw out"
)
MINI_LB = "MiniLB is not implemented; leave --mini-lb out: the PD router does its job"
WASM = (
    "WASM middleware is not implemented; put request middleware in a proxy in front of the router"
)


@attrs.frozen
class ZmqDiscoverySettings:
    """vLLM's ZMQ registration of PD workers (refused; Kubernetes discovery is
    :mod:`trio_pdrouter.config.discovery`)."""

    vllm_discovery_address: str | None = setting(
        None,
        Flag(
            "--vllm-discovery-address",
            Group.REFUSED,
            "ZMQ address where vLLM workers register (PD mode)",
            refused=ZMQ_DISCOVERY,
        ),
    )


@attrs.frozen
class ExtensionSettings:
    """vllm-router's program scheduling, IGW mode, MiniLB and WASM middleware (refused)."""

    program_scheduling: bool = setting(
        False,
        Flag(
            "--enable-program-scheduling",
            Group.REFUSED,
            "program-level scheduling",
            action="store_true",
            refused=PROGRAM_SCHEDULING,
        ),
    )
    program_scheduling_config_json: str | None = setting(
        None,
        Flag(
            "--program-scheduling-config-json",
            Group.REFUSED,
            "overrides of program-level scheduling",
            refused=PROGRAM_SCHEDULING,
        ),
    )
    igw: bool = setting(
        False,
        Flag(
            "--enable-igw",
            Group.REFUSED,
            "inference-gateway mode (several models)",
            action="store_true",
            refused=IGW,
        ),
    )
    mini_lb: bool = setting(
        False,
        Flag("--mini-lb", Group.REFUSED, "MiniLB", action="store_true", refused=MINI_LB),
    )
    wasm_middleware: str | None = setting(
        None,
        Flag("--wasm-middleware", Group.REFUSED, "WASM middleware artifact", refused=WASM),
    )
    wasm_middleware_sha256: str | None = setting(
        None,
        Flag(
            "--wasm-middleware-sha256",
            Group.REFUSED,
            "SHA-256 the artifact must match",
            refused=WASM,
        ),
    )
    wasm_middleware_routes: tuple[str, ...] = setting(
        (),
        Flag(
            "--wasm-middleware-route",
            Group.REFUSED,
            "path that runs the middleware; repeatable",
            action="append",
            metavar="PATH",
            parse=as_tuple,
            refused=WASM,
        ),
    )
