"""LWS dialect: the multi-stage-reward protocol for reasoning models.

Tags are ``<think>``, ``<search>``, ``<information>``, ``<reflect>`` and ``<answer>``. A complete
response has one of two structures (checked by ``format_check``; the format reward is ±1):

* think → reflect → answer (no retrieval), or
* think → (search → information → reflect)+ → answer.

Per segment this means: the first segment is ``<think>`` followed by a ``<search>`` (or by
``<reflect>`` and the ``<answer>``), and every segment after an observation opens with
``<reflect>`` and ends with a search or the answer.
"""

from __future__ import annotations

from raggym.protocol.action import ANSWER, SEARCH
from raggym.protocol.base import Dialect


class LWSDialect(Dialect):
    name = "lws"
    paper = "LWS"
    stop_strings = ("</search>", "</answer>")
    reasoning_blocks = ("think", "reflect")
    action_blocks = {"search": SEARCH, "answer": ANSWER}
    observation_block = "information"
    default_mode = "passage"
    trajectory_pattern = r"tT(?:rRaA|(?:sSiIrR)+aA)"

    def action_hint(self) -> str:
        return (
            "Reflect inside <reflect> </reflect>, then either search with <search> your query "
            "</search> or finish with <answer> your answer </answer>."
        )

    def instruction_prompt(self, question: str, max_searches: int | None = None, **_: object) -> str:
        budget = f" You may search at most {max_searches} times." if max_searches else ""
        return (
            "Answer the question below. First think it through inside <think> and </think>. If "
            "you can already answer, check your reasoning inside <reflect> and </reflect> and "
            "then answer. Otherwise search by writing a concise query between <search> and "
            "</search>; results arrive between <information> and </information>. After every "
            "result, reflect inside <reflect> and </reflect> on what you learned and whether it "
            f"is enough, then either search again or answer.{budget} Search only when it helps, "
            "and never repeat a query. Give the final answer inside <answer> and </answer> as a "
            "short phrase, for example <answer> Mount Everest </answer>.\n\n"
            f"Question: {question}\n"
        )

    def _reasoning_block(self, turn: int) -> str:
        # the first turn thinks; every turn after an observation opens with a reflection
        return "think" if turn == 0 else "reflect"

    def answer_segment(self, answer: str, *, reasoning: str = "", turn: int = 0) -> str:
        if turn == 0:  # no retrieval: think -> reflect -> answer
            text = f"<think> {reasoning.strip()} </think>\n<reflect> {reasoning.strip()} </reflect>\n<answer> {answer} </answer>"
            return self._checked(text, ANSWER)
        return super().answer_segment(answer, reasoning=reasoning, turn=turn)
