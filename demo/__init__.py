"""``make demo``: the router (:mod:`trio_pdrouter`) in front of simulated vLLM servers
(:mod:`trio_pdrouter_sim`), with a live view of load. Run it with ``python -m demo``; see
:mod:`demo.run`.

It lives outside both packages because it composes them: the router never imports the simulator.
"""
