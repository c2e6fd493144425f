"""What a parsed assistant segment means: the ``Action`` and the ``FormatCheck`` verdict.

A segment is the text the policy generated for one turn, ending at one of the dialect's stop
strings. Parsing never fails: text that does not follow the dialect becomes an ``Action`` of kind
``"invalid"`` whose ``error`` says what was wrong, so that an environment can answer with a
format-error observation instead of raising.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK = "think"  # reasoning only, no search and no answer
SEARCH = "search"  # one retrieval request (RouteRAG, Search-R1, Graph-R1, LWS, GraphRAG-R1)
ANSWER = "answer"  # final answer, or an intermediate answer in R1-Router's answer steps
ROUTE = "route"  # R1-Router routing step: a sub-question sent to one knowledge base
INVALID = "invalid"  # anything that does not follow the dialect

ACTION_KINDS = (THINK, SEARCH, ANSWER, ROUTE, INVALID)


@dataclass(frozen=True, slots=True)
class Action:
    """One parsed segment.

    ``mode`` is the retrieval mode of a search (``passage``/``graph``/``hybrid``; ``None`` when
    the dialect has no modes and the environment's default applies) or the knowledge-base name of
    a route. A route whose sub-question and knowledge base are both ``None`` in the text is the
    R1-Router stop signal: ``kind == "route"`` with ``query is None`` (see ``stops_routing``).

    ``well_formed`` is stricter than validity: a valid action may still carry free text outside
    the dialect's tags or skip the reasoning block. Environments execute any valid action; format
    rewards can look at ``well_formed`` or at the trajectory-level ``Dialect.format_check``.
    """

    kind: str
    mode: str | None = None
    query: str | None = None
    answer: str | None = None
    reasoning: str = ""
    error: str | None = None
    well_formed: bool = False

    @property
    def is_valid(self) -> bool:
        """True when an environment can execute the action (search, answer or route)."""
        return self.kind in (SEARCH, ANSWER, ROUTE)

    @property
    def stops_routing(self) -> bool:
        return self.kind == ROUTE and self.query is None

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "mode": self.mode,
            "query": self.query,
            "answer": self.answer,
            "reasoning": self.reasoning,
            "error": self.error,
            "well_formed": self.well_formed,
        }


def invalid(error: str, reasoning: str = "") -> Action:
    return Action(kind=INVALID, error=error, reasoning=reasoning)


@dataclass(frozen=True, slots=True)
class FormatCheck:
    """Verdict of a trajectory-level format check.

    ``ok`` is the verdict, ``reason`` explains a failure, ``structure`` is the compact block
    sequence that was matched (for example ``"T SIR SIR A"`` for LWS), useful in error reports,
    and ``num_searches`` counts the retrieval blocks seen.
    """

    ok: bool
    reason: str | None = None
    structure: str = ""
    num_searches: int = 0

    def __bool__(self) -> bool:
        return self.ok
