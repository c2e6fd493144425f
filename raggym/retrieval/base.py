"""Shared result types for every retrieval mode.

``Retriever.retrieve(queries, mode, k)`` returns one ``QueryResult`` per query. ``seconds`` is
measured wall time; ``cost`` is a deterministic work count (it depends only on the work done, not
on the machine), so rewards that penalise retrieval effort can be made reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("passage", "graph", "hybrid")


@dataclass(frozen=True)
class Hit:
    id: str
    title: str
    text: str
    score: float

    def as_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "score": float(self.score), "text": self.text}


@dataclass
class QueryResult:
    query: str
    hits: list[Hit] = field(default_factory=list)
    seconds: float = 0.0
    cost: float = 0.0
    mode: str = "passage"
    # Facts the graph mode linked the query to, as (subject, relation, object, score); empty for
    # passage mode. GraphRAG-R1 observations mix these with passages.
    facts: list[tuple[str, str, str, float]] = field(default_factory=list)
    # Why a query produced no hits (empty, too long, not valid UTF-8); None when it was served.
    error: str | None = None

    @property
    def ids(self) -> list[str]:
        return [h.id for h in self.hits]

    def as_dict(self) -> dict:
        out = {
            "query": self.query,
            "hits": [h.as_dict() for h in self.hits],
            "seconds": float(self.seconds),
            "cost": float(self.cost),
        }
        if self.error is not None:
            out["error"] = self.error
        return out


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown retrieval mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode
