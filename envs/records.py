"""Episode records: everything an algorithm needs after an episode, in one place.

Environments append to these while stepping; rewards and advantage estimators read them later.
Batch-level quantities (RouteRAG's batch-centred efficiency, LWS's stage schedules) are computed
by the algorithms layer from the per-episode numbers stored here, so nothing in a record depends
on the other episodes of a batch.

``EpisodeRecord.as_dict()`` uses the key spellings that ``raggym.rewards.outcome.EpisodeOutcome``
reads (``answer``, ``gold_answers``, ``queries``, ``modes``, ``retrieved_ids``,
``retrieved_texts``, ``retrieval_seconds``, ``retrieval_cost``, ``truncated``, ``format_ok``,
``gold_passages``, ``question_id``, ``response_text``), plus the full per-turn list.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Sequence

from raggym.data.types import Question
from raggym.protocol import Action, Dialect, FormatCheck


@dataclass(slots=True)
class TurnRecord:
    """One ``step`` of a ``RagSearchEnv`` episode."""

    index: int
    segment: str
    action: Action
    observation: str
    mode: str | None = None
    query: str | None = None
    retrieved_ids: tuple[str, ...] = ()
    retrieved_titles: tuple[str, ...] = ()
    retrieved_texts: tuple[str, ...] = ()
    facts: tuple[tuple, ...] = ()
    seconds: float = 0.0
    cost: float = 0.0
    format_error: bool = False

    @property
    def retrieved(self) -> bool:
        """True when this turn ran a retrieval (a valid search)."""
        return self.query is not None

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "segment": self.segment,
            "action": self.action.as_dict(),
            "observation": self.observation,
            "mode": self.mode,
            "query": self.query,
            "retrieved_ids": list(self.retrieved_ids),
            "retrieved_titles": list(self.retrieved_titles),
            "retrieved_texts": list(self.retrieved_texts),
            "facts": [list(f) for f in self.facts],
            "seconds": self.seconds,
            "cost": self.cost,
            "format_error": self.format_error,
        }


@dataclass(slots=True)
class EpisodeRecordBase:
    """What both episode records hold: the question, how the episode ended and its totals.

    The outcome fields are keyword-only so that each record keeps its own fields (dialect and
    prompt, or steps) positional right after ``question``.
    """

    question: Question
    _: KW_ONLY
    answer: str | None = None
    terminated: bool = False
    truncated: bool = False
    truncation_reason: str | None = None
    reward: float | None = None
    num_retrievals: int = 0
    retrieval_seconds: float = 0.0
    retrieval_cost: float = 0.0
    num_format_errors: int = 0
    gold_passages: tuple[str, ...] = ()
    # The finished episode's outcome, built once by ``close`` (its answer metrics cached on it).
    closed_outcome: Any = field(default=None, repr=False, compare=False)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def close(self):
        """Build the finished episode's outcome once and keep it: the env calls this when the episode
        ends, before its ``reward_fn``, so the env's reward (EM by default), the rewards of training
        and the step log all read one ``EpisodeOutcome`` and compute each answer metric once."""
        if not self.done:
            raise RuntimeError("close() is for a finished episode (terminated or truncated)")
        self.closed_outcome = None
        self.closed_outcome = self.outcome()
        return self.closed_outcome

    def as_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def outcome(self):
        """This episode as a ``raggym.rewards.outcome.EpisodeOutcome``, built from the record's own
        fields (no dict in between; ``EpisodeOutcome.from_dict(self.as_dict())`` gives the same).
        Once the episode is closed, the kept outcome, with the env's reward as it stands now."""
        if self.closed_outcome is not None:
            if self.closed_outcome.env_reward != self.reward:
                self.closed_outcome = self.closed_outcome.with_env_reward(self.reward)
            return self.closed_outcome
        # Imported on first use: the raggym.rewards package pulls in torch, which stepping an
        # environment does not need.
        from raggym.rewards.outcome import EpisodeOutcome

        queries, modes, retrievals = self._retrievals()
        return EpisodeOutcome(
            answer=self.answer, gold_answers=self.question.answers, queries=queries,
            modes=modes if any(m is not None for m in modes) else (),  # a dialect without modes
            retrieved_ids=[r.retrieved_ids for r in retrievals], retrieved_texts=[r.retrieved_texts for r in retrievals],
            retrieval_seconds=self.retrieval_seconds, retrieval_cost=self.retrieval_cost, truncated=self.truncated,
            format_ok=self._format_ok(), gold_passages=self.gold_passages, prompt_id=self.question.id,
            response_text=self._outcome_response_text(), steps=self._outcome_steps(), env_reward=self.reward,
            question=self.question.question)

    # What ``outcome`` reads, per record kind.
    def _retrievals(self) -> tuple[list, list, list]:
        raise NotImplementedError

    def _format_ok(self) -> bool:
        raise NotImplementedError

    def _outcome_response_text(self) -> str:
        return ""

    def _outcome_steps(self) -> tuple[dict, ...]:
        return ()

    # The pieces of ``as_dict`` both records share, each in the key order the records emit.

    def _question_fields(self) -> dict[str, Any]:
        return {
            "question_id": self.question.id,
            "question": self.question.question,
            "gold_answers": list(self.question.answers),
            "gold_passage_ids": list(self.question.gold_passage_ids),
            "gold_passages": list(self.gold_passages),
        }

    def _outcome_fields(self, **between: Any) -> dict[str, Any]:
        """How the episode ended, then ``between`` (keys a record adds there), then its totals."""
        return {
            "answer": self.answer,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "truncation_reason": self.truncation_reason,
            "reward": self.reward,
            **between,
            "num_retrievals": self.num_retrievals,
            "num_format_errors": self.num_format_errors,
            "retrieval_seconds": self.retrieval_seconds,
            "retrieval_cost": self.retrieval_cost,
        }


