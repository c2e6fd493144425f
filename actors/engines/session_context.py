"""A session's context kept on the rollout worker, so that each turn sends only what is new.

Turn ``n`` of an episode's session is the whole context so far: the prompt, then every earlier
turn's sampled ids and observation ids. The worker already holds all of it but the newest
observation: it saw the context of turn ``n - 1`` and sampled that turn's ids itself. So the
caller (``actors.env_runner.RayBackend``) sends ``keep``, how many of the held ids the new context
starts with, and the ids after them; the worker rebuilds the context from its copy and hands the
whole of it to the engine, whose prefix cache (vLLM's) finds the earlier turns' KV blocks again.

``keep`` is usually all of the held ids. It is fewer when the rollout kept only part of a turn's
sampled ids (the response budget cut them), and 0 on a session's first turn. A worker that does
not hold ``keep`` ids of the session (Ray restarted it, or the session ended) refuses with
``SessionContextLostError``, and the caller sends the whole context again.
"""

from __future__ import annotations

from typing import Sequence


class SessionContextLostError(RuntimeError):
    """The worker does not hold the part of a session's context that a call continues from."""


def shared_prefix_length(held: Sequence[int], context: Sequence[int]) -> int:
    """How many leading ids ``held`` and ``context`` have in common."""
    n = min(len(held), len(context))
    if list(held[:n]) == list(context[:n]):  # the usual case, compared at C speed
        return n
    low, high = 0, n  # held[:low] == context[:low] and held[:high] != context[:high]: halve the gap
    while high - low > 1:
        middle = (low + high) // 2
        if list(held[low:middle]) == list(context[low:middle]):
            low = middle
        else:
            high = middle
    return low


class HeldContexts:
    """The worker's copy of each open session's context: what it was last asked plus what it sampled."""

    def __init__(self):
        self._held: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def rebuild(self, session_id: str, keep: int, new_token_ids: Sequence[int]) -> list[int]:
        """The turn's whole context: the first ``keep`` held ids, then ``new_token_ids``."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        held = self._held.get(session_id, [])
        if keep > len(held):
            raise SessionContextLostError(
                f"session {session_id!r}: asked to continue from {keep} held ids but this worker holds "
                f"{len(held)} (it was restarted or the session ended); send the whole context (keep=0)")
        return held[:keep] + [int(t) for t in new_token_ids]

    def record(self, session_id: str, context: list[int], sampled_ids: Sequence[int]) -> None:
        """After a turn: the session now holds its context followed by the ids just sampled."""
        self._held[session_id] = context + [int(t) for t in sampled_ids]

    def end(self, session_id: str) -> None:
        self._held.pop(session_id, None)


class SentContexts:
    """The caller's mirror of ``HeldContexts``: per session, the ids the worker holds, so that a
    turn sends only the ids after the shared part (``delta``). Counts the ids sent and the ids of
    the contexts they stand for."""

    def __init__(self):
        self._held: dict[str, list[int]] = {}
        self.ids_sent = 0  # ids that crossed to the workers
        self.context_ids = 0  # ids of the contexts those calls stood for (what sending them whole would cost)

    def delta(self, session_id: str, context: Sequence[int]) -> tuple[int, list[int]]:
        """``(keep, new_ids)`` for this turn: the worker rebuilds ``context`` as held[:keep] + new_ids."""
        keep = shared_prefix_length(self._held.get(session_id, ()), context)
        return keep, list(context[keep:])

    def sent(self, session_id: str, context: Sequence[int], new_ids: Sequence[int], sampled_ids: Sequence[int]) -> None:
        """A call went through: count it and mirror what the worker now holds."""
        self.ids_sent += len(new_ids)
        self.context_ids += len(context)
        self._held[session_id] = [*context, *sampled_ids]

    def forget(self, session_id: str) -> None:
        self._held.pop(session_id, None)

    def counts(self) -> dict[str, int]:
        return {"context_ids_sent": self.ids_sent, "context_ids": self.context_ids}


__all__ = ["HeldContexts", "SentContexts", "SessionContextLostError", "shared_prefix_length"]
