"""Golden trajectories for real datasets: the steps a supervised cold start replays.

The synthetic world writes each question's golden trajectory, and the MuSiQue loader turns
``question_decomposition`` into one (``raggym.data.loaders``). Other datasets say less, but often
enough to replay a grounded search episode:

- **2WikiMultiHopQA** ``evidences`` (kept as ``Question.gold_triples``): one step per
  ``(subject, relation, object)`` triple, asking for the relation of the subject, whose answer is
  the object. Its passage is the gold passage titled by the subject, when there is one.
- **HotpotQA** ``supporting_facts`` (and any format whose gold passages are known, such as a
  MuSiQue record without a decomposition): one step per gold passage, in the order the data
  names them, searching for the passage's title. These steps carry no intermediate answer (the
  data do not give one), so they suit the search dialects' cold start but not R1-Router, whose
  answer steps are scored against it.

A question with none of these cannot be given a golden trajectory; ``golden_trajectory_for``
raises ``GoldenTrajectoryError`` naming the question, its dataset and what is missing, rather
than inventing steps.

Every derived step has the keys of the synthetic world's steps: ``query``, ``mode``, ``kb``,
``answer`` (None where the data give none) and ``passage_ids``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from raggym.data.types import Question


class GoldenTrajectoryError(ValueError):
    """A question whose data do not determine a golden trajectory."""


def _dataset(question: Question) -> str:
    kind = question.kind or ""
    return kind.split(":")[0] or "an unnamed dataset"


def _title_of(corpus, passage_id: str) -> str | None:
    passage = corpus.get(passage_id) if corpus is not None else None
    return None if passage is None else passage.title


def _steps_from_triples(question: Question, corpus) -> tuple[dict, ...]:
    gold_by_title = {}
    for pid in question.gold_passage_ids:
        title = _title_of(corpus, pid)
        if title is not None:
            gold_by_title.setdefault(title, pid)
    steps = []
    for subject, relation, obj in question.gold_triples:
        # 2Wiki relations are noun phrases ("director", "date of birth"): "director of Inception"
        query = f"{relation.replace('_', ' ').strip()} of {subject.strip()}"
        pid = gold_by_title.get(subject.strip())
        steps.append({"query": query, "mode": "passage", "kb": "text", "answer": obj.strip(),
                      "passage_ids": [pid] if pid else []})
    return tuple(steps)


def _steps_from_gold_passages(question: Question, corpus) -> tuple[dict, ...]:
    steps = []
    for pid in question.gold_passage_ids:
        title = _title_of(corpus, pid)
        if not title or not title.strip():
            raise GoldenTrajectoryError(
                f"question {question.id!r} ({_dataset(question)}): gold passage {pid!r} has no title in the corpus "
                "given, so no search step can be derived for it; pass the corpus the questions were loaded against")
        steps.append({"query": title.strip(), "mode": "passage", "kb": "text", "answer": None, "passage_ids": [pid]})
    return tuple(steps)


def golden_trajectory_for(question: Question, corpus=None) -> tuple[dict, ...]:
    """The question's golden steps: its own, else derived from its evidence (see the module docstring).

    ``corpus`` (a ``raggym.data.Corpus``) is needed for steps derived from gold passages, whose
    titles become the queries. Raises ``GoldenTrajectoryError`` when nothing determines the steps.
    """
    if question.golden_trajectory:
        return tuple(question.golden_trajectory)
    if question.gold_triples:
        return _steps_from_triples(question, corpus)
    if question.gold_passage_ids:
        if corpus is None:
            raise GoldenTrajectoryError(
                f"question {question.id!r} ({_dataset(question)}): its golden steps come from its gold passages' "
                "titles, and no corpus was given to look them up")
        return _steps_from_gold_passages(question, corpus)
    raise GoldenTrajectoryError(
        f"question {question.id!r} ({_dataset(question)}): cannot derive a golden trajectory: the record has no "
        "question_decomposition (MuSiQue), no evidences (2WikiMultiHopQA) and no gold supporting passages "
        "(HotpotQA supporting_facts, MuSiQue is_supporting); the supervised cold start needs one of them")


def with_golden_trajectories(questions: Iterable[Question], corpus=None, *,
                             need_answers: bool = False) -> list[Question]:
    """Copies of ``questions`` whose ``golden_trajectory`` is filled (``golden_trajectory_for``).

    ``need_answers`` refuses steps without an intermediate answer (R1-Router's answer steps are
    scored against it). Every question is checked; the error names the first few that fail.
    """
    out: list[Question] = []
    failures: list[str] = []
    for q in questions:
        try:
            steps = golden_trajectory_for(q, corpus)
        except GoldenTrajectoryError as exc:
            failures.append(str(exc))
            continue
        if need_answers and any(step.get("answer") is None for step in steps):
            failures.append(f"question {q.id!r} ({_dataset(q)}): its golden steps (derived from gold passages) have "
                            "no intermediate answers, which this dialect's golden episodes need")
            continue
        out.append(q if steps == tuple(q.golden_trajectory) else replace(q, golden_trajectory=steps))
    if failures:
        shown = "; ".join(failures[:3]) + (f"; and {len(failures) - 3} more" if len(failures) > 3 else "")
        raise GoldenTrajectoryError(f"{len(failures)} of {len(failures) + len(out)} questions have no golden "
                                    f"trajectory: {shown}")
    return out

