"""``python -m fabric.cli``: the ``meshnet`` command, for a checkout not installed."""
import sys

from . import main

sys.exit(main())
