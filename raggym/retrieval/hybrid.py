"""Reciprocal-rank fusion (Cormack et al., 2009) of several ranked lists.

    score(d) = sum over lists L containing d of 1 / (k_rrf + rank_L(d)),   rank starting at 1

Each list counts a passage at most once (its best rank), so a duplicated id inside one list does
not double its vote. Ties in the fused score are broken by the best single-list rank, then by
the order of first appearance (list order, then position), so the output is deterministic.
"""

from __future__ import annotations

from typing import Hashable, Sequence

DEFAULT_K_RRF = 60


def rrf_fuse(rankings: Sequence[Sequence[Hashable]], k_rrf: int = DEFAULT_K_RRF, depth: int | None = None) -> list[tuple[Hashable, float]]:
    """Fuse ranked id lists; return ``(id, score)`` pairs, best first, ids deduplicated.

    ``depth`` truncates every input list before fusing (``None`` keeps them whole).
    """
    if k_rrf < 0:
        raise ValueError(f"k_rrf must be non-negative, got {k_rrf}")
    score: dict[Hashable, float] = {}
    best_rank: dict[Hashable, int] = {}
    first_seen: dict[Hashable, int] = {}
    for ranking in rankings:
        seen_here: set = set()
        for rank, item in enumerate(ranking[:depth] if depth is not None else ranking, start=1):
            if item in seen_here:
                continue
            seen_here.add(item)
            score[item] = score.get(item, 0.0) + 1.0 / (k_rrf + rank)
            best_rank[item] = min(best_rank.get(item, rank), rank)
            first_seen.setdefault(item, len(first_seen))
    return sorted(score.items(), key=lambda kv: (-kv[1], best_rank[kv[0]], first_seen[kv[0]]))
