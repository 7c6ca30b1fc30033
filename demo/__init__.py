"""``make demo``: the router (:mod:`trio_pdrouter`) in front of simulated vLLM servers
(:mod:`trio_pdrouter_sim`), with a live view of load. Run it with ``python -m demo``; see
:mod:`demo.run`.

It lives outside both packages because it composes them: the router never imports the simulator.
It is a tool of the source tree, not part of the wheel: run it from a clone (``make demo``). An
installed wheel offers the two commands instead, ``trio-pdrouter`` and ``trio-pdrouter-sim``.
"""
