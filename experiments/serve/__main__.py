"""``python -m experiments.serve``: serve a trained agent, as ``raggym serve``."""

import sys

from experiments.serve.app import main

sys.exit(main())