def _retrieval_fields(queries: list, modes: list, retrievals: Sequence) -> dict[str, Any]:
    """The per-retrieval lists ``EpisodeOutcome.from_dict`` reads, one entry per retrieval."""
    return {
        "queries": queries,
        "modes": modes,
        "retrieved_ids": [list(r.retrieved_ids) for r in retrievals],
        "retrieved_texts": [list(r.retrieved_texts) for r in retrievals],
    }


@dataclass(slots=True)
class EpisodeRecord(EpisodeRecordBase):
    """A whole ``RagSearchEnv`` episode: prompt, turns, outcome and retrieval totals."""

    dialect: Dialect
    prompt: str
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def segments(self) -> list[str]:
        return [t.segment for t in self.turns]

    @property
    def observations(self) -> list[str]:
        return [t.observation for t in self.turns]

    def retrieval_turns(self) -> list[TurnRecord]:
        return [t for t in self.turns if t.retrieved]

    def all_retrieved_ids(self) -> list[str]:
        return [pid for t in self.turns for pid in t.retrieved_ids]

    def all_retrieved_texts(self) -> list[str]:
        """Every retrieved passage text in order (PathRouter's evidence overlap reads these)."""
        return [text for t in self.turns for text in t.retrieved_texts]

    def response_text(self) -> str:
        """Model segments and observations interleaved, without the prompt."""
        return "".join(t.segment + t.observation for t in self.turns)

    def transcript(self) -> str:
        return self.prompt + self.response_text()

    def format_check(self) -> FormatCheck:
        """The dialect's trajectory-level format verdict; an episode with a format-error turn or
        without an answer never passes."""
        check = self.dialect.format_check(self.response_text())
        if check.ok and (self.num_format_errors or self.answer is None):
            reason = "a turn had a format error" if self.num_format_errors else "no final answer"
            return FormatCheck(False, reason, check.structure, check.num_searches)
        return check

    def _retrievals(self) -> tuple[list, list, list]:
        retrievals = self.retrieval_turns()
        return [t.query for t in retrievals], [t.mode for t in retrievals], retrievals

    def _format_ok(self) -> bool:
        return self.format_check().ok

    def _outcome_response_text(self) -> str:
        return self.response_text()

    def as_dict(self) -> dict[str, Any]:
        check = self.format_check()
        return {
            **self._question_fields(),
            "dialect": self.dialect.name,
            "prompt": self.prompt,
            **self._outcome_fields(num_turns=len(self.turns)),
            **_retrieval_fields(*self._retrievals()),
            "format_ok": check.ok,
            "format_reason": check.reason,
            "response_text": self.response_text(),
            "turns": [t.as_dict() for t in self.turns],
        }


