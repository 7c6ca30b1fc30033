"""trio-pdrouter: a vLLM prefill/decode disaggregation router built on trio.

The load of every endpoint is held by a lease (:mod:`trio_pdrouter.ledger.load`) that is released
exactly once on every path, so the routing policies always read the truth.
"""

__version__ = "0.1.0"
