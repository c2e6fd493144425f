"""Graph-R1 dialect, as PathRouter uses it (Luo et al., 2025, "Graph-R1: Towards Agentic GraphRAG
Framework via End-to-end Reinforcement Learning").

The agent reasons in ``<think>``, queries the graph with ``<query>…</query>``, reads results in
``<knowledge>…</knowledge>`` and finishes with ``<answer>``. Graph-R1's own prompt lets the query
be a small JSON object; both ``<query> who founded X </query>`` and
``<query> {"query": "who founded X"} </query>`` are accepted.
"""

from __future__ import annotations

import json

from raggym.protocol.action import ANSWER, SEARCH
from raggym.protocol.base import Dialect


class GraphR1Dialect(Dialect):
    name = "graph_r1"
    paper = "Graph-R1 / PathRouter"
    stop_strings = ("</query>", "</answer>")
    reasoning_blocks = ("think",)
    action_blocks = {"query": SEARCH, "answer": ANSWER}
    observation_block = "knowledge"
    default_mode = "graph"
    trajectory_pattern = r"(?:tTqQkK)*tTaA"

    def _parse_search(self, content: str):
        stripped = content.strip()
        if stripped.startswith("{") and stripped.endswith("}") and len(stripped) <= self.max_query_chars:
            try:
                payload = json.loads(stripped)
            except (ValueError, RecursionError):  # not JSON after all: braces in a plain query
                payload = None
            if isinstance(payload, dict):
                inner = payload.get("query")
                if not isinstance(inner, str):
                    return None, None, 'a JSON query needs a string "query" field'
                return (None, *self._clean_query(inner))
        return (None, *self._clean_query(content))

    def action_hint(self) -> str:
        return "To query the graph, write <query> your query </query>; to finish, write <answer> your answer </answer>."

    def instruction_prompt(self, question: str, max_searches: int | None = None, **_: object) -> str:
        budget = f" You may query at most {max_searches} times." if max_searches else ""
        return (
            "Answer the question below by consulting a knowledge graph over several turns. Begin "
            "every turn by reasoning inside <think> and </think>. To look something up, write one "
            "query between <query> and </query>; the matching knowledge arrives between "
            f"<knowledge> and </knowledge>.{budget} When the knowledge suffices, give the answer "
            "inside <answer> and </answer> as a short phrase, for example <answer> 1969 </answer>.\n\n"
            f"Question: {question}\n"
        )
