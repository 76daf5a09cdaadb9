"""`python -m minilade`: the same command line as `python -m minilade.generate`."""

import sys

from .cli import main

sys.exit(main())
