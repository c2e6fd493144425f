"""GraphRAG-R1 dialect (Yu et al., 2025, "GraphRAG-R1: Graph Retrieval-Augmented Generation with
Process-Constrained Reinforcement Learning").

GraphRAG-R1 uses R1-Searcher's markers: the agent reasons inside ``<think>`` and may issue a query
in the middle of that reasoning with ``<|begin_of_query|> q <|end_of_query|>``; the environment
inserts ``<|begin_of_documents|> … <|end_of_documents|>`` and the agent continues, eventually
closing ``</think>`` and answering in ``<answer>``. Because a ``<think>`` may open in one turn and
close in a later one, the segment grammar treats ``<think>`` tags as markers (``format_check``
still checks them across the whole trajectory).

Observations mix the retriever's top facts, one ``(subject relation object)`` line each, with
passages. The body is capped at 1,024 characters: that cap is raggym's choice (it keeps the
documents within the rollout's observation budget), not a value the paper states.
"""

from __future__ import annotations

from typing import Sequence

from raggym.protocol.action import ANSWER, SEARCH
from raggym.protocol.base import Dialect

OBSERVATION_BODY_CHARS = 1024  # raggym's choice; the paper gives no character cap
MAX_FACTS = 5


class GraphRAGR1Dialect(Dialect):
    name = "graphrag_r1"
    paper = "GraphRAG-R1"
    stop_strings = ("<|end_of_query|>", "</answer>")
    reasoning_blocks = ()
    transparent_blocks = ("think",)
    action_blocks = {"begin_of_query": SEARCH, "answer": ANSWER}
    observation_block = "begin_of_documents"
    default_mode = "graph"
    # Either one <think> spanning every query (R1-Searcher style) or a closed <think> before each
    # query; in both cases the reasoning closes before the answer.
    trajectory_pattern = r"(?:t(?:bBdD)*T|(?:tTbBdD)+tT)aA"

    def render_documents(self, hits: Sequence, facts: Sequence = ()) -> str:
        lines = [f"({s} {r} {o})\n" for s, r, o, *_ in list(facts)[:MAX_FACTS]]
        lines.extend(f"Doc {i} (Title: {h.title}) {h.text}\n" for i, h in enumerate(hits, 1))
        body = "".join(lines)
        return body[:OBSERVATION_BODY_CHARS]

    def _wrap(self, body: str, max_chars: int | None) -> str:
        # The markers sit on their own lines, as R1-Searcher lays the documents out.
        head = "\n" + self.observation_open + "\n"
        foot = self.observation_close + "\n"
        if max_chars is not None:
            room = max_chars - len(head) - len(foot)
            if room < 0:
                raise ValueError(f"max_chars={max_chars} cannot hold the {self.name} observation markers")
            body = body[:room]
        return head + body + foot

    def action_hint(self) -> str:
        return (
            "To search, write <|begin_of_query|> your query <|end_of_query|>; to finish, close "
            "</think> and write <answer> your answer </answer>."
        )

    def instruction_prompt(self, question: str, max_searches: int | None = None, **_: object) -> str:
        budget = f" You may search at most {max_searches} times." if max_searches else ""
        return (
            "Answer the question below. Reason step by step inside <think> and </think>. While "
            "reasoning, whenever you need a fact, write a query as <|begin_of_query|> your query "
            "<|end_of_query|>; the search returns related facts as (subject relation object) "
            "lines together with passages, between <|begin_of_documents|> and "
            f"<|end_of_documents|>, and you carry on reasoning.{budget} When you are done, close "
            "</think> and give the answer inside <answer> and </answer> as a short phrase, for "
            "example <answer> Lisbon </answer>.\n\n"
            f"Question: {question}\n"
        )

    def search_segment(self, query: str, *, mode: str | None = None, reasoning: str = "", turn: int = 0) -> str:
        # One <think> spans every query (R1-Searcher style): the first turn opens it, later
        # turns carry on reasoning inside it after the documents.
        opener = "<think> " if turn == 0 else ""
        text = f"{opener}{reasoning.strip()}\n<|begin_of_query|> {query} <|end_of_query|>"
        return self._checked(text, SEARCH)

    def answer_segment(self, answer: str, *, reasoning: str = "", turn: int = 0) -> str:
        opener = "<think> " if turn == 0 else ""
        text = f"{opener}{reasoning.strip()} </think>\n<answer> {answer} </answer>"
        return self._checked(text, ANSWER)
