"""``python -m heron.cli``: the ``heron`` command (tests and ``heron up`` start children so)."""

import sys

from heron.cli.main import main

sys.exit(main())
