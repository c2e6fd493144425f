"""``RetrievalMemo``: one rollout call's retrievals, each asked of the retriever once.

The G samples of a GRPO group often issue the same search (the question itself, in the same mode),
and usually not at the same moment, so the retrieval batches of one rollout call repeat each
other. The rollout loop's ``RetrievalBatcher`` keeps one ``RetrievalMemo`` per call (one training
step's rollout on one runner): a request identical to one already answered, or already sent, in
that call gets the same answer without a new retrieval, and identical requests gathered into one
batch are sent once.

Two requests are identical when they have the same key: the retriever object (``id``; the memo
holds a reference to it, so the id cannot be reused during the call), the mode, ``k`` and the exact
query string. One retriever object is one index: ``LocalBackend`` envs carry the retriever (or the
knowledge bases) they were made with, and an ``EnvRunner`` hands every env the same
``ServiceRetriever`` per retrieval service. Two objects over the same index are two keys: the memo
may retrieve twice, never serve one index's answer for another's.

Served answers are the very ``QueryResult`` objects the retriever returned for the first
request, so an episode served from the memo records what a retrieval of its own would have
returned (hits, facts, and the ``seconds`` and ``cost`` of that retrieval). Environments only
read a ``QueryResult`` (``finish_step`` copies what it keeps into tuples of its record), which is
what makes sharing one object safe. The memo is the one place where identical retrievals are
folded: the rollout loop's batcher keeps one per step, and ``retrieve_distinct`` gives a batch
outside the loop (``envs.batching.step_batch``, the served retriever) the same folding.

The memo stores opaque entries (the batcher stores one ``asyncio.Future`` per key) and counts:

- ``retrieval_requests``: requests asked of it (every search of every episode);
- ``retrieval_unique``: requests sent to the retriever;
- ``retrieval_memo_hits``: requests answered by an earlier batch's retrieval (answered or in flight);
- ``retrieval_batch_duplicates``: requests folded into an identical request of their own batch.

Once every batch is out, ``requests == unique + memo_hits + batch_duplicates``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

COUNTERS = ("retrieval_requests", "retrieval_unique", "retrieval_memo_hits", "retrieval_batch_duplicates")


class RetrievalMemo:
    """Entries by retrieval key for one rollout call, and the counts above."""

    def __init__(self):
        self._entries: dict[tuple, Any] = {}
        self._retrievers: dict[int, Any] = {}  # every keyed retriever, alive for the memo's lifetime
        self.requests = self.unique = self.memo_hits = self.batch_duplicates = 0

    @staticmethod
    def key(request) -> tuple:
        """``(id(retriever), mode, k, query)`` of an ``envs.stepping.RetrievalRequest``."""
        return id(request.retriever), str(request.mode), int(request.k), request.query

    def lookup(self, request) -> Any:
        """Count one request; the entry of an identical earlier request (a memo hit), else None."""
        self.requests += 1
        entry = self._entries.get(self.key(request))
        if entry is not None:
            self.memo_hits += 1
        return entry

    def fold(self, requests: Sequence) -> list[int]:
        """Per request of a batch (none of them in the memo), the index of the first identical request.

        A request that is its own first is sent to the retriever (``retrieval_unique``); the
        others are answered with it (``retrieval_batch_duplicates``).
        """
        first: dict[tuple, int] = {}
        owners = []
        for i, request in enumerate(requests):
            owner = first.setdefault(self.key(request), i)
            owners.append(owner)
            if owner == i:
                self.unique += 1
            else:
                self.batch_duplicates += 1
        return owners

    def store(self, request, entry: Any) -> None:
        """Remember ``entry`` as the answer to ``request`` and to every identical later request."""
        if entry is None:
            raise ValueError("a memo entry cannot be None")
        self._retrievers[id(request.retriever)] = request.retriever
        self._entries[self.key(request)] = entry

    def forget(self, request) -> None:
        """Drop ``request``'s entry (its retrieval failed: a later identical request retrieves again)."""
        self._entries.pop(self.key(request), None)

    def __len__(self) -> int:
        return len(self._entries)

    def counts(self) -> dict[str, int]:
        """The four counters, by their names in ``COUNTERS``."""
        return dict(zip(COUNTERS, (self.requests, self.unique, self.memo_hits, self.batch_duplicates)))


def retrieve_distinct(requests: Sequence, retrieve: Callable[[list], Sequence]) -> list:
    """``retrieve`` (a batch call, one answer per request) on the distinct requests of one batch;
    every request gets the answer of the first request identical to it."""
    owners = RetrievalMemo().fold(requests)
    sent = [i for i, owner in enumerate(owners) if owner == i]
    answers = list(retrieve([requests[i] for i in sent]))
    if len(answers) != len(sent):
        raise RuntimeError(f"retrieval returned {len(answers)} results for {len(sent)} requests")
    by_owner = dict(zip(sent, answers))
    return [by_owner[owner] for owner in owners]


__all__ = ["COUNTERS", "RetrievalMemo", "retrieve_distinct"]