@dataclass(slots=True)
class RouteStepRecord:
    """One model call of a ``MultiKBRouteEnv`` episode, as Step-GRPO groups them.

    ``phase`` is ``"route"``, ``"answer"`` (intermediate answer to the step's sub-question) or
    ``"final"``. ``context`` is the full prompt the model saw, ``output`` what it wrote. The
    ``gold_*`` fields come from the question's golden trajectory where it is known; in a
    teacher-forced routing step past the last golden step the gold is the stop action, ``"None"``
    for both the sub-question and the knowledge base. ``retrieved`` says whether the documents
    fields hold a retrieval: a free-running routing step's, or the golden sub-question's that a
    teacher-forced answer step was shown.
    """

    index: int
    phase: str
    route_step: int
    context: str
    output: str
    action: Action
    knowledge_base: str | None = None
    sub_question: str | None = None
    answer: str | None = None
    retrieved_ids: tuple[str, ...] = ()
    retrieved_titles: tuple[str, ...] = ()
    retrieved_texts: tuple[str, ...] = ()
    seconds: float = 0.0
    cost: float = 0.0
    retrieved: bool = False
    format_error: bool = False
    # Why the output was rejected; differs from action.error when a valid action came in the
    # wrong phase (an answer where a routing step was due).
    error: str | None = None
    gold_knowledge_base: str | None = None
    gold_sub_question: str | None = None
    gold_answer: str | None = None

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "phase": self.phase,
            "route_step": self.route_step,
            "context": self.context,
            "output": self.output,
            "action": self.action.as_dict(),
            "knowledge_base": self.knowledge_base,
            "sub_question": self.sub_question,
            "answer": self.answer,
            "retrieved_ids": list(self.retrieved_ids),
            "retrieved_titles": list(self.retrieved_titles),
            "retrieved_texts": list(self.retrieved_texts),
            "seconds": self.seconds,
            "cost": self.cost,
            "retrieved": self.retrieved,
            "format_error": self.format_error,
            "error": self.error,
            "gold_knowledge_base": self.gold_knowledge_base,
            "gold_sub_question": self.gold_sub_question,
            "gold_answer": self.gold_answer,
        }


@dataclass(slots=True)
class RouteEpisodeRecord(EpisodeRecordBase):
    """A whole ``MultiKBRouteEnv`` episode.

    A teacher-forced episode (Step-GRPO, one model call) sets ``teacher_forced_phase`` (``route``,
    ``answer`` or ``final``), ``golden_prefix`` (how many golden steps its input holds) and
    ``golden_step_index`` (the caller's ``step_index`` option, the step's position in
    ``MultiKBRouteEnv.golden_step_options``); they are ``None`` in a free-running episode.
    """

    steps: list[RouteStepRecord] = field(default_factory=list)
    # Keyword-only like the outcome fields: only the question and the steps are positional.
    _: KW_ONLY
    teacher_forced_phase: str | None = None
    golden_prefix: int | None = None
    golden_step_index: int | None = None

    def retrieval_steps(self) -> list[RouteStepRecord]:
        return [s for s in self.steps if s.retrieved]

    def all_retrieved_texts(self) -> list[str]:
        return [text for s in self.steps for text in s.retrieved_texts]

    def _retrievals(self) -> tuple[list, list, list]:
        retrievals = self.retrieval_steps()
        return [s.sub_question for s in retrievals], [s.knowledge_base for s in retrievals], retrievals

    def _format_ok(self) -> bool:
        return self.num_format_errors == 0 and self.answer is not None

    def _outcome_steps(self) -> tuple[dict, ...]:
        return tuple(s.as_dict() for s in self.steps)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self._question_fields(),
            "dialect": "r1_router",
            **self._outcome_fields(),
            **_retrieval_fields(*self._retrievals()),
            "format_ok": self._format_ok(),
            "teacher_forced_phase": self.teacher_forced_phase,
            "golden_prefix": self.golden_prefix,
            "golden_step_index": self.golden_step_index,
            "steps": [s.as_dict() for s in self.steps],
        }
