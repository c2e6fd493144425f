"""LWS multi-stage reward for reasoning models that search: format, search and answer terms.

LWS ("learning when to search" with a reasoning model; the method named LWS in raggym's
DESIGN.md) — multi-stage reward design, trained with DAPO. Tags: ``<think>``, ``<search>``,
``<information>``, ``<reflect>``, ``<answer>``.

Total reward (the three terms add)::

    R = R_format + R_search + R_answer

Format::

    R_format = +1  if the tag sequence is  think → reflect → answer
                                       or  think → (search → information → reflect)+ → answer
             = −1  otherwise

Search, with RC the number of retrievals and q_1..q_RC the queries (Eq. 8 for RC > 1)::

    RC ≤ 1:  R_search = 0 if the query is concise (or there is none), −1 if not
    RC > 1:  R_search = − (1 / (RC·(RC−1))) · Σ_{i<j} cos(E(q_i), E(q_j))

This is Eq. 8's normaliser as printed (``similarity_normaliser="eq8"``, the default): RC·(RC−1)
over the RC·(RC−1)/2 unordered pairs, so the term is half the mean pairwise cosine and lies in
[−½, ½]. ``similarity_normaliser="pair_mean"`` divides by the number of pairs instead (the plain
mean, in [−1, 1]), for anyone who reads Eq. 8's sum as running over ordered pairs.

Conciseness (the paper leaves it informal; configurable in ``LWSConfig``): a query is concise
when, after lowercasing, it is non-empty, has at most ``max_query_words`` (12) words, contains no
question word (what, who, whom, whose, which, when, where, why, how), no ``?``, and none of the
filler phrases (``please``, ``can you``, ``i want``, ``search for``, ``tell me``, …). The idea is
that a search query should be keywords, not a chatty question.

Answer, with β = 0.3::

    stage 1:  R_answer = 1           if correct,  else −1 + β·RC   (failing without searching
                                                                      costs more: learn to search)
    stage 2:  R_answer = 1 − β·RC    if correct,  else −1          (learn not to over-search)

Note that with β = 0.3 a wrong stage-1 answer after 4 retrievals scores +0.2; that is the
formula as given.

"Correct" is decided by a judge ``judge(question, answer, gold_answers) -> bool``
(``raggym.judge``): the paper uses an LLM judge in training and testing, which
``experiments.recipe.judge.make_judge`` builds from the ``reward.judge`` config section. Without one the
documented fallback applies: ``EM = 1 or F1 ≥ 0.5`` (``correct_if="em_or_f1"``; ``"em"`` or
``"f1"`` select one metric).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from raggym.algorithms.spans import tag_sequence
from raggym.judge import CORRECTNESS_RULES, Judge, judge_many, lexical_correct
from raggym.rewards.outcome import EpisodeOutcome

Embedder = Callable[[Sequence[str]], "np.ndarray"]

_ALLOWED_STRUCTURE = re.compile(r"think (reflect |(search information reflect )+)answer")
SIMILARITY_NORMALISERS = ("eq8", "pair_mean")


@dataclass(frozen=True)
class LWSConfig:
    beta: float = 0.3  # β: per-retrieval term in the answer reward
    format_reward: float = 1.0  # +1 / −1
    max_query_words: int = 12
    question_words: tuple[str, ...] = (
        "what", "who", "whom", "whose", "which", "when", "where", "why", "how",
    )
    filler_phrases: tuple[str, ...] = (
        "please", "can you", "could you", "would you", "i want", "i need", "i would like",
        "search for", "look up", "look for", "find out", "tell me", "let me", "information about",
    )
    correct_if: str = "em_or_f1"  # the fallback rule when no judge is configured
    f1_threshold: float = 0.5
    similarity_normaliser: str = "eq8"  # Eq. 8: RC·(RC−1); "pair_mean": RC·(RC−1)/2

    def __post_init__(self):
        if self.correct_if not in CORRECTNESS_RULES:
            raise ValueError(
                f"correct_if must be one of {', '.join(CORRECTNESS_RULES)}, got {self.correct_if!r}"
            )
        if self.similarity_normaliser not in SIMILARITY_NORMALISERS:
            raise ValueError(f"similarity_normaliser must be one of {', '.join(SIMILARITY_NORMALISERS)}, "
                             f"got {self.similarity_normaliser!r}")


def lws_structure_ok(tags: Sequence[str]) -> bool:
    """Is the tag sequence think→reflect→answer or think→(search→information→reflect)+→answer?"""
    return _ALLOWED_STRUCTURE.fullmatch(" ".join(tags)) is not None


def lws_format_reward(format_ok: bool, config: LWSConfig = LWSConfig()) -> float:
    """R_format = +1 if the structure is allowed, else −1."""
    return config.format_reward if format_ok else -config.format_reward


def is_concise_query(query: str, config: LWSConfig = LWSConfig()) -> bool:
    """The conciseness rule of the module docstring."""
    text = " ".join(query.lower().split())
    if not text or "?" in text:
        return False
    words = re.findall(r"[a-z0-9']+", text)
    if not words or len(words) > config.max_query_words:
        return False
    if any(w in config.question_words for w in words):
        return False
    padded = f" {' '.join(words)} "
    return not any(f" {phrase} " in padded for phrase in config.filler_phrases)


def pairwise_cosine_sum(embeddings: np.ndarray) -> float:
    """Σ_{i<j} cos(e_i, e_j) over the unordered pairs of rows (n ≥ 2)."""
    e = np.asarray(embeddings, dtype=np.float64)
    if e.ndim != 2 or e.shape[0] < 2:
        raise ValueError(f"need at least two embedding rows, got shape {e.shape}")
    norms = np.linalg.norm(e, axis=1, keepdims=True)
    unit = e / np.where(norms > 0, norms, 1.0)  # a zero vector has cosine 0 with everything
    cos = unit @ unit.T
    return float(cos[np.triu_indices(e.shape[0], k=1)].sum())


def mean_pairwise_cosine(embeddings: np.ndarray) -> float:
    """Mean cosine similarity over the n·(n−1)/2 unordered pairs of rows (n ≥ 2)."""
    n = len(embeddings)
    return pairwise_cosine_sum(embeddings) * 2.0 / (n * (n - 1))  # (2 / (n(n−1))) Σ_{i<j} cos_ij


def query_redundancy(embeddings: np.ndarray, normaliser: str = "eq8") -> float:
    """Eq. 8's average similarity: Σ_{i<j} cos / (n·(n−1)) ("eq8") or the pair mean ("pair_mean")."""
    if normaliser == "pair_mean":
        return mean_pairwise_cosine(embeddings)
    if normaliser != "eq8":
        raise ValueError(f"similarity_normaliser must be one of {', '.join(SIMILARITY_NORMALISERS)}, got {normaliser!r}")
    n = len(embeddings)
    return pairwise_cosine_sum(embeddings) / (n * (n - 1))  # (1 / (n(n−1))) Σ_{i<j} cos_ij


