"""Batched stepping: advance many episodes at once and batch their retrievals.

Every environment here splits ``step`` into two halves. ``_begin_step(action)`` parses the
segment and either finishes the step at once (answer, format error, truncation) or returns a
``RetrievalRequest`` without changing any state. ``_finish_step(request, result)`` applies the
retrieval result. ``step_batch`` runs the first half for all episodes, sends every pending query
to its retriever in one ``retrieve`` call per (retriever, mode, k) group, with identical queries
deduplicated, then runs the second half. Rollout workers use it so that graph retrieval (batched
personalised PageRank) sees whole batches instead of single queries.

If a retriever raises, no environment has been changed by its pending request, so the caller may
retry the same ``step_batch``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from raggym.protocol import Action


class StepResult(NamedTuple):
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class RetrievalRequest(NamedTuple):
    env: Any
    retriever: Any
    mode: str
    k: int
    query: str
    segment: str
    action: Action


def run_retrieval(requests: Sequence[RetrievalRequest]) -> list:
    """One ``QueryResult`` per request, calling each retriever once per (mode, k) group."""
    groups: dict[tuple[int, str, int], list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault((id(req.retriever), req.mode, req.k), []).append(i)
    results: list = [None] * len(requests)
    for (_, mode, k), members in groups.items():
        retriever = requests[members[0]].retriever
        # Episodes of one GRPO group often issue the same query; retrieve it once.
        unique: dict[str, int] = {}
        for i in members:
            unique.setdefault(requests[i].query, len(unique))
        queries = list(unique)
        answers = list(retriever.retrieve(queries, mode, k))
        if len(answers) != len(queries):
            raise RuntimeError(
                f"{type(retriever).__name__}.retrieve returned {len(answers)} results for "
                f"{len(queries)} queries"
            )
        for i in members:
            results[i] = answers[unique[requests[i].query]]
    return results


def retrieve_one(request: RetrievalRequest):
    """The single-episode path of ``run_retrieval``, without the grouping bookkeeping."""
    results = request.retriever.retrieve([request.query], request.mode, request.k)
    if len(results) != 1:
        raise RuntimeError(
            f"{type(request.retriever).__name__}.retrieve returned {len(results)} results for 1 query"
        )
    return results[0]


def step_batch(envs: Sequence[Any], actions: Sequence[str]) -> list[StepResult]:
    """``env.step(action)`` for every pair, with retrieval batched across the episodes.

    Returns one ``StepResult`` per environment, in order. API misuse (an episode already over, a
    non-string action, mismatched lengths) raises before any environment changes state.
    """
    if len(envs) != len(actions):
        raise ValueError(f"step_batch got {len(envs)} environments but {len(actions)} actions")
    if len({id(e) for e in envs}) != len(envs):
        raise ValueError("step_batch got the same environment twice")
    for env, action in zip(envs, actions):
        env._check_step_call(action)
    results: list[StepResult | None] = [None] * len(envs)
    pending: list[tuple[int, RetrievalRequest]] = []
    for i, (env, action) in enumerate(zip(envs, actions)):
        outcome = env._begin_step(action)
        if isinstance(outcome, RetrievalRequest):
            pending.append((i, outcome))
        else:
            results[i] = outcome
    if pending:
        fetched = run_retrieval([req for _, req in pending])
        for (i, req), query_result in zip(pending, fetched):
            results[i] = req.env._finish_step(req, query_result)
    return results  # type: ignore[return-value]
