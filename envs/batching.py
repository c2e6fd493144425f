"""``step_batch``: advance many episodes at once and batch their retrievals.

``step_batch`` runs the first half of the batched-step protocol (``envs.stepping``) for all
episodes, sends every pending query to its retriever in one ``retrieve`` call per (retriever,
mode, k) group, identical requests once (``envs.retrieval_memo.retrieve_distinct``), then runs the
second half. Rollout workers
use it so that graph retrieval (batched personalised PageRank) sees whole batches instead of
single queries. If a retriever raises, no environment has been changed by its pending request, so
the caller may retry the same ``step_batch``.

It lives apart from ``envs.stepping`` because it resolves wrapper chains with
``envs.wrappers.batched_step_env``, and the wrappers build on ``envs.stepping``.
"""

from __future__ import annotations

from typing import Any, Sequence

from envs.retrieval_memo import retrieve_distinct
from envs.stepping import RetrievalRequest, StepResult, run_retrieval
from envs.wrappers import batched_step_env


def step_batch(envs: Sequence[Any], actions: Sequence[str]) -> list[StepResult]:
    """``env.step(action)`` for every pair, with retrieval batched across the episodes.

    ``envs`` may be what ``gymnasium.make`` returned: each is resolved with
    ``envs.batched_step_env`` (so ``BatchedStepWrapper`` transforms apply and a wrapper whose
    ``step`` would be bypassed is refused). Returns one ``StepResult`` per environment, in order.
    API misuse (an episode already over, a non-string action, mismatched lengths) raises before
    any environment changes state.
    """
    if len(envs) != len(actions):
        raise ValueError(f"step_batch got {len(envs)} environments but {len(actions)} actions")
    stepping = [batched_step_env(env) for env in envs]
    if len({id(env.unwrapped) for env in stepping}) != len(stepping):
        raise ValueError("step_batch got the same environment twice")
    for env, action in zip(stepping, actions):
        env.check_step_call(action)
    results: list[StepResult | None] = [None] * len(stepping)
    pending: list[tuple[int, RetrievalRequest]] = []
    for i, (env, action) in enumerate(zip(stepping, actions)):
        outcome = env.begin_step(action)
        if isinstance(outcome, RetrievalRequest):
            pending.append((i, outcome))
        else:
            results[i] = outcome
    if pending:
        fetched = retrieve_distinct([req for _, req in pending], run_retrieval)
        for (i, req), query_result in zip(pending, fetched):
            # The object whose begin_step issued the request finishes it, so wrappers see it too.
            results[i] = stepping[i].finish_step(req, query_result)
    return results  # type: ignore[return-value]
