"""Answer and evidence metrics on texts, shared by every reward and by the evaluation harness.

Normalisation follows the SQuAD evaluation script: lowercase, drop ASCII punctuation, drop the
articles *a*, *an*, *the*, and collapse whitespace. Every answer metric takes the **maximum over
the gold answers** (the main answer and its aliases), so a prediction only has to match one.

Definitions (``norm`` is the normalisation above, ``toks`` splits it on whitespace, and ``∩`` is
multiset intersection):

    EM(p, G)       = max_g [norm(p) == norm(g)]
    cover-EM(p, G) = max_g [toks(g) appears as a contiguous token run inside toks(p)]
    F1(p, g)       = 2·P·R / (P + R),  P = |toks(p) ∩ toks(g)| / |toks(p)|,
                                       R = |toks(p) ∩ toks(g)| / |toks(g)|
    recall(p, g)   = |toks(p) ∩ toks(g)| / |toks(g)|                       (R1-Router)
    EO             = mean_{d ∈ gold passages} F1(concat(all retrieved text), d)   (PathRouter)
    UAR(a, docs)   = |{answer tokens not present in any retrieved text}| / |answer tokens|

A prediction of ``None`` (no answer was given) scores 0 on every answer metric.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, strip punctuation and articles, collapse whitespace."""
    text = text.lower()
    # Punctuation is removed before articles so that "the," still loses its article.
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_tokens(text: str | None) -> list[str]:
    """Normalised whitespace tokens of ``text``; ``None`` has no tokens."""
    if text is None:
        return []
    return normalize_answer(text).split()


def _as_gold_list(gold: str | Iterable[str]) -> list[str]:
    if isinstance(gold, str):
        return [gold]
    golds = list(gold)
    if not golds:
        raise ValueError("at least one gold answer is required")
    return golds


def _overlap(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> int:
    return sum((Counter(pred_tokens) & Counter(gold_tokens)).values())


def _f1_tokens(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # SQuAD v2 convention: two empty strings agree, one empty string matches nothing.
        return float(not pred_tokens and not gold_tokens)
    common = _overlap(pred_tokens, gold_tokens)
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)  # F1 = 2PR / (P + R)


def exact_match(prediction: str | None, gold: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _as_gold_list(gold)))


def cover_exact_match(prediction: str | None, gold: str | Iterable[str]) -> float:
    """1.0 if some gold answer occurs inside the prediction, else 0.0.

    Containment is checked on normalised *tokens*, so the gold "1" is not found inside "1990".
    A gold answer that normalises to nothing (e.g. "the") is never contained.
    """
    if prediction is None:
        return 0.0
    padded_pred = f" {normalize_answer(prediction)} "
    for g in _as_gold_list(gold):
        norm_gold = normalize_answer(g)
        if norm_gold and f" {norm_gold} " in padded_pred:
            return 1.0
    return 0.0


def token_f1(prediction: str | None, gold: str | Iterable[str]) -> float:
    """Token-level F1 between prediction and gold, maximised over the gold answers."""
    if prediction is None:
        return 0.0
    pred_tokens = answer_tokens(prediction)
    return max(_f1_tokens(pred_tokens, answer_tokens(g)) for g in _as_gold_list(gold))


def token_recall(prediction: str | None, reference: str | Iterable[str]) -> float:
    """Share of reference tokens (multiset) found in the prediction, maximised over references.

    An empty reference is recalled only by an empty prediction, mirroring the F1 convention.
    """
    if prediction is None:
        return 0.0
    pred_tokens = answer_tokens(prediction)
    best = 0.0
    for ref in _as_gold_list(reference):
        ref_tokens = answer_tokens(ref)
        if not ref_tokens:
            score = float(not pred_tokens)
        else:
            score = _overlap(pred_tokens, ref_tokens) / len(ref_tokens)  # recall = |p ∩ g| / |g|
        best = max(best, score)
    return best


def evidence_overlap(retrieved_texts: Iterable[str], gold_passages: Sequence[str]) -> float:
    """PathRouter's EO: mean over gold passages of token-F1(all retrieved text, gold passage).

    ``retrieved_texts`` is every passage text returned during the trajectory, in order; they are
    concatenated as they are (a passage retrieved twice counts twice, which is what "all retrieved
    text" says, and lowers precision). Without gold passages EO is 0.0 by convention, so callers
    that train on EO must make sure their questions carry gold evidence.
    """
    if not gold_passages:
        return 0.0
    retrieved_tokens = answer_tokens(" ".join(retrieved_texts))
    # EO = (1/|D*|) Σ_{d ∈ D*} F1(concat(retrieved), d)
    return sum(_f1_tokens(retrieved_tokens, answer_tokens(d)) for d in gold_passages) / len(
        gold_passages
    )


def unsupported_answer_rate(answer: str | None, retrieved_texts: Iterable[str]) -> float | None:
    """Share of the answer's normalised tokens that appear in no retrieved text.

    Returns ``None`` when the answer has no tokens (no answer, or an answer made only of
    punctuation and articles): the rate is undefined there and averages should skip it.
    """
    tokens = answer_tokens(answer)
    if not tokens:
        return None
    support = set(answer_tokens(" ".join(retrieved_texts)))
    unsupported = sum(1 for tok in tokens if tok not in support)
    return unsupported / len(tokens)  # UAR = |answer tokens ∉ retrieved| / |answer tokens|
