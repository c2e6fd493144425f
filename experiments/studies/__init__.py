"""Research studies built on the recipe, each runnable as ``python -m experiments.studies.NAME``
(docs/results.md):

- ``routing``: the routing learning proof over seeds (SFT, RouteRAG GRPO stage 1 and 2, report);
  ``make demo`` runs one seed of it (``experiments.demo``)
- ``mode_gradients``: the mode-slot gradient diagnostic of a routing policy
"""
