"""Dialects by name."""

from __future__ import annotations

from raggym.protocol.base import Dialect
from raggym.protocol.graph_r1 import GraphR1Dialect
from raggym.protocol.graphrag_r1 import GraphRAGR1Dialect
from raggym.protocol.lws import LWSDialect
from raggym.protocol.r1_router import R1RouterDialect
from raggym.protocol.routerag import RouteRAGDialect
from raggym.protocol.search_r1 import SearchR1Dialect

DIALECT_CLASSES: dict[str, type[Dialect]] = {
    cls.name: cls
    for cls in (
        RouteRAGDialect,
        SearchR1Dialect,
        GraphR1Dialect,
        LWSDialect,
        GraphRAGR1Dialect,
        R1RouterDialect,
    )
}

DIALECT_NAMES = tuple(DIALECT_CLASSES)

# Dialects are stateless; one shared default instance each. R1-Router's knowledge-base names are
# configuration, so environments build their own R1RouterDialect.
DIALECTS: dict[str, Dialect] = {name: cls() for name, cls in DIALECT_CLASSES.items()}


def get_dialect(dialect: str | Dialect) -> Dialect:
    """The dialect called ``dialect`` (or ``dialect`` itself when it already is one)."""
    if isinstance(dialect, Dialect):
        return dialect
    try:
        return DIALECTS[dialect]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECT_NAMES)}"
        ) from None
