"""Deterministic train / held-out splits of a question list.

The demo trains on some questions of a synthetic world and evaluates on the others; both sides
must agree on which is which without sharing state, so the split is a pure function of the
question ids, the held-out fraction and a seed:

* every question gets the key ``sha1(f"{seed}:{question.id}")``;
* the ``round(fraction · n)`` questions with the smallest keys are held out;
* both parts keep the input order.

The result does not depend on the order of the input list, and a question keeps its side when
other questions are added (its key does not change; only the cut-off moves).
"""

from __future__ import annotations

import hashlib
from typing import Sequence, TypeVar

T = TypeVar("T")


def _key(seed: int, qid: str) -> bytes:
    return hashlib.sha1(f"{int(seed)}:{qid}".encode("utf-8")).digest()


def split_questions(questions: Sequence[T], heldout_fraction: float, seed: int = 0) -> tuple[list[T], list[T]]:
    """``(train, heldout)``: disjoint, together all of ``questions``, each in input order.

    ``heldout_fraction`` is in ``[0, 1]``; the held-out part has ``round(fraction · n)``
    questions. Items need an ``id`` attribute (``raggym.data.Question``) or an ``"id"`` key.
    """
    fraction = float(heldout_fraction)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be between 0 and 1, got {heldout_fraction}")
    items = list(questions)
    ids = [str(q["id"] if isinstance(q, dict) else q.id) for q in items]
    n_heldout = int(round(fraction * len(items)))
    # Ties (duplicate ids) are broken by position, so the split is still a function of the input.
    ranked = sorted(range(len(items)), key=lambda i: (_key(seed, ids[i]), i))
    heldout = set(ranked[:n_heldout])
    return ([q for i, q in enumerate(items) if i not in heldout], [q for i, q in enumerate(items) if i in heldout])


def hold_out(questions: Sequence[T], count: int, seed: int = 0) -> tuple[list[T], list[T]]:
    """``split_questions`` by a held-out count rather than a fraction: ``(train, heldout)`` with
    ``len(heldout) == count``."""
    items = list(questions)
    if not 0 <= count <= len(items):
        raise ValueError(f"cannot hold out {count} of {len(items)} questions")
    return split_questions(items, count / len(items) if items else 0.0, seed)


def hold_out_balanced(questions: Sequence[T], per_value: int, seed: int = 0, attribute: str = "kind") -> tuple[list[T], list[T]]:
    """``(train, heldout)`` with ``per_value`` held-out questions of each value of ``attribute``
    (``kind``: 48 ``direct`` + 48 ``graph_only`` on the routing task), so that a held-out mean
    does not lean to whichever type the world has more of. Each value's questions are split as
    ``hold_out`` splits a list (the same keys), and both parts keep the input order. A value with
    fewer than ``per_value`` questions, or a question without the attribute, is an error."""
    items = list(questions)
    ids = [str(q["id"] if isinstance(q, dict) else q.id) for q in items]
    values = [q.get(attribute) if isinstance(q, dict) else getattr(q, attribute) for q in items]
    if None in values:
        raise ValueError(f"question {ids[values.index(None)]!r} has no {attribute!r} to balance the held-out split by")
    held: set[int] = set()
    for value in sorted(set(values), key=str):
        members = [i for i, v in enumerate(values) if v == value]
        if not 0 <= per_value <= len(members):
            raise ValueError(f"cannot hold out {per_value} questions of {attribute} {value!r}: there are {len(members)}")
        held.update(sorted(members, key=lambda i: (_key(seed, ids[i]), i))[:per_value])  # split_questions' rule
    return [q for i, q in enumerate(items) if i not in held], [q for i, q in enumerate(items) if i in held]


__all__ = ["hold_out", "hold_out_balanced", "split_questions"]
