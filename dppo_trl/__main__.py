"""``python -m dppo_trl``: the ``dppo-trl`` command line."""

import sys

from .cli import main

sys.exit(main())
