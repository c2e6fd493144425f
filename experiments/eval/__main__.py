"""``python -m experiments.eval``: the evaluation harness, as ``raggym eval``."""

import sys

from experiments.eval.harness import main

sys.exit(main(sys.argv[1:]))
