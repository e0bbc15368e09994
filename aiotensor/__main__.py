"""``python -m aiotensor``: the command line (see :mod:`aiotensor.cli`)."""

import sys

from .cli import main

sys.exit(main())
