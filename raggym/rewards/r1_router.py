"""R1-Router step rewards for Step-GRPO: router steps, intermediate answers and the final answer.

Peng et al., "Learning to Route Queries across Knowledge Bases for Step-wise Retrieval-Augmented
Reasoning" (R1-Router), 2025, arXiv:2505.22095 — Step-GRPO and its step-specific rewards.

A trajectory alternates router steps
(``<think>…</think><sub-question>q</sub-question><ret>KB</ret>``) and intermediate-answer steps, then ends with a final answer. Each step is scored on its own and
Step-GRPO normalises within groups of the same (prompt, step index)
(``raggym.algorithms.step_grpo_advantages``).

Router step, with q the generated sub-question and q* the reference sub-question::

    R_route = r_format · (0.5 · sim(E(q), E(q*)) + 0.5 · [route = gold])
    sim(u, v) = (u / ‖u‖) · (v / ‖v‖)

``r_format`` is 1 when the step is well formed, else 0. The route indicator counts only when the
``<ret>`` field names **exactly one** valid knowledge base: the field is split on ``,``, ``;``,
``|``, ``/``, `` and `` and `` or ``; there must be one piece, it must be (case-insensitively) one
of ``valid_kbs``, and it must equal the gold KB. Include ``"None"`` in ``valid_kbs`` when the
stop action is a legal route.

Intermediate answer::

    R_mid = recall(answer, reference)        (token recall after SQuAD normalisation)

Final answer::

    R_final = 1 if recall(answer, gold) = 1, else 0
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import numpy as np

from raggym.rewards.metrics import token_recall

_KB_SEPARATORS = re.compile(r"\s*(?:,|;|\||/|\band\b|\bor\b)\s*", flags=re.IGNORECASE)


def normalized_dot(u: np.ndarray, v: np.ndarray) -> float:
    """sim(u, v) = u·v / (‖u‖ ‖v‖); 0 if either vector is zero."""
    a = np.asarray(u, dtype=np.float64).ravel()
    b = np.asarray(v, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"embedding shapes differ: {a.shape} vs {b.shape}")
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b / (na * nb))  # (u/‖u‖)·(v/‖v‖)


def chosen_knowledge_bases(ret: str | Sequence[str]) -> list[str]:
    """The KB names written in a ``<ret>`` field (a string) or given as a list, stripped."""
    pieces = _KB_SEPARATORS.split(ret) if isinstance(ret, str) else list(ret)
    return [p.strip() for p in pieces if p and p.strip()]


def route_is_gold(ret: str | Sequence[str], gold_kb: str, valid_kbs: Iterable[str]) -> bool:
    """[route = gold]: exactly one valid KB was chosen and it is the gold one."""
    chosen = chosen_knowledge_bases(ret)
    valid = {kb.lower() for kb in valid_kbs}
    if len(chosen) != 1 or chosen[0].lower() not in valid:
        return False
    return chosen[0].lower() == gold_kb.lower()


def router_step_reward(
    format_ok: bool,
    sub_question_embedding: np.ndarray,
    gold_sub_question_embedding: np.ndarray,
    ret: str | Sequence[str],
    gold_kb: str,
    valid_kbs: Iterable[str],
) -> float:
    """R_route = r_format · (0.5·sim(E(q), E(q*)) + 0.5·[route = gold])."""
    r_format = 1.0 if format_ok else 0.0
    similarity = normalized_dot(sub_question_embedding, gold_sub_question_embedding)
    route_hit = 1.0 if route_is_gold(ret, gold_kb, valid_kbs) else 0.0
    return r_format * (0.5 * similarity + 0.5 * route_hit)  # r_f · (½ sim + ½ [route = gold])


def intermediate_answer_reward(answer: str | None, reference: str | Sequence[str]) -> float:
    """R_mid = token recall of the reference in the intermediate answer."""
    return token_recall(answer, reference)


def final_answer_reward(answer: str | None, gold: str | Sequence[str]) -> float:
    """R_final = 1 if every gold token is recalled, else 0."""
    return 1.0 if token_recall(answer, gold) == 1.0 else 0.0
