"""Text protocols ("dialects") that the supported papers' agents speak.

Each dialect parses one assistant segment into an ``Action``, renders observations in its own
tags, names the stop strings that end a segment, writes the instruction prompt, and checks the
format of a whole trajectory:

>>> from raggym.protocol import get_dialect
>>> d = get_dialect("routerag")
>>> d.parse("<think>need a fact</think><search> [graph] capital of France </search>").mode
'graph'

Parsing never raises on a string: malformed text becomes ``Action(kind="invalid", error=...)``.
"""

from raggym.protocol.action import (
    ACTION_KINDS,
    ANSWER,
    INVALID,
    ROUTE,
    SEARCH,
    THINK,
    Action,
    FormatCheck,
)
from raggym.protocol.base import Dialect
from raggym.protocol.graph_r1 import GraphR1Dialect
from raggym.protocol.graphrag_r1 import GraphRAGR1Dialect
from raggym.protocol.lws import LWSDialect
from raggym.protocol.r1_router import PAPER_KNOWLEDGE_BASES, R1RouterDialect
from raggym.protocol.registry import (
    DIALECT_CLASSES,
    DIALECT_NAMES,
    DIALECTS,
    get_dialect,
    register_dialect,
    unregister_dialect,
)
from raggym.protocol.routerag import RouteRAGDialect
from raggym.protocol.search_r1 import SearchR1Dialect
from raggym.protocol.tags import scan_tags

__all__ = [
    "ACTION_KINDS",
    "ANSWER",
    "INVALID",
    "ROUTE",
    "SEARCH",
    "THINK",
    "Action",
    "FormatCheck",
    "Dialect",
    "DIALECTS",
    "DIALECT_CLASSES",
    "DIALECT_NAMES",
    "get_dialect",
    "register_dialect",
    "unregister_dialect",
    "RouteRAGDialect",
    "SearchR1Dialect",
    "GraphR1Dialect",
    "LWSDialect",
    "GraphRAGR1Dialect",
    "R1RouterDialect",
    "PAPER_KNOWLEDGE_BASES",
    "scan_tags",
]
