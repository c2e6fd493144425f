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

``r_format`` is 1 when the step is well formed — exactly ``<think>…</think>`` then
``<sub-question>…</sub-question><ret>…</ret>``, nothing outside the blocks — else 0. A routing
step without its think block parses as a route (the environment still retrieves for it) but
scores ``r_format = 0`` (``step_format_ok``). The route indicator counts only when the
``<ret>`` field names **exactly one** valid knowledge base: the field is split on ``,``, ``;``,
``|``, ``/``, `` and `` and `` or ``; there must be one piece, it must be (case-insensitively) one
of ``valid_kbs``, and it must equal the gold KB. Include ``"None"`` in ``valid_kbs`` when the
stop action is a legal route.

Answer steps (Eq. 10: r(2) = r_format(a_i) · r_answer(a_i)); the appendix asks for the
reasoning inside ``<think>`` and the answer inside ``<answer>``, so ``r_format`` is the same
``step_format_ok`` test as for routing steps, applied to the intermediate and the final answer::

    R_mid   = r_format · recall(answer, reference)     (token recall after SQuAD normalisation)
    R_final = r_format · accuracy(answer, gold)

Accuracy (Eq. 24) is read as cover exact match (``raggym.rewards.metrics.cover_exact_match``):
1 when some normalised gold answer occurs in the normalised answer as a contiguous run of whole
tokens, else 0, the usual meaning of "accuracy" in open-domain QA evaluation. Full bag-of-tokens recall
(every gold token somewhere in the answer, in any order) would be a looser test: it accepts
"york is a new city" for the gold "New York".
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import numpy as np

from raggym.rewards.metrics import cover_exact_match, token_recall

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


def intermediate_answer_reward(format_ok: bool, answer: str | None, reference: str | Sequence[str]) -> float:
    """R_mid = r_format · token recall of the reference in the intermediate answer."""
    r_format = 1.0 if format_ok else 0.0
    return r_format * token_recall(answer, reference)  # r_f · recall


def final_answer_reward(format_ok: bool, answer: str | None, gold: str | Sequence[str]) -> float:
    """R_final = r_format · accuracy, accuracy being cover exact match (module docstring)."""
    r_format = 1.0 if format_ok else 0.0
    return r_format * cover_exact_match(answer, gold)  # r_f · [a normalised gold answer occurs in the answer]


# The knowledge-base names the model writes inside <ret> in raggym's R1-Router setting (the
# runtime names its retrieval services with them; "None" is the stop route).
TEXT_KB, TABLE_KB = "Text Retriever", "Table Retriever"
DEFAULT_KNOWLEDGE_BASES = (TEXT_KB, TABLE_KB)
STOP_ROUTE = "None"


def step_format_ok(step) -> bool:
    """r_format of a recorded step (``RouteStepRecord.as_dict()``): accepted by the environment
    *and* well formed, which requires the think block before the action."""
    action = step.get("action") or {}
    return not step["format_error"] and bool(action.get("well_formed", False))


def r1_router_step_rewards(outcomes: Sequence, embed, knowledge_bases: Sequence[str] = DEFAULT_KNOWLEDGE_BASES) -> list[float]:
    """One reward per teacher-forced step (each outcome holds exactly one step record).

    Routing step: ``R_route`` with ``None`` as the stop action's sub-question and route. The gold
    of a routing step past the golden trajectory (sampled only with ``advantage.stop_route_group``)
    is the stop action itself, which the environment records as ``"None"``; any other missing gold
    is an error, never a silent reward.
    Intermediate answer: ``R_mid`` against the golden step answer. Final answer: ``R_final``.
    Every phase takes ``r_format`` from ``step_format_ok`` (Eq. 10 gates answer steps too).
    ``embed(texts) -> [n, d]`` embeds sub-questions (one batched call for the whole batch).
    """
    steps = []
    for i, outcome in enumerate(outcomes):
        if len(outcome.steps) != 1:
            raise ValueError(f"R1-Router's Step-GRPO reward scores one teacher-forced step per rollout; "
                             f"rollout {i} ({outcome.prompt_id}) has {len(outcome.steps)} steps")
        steps.append(outcome.steps[0])
    for step, outcome in zip(steps, outcomes):
        needs = ("gold_sub_question", "gold_knowledge_base") if step["phase"] == "route" else ("gold_answer",)
        missing = [k for k in needs if step.get(k) is None]
        if missing:
            raise ValueError(f"question {outcome.prompt_id}: {step['phase']} step {step.get('route_step')} has no "
                             f"{', '.join(missing)}; R1-Router needs golden steps for every rewarded step")
    routes = [s for s in steps if s["phase"] == "route"]
    texts = [s.get("sub_question") or STOP_ROUTE for s in routes] + [s["gold_sub_question"] for s in routes]
    vectors = np.asarray(embed(texts)) if texts else np.zeros((0, 1))
    embedded = {id(s): (vectors[i], vectors[len(routes) + i]) for i, s in enumerate(routes)}
    valid = [*knowledge_bases, STOP_ROUTE]
    rewards = []
    for step, outcome in zip(steps, outcomes):
        if step["phase"] == "route":
            q, gold_q = embedded[id(step)]
            rewards.append(router_step_reward(step_format_ok(step), q, gold_q,
                                              step.get("knowledge_base") or STOP_ROUTE, step["gold_knowledge_base"], valid))
        elif step["phase"] == "answer":
            rewards.append(intermediate_answer_reward(step_format_ok(step), step.get("answer"), step["gold_answer"]))
        else:
            rewards.append(final_answer_reward(step_format_ok(step), step.get("answer"), outcome.gold_answers))
    return [float(r) for r in rewards]
