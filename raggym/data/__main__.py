"""``python -m raggym.data inspect FILE``: see ``raggym.data.cli``."""

import sys

from .cli import main

sys.exit(main())
