"""RouteRAG dialect (Guo et al., 2025, "RouteRAG: Efficient Retrieval-Augmented Generation from
Text and Graph via Reinforcement Learning").

The agent reasons in ``<think>…</think>``, retrieves with ``<search> [mode] query </search>`` and
finishes with ``<answer>…</answer>``; results come back in ``<information>…</information>``. The
mode tag picks the retriever: ``[passage]`` (dense passages), ``[graph]`` (graph retrieval) or
both tags, in either order, for hybrid fusion.
"""

from __future__ import annotations

import re

from raggym.protocol.action import ANSWER, SEARCH
from raggym.protocol.base import Dialect

# Mode tags are bracketed identifiers at the start of the query. A bracket group that is not an
# identifier (for example "[1990 film]") ends the mode prefix and belongs to the query.
_MODE_TAG_RE = re.compile(r"\s*\[([A-Za-z_-]{1,24})\]")

_MODE_BY_TAGS = {
    frozenset({"passage"}): "passage",
    frozenset({"graph"}): "graph",
    frozenset({"graph", "passage"}): "hybrid",
}
_TAG_OF_MODE = {"passage": "[passage]", "graph": "[graph]", "hybrid": "[graph][passage]"}


class RouteRAGDialect(Dialect):
    name = "routerag"
    paper = "RouteRAG"
    stop_strings = ("</search>", "</answer>")
    reasoning_blocks = ("think",)
    action_blocks = {"search": SEARCH, "answer": ANSWER}
    observation_block = "information"
    modes = ("passage", "graph", "hybrid")
    mode_slot = r"<search>\s*\["
    trajectory_pattern = r"(?:tTsSiI)*tTaA"

    def _parse_search(self, content: str):
        tags: list[str] = []
        pos = 0
        while True:
            m = _MODE_TAG_RE.match(content, pos)
            if m is None:
                break
            tag = m.group(1)
            if tag not in ("passage", "graph"):
                return None, None, f"unknown retrieval mode [{tag}]; use [passage], [graph] or [graph][passage]"
            if tag in tags:
                return None, None, f"retrieval mode [{tag}] given twice"
            tags.append(tag)
            pos = m.end()
        if not tags:
            return None, None, "missing retrieval mode; start the query with [passage], [graph] or [graph][passage]"
        query, error = self._clean_query(content[pos:])
        if error is not None:
            return None, None, error
        return _MODE_BY_TAGS[frozenset(tags)], query, None

    def action_hint(self) -> str:
        return (
            "To search, write <search> [passage] your query </search>, or use [graph] or "
            "[graph][passage] as the mode; to finish, write <answer> your answer </answer>."
        )

    def instruction_prompt(self, question: str, max_searches: int | None = None,
                           modes: tuple[str, ...] | None = None, **_: object) -> str:
        """The task prompt; ``modes`` restricts the retrieval modes it describes (ablations, serving)."""
        budget = f" You may search at most {max_searches} times." if max_searches else ""
        if modes is None or set(modes) == set(self.modes):
            # Like the paper's prompt (Table 6), the modes are told apart only by how they find
            # documents: which one pays off is for the efficiency reward to teach, not the prompt.
            how = (
                "<search>, then a retrieval mode, then your query, then </search>. Every mode "
                "returns documents, each by its own method: [passage] matches your query against "
                "text passages, [graph] goes through a knowledge graph of entities and their "
                "relations, and [graph][passage] runs both and merges what they find. For "
                "example: <search> [graph] who directed the film Inception </search>."
            )
        else:
            unknown = [m for m in modes if m not in self.modes]
            if unknown or not modes:
                raise ValueError(f"unknown retrieval modes {unknown or list(modes)}; expected a subset of {self.modes}")
            tags = [_TAG_OF_MODE[m] for m in self.modes if m in modes]
            what = {"passage": "text passages", "graph": "a knowledge graph of entities and their relations",
                    "hybrid": "both text passages and the knowledge graph, merged"}
            listed = "; ".join(f"{_TAG_OF_MODE[m]} searches {what[m]}" for m in self.modes if m in modes)
            how = (
                f"<search>, then the retrieval mode {' or '.join(tags)}, then your query, then </search> "
                f"({listed}; no other mode is available). For example: <search> {tags[0]} who directed "
                "the film Inception </search>."
            )
        often = "" if max_searches else " You may search as many times as you like."
        return (
            "Answer the question below, working in turns. Begin every turn by reasoning inside "
            "<think> and </think>. If you are missing a fact, run one search in that turn: write "
            f"{how} The results arrive between <information> and </information>."
            f"{often}{budget} Once you know the answer, give it inside <answer> and </answer> as a short "
            "phrase without explanation, for example <answer> Paris </answer>.\n\n"
            f"Question: {question}\n"
        )

    def _search_body(self, query: str, mode: str | None) -> str:
        # hybrid is written as both tags, graph first, as in the paper's examples
        tags = {"passage": "[passage]", "graph": "[graph]", "hybrid": "[graph][passage]"}
        if (mode or "passage") not in tags:
            raise ValueError(f"unknown retrieval mode {mode!r}; expected one of {self.modes}")
        return f"{tags[mode or 'passage']} {query}"
