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

``run_retrieval`` sends the pending queries of many episodes in one ``retrieve`` call per
(retriever, mode, k) group (``retrieval_groups``); ``envs.batching.step_batch`` drives a whole
batch of episodes with it. It sends what it is given: identical requests are folded before, in one
place, ``envs.retrieval_memo.RetrievalMemo`` (the rollout loop's per-step batcher, or
``retrieve_distinct`` for a batch outside it).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import gymnasium as gym

from envs.questions import QuestionPicker, QuestionSource
from envs.rewards import exact_match_reward
from envs.spaces import UnicodeText
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


class RetrievalGroup(NamedTuple):
    """Requests that one ``retrieve`` call answers: the same retriever object, mode and ``k``."""

    retriever: Any
    mode: str
    k: int
    members: list[int]  # their indices in the batch, in order


def retrieval_groups(requests: Sequence[RetrievalRequest]) -> list[RetrievalGroup]:
    """The requests by (retriever, mode, k), groups and members in the order they first appear."""
    groups: dict[tuple[int, str, int], RetrievalGroup] = {}
    for i, req in enumerate(requests):
        key = (id(req.retriever), str(req.mode), int(req.k))
        if key not in groups:
            groups[key] = RetrievalGroup(req.retriever, key[1], key[2], [])
        groups[key].members.append(i)
    return list(groups.values())


def place_answers(groups: Sequence[RetrievalGroup], answered: Sequence[Sequence], size: int) -> list:
    """Per request of the batch (``size`` of them), its answer out of each group's answers in order."""
    results: list = [None] * size
    for group, answers in zip(groups, answered):
        if len(answers) != len(group.members):
            raise RuntimeError(f"{type(group.retriever).__name__}.retrieve returned {len(answers)} results for "
                               f"{len(group.members)} queries")
        for i, answer in zip(group.members, answers):
            results[i] = answer
    return results


def run_retrieval(requests: Sequence[RetrievalRequest]) -> list:
    """One ``QueryResult`` per request, calling each retriever once per (mode, k) group."""
    groups = retrieval_groups(requests)
    answered = [list(g.retriever.retrieve([requests[i].query for i in g.members], g.mode, g.k)) for g in groups]
    return place_answers(groups, answered, len(requests))


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
    ``_truncation_result``. ``step``, ``check_step_call`` and ``truncate`` come from here, and
    ``_init_shared_settings`` stores the constructor settings the environments have in common.
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

    def _init_shared_settings(
        self,
        *,
        questions: QuestionSource | None,
        question_order: str,
        top_k: int,
        reward_fn: Callable[[Any], float] | None,
        corpus: Any,
        max_segment_chars: int,
        max_observation_chars: int,
        observation_space_chars: int,
        render_mode: str | None,
    ) -> None:
        """Check and store the constructor settings ``RagSearchEnv`` and ``MultiKBRouteEnv`` share,
        and build the text spaces: observations of up to ``observation_space_chars`` characters
        (the longest text ``reset`` or ``step`` returns), actions of up to ``max_segment_chars``.

        A subclass calls it after its own checks (``top_k``'s among them: its limits and message
        differ per environment), so those errors come first; this one then checks
        ``render_mode`` and the question source.
        """
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"unsupported render_mode {render_mode!r}")
        self.questions = questions
        self._questions = QuestionPicker(questions, question_order)
        self.top_k = top_k
        self.reward_fn = reward_fn or exact_match_reward
        self.corpus = corpus
        self.max_segment_chars = max_segment_chars
        self.max_observation_chars = max_observation_chars
        self.render_mode = render_mode
        self.observation_space = UnicodeText(observation_space_chars)
        self.action_space = UnicodeText(max_segment_chars, allow_surrogates=True)

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
        """``reward_fn(record)``, stored in the record; called once, when the episode ends (and after
        ``record.close()``, which builds the outcome the default reward reads)."""
        self._record.close()
        reward = float(self.reward_fn(self._record))
        self._record.reward = reward
        return reward

    def _truncation_result(self, reward: float) -> StepResult:
        """The ``StepResult`` ``truncate`` returns once the record says truncated."""
        raise NotImplementedError


def episode_info(record, **between: Any) -> dict[str, Any]:
    """The episode-level keys of every step's ``info`` (``record`` is an
    ``envs.records.EpisodeRecordBase``), with ``between``, the keys an environment adds, before
    the truncation reason."""
    return {
        "answer": record.answer,
        "total_retrieval_seconds": record.retrieval_seconds,
        "total_retrieval_cost": record.retrieval_cost,
        "num_retrievals": record.num_retrievals,
        **between,
        "truncation_reason": record.truncation_reason,
        "question_id": record.question.id,
    }


def turn_retrieval_info(turn) -> dict[str, Any]:
    """The ``info`` keys of one turn's retrieval and format verdict (``turn`` is a ``TurnRecord``
    or a ``RouteStepRecord``)."""
    return {
        "retrieved_ids": turn.retrieved_ids,
        "retrieved_titles": turn.retrieved_titles,
        "retrieved_texts": turn.retrieved_texts,
        "retrieval_seconds": turn.seconds,
        "retrieval_cost": turn.cost,
        "format_valid": not turn.format_error,
        "format_error": turn.format_error,
    }

