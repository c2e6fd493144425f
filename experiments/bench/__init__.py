"""Benchmark scripts, one per part of the stack; each prints JSON and runs as
``python -m experiments.bench.NAME`` or ``raggym bench NAME`` (docs/benchmarks.md).

- ``env``: environment steps and dialect parsing without retrieval or a model
- ``retrieval``: retrieval quality and speed (PPR, encoding, dense search, OpenIE)
- ``routerag_time``: RouteRAG's timed retrieval modes
- ``runtime``: rollout and Ray retrieval (HF, vLLM and AsyncLLM engines)
- ``learner``: learner steps, memory and weight sync
- ``serve``: the HTTP agent under load
- ``synthetic``: synthetic world generation
- ``gpu``: the GPU sections in one run, each in its own process
"""
