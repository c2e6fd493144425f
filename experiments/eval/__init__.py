"""Evaluation: the harness (``raggym eval``, ``python -m experiments.eval``) and the demo's report."""
