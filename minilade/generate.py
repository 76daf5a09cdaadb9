"""`python -m minilade.generate`: the documented entry point of the command line (see cli.py)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