def lws_search_reward(
    queries: Sequence[str],
    query_embeddings: np.ndarray | None = None,
    embed: Embedder | None = None,
    config: LWSConfig = LWSConfig(),
) -> float:
    """R_search: conciseness for ≤ 1 query, minus Eq. 8's average query similarity for more.

    For more than one query, pass either ``query_embeddings`` ([RC, dim]) or ``embed``, a callable
    mapping a list of strings to such an array.
    """
    if len(queries) <= 1:
        if not queries:
            return 0.0
        return 0.0 if is_concise_query(queries[0], config) else -1.0
    if query_embeddings is None:
        if embed is None:
            raise ValueError(
                "the LWS search reward for more than one query needs query_embeddings or embed"
            )
        query_embeddings = embed(list(queries))
    if len(query_embeddings) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(query_embeddings)} embeddings")
    return -query_redundancy(query_embeddings, config.similarity_normaliser)  # R_search = −Σ_{i<j} cos / (RC(RC−1))


def lws_is_correct(
    answer: str | None,
    gold_answers: Sequence[str],
    config: LWSConfig = LWSConfig(),
    judge: Judge | None = None,
    question: str = "",
) -> bool:
    """The judge's verdict on ``answer``, or the fallback rule ``config.correct_if`` without one."""
    if answer is None:
        return False
    if judge is not None:
        return bool(judge(question, answer, gold_answers))
    return lexical_correct(answer, gold_answers, config.correct_if, config.f1_threshold)


