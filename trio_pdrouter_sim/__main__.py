"""``python -m trio_pdrouter_sim``: see :mod:`trio_pdrouter_sim.cli`."""

from .cli import main

if __name__ == "__main__":
    main()
