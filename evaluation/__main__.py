"""``python -m evaluation``: run a sweep, or ``plot``/``summarize``/``compare``/``errors`` its results (see
``--help`` and :mod:`evaluation.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