def lws_answer_reward(correct: bool, retrieval_count: int, stage: int, beta: float = 0.3) -> float:
    """R_answer for stage 1 or 2 (see the module docstring)."""
    if stage == 1:
        return 1.0 if correct else -1.0 + beta * retrieval_count  # 1 | −1 + β·RC
    if stage == 2:
        return 1.0 - beta * retrieval_count if correct else -1.0  # 1 − β·RC | −1
    raise ValueError(f"LWS has stages 1 and 2, got {stage!r}")


def lws_reward_terms(
    outcome: EpisodeOutcome,
    stage: int,
    config: LWSConfig = LWSConfig(),
    query_embeddings: np.ndarray | None = None,
    embed: Embedder | None = None,
    judge: Judge | None = None,
    correct: bool | None = None,
) -> dict[str, float]:
    """All three LWS terms and their sum (``total``).

    The format passes only if the environment's verdict ``outcome.format_ok`` is true and, when
    ``outcome.response_text`` is recorded, its tag sequence also has an allowed structure. Both
    must agree, so a turn the environment flagged (e.g. a malformed search) fails the format even
    if the surviving tags happen to line up. ``correct``, when given, is a verdict already reached
    for this outcome (``lws_batch_rewards``); otherwise ``lws_is_correct`` decides.
    """
    format_ok = outcome.format_ok
    if format_ok and outcome.response_text:
        format_ok = lws_structure_ok(tag_sequence(outcome.response_text, "lws"))
    r_format = lws_format_reward(format_ok, config)
    r_search = lws_search_reward(outcome.queries, query_embeddings, embed, config)
    if correct is None:
        correct = lws_is_correct(outcome.answer, outcome.gold_answers, config, judge, outcome.question)
    r_answer = lws_answer_reward(correct, outcome.retrieval_count, stage, config.beta)
    return {
        "format": r_format,
        "search": r_search,
        "answer": r_answer,
        "total": r_format + r_search + r_answer,  # R = R_format + R_search + R_answer
    }


def lws_reward(
    outcome: EpisodeOutcome,
    stage: int,
    config: LWSConfig = LWSConfig(),
    query_embeddings: np.ndarray | None = None,
    embed: Embedder | None = None,
    judge: Judge | None = None,
) -> float:
    """R = R_format + R_search + R_answer."""
    return lws_reward_terms(outcome, stage, config, query_embeddings, embed, judge)["total"]


def lws_batch_rewards(
    outcomes: Sequence[EpisodeOutcome],
    stage: int,
    config: LWSConfig = LWSConfig(),
    embed: Embedder | None = None,
    judge: Judge | None = None,
) -> list[float]:
    """``lws_reward`` over a batch; a judge sees all the batch's answers at once (one call of an
    LLM judge's ``judge_many``)."""
    verdicts: list[bool | None] = [None] * len(outcomes)
    if judge is not None:
        verdicts = judge_many(judge, [(o.question, o.answer, o.gold_answers) for o in outcomes])
    return [lws_reward_terms(o, stage, config, embed=embed, judge=judge, correct=v)["total"]
            for o, v in zip(outcomes, verdicts)]
