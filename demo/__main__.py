"""``python -m demo``: see :mod:`demo.run`."""

from .run import main

if __name__ == "__main__":
    main()
