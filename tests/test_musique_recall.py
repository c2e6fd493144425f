"""The headline retrieval claim on real data: on all 60 MuSiQue questions of ../shared/data/musique_sub
(its full 1,890-passage corpus and shipped OpenIE triples, MiniLM embeddings), graph and hybrid
retrieval beat dense retrieval at recall@5, and each mode's recall is the measured one.

The measured values (README, "Performance") are pinned to ±RECALL_TOLERANCE = 0.01. Each question
has 2-4 gold passages, so one gold passage found or lost moves recall@5 by 1/(60·4) ≈ 0.004 to
1/(60·2) ≈ 0.008: the tolerance admits one such change (float noise between machines reordering a
near-tie) and not two.
"""

from __future__ import annotations

import numpy as np
import pytest

# Embedding 1,890 passages, their OpenIE phrases and facts: about 5 CPU-minutes with a cold embedding
# cache, 1.4 with a warm one (~/.cache/raggym), more than `make test` can spare:
# CI's integration target.
pytestmark = pytest.mark.integration

MEASURED_RECALL_AT_5 = {"passage": 0.6097, "graph": 0.7194, "hybrid": 0.7042}  # 2026-11-23, this machine
RECALL_TOLERANCE = 0.01


def recall_at(results, questions, k: int) -> float:
    """Mean over questions of the share of gold passages among the first k hits."""
    return float(np.mean([len(set(r.ids[:k]) & set(q.gold_passage_ids)) / len(q.gold_passage_ids)
                          for r, q in zip(results, questions)]))


@pytest.fixture(scope="module")
def musique_recalls(musique_dir):
    from raggym.data import load_corpus, load_questions
    from raggym.retrieval import Retriever

    corpus = load_corpus(musique_dir / "corpus.json")
    questions = load_questions(musique_dir / "questions.json", corpus)
    assert len(questions) == 60 and len(corpus) == 1890
    retriever = Retriever.build(corpus, embedder="minilm", openie=musique_dir / "openie_gpt-3.5-turbo-1106.json",
                                show_progress=False)
    texts = [q.question for q in questions]
    return {mode: recall_at(retriever.retrieve(texts, mode, 5), questions, 5) for mode in MEASURED_RECALL_AT_5}


def test_graph_and_hybrid_beat_dense_on_musique(musique_recalls):
    r5 = musique_recalls
    assert r5["graph"] > r5["passage"] and r5["hybrid"] > r5["passage"], r5


@pytest.mark.parametrize("mode", list(MEASURED_RECALL_AT_5))
def test_recall_at_5_is_the_measured_value(musique_recalls, mode):
    assert musique_recalls[mode] == pytest.approx(MEASURED_RECALL_AT_5[mode], abs=RECALL_TOLERANCE), musique_recalls
