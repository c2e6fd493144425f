"""Search-R1 dialect (Jin et al., 2025, "Search-R1: Training LLMs to Reason and Leverage Search
Engines with Reinforcement Learning").

Like RouteRAG without modes: ``<think>``, ``<search> query </search>``, ``<information>`` and
``<answer>``. Every search goes to the environment's configured mode (passage by default).
"""

from __future__ import annotations

from raggym.protocol.action import ANSWER, SEARCH
from raggym.protocol.base import Dialect


class SearchR1Dialect(Dialect):
    name = "search_r1"
    paper = "Search-R1"
    stop_strings = ("</search>", "</answer>")
    reasoning_blocks = ("think",)
    action_blocks = {"search": SEARCH, "answer": ANSWER}
    observation_block = "information"
    default_mode = "passage"
    trajectory_pattern = r"(?:tTsSiI)*tTaA"

    def action_hint(self) -> str:
        return "To search, write <search> your query </search>; to finish, write <answer> your answer </answer>."

    def instruction_prompt(self, question: str, max_searches: int | None = None, **_: object) -> str:
        budget = f" You may search at most {max_searches} times." if max_searches else ""
        return (
            "Answer the question below, working in turns. Begin every turn by reasoning inside "
            "<think> and </think>. If you are missing a fact, search for it by writing your query "
            "between <search> and </search>; the top results arrive between <information> and "
            f"</information>.{budget} Once you know the answer, give it inside <answer> and "
            "</answer> as a short phrase without explanation, for example <answer> Paris </answer>.\n\n"
            f"Question: {question}\n"
        )
