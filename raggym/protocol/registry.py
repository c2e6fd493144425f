"""Dialects by name."""

from __future__ import annotations

from raggym.protocol.action import ANSWER, ROUTE, SEARCH
from raggym.protocol.base import Dialect, _close_literal, _open_literal
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
            f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}"
        ) from None


def register_dialect(cls: type[Dialect], *, replace: bool = False) -> Dialect:
    """Make a new ``Dialect`` subclass available by name everywhere a dialect name is accepted
    (``get_dialect``, the environments, ``RolloutBuilder``'s span labels).

    The span-labelling rules (``raggym.algorithms.spans.DIALECT_TAGS``) are derived from the
    class: reasoning blocks label THINK, search/route blocks QUERY, the answer block ANSWER and the
    observation block OBSERVATION. The six built-in names cannot be replaced. In a multi-process
    run, register in a module that every process imports (for example the module holding the
    environment's gymnasium entry point). Returns the shared instance."""
    # Imported on use: raggym.algorithms.spans imports torch, which `import raggym, envs` avoids.
    from raggym.algorithms.spans import DIALECT_TAGS, SpanLabel, TagRule

    if not (isinstance(cls, type) and issubclass(cls, Dialect)):
        raise TypeError(f"register_dialect expects a Dialect subclass, got {cls!r}")
    name = cls.name
    if not name or not isinstance(name, str):
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    if name in DIALECT_NAMES or (name in DIALECTS and not replace):
        raise ValueError(f"a dialect called {name!r} is already registered")
    instance = cls()
    labels = {block: SpanLabel.THINK for block in (*cls.reasoning_blocks, *cls.transparent_blocks)}
    for block, kind in cls.action_blocks.items():
        labels[block] = {SEARCH: SpanLabel.QUERY, ROUTE: SpanLabel.QUERY, ANSWER: SpanLabel.ANSWER}.get(kind, SpanLabel.OTHER)
    labels[cls.observation_block] = SpanLabel.OBSERVATION
    rules = tuple(TagRule(b, _open_literal(b), _close_literal(b), label) for b, label in labels.items())
    DIALECT_CLASSES[name] = cls
    DIALECTS[name] = instance
    DIALECT_TAGS[name] = rules
    return instance


def unregister_dialect(name: str) -> None:
    """Remove a dialect added with ``register_dialect`` (built-ins stay)."""
    # Imported on use: raggym.algorithms.spans imports torch, which `import raggym, envs` avoids.
    from raggym.algorithms.spans import DIALECT_TAGS

    if name in DIALECT_NAMES:
        raise ValueError(f"{name!r} is a built-in dialect and cannot be removed")
    for table in (DIALECT_CLASSES, DIALECTS, DIALECT_TAGS):
        table.pop(name, None)
