"""Every metric the rewards and the evaluation harness read, in one place.

The answer and evidence metrics on texts (EM, cover-EM, token F1 and recall, evidence overlap,
unsupported-answer rate; definitions in ``raggym.text_metrics``) are re-exported here, next to
the episode-level ones below, which read an ``EpisodeOutcome``. The text metrics live outside this
package because ``EpisodeOutcome`` and the judge (``raggym.judge``, which the LWS reward imports)
compute with them: a module of this package would run the package's init, and so the judge's
importers, first.
"""

from __future__ import annotations

from raggym.rewards.outcome import EpisodeOutcome

# Re-exported: the rewards and the evaluation harness import the text metrics from here.
from raggym.text_metrics import (  # noqa: F401
    answer_tokens,
    cover_exact_match,
    evidence_overlap,
    exact_match,
    normalize_answer,
    token_f1,
    token_recall,
    unsupported_answer_rate,
)

# ---------------------------------------------------------------------------------------------
# Episode-level conveniences
# ---------------------------------------------------------------------------------------------


def retrieval_count(outcome: EpisodeOutcome) -> int:
    """Number of retrieval calls the episode made."""
    return outcome.retrieval_count


def total_retrieval_seconds(outcome: EpisodeOutcome) -> float:
    """Measured wall seconds spent in retrieval over the whole episode."""
    return float(outcome.retrieval_seconds)


def total_retrieval_cost(outcome: EpisodeOutcome) -> float:
    """Deterministic retrieval cost (a work count) over the whole episode."""
    return float(outcome.retrieval_cost)


def outcome_metrics(outcome: EpisodeOutcome) -> dict[str, float | int | None]:
    """Every metric of one episode, as the evaluation harness reports them.

    ``eo`` is ``None`` when the question carries no gold passages; ``uar`` is ``None`` when the
    answer has no tokens.
    """
    retrieved = outcome.all_retrieved_texts()
    return {
        "em": outcome.em,  # the outcome's cached metrics: computed once per episode, whoever asks first
        "cover_em": cover_exact_match(outcome.answer, outcome.gold_answers),
        "f1": outcome.f1,
        "eo": outcome.evidence_overlap if outcome.gold_passages else None,
        "uar": unsupported_answer_rate(outcome.answer, retrieved),
        "retrieval_count": retrieval_count(outcome),
        "retrieval_seconds": total_retrieval_seconds(outcome),
        "retrieval_cost": total_retrieval_cost(outcome),
    }
