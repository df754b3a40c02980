"""``python -m p2ptrain``: the same as the ``p2ptrain`` command."""

from __future__ import annotations

import sys

from p2ptrain.cli.main import main

sys.exit(main())
