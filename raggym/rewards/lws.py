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

Search, with RC the number of retrievals and q_1..q_RC the queries::

    RC ≤ 1:  R_search = 0 if the query is concise (or there is none), −1 if not
    RC > 1:  R_search = − (2 / (RC·(RC−1))) · Σ_{i<j} cos(E(q_i), E(q_j))

The second line is the true mean over the RC·(RC−1)/2 unordered pairs. The paper writes the
normaliser as 1/(RC·(RC−1)) over i<j, which is half that mean; we use the mean so that the term
stays in [−1, 1] and means "average redundancy between queries".

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

Correctness defaults to ``EM = 1 or F1 ≥ 0.5`` (``correct_if="em_or_f1"``); ``"em"`` or ``"f1"``
select one metric, and a ``judge(answer, gold_answers) -> bool`` callable replaces the check
entirely (e.g. an LLM judge).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from raggym.algorithms.spans import tag_sequence
from raggym.rewards.metrics import exact_match, token_f1
from raggym.rewards.outcome import EpisodeOutcome

Embedder = Callable[[Sequence[str]], "np.ndarray"]
Judge = Callable[[str, Sequence[str]], bool]

_ALLOWED_STRUCTURE = re.compile(r"think (reflect |(search information reflect )+)answer")
CORRECTNESS_RULES = ("em", "f1", "em_or_f1")


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
    correct_if: str = "em_or_f1"
    f1_threshold: float = 0.5

    def __post_init__(self):
        if self.correct_if not in CORRECTNESS_RULES:
            raise ValueError(
                f"correct_if must be one of {', '.join(CORRECTNESS_RULES)}, got {self.correct_if!r}"
            )


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


def mean_pairwise_cosine(embeddings: np.ndarray) -> float:
    """Mean cosine similarity over the n·(n−1)/2 unordered pairs of rows (n ≥ 2)."""
    e = np.asarray(embeddings, dtype=np.float64)
    if e.ndim != 2 or e.shape[0] < 2:
        raise ValueError(f"need at least two embedding rows, got shape {e.shape}")
    norms = np.linalg.norm(e, axis=1, keepdims=True)
    unit = e / np.where(norms > 0, norms, 1.0)  # a zero vector has cosine 0 with everything
    cos = unit @ unit.T
    n = e.shape[0]
    upper = cos[np.triu_indices(n, k=1)]
    return float(upper.sum() * 2.0 / (n * (n - 1)))  # (2 / (n(n−1))) Σ_{i<j} cos_ij


def lws_search_reward(
    queries: Sequence[str],
    query_embeddings: np.ndarray | None = None,
    embed: Embedder | None = None,
    config: LWSConfig = LWSConfig(),
) -> float:
    """R_search: conciseness for ≤ 1 query, minus mean pairwise query similarity for more.

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
    return -mean_pairwise_cosine(query_embeddings)  # R_search = −mean_{i<j} cos(E q_i, E q_j)


def lws_is_correct(
    answer: str | None,
    gold_answers: Sequence[str],
    config: LWSConfig = LWSConfig(),
    judge: Judge | None = None,
) -> bool:
    if answer is None:
        return False
    if judge is not None:
        return bool(judge(answer, gold_answers))
    em = exact_match(answer, gold_answers)
    if config.correct_if == "em":
        return em == 1.0
    f1_ok = token_f1(answer, gold_answers) >= config.f1_threshold
    if config.correct_if == "f1":
        return f1_ok
    return em == 1.0 or f1_ok


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
) -> dict[str, float]:
    """All three LWS terms and their sum (``total``).

    The format passes only if the environment's verdict ``outcome.format_ok`` is true and, when
    ``outcome.response_text`` is recorded, its tag sequence also has an allowed structure. Both
    must agree, so a turn the environment flagged (e.g. a malformed search) fails the format even
    if the surviving tags happen to line up.
    """
    format_ok = outcome.format_ok
    if format_ok and outcome.response_text:
        format_ok = lws_structure_ok(tag_sequence(outcome.response_text, "lws"))
    r_format = lws_format_reward(format_ok, config)
    r_search = lws_search_reward(outcome.queries, query_embeddings, embed, config)
    correct = lws_is_correct(outcome.answer, outcome.gold_answers, config, judge)
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
