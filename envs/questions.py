"""Choosing the question of the next episode."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from raggym.data.types import Question

QuestionSource = Sequence[Question] | Callable[[np.random.Generator], Question]

QUESTION_ORDERS = ("random", "cycle")


def check_question_source(questions: QuestionSource | None, order: str) -> None:
    if order not in QUESTION_ORDERS:
        raise ValueError(f"question_order must be one of {QUESTION_ORDERS}, got {order!r}")
    if questions is not None and not callable(questions) and len(questions) == 0:
        raise ValueError("questions is empty")


class QuestionPicker:
    """``reset(options={"question": q})`` wins; otherwise draw from the source: a sequence (at
    random with the env's seeded generator, or in order) or a callable ``rng -> Question``."""

    def __init__(self, source: QuestionSource | None, order: str = "random"):
        check_question_source(source, order)
        self.source = source
        self.order = order
        self._cursor = 0

    def pick(self, options: dict | None, rng: np.random.Generator) -> Question:
        if options and options.get("question") is not None:
            question = options["question"]
            if not isinstance(question, Question):
                raise TypeError(
                    f'options["question"] must be a raggym.data.Question, got {type(question).__name__}'
                )
            return question
        source = self.source
        if source is None:
            raise ValueError(
                'no question: pass questions=... to the env or options={"question": ...} to reset'
            )
        if callable(source):
            question = source(rng)
            if not isinstance(question, Question):
                raise TypeError(f"the question source returned {type(question).__name__}, not a Question")
            return question
        if self.order == "cycle":
            question = source[self._cursor % len(source)]
            self._cursor += 1
            return question
        return source[int(rng.integers(len(source)))]


def gold_passage_texts(corpus, question: Question) -> tuple[str, ...]:
    """Texts of the question's gold passages found in ``corpus`` (empty without a corpus)."""
    if corpus is None:
        return ()
    found = (corpus.get(pid) for pid in question.gold_passage_ids)
    return tuple(p.text for p in found if p is not None)
