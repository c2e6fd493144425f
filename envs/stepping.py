"""The batched-step protocol: advance many episodes at once and batch their retrievals.

Every environment the rollout loop drives splits ``step`` into two public halves, so that the loop
can gather the retrievals of a whole batch of episodes and send them together:

``begin_step(segment) -> StepResult | RetrievalRequest``
    Parse one model segment. Either finish the step at once (an answer, a format error, a
    truncation) and return its ``StepResult``, or return a ``RetrievalRequest`` **without
    changing any state**, so that a failed retrieval can be retried.
``finish_step(request, result) -> StepResult``
    Apply the retriever's ``QueryResult`` for a request that ``begin_step`` returned.
``truncate(reason) -> StepResult``
    End the episode now, from outside (the rollout loop calls it with ``"response_tokens"`` when
    its token budget runs out). Sets ``record.truncated`` and ``record.truncation_reason``,
    computes the terminal reward with ``reward_fn`` once and returns the final ``StepResult``
    (``truncated=True``, ``info["episode"]`` the record). ``RuntimeError`` if the episode is over.
``check_step_call(action)``
    Raise on API misuse (no ``reset`` yet, the episode is over, an action that is not a ``str``)
    without changing anything; ``step_batch`` checks every episode before it steps any.

and exposes ``stop_strings`` (where generation of a segment stops), ``record`` (the episode
record), ``dialect`` and ``context_mode``: ``"append"`` when each observation is appended to the
running transcript (``RagSearchEnv``) or ``"replace"`` when each observation is the complete next
prompt (``MultiKBRouteEnv``). ``step(action)`` is exactly ``check_step_call``, ``begin_step`` and,
for a request, ``finish_step`` with a single retrieval (``step_through``).

``BatchedStepEnv`` implements ``step``, ``check_step_call``, ``truncate`` and the properties on
top of two methods a subclass writes (``begin_step``/``finish_step``) plus
``_truncation_result``. Wrappers that change step results subclass ``envs.BatchedStepWrapper``.

``step_batch`` runs the first half for all episodes, sends every pending query to its retriever in
one ``retrieve`` call per (retriever, mode, k) group, with identical queries deduplicated, then
runs the second half. Rollout workers use it so that graph retrieval (batched personalised
PageRank) sees whole batches instead of single queries. If a retriever raises, no environment has
been changed by its pending request, so the caller may retry the same ``step_batch``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import gymnasium as gym

from raggym.protocol import Action

APPEND_CONTEXT = "append"
REPLACE_CONTEXT = "replace"
CONTEXT_MODES = (APPEND_CONTEXT, REPLACE_CONTEXT)


class StepResult(NamedTuple):
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class RetrievalRequest(NamedTuple):
    """A retrieval ``begin_step`` asks for; ``env`` is the environment that issued it."""

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


def retrieve_single(retriever, query: str, mode: str, k: int):
    """The ``QueryResult`` of one query, checking that the retriever returned exactly one."""
    results = retriever.retrieve([query], mode, k)
    if len(results) != 1:
        raise RuntimeError(f"{type(retriever).__name__}.retrieve returned {len(results)} results for 1 query")
    return results[0]


def retrieve_one(request: RetrievalRequest):
    """The single-episode path of ``run_retrieval``, without the grouping bookkeeping."""
    return retrieve_single(request.retriever, request.query, request.mode, request.k)


def step_through(env, action: str) -> StepResult:
    """One ``step`` through the batched protocol of ``env``, retrieving for this episode alone."""
    env.check_step_call(action)
    outcome = env.begin_step(action)
    if isinstance(outcome, RetrievalRequest):
        outcome = env.finish_step(outcome, retrieve_one(outcome))
    return outcome


class BatchedStepEnv(gym.Env):
    """Base of the environments that implement the batched-step protocol.

    A subclass sets ``dialect``, ``reward_fn`` and ``_record`` (``None`` until ``reset``; a record
    with ``terminated``, ``truncated``, ``truncation_reason`` and ``reward``), sets
    ``context_mode``, and implements ``reset``, ``begin_step``, ``finish_step`` and
    ``_truncation_result``. ``step``, ``check_step_call`` and ``truncate`` come from here.
    """

    context_mode: str = APPEND_CONTEXT
    dialect: Any
    reward_fn: Callable[[Any], float]
    _record: Any = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings at which the rollout engine must stop generating a segment (kept in it)."""
        return self.dialect.stop_strings

    @property
    def record(self):
        """The current (or just finished) episode's record; ``None`` before the first ``reset``."""
        return self._record

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return tuple(step_through(self, action))  # type: ignore[return-value]

    def check_step_call(self, action: Any) -> None:
        if self._record is None:
            raise RuntimeError("call reset() before step()")
        if self._record.terminated or self._record.truncated:
            raise RuntimeError("the episode is over (terminated or truncated); call reset() first")
        if not isinstance(action, str):
            raise TypeError(f"step() expects the assistant segment as str, got {type(action).__name__}")

    def begin_step(self, segment: str) -> StepResult | RetrievalRequest:
        raise NotImplementedError

    def finish_step(self, request: RetrievalRequest, result) -> StepResult:
        raise NotImplementedError

    def truncate(self, reason: str) -> StepResult:
        record = self._record
        if record is None:
            raise RuntimeError("call reset() before truncate()")
        if record.terminated or record.truncated:
            raise RuntimeError("the episode is over (terminated or truncated); there is nothing to truncate")
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"truncate() needs a non-empty reason string, got {reason!r}")
        record.truncated = True
        record.truncation_reason = reason
        reward = self._terminal_reward() if record.reward is None else record.reward
        return self._truncation_result(reward)

    def _terminal_reward(self) -> float:
        """``reward_fn(record)``, stored in the record; called once, when the episode ends."""
        reward = float(self.reward_fn(self._record))
        self._record.reward = reward
        return reward

    def _truncation_result(self, reward: float) -> StepResult:
        """The ``StepResult`` ``truncate`` returns once the record says truncated."""
        raise NotImplementedError


def step_batch(envs: Sequence[Any], actions: Sequence[str]) -> list[StepResult]:
    """``env.step(action)`` for every pair, with retrieval batched across the episodes.

    ``envs`` may be what ``gymnasium.make`` returned: each is resolved with
    ``envs.batched_step_env`` (so ``BatchedStepWrapper`` transforms apply and a wrapper whose
    ``step`` would be bypassed is refused). Returns one ``StepResult`` per environment, in order.
    API misuse (an episode already over, a non-string action, mismatched lengths) raises before
    any environment changes state.
    """
    # Imported here: envs.wrappers builds on this module.
    from envs.wrappers import batched_step_env

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
        fetched = run_retrieval([req for _, req in pending])
        for (i, req), query_result in zip(pending, fetched):
            # The object whose begin_step issued the request finishes it, so wrappers see it too.
            results[i] = stepping[i].finish_step(req, query_result)
    return results  # type: ignore[return-value]
