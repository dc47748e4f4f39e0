"""``python -m kvzap.harness ...`` (what ``accelerate launch -m kvzap.harness ...`` runs): ``kvzap harness``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
