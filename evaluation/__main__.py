"""``python -m evaluation``: run a sweep, or ``plot``/``summarize`` its results (see ``--help``)."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
