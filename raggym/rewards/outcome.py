"""``EpisodeOutcome``: the one record every episode-level reward reads.

Rewards are pure functions of this record, so they can be tested without an environment and the
environment layer only has to fill in a handful of plain fields (``EpisodeOutcome.from_dict``
accepts the usual spellings). The record is frozen; sequences are stored as tuples.

Fields
------
answer
    The final answer text, or ``None`` when the episode ended without one (turn limit, budget,
    parse failure).
gold_answers
    The gold answers: the first is the main answer, the rest are aliases. Never empty.
queries
    The query sent to the retriever, one per retrieval call, in order.
modes
    The retrieval mode of each call (``"passage"``, ``"graph"``, ``"hybrid"``, or a knowledge-base
    name); empty when the dialect has no modes.
retrieved_ids
    Per retrieval call, the ids of the passages it returned.
retrieved_texts
    Per retrieval call, the texts of the passages it returned (same order as the ids).
retrieval_seconds
    Total measured wall seconds spent in retrieval over the episode.
retrieval_cost
    Total deterministic retrieval cost (a work count that does not depend on the machine).
truncated
    True when the episode was cut off (turn limit, retrieval budget, token or character limit)
    rather than ending with an answer.
format_ok
    The environment's verdict on whether the whole trajectory followed the dialect's format.
gold_passages
    Texts of the gold evidence passages (used by PathRouter's evidence overlap).
prompt_id
    The question / prompt identifier; GRPO groups rollouts by it.
steps
    R1-Router's per-call step records (``RouteStepRecord.as_dict()``: phase, sub-question, knowledge
    base, answer and their gold values); empty for single-transcript episodes.
env_reward
    The terminal reward the environment's own ``reward_fn`` gave (exact match by default), kept so
    training can log it next to the recipe's reward; ``None`` when the episode has none.
question
    The question's text (an LLM judge of correctness reads it); ``""`` when not recorded.
response_text
    The full response side of the trajectory (model segments and observations, without the
    prompt). Optional; rewards that check tag structure (LWS) read it when it is present.

The answer metrics ``em``, ``f1`` and ``evidence_overlap`` are computed on first use and cached on
the (frozen) record, so a reward, an advantage estimator and the step log that all read them
compute each once.

``queries``, ``modes``, ``retrieved_ids`` and ``retrieved_texts`` are aligned: each is either
empty (not recorded) or has one entry per retrieval call. ``retrieval_count`` is that length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, Mapping, Sequence

from raggym import text_metrics


def _tuple_of_str(values: Any) -> tuple[str, ...]:
    """A tuple of strings; a missing (``None``) element becomes ``""``."""
    if values is None:
        return ()
    if isinstance(values, str):
        return (values,)
    return tuple("" if v is None else str(v) for v in values)


def _nested_tuple_of_str(values: Any) -> tuple[tuple[str, ...], ...]:
    if values is None:
        return ()
    return tuple(_tuple_of_str(v) for v in values)


def _total(value: Any) -> float:
    """A scalar total, or the sum of a per-call list."""
    if value is None:
        return 0.0
    if isinstance(value, (int, float)):
        return float(value)
    return float(sum(float(v) for v in value))


# The cached_property metrics of EpisodeOutcome (computed on first use, kept by with_env_reward).
_CACHED_METRICS = ("em", "f1", "evidence_overlap")


@dataclass(frozen=True)
class EpisodeOutcome:
    answer: str | None
    gold_answers: tuple[str, ...]
    queries: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    retrieved_ids: tuple[tuple[str, ...], ...] = ()
    retrieved_texts: tuple[tuple[str, ...], ...] = ()
    retrieval_seconds: float = 0.0
    retrieval_cost: float = 0.0
    truncated: bool = False
    format_ok: bool = True
    gold_passages: tuple[str, ...] = ()
    prompt_id: str = ""
    response_text: str = ""
    steps: tuple[Mapping[str, Any], ...] = ()
    env_reward: float | None = None
    question: str = ""

    def __post_init__(self):
        # Accept lists from callers but store tuples, so the record stays hashable and frozen.
        set_ = object.__setattr__
        set_(self, "gold_answers", _tuple_of_str(self.gold_answers))
        set_(self, "queries", _tuple_of_str(self.queries))
        set_(self, "modes", _tuple_of_str(self.modes))
        set_(self, "retrieved_ids", _nested_tuple_of_str(self.retrieved_ids))
        set_(self, "retrieved_texts", _nested_tuple_of_str(self.retrieved_texts))
        set_(self, "gold_passages", _tuple_of_str(self.gold_passages))
        set_(self, "retrieval_seconds", float(self.retrieval_seconds))
        set_(self, "retrieval_cost", float(self.retrieval_cost))
        set_(self, "steps", tuple(dict(step) for step in self.steps))
        if self.answer is not None and not isinstance(self.answer, str):
            raise TypeError(f"answer must be str or None, got {type(self.answer).__name__}")
        if not self.gold_answers:
            raise ValueError("EpisodeOutcome needs at least one gold answer")
        lengths = {
            name: len(getattr(self, name))
            for name in ("queries", "modes", "retrieved_ids", "retrieved_texts")
            if getattr(self, name)
        }
        if len(set(lengths.values())) > 1:
            raise ValueError(
                "per-retrieval fields must have one entry per retrieval call; got lengths "
                + ", ".join(f"{k}={v}" for k, v in lengths.items())
            )
        if self.retrieved_ids and self.retrieved_texts:
            for turn, (ids, texts) in enumerate(zip(self.retrieved_ids, self.retrieved_texts)):
                if len(ids) != len(texts):
                    raise ValueError(
                        f"retrieval {turn}: {len(ids)} ids but {len(texts)} texts"
                    )

    @property
    def retrieval_count(self) -> int:
        """Number of retrieval calls (RC in the LWS paper, N in GraphRAG-R1)."""
        return max(
            len(self.queries), len(self.modes), len(self.retrieved_ids), len(self.retrieved_texts)
        )

    @cached_property
    def em(self) -> float:
        """Exact match of the answer against the gold answers (SQuAD normalisation)."""
        return text_metrics.exact_match(self.answer, self.gold_answers)

    @cached_property
    def f1(self) -> float:
        """Token F1 of the answer, the best over the gold aliases."""
        return text_metrics.token_f1(self.answer, self.gold_answers)

    @cached_property
    def evidence_overlap(self) -> float:
        """EO: mean over gold passages of token-F1(all retrieved text, gold passage); 0 without gold."""
        if not self.gold_passages:
            return 0.0
        return text_metrics.evidence_overlap(self.all_retrieved_texts(), self.gold_passages)

    def with_env_reward(self, reward: float | None) -> "EpisodeOutcome":
        """This outcome with ``env_reward`` set, keeping the answer metrics already computed (the
        environment's default reward is this outcome's EM, computed before the reward existed)."""
        out = replace(self, env_reward=reward)
        out.__dict__.update({name: self.__dict__[name] for name in _CACHED_METRICS if name in self.__dict__})
        return out

    def all_retrieved_texts(self) -> list[str]:
        """Every retrieved passage text in the order it was returned."""
        return [text for turn in self.retrieved_texts for text in turn]

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "EpisodeOutcome":
        """Build from a plain episode record, accepting the common key spellings.

        Recognised keys (first spelling wins): ``answer``/``final_answer``;
        ``gold_answers``/``answers``; ``queries``; ``modes``; ``retrieved_ids``;
        ``retrieved_texts``; ``retrieval_seconds``/``total_retrieval_seconds`` and
        ``retrieval_cost``/``retrieval_costs``/``total_retrieval_cost`` (a number, or a per-call
        list that is summed); ``truncated``/``timeout``; ``format_ok``/``format_valid``;
        ``gold_passages``/``gold_passage_texts``; ``prompt_id``/``question_id``;
        ``response_text``; ``question`` (the text).

        Instead of the per-retrieval lists, a record may hold ``turns``: a list of per-turn dicts.
        A turn counts as a retrieval call when it has ``retrieved_ids`` or ``retrieved_texts``
        (or ``ids``/``texts``); its ``query``, ``mode``, ``seconds`` and ``cost`` are collected.
        Top-level totals, when present, take precedence over the per-turn sums. Unknown keys are
        ignored, so an environment can pass its whole record.
        """

        def pick(*names, default=None):
            for name in names:
                if name in record and record[name] is not None:
                    return record[name]
            return default

        queries = pick("queries")
        modes = pick("modes")
        if modes is not None and all(m is None for m in modes):
            modes = None  # a dialect without modes
        ids = pick("retrieved_ids")
        texts = pick("retrieved_texts")
        seconds = pick("retrieval_seconds", "total_retrieval_seconds")
        cost = pick("retrieval_cost", "retrieval_costs", "total_retrieval_cost")

        turns = pick("turns")
        if turns is not None and queries is None and ids is None and texts is None:
            result_keys = ("retrieved_ids", "retrieved_texts", "ids", "texts")
            retrieval_turns = [
                t for t in turns if any(t.get(k) is not None for k in result_keys)
            ]
            queries = [t.get("query", "") or "" for t in retrieval_turns]
            if any(t.get("mode") is not None for t in retrieval_turns):
                modes = [t.get("mode") or "" for t in retrieval_turns]
            ids = [t.get("retrieved_ids", t.get("ids")) or () for t in retrieval_turns]
            texts = [t.get("retrieved_texts", t.get("texts")) or () for t in retrieval_turns]
            if not any(ids):
                ids = None
            if not any(texts):
                texts = None
            if seconds is None:
                seconds = [float(t.get("seconds") or 0.0) for t in retrieval_turns]
            if cost is None:
                cost = [float(t.get("cost") or 0.0) for t in retrieval_turns]

        answer = pick("answer", "final_answer")
        return cls(
            answer=None if answer is None else str(answer),
            gold_answers=_tuple_of_str(pick("gold_answers", "answers", default=())),
            queries=_tuple_of_str(queries),
            modes=_tuple_of_str(modes),
            retrieved_ids=_nested_tuple_of_str(ids),
            retrieved_texts=_nested_tuple_of_str(texts),
            retrieval_seconds=_total(seconds),
            retrieval_cost=_total(cost),
            truncated=bool(pick("truncated", "timeout", default=False)),
            format_ok=bool(pick("format_ok", "format_valid", default=True)),
            gold_passages=_tuple_of_str(pick("gold_passages", "gold_passage_texts", default=())),
            prompt_id=str(pick("prompt_id", "question_id", default="")),
            response_text=str(pick("response_text", default="")),
            steps=tuple(pick("steps", default=())),
            env_reward=None if pick("env_reward", "reward") is None else float(pick("env_reward", "reward")),
            question=str(pick("question", default="")),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict; ``from_dict(as_dict())`` round-trips."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("retrieved_ids", "retrieved_texts"):
                value = [list(v) for v in value]
            elif f.name == "steps":
                value = [dict(step) for step in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def outcomes_from_dicts(records: Sequence[Mapping[str, Any]]) -> list[EpisodeOutcome]:
    """``EpisodeOutcome.from_dict`` over a batch."""
    return [EpisodeOutcome.from_dict(r) for r in records]
