"""R1-Router dialect (Peng et al., 2025, "Learning to Route Queries Across Knowledge Bases for
Step-wise Retrieval-Augmented Reasoning").

R1-Router calls the model once per step, each time with a fresh prompt:

* a routing step answers with ``<think>…</think><sub-question>…</sub-question><ret>KB</ret>``,
  where KB names one of the configured knowledge bases; ``<sub-question>None</sub-question>``
  means no more retrieval is needed (the paper's stop condition; whatever ``<ret>`` then holds is
  ignored, and the prompt asks for ``<ret>None</ret>``);
* an answer step (the intermediate answer to a sub-question from that step's documents, or the
  final answer) is ``<think>…</think><answer>…</answer>``.

The paper's knowledge bases are named "Text Retriever", "Text Image Retriever" and
"Table Retriever"; an environment may configure any names. KB names match case-insensitively
with whitespace collapsed, and the action carries the configured spelling.
"""

from __future__ import annotations

from typing import Sequence

from raggym.protocol.action import ANSWER, ROUTE, Action, invalid
from raggym.protocol.base import Block, Dialect
from raggym.protocol.tags import clean_inline

PAPER_KNOWLEDGE_BASES = ("Text Retriever", "Text Image Retriever", "Table Retriever")
STOP_WORD = "None"


