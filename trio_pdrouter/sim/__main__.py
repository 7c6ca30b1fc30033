"""``python -m trio_pdrouter.sim``: see :mod:`trio_pdrouter.sim.cli`."""

from .cli import main

if __name__ == "__main__":
    main()
