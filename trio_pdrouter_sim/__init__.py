"""A vLLM simulator for tests, demos and benchmarks of the router (no GPU needed).

It speaks vLLM's OpenAI-compatible HTTP (completions, chat, streaming, logprobs, metrics),
models an engine's scheduler and timing per data-parallel rank, implements the NIXL
prefill/decode handshake between simulators, injects faults on demand, and reports the
ground truth at ``GET /sim/stats``. It never imports the router.

Start one from the command line (``python -m trio_pdrouter_sim --help``) or in a trio
program::

    url = await nursery.start(serve_sim, SimConfig.fast(port=0, role="decode", dp_size=2))
"""

from .app import SimApp, SimState
from .config import SimConfig
from .faults import Fault, parse_faults
from .server import SimServer, serve_sim

__all__ = ["Fault", "SimApp", "SimConfig", "SimServer", "SimState", "parse_faults", "serve_sim"]
