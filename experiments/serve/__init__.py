"""Serving a trained agent with Ray Serve (``raggym serve``, ``python -m experiments.serve``,
``serve run experiments.serve.app:app``)."""