class R1RouterDialect(Dialect):
    name = "r1_router"
    paper = "R1-Router"
    stop_strings = ("</ret>", "</answer>")
    reasoning_blocks = ("think",)
    action_blocks = {"sub-question": ROUTE, "ret": ROUTE, "answer": ANSWER}
    # R1-Router puts retrieved documents into the next prompt rather than behind tags; the block
    # name is only used by the shared machinery and never rendered (see render_observation).
    observation_block = "information"
    trajectory_pattern = r"tT(?:uUeE|aA)"

    def __init__(self, knowledge_bases: Sequence[str] = PAPER_KNOWLEDGE_BASES):
        super().__init__()
        names = tuple(knowledge_bases)
        if not names:
            raise ValueError("R1-Router needs at least one knowledge base name")
        self.knowledge_bases = names
        self._kb_by_key: dict[str, str] = {}
        for kb in names:
            key = _kb_key(kb)
            if not key or key == STOP_WORD.lower():
                raise ValueError(f"invalid knowledge base name {kb!r}")
            if key in self._kb_by_key:
                raise ValueError(f"knowledge base names {self._kb_by_key[key]!r} and {kb!r} collide")
            self._kb_by_key[key] = kb

    def _action_from_blocks(self, blocks: list[Block], reasoning: str, well_formed: bool) -> Action:
        first = blocks[0]
        if first.name == "answer":
            if len(blocks) > 1:
                return invalid("more than one action in one segment", reasoning)
            return self._answer(first.content, reasoning, well_formed)
        if first.name == "ret":
            return invalid("<ret> must follow a <sub-question>", reasoning)
        if first.name != "sub-question":
            return invalid("a reasoning block follows the action", reasoning)
        if len(blocks) == 1:
            return invalid("<sub-question> must be followed by <ret>KB</ret>", reasoning)
        if blocks[1].name != "ret":
            return invalid("<sub-question> must be followed by <ret>KB</ret>", reasoning)
        if len(blocks) > 2:
            return invalid("more than one action in one segment", reasoning)
        if len(blocks[0].content) > self.max_query_chars:
            return invalid(f"sub-question longer than {self.max_query_chars} characters", reasoning)
        sub_question = clean_inline(blocks[0].content)
        kb_text = clean_inline(blocks[1].content[:200])
        # The paper stops when the sub-question is None; the <ret> field then does not matter.
        if sub_question.lower() == STOP_WORD.lower():
            return Action(kind=ROUTE, reasoning=reasoning, well_formed=well_formed)
        if kb_text.lower() == STOP_WORD.lower():
            return invalid("<ret>None</ret> needs a None sub-question: a real sub-question needs a knowledge base",
                           reasoning)
        if not sub_question:
            return invalid("empty sub-question", reasoning)
        kb = self._kb_by_key.get(kb_text.lower())
        if kb is None:
            return invalid(
                "unknown knowledge base; choose one of " + ", ".join(self.knowledge_bases) + " or None",
                reasoning,
            )
        return Action(kind=ROUTE, mode=kb, query=sub_question, reasoning=reasoning, well_formed=well_formed)

    def _content_error(self, block: str, content: str) -> str | None:
        if block == "answer":
            return super()._content_error(block, content)
        if block in ("sub-question", "ret") and not clean_inline(content):
            return f"empty <{block}>"
        return None

    def render_documents(self, hits: Sequence, facts: Sequence = ()) -> str:
        return "".join(f"Doc {i} (Title: {h.title}) {h.text}\n" for i, h in enumerate(hits, 1))

    def render_observation(self, hits: Sequence, facts: Sequence = (), max_chars: int | None = None) -> str:
        """Documents as they appear in an answer-step prompt (no tags: R1-Router re-prompts)."""
        body = self.render_documents(hits) if hits else "No documents were found.\n"
        return body if max_chars is None else body[:max_chars]

    def render_error(self, error: str, max_chars: int | None = None) -> str:
        text = f"Your previous output was invalid: {error}. {self.action_hint()}\n"
        return text if max_chars is None else text[:max_chars]

    def action_hint(self) -> str:
        return (
            "A routing step is <think> reasoning </think><sub-question> one question "
            "</sub-question><ret> knowledge base </ret>; an answer step is <think> reasoning "
            "</think><answer> answer </answer>."
        )

    # R1-Router has three prompts; instruction_prompt is the routing one.
    def instruction_prompt(self, question: str, history: Sequence[tuple[str, str]] = (), **_: object) -> str:
        return self.routing_prompt(question, history)

    def routing_prompt(self, question: str, history: Sequence[tuple[str, str]] = ()) -> str:
        kbs = ", ".join(self.knowledge_bases)
        return (
            "You break a complex question into simple steps. At each step, decide on the single "
            "next sub-question that must be looked up, one that needs exactly one lookup, and pick "
            "the knowledge base best suited to it. Reason first inside <think> and </think> "
            "without guessing the answer, then write the sub-question between <sub-question> and "
            f"</sub-question> and the knowledge base between <ret> and </ret>, chosen from: {kbs}. "
            "Choose by the kind of content the sub-question needs, for example tables for numbers "
            "and records. If the sub-questions answered so far are enough to answer the original "
            "question, write <sub-question>None</sub-question>"
            "<ret>None</ret>.\n\n" + _history_text(question, history)
        )

    def intermediate_answer_prompt(self, sub_question: str, documents: str) -> str:
        return (
            "Answer the question using only the documents below. Reason step by step inside "
            "<think> and </think>, then give a short answer inside <answer> and </answer>.\n\n"
            f"Documents:\n{documents}\nQuestion: {sub_question}\n"
        )

    def final_answer_prompt(self, question: str, history: Sequence[tuple[str, str]] = ()) -> str:
        return (
            "Answer the original question using the sub-questions and their answers below. Reason "
            "step by step inside <think> and </think>, then give a short final answer inside "
            "<answer> and </answer>.\n\n" + _history_text(question, history)
        )


    # ------------------------------------------------------- writing segments

    def search_segment(self, query: str, *, mode: str | None = None, reasoning: str = "", turn: int = 0) -> str:
        raise NotImplementedError("R1-Router routes instead of searching; use route_segment")

    def route_segment(self, sub_question: str, knowledge_base: str, *, reasoning: str = "") -> str:
        """A routing step: reasoning, the sub-question and the knowledge base to ask."""
        text = (f"<think> {reasoning.strip()} </think>\n<sub-question> {sub_question} </sub-question>"
                f"<ret> {knowledge_base} </ret>")
        action = self.parse(text)
        if action.kind != ROUTE or action.query is None or not action.well_formed:
            raise ValueError(f"r1_router: the routing segment {text[:200]!r} does not parse back as a route "
                             f"({action.error or action.kind})")
        return text

    def stop_segment(self, *, reasoning: str = "") -> str:
        """The routing step that ends retrieval: ``None`` for both the sub-question and the base."""
        return f"<think> {reasoning.strip()} </think>\n<sub-question> {STOP_WORD} </sub-question><ret> {STOP_WORD} </ret>"

def _kb_key(name: str) -> str:
    return " ".join(name.split()).lower()


def _history_text(question: str, history: Sequence[tuple[str, str]]) -> str:
    lines = [f"Original question: {question}"]
    for i, (sub_question, answer) in enumerate(history, 1):
        lines.append(f"Sub-question {i}: {sub_question}")
        lines.append(f"Answer {i}: {answer}")
    return "\n".join(lines) + "\n"
