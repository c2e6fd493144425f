"""The retriever interface environments depend on.

Any object with ``retrieve(queries, mode, k) -> list[QueryResult]`` works: the real
``raggym.retrieval.Retriever``, a Ray ``RetrievalService`` handle wrapper, a precomputed table in
a benchmark, or a small keyword retriever in tests. Environments only ever call it with a
non-empty list of clean, one-line queries and one of ``raggym.retrieval.base.MODES`` (or the
mode configured for a knowledge base), and expect one ``QueryResult`` per query, in order.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from raggym.retrieval.base import QueryResult


@runtime_checkable
class Retriever(Protocol):
    def retrieve(self, queries: list[str], mode: str, k: int) -> Sequence[QueryResult]: ...


def check_retriever(obj: object, what: str = "retriever") -> None:
    if not callable(getattr(obj, "retrieve", None)):
        raise TypeError(
            f"{what} must have a retrieve(queries, mode, k) method, got {type(obj).__name__}"
        )
