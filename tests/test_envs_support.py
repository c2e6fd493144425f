"""Test fixtures shared by the environment tests (this module holds no tests).

``KeywordRetriever`` is a real but deliberately tiny retriever: it ranks passages by how many
query words they share (ties broken by corpus order) and, in graph and hybrid modes, also returns
the triples whose subject or object is mentioned in the query. It stands in for the dense and
graph retrievers so that environment tests are fast and need no models.
"""

from __future__ import annotations

import re
import time

from raggym.data.types import Passage, Question
from raggym.retrieval.base import Hit, QueryResult

_WORD_RE = re.compile(r"[a-z0-9]+")
_STOP_WORDS = frozenset("a an the of in on at to is was who what which when where did does by for".split())


def words(text: str) -> set[str]:
    return {w for w in _WORD_RE.findall(text.lower()) if w not in _STOP_WORDS}


class KeywordRetriever:
    def __init__(self, passages, triples=()):
        self.passages = list(passages)
        self.triples = list(triples)
        self._words = [words(p.title + " " + p.text) for p in self.passages]
        self.calls: list[tuple[tuple[str, ...], str, int]] = []

    def retrieve(self, queries, mode, k):
        self.calls.append((tuple(queries), mode, k))
        return [self._one(q, mode, k) for q in queries]

    def _one(self, query, mode, k):
        start = time.perf_counter()
        q = words(query)
        scored = sorted(
            ((len(q & w), -i) for i, w in enumerate(self._words) if q & w), reverse=True
        )[:k]
        hits = [
            Hit(self.passages[-i].id, self.passages[-i].title, self.passages[-i].text, float(s))
            for s, i in scored
        ]
        facts = []
        if mode in ("graph", "hybrid"):
            for s, r, o in self.triples:
                if words(s) & q or words(o) & q:
                    facts.append((s, r, o, 1.0))
        # Deterministic work count: passages scored, plus triples visited in graph modes.
        cost = float(len(self.passages) + (len(self.triples) if mode != "passage" else 0))
        return QueryResult(query, hits, time.perf_counter() - start, cost, mode, facts)


PASSAGES = [
    Passage.from_content("Inception", "Inception is a 2010 film directed by Christopher Nolan."),
    Passage.from_content("Christopher Nolan", "Christopher Nolan was born in London in 1970."),
    Passage.from_content("London", "London is the capital of England."),
    Passage.from_content("Paris", "Paris is the capital of France."),
    Passage.from_content("Jaws", "Jaws is a 1975 film directed by Steven Spielberg."),
]
TRIPLES = [
    ("Inception", "directed by", "Christopher Nolan"),
    ("Christopher Nolan", "born in", "London"),
    ("Jaws", "directed by", "Steven Spielberg"),
]
QUESTIONS = [
    Question(
        id="q-nolan",
        question="Where was the director of Inception born?",
        answers=("London",),
        gold_passage_ids=(PASSAGES[0].id, PASSAGES[1].id),
        hops=2,
        golden_trajectory=(
            {"query": "director of Inception", "mode": "graph", "kb": "Text Retriever", "answer": "Christopher Nolan"},
            {"query": "Christopher Nolan born", "mode": "passage", "kb": "Text Retriever", "answer": "London"},
        ),
    ),
    Question(id="q-france", question="What is the capital of France?", answers=("Paris",), gold_passage_ids=(PASSAGES[3].id,), hops=1),
]


def make_retriever() -> KeywordRetriever:
    return KeywordRetriever(PASSAGES, TRIPLES)


def play_to_the_end(env, segments) -> None:
    """Step ``env`` (already reset) through ``segments`` until the episode ends; if they run out
    first, end it from outside as the rollout loop does when its token budget is spent."""
    for segment in segments:
        *_, terminated, truncated, _ = env.step(segment)
        if terminated or truncated:
            return
    env.truncate("response_tokens")
