"""The ``Dialect`` base class: segment grammar, observation rendering and format checking.

A dialect is the text protocol one paper's agent speaks. Every dialect here has the same shape:

* a segment is optional reasoning blocks (``<think>``; LWS also ``<reflect>``), then exactly one
  action (a search-like block or ``<answer>``), then nothing but whitespace, because generation
  stopped at the action's closing tag (the dialect's ``stop_strings``);
* the environment replies with an observation wrapped in the dialect's observation tags.

Subclasses fill in class attributes (tags, stop strings) and override the hooks that differ:
``_parse_search`` (what a query may look like), ``_action_from_blocks`` (R1-Router's two-block
route) and the trajectory pattern used by ``format_check``.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple, Sequence

from raggym.protocol.action import ANSWER, SEARCH, THINK, Action, FormatCheck, invalid
from raggym.protocol.tags import TAG_TABLE, clean_block, clean_inline, is_blank, split_tags

# One letter per tag for trajectory-level format checks: lower case opens, upper case closes.
# 'x' stands for non-blank text outside every block.
_BLOCK_LETTER = {
    "think": "t",
    "search": "s",
    "answer": "a",
    "information": "i",
    "query": "q",
    "knowledge": "k",
    "reflect": "r",
    "sub-question": "u",
    "ret": "e",
    "begin_of_query": "b",
    "begin_of_documents": "d",
}

DEFAULT_MAX_QUERY_CHARS = 1000


class Block(NamedTuple):
    name: str
    content: str


def _open_literal(block: str) -> str:
    for literal, (name, opening) in TAG_TABLE.items():
        if name == block and opening:
            return literal
    raise KeyError(block)


def _close_literal(block: str) -> str:
    for literal, (name, opening) in TAG_TABLE.items():
        if name == block and not opening:
            return literal
    raise KeyError(block)


class Dialect:
    """Base class; see the module docstring. Instances are stateless and safe to share."""

    name: str = ""
    # The paper's agent, for docs and error messages.
    paper: str = ""
    stop_strings: tuple[str, ...] = ()
    # Blocks whose content is reasoning, allowed before the action.
    reasoning_blocks: tuple[str, ...] = ("think",)
    # Blocks the model writes that carry an action, mapped to the action kind.
    action_blocks: dict[str, str] = {}
    # Blocks whose tags are ignored by the segment grammar (GraphRAG-R1 reasons with queries
    # embedded inside an open <think>, so a <think> may open in one turn and close in another).
    transparent_blocks: tuple[str, ...] = ()
    # The block the environment wraps observations in.
    observation_block: str = "information"
    # Retrieval modes a search may name; empty when the dialect has no mode syntax and the
    # environment's configured mode applies.
    modes: tuple[str, ...] = ()
    # A regex whose match ends where the model writes a search's mode name (RouteRAG:
    # "<search> [" before "graph]"); the token there is the agent's retrieval choice, which
    # the learner's mode entropy bonus (``learner.loss.mode_entropy_coef``) acts on. Empty: none.
    mode_slot: str = ""
    # Mode used for searches when the dialect has no mode syntax (an environment may override).
    default_mode: str = "passage"
    # Regex over block letters (see _BLOCK_LETTER) that a whole trajectory must match.
    trajectory_pattern: str = ""
    # Cap on one query; longer text is almost surely a runaway generation, not a query.
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS

    def __init__(self) -> None:
        self.observation_open = _open_literal(self.observation_block)
        self.observation_close = _close_literal(self.observation_block)
        self._writable = frozenset(self.reasoning_blocks) | frozenset(self.action_blocks)
        self._transparent = frozenset(self.transparent_blocks)
        self._transparent_literals = tuple(
            literal for literal, (block, _) in TAG_TABLE.items() if block in self._transparent
        )
        self._trajectory_re = re.compile(self.trajectory_pattern) if self.trajectory_pattern else None

    def __repr__(self) -> str:
        return f"<Dialect {self.name}>"

    # ------------------------------------------------------------------ parsing

    def parse(self, segment: str) -> Action:
        """Parse one assistant segment. Never raises for a ``str``; raises ``TypeError`` for
        anything else, because passing a non-string is a programming error, not model output."""
        if not isinstance(segment, str):
            raise TypeError(
                f"{self.name}.parse expects the segment as str, got {type(segment).__name__}"
            )
        blocks, stray, tail, error = self._split(segment)
        if error is not None:
            return invalid(error, self._reasoning(blocks, stray))
        n_reasoning = 0
        while n_reasoning < len(blocks) and blocks[n_reasoning].name in self.reasoning_blocks:
            n_reasoning += 1
        reasoning = self._reasoning(blocks[:n_reasoning], stray)
        rest = blocks[n_reasoning:]
        if not rest:
            if n_reasoning or (self._transparent and reasoning):
                return Action(
                    kind=THINK, reasoning=reasoning, error="no search or answer follows the reasoning"
                )
            if is_blank(segment):
                return invalid("empty segment")
            return invalid("no reasoning, search or answer tags in the segment")
        if not is_blank(tail):
            return invalid("text follows the action; generation should stop at its closing tag", reasoning)
        has_reasoning = n_reasoning > 0 or (bool(self._transparent) and bool(reasoning))
        well_formed = has_reasoning and not (stray and not self._transparent)
        return self._action_from_blocks(rest, reasoning, well_formed)

    def _split(self, text: str) -> tuple[list[Block], list[str], str, str | None]:
        """Group the tags of ``text`` into top-level blocks.

        Returns (blocks, stray text pieces, text after the last block, error). Blocks may not nest;
        every tag must belong to this dialect and be written by the model (observation tags are
        the environment's)."""
        parts = split_tags(text)
        if self._transparent and len(parts) > 1:
            parts = self._merge_transparent(parts)
        table = TAG_TABLE
        blocks: list[Block] = []
        stray: list[str] = []
        between = parts[0]
        i = 1
        n = len(parts)
        while i < n:
            literal = parts[i]
            block, opening = table[literal]
            if block not in self._writable:
                if block == self.observation_block:
                    why = f"{literal} is written by the environment, not the model"
                else:
                    why = f"{literal} is not a tag of the {self.name} dialect"
                return blocks, stray, "", why
            if not opening:
                return blocks, stray, "", f"{literal} closes a block that was never opened"
            if i + 2 >= n:
                return blocks, stray, "", f"{literal} is never closed"
            closing = parts[i + 2]
            if table[closing] != (block, False):
                return blocks, stray, "", f"{closing} appears inside an open {literal} block"
            if between and not between.isspace():
                stray.append(between)
            blocks.append(Block(block, parts[i + 1]))
            between = parts[i + 3]
            i += 4
        if not blocks and between and not between.isspace():
            stray.append(between)
        return blocks, stray, between, None

    def _merge_transparent(self, parts: list[str]) -> list[str]:
        """Fold transparent tags back into the surrounding text."""
        merged: list[str] = []
        text_run = [parts[0]]  # joined once per run: repeated += would be quadratic
        for j in range(1, len(parts), 2):
            if TAG_TABLE[parts[j]][0] in self._transparent:
                text_run.append(parts[j])
                text_run.append(parts[j + 1])
            else:
                merged.append("".join(text_run))
                merged.append(parts[j])
                text_run = [parts[j + 1]]
        merged.append("".join(text_run))
        return merged

    def _reasoning(self, blocks: Iterable[Block], stray: Sequence[str]) -> str:
        parts = [b.content for b in blocks if b.name in self.reasoning_blocks]
        if self._transparent:
            # Transparent-tag dialects reason in free text around the action; their own tags
            # (for example an unclosed <think>) are markers, not content.
            text = "\n".join(p.strip() for p in [*parts, *stray] if not is_blank(p))
            for literal in self._transparent_literals:
                text = text.replace(literal, "")
            return clean_block(text)
        if not parts:
            return ""
        return clean_block("\n".join(p.strip() for p in parts))

    def _action_from_blocks(self, blocks: list[Block], reasoning: str, well_formed: bool) -> Action:
        """Interpret the blocks after the reasoning; the default is exactly one action block."""
        if len(blocks) > 1:
            if blocks[1].name in self.reasoning_blocks:
                return invalid("a reasoning block follows the action", reasoning)
            return invalid("more than one action in one segment", reasoning)
        block = blocks[0]
        kind = self.action_blocks.get(block.name)
        if kind == ANSWER:
            return self._answer(block.content, reasoning, well_formed)
        if kind == SEARCH:
            mode, query, error = self._parse_search(block.content)
            if error is not None:
                return invalid(error, reasoning)
            return Action(kind=SEARCH, mode=mode, query=query, reasoning=reasoning, well_formed=well_formed)
        return invalid(f"{_open_literal(block.name)} is not an action", reasoning)

    def _answer(self, content: str, reasoning: str, well_formed: bool) -> Action:
        answer = clean_block(content)
        if not answer:
            return invalid("empty answer", reasoning)
        return Action(kind=ANSWER, answer=answer, reasoning=reasoning, well_formed=well_formed)

    def _parse_search(self, content: str) -> tuple[str | None, str | None, str | None]:
        """(mode, query, error) from the content of a search block; plain-query default."""
        return None, *self._clean_query(content)

    def _clean_query(self, raw: str) -> tuple[str | None, str | None]:
        if len(raw) > self.max_query_chars:
            return None, f"query longer than {self.max_query_chars} characters"
        query = clean_inline(raw)
        if not query:
            return None, "empty query"
        return query, None

    # ---------------------------------------------------------------- rendering

    def render_documents(self, hits: Sequence, facts: Sequence = ()) -> str:
        """Body of an observation: ``Doc i (Title: …) text`` lines, as Search-R1 formats them."""
        return "".join(
            [f"Doc {i} (Title: {h.title}) {h.text}\n" for i, h in enumerate(hits, 1)]
        )

    def render_observation(self, hits: Sequence, facts: Sequence = (), max_chars: int | None = None) -> str:
        """The observation for a search result, wrapped in the dialect's observation tags.

        ``hits`` are ``raggym.retrieval.Hit``-like objects (``title``, ``text``); ``facts`` are
        ``(subject, relation, object, score)`` tuples (used by GraphRAG-R1). ``max_chars`` caps
        the whole observation; the body is cut, never the tags."""
        body = self.render_documents(hits, facts)
        if not hits and not facts:
            body = "No documents were found.\n"
        return self._wrap(body, max_chars)

    def render_error(self, error: str, max_chars: int | None = None) -> str:
        """Format-error observation in the dialect's form: the model learns what was wrong and
        what a correct action looks like, inside the tags it would see after a search."""
        return self._wrap(f"Invalid action: {error}. {self.action_hint()}\n", max_chars)

    def _wrap(self, body: str, max_chars: int | None) -> str:
        head = "\n\n" + self.observation_open
        foot = self.observation_close + "\n\n"
        if max_chars is not None:
            room = max_chars - len(head) - len(foot)
            if room < 0:
                raise ValueError(f"max_chars={max_chars} cannot hold the {self.name} observation tags")
            if len(body) > room:
                body = body[:room]
        return head + body + foot

    def action_hint(self) -> str:  # pragma: no cover - every dialect overrides
        raise NotImplementedError

    def instruction_prompt(self, question: str, **options) -> str:  # pragma: no cover
        raise NotImplementedError

    # ---------------------------------------------------------- format checking

    def format_check(self, trajectory: str) -> FormatCheck:
        """Check a whole response (every model segment and every observation, concatenated in
        order, without the prompt) against the dialect's trajectory structure.

        Structure is judged on the sequence of tags; non-blank text outside every block fails,
        and each action block's content must parse (non-empty query or answer, valid mode)."""
        if not isinstance(trajectory, str):
            raise TypeError(f"format_check expects str, got {type(trajectory).__name__}")
        if self._trajectory_re is None:  # pragma: no cover - every dialect sets a pattern
            raise NotImplementedError
        parts = split_tags(trajectory)
        letters: list[str] = []
        action_contents: list[tuple[str, str]] = []
        open_stack: list[tuple[str, int]] = []  # (block, index in parts of its opening tag)
        observation = self.observation_block
        inside_observation = False
        depth = 0
        text_before = parts[0]  # text since the last structural tag
        for i in range(1, len(parts), 2):
            block, opening = TAG_TABLE[parts[i]]
            # Observation bodies are retrieved text and error hints; tag-like text inside them
            # (a passage quoting "<answer>", the hint showing the search syntax) is not structure.
            if inside_observation and not (block == observation and not opening):
                continue
            inside_observation = block == observation and opening
            if depth == 0 and text_before and not text_before.isspace():
                letters.append("x")
            letter = _BLOCK_LETTER[block]
            if opening:
                letters.append(letter)
                open_stack.append((block, i))
                depth += 1
            else:
                letters.append(letter.upper())
                depth -= 1
                if open_stack and open_stack[-1][0] == block:
                    _, opened_at = open_stack.pop()
                    if block in self.action_blocks:
                        action_contents.append((block, "".join(parts[opened_at + 1 : i])))
            text_before = parts[i + 1]
        if depth == 0 and text_before and not text_before.isspace():
            letters.append("x")
        structure = "".join(letters)
        num_searches = sum(1 for b, _ in action_contents if self.action_blocks[b] == SEARCH)
        if not self._trajectory_re.fullmatch(structure):
            shown = structure if len(structure) <= 80 else structure[:80] + "…"
            return FormatCheck(
                False, f"structure {shown!r} does not match {self.trajectory_pattern!r}", structure, num_searches
            )
        for block, content in action_contents:
            error = self._content_error(block, content)
            if error is not None:
                return FormatCheck(False, error, structure, num_searches)
        return FormatCheck(True, None, structure, num_searches)

    def _content_error(self, block: str, content: str) -> str | None:
        kind = self.action_blocks.get(block)
        if kind == SEARCH:
            return self._parse_search(content)[2]
        if kind == ANSWER and not clean_block(content):
            return "empty answer"
        return None


    # ------------------------------------------------------- writing segments
    #
    # The inverse of ``parse``: the text a model following this dialect would write for one
    # action. Used to build golden (supervised) transcripts; every helper checks that its output
    # parses back to the intended action, so a query or answer that would break the grammar (for
    # example one containing a tag) raises ``ValueError`` instead of producing a bad example.

    def _action_block(self, kind: str) -> str:
        for block, block_kind in self.action_blocks.items():
            if block_kind == kind:
                return block
        raise NotImplementedError(f"the {self.name} dialect has no {kind} block")

    def _reasoning_block(self, turn: int) -> str:
        """The reasoning block a segment opens with at ``turn`` (0 = the first model turn)."""
        return self.reasoning_blocks[0] if self.reasoning_blocks else "think"

    def _reasoning_prefix(self, reasoning: str, turn: int) -> str:
        block = self._reasoning_block(turn)
        return f"{_open_literal(block)} {reasoning.strip()} {_close_literal(block)}\n"

    def _search_body(self, query: str, mode: str | None) -> str:
        """Content of the search block; dialects with mode syntax put the mode in it."""
        return query

    def search_segment(self, query: str, *, mode: str | None = None, reasoning: str = "", turn: int = 0) -> str:
        """One search turn: reasoning, then the search action. ``mode`` is ignored by dialects
        without mode syntax (the environment's mode applies)."""
        block = self._action_block(SEARCH)
        text = (
            self._reasoning_prefix(reasoning, turn)
            + f"{_open_literal(block)} {self._search_body(query, mode)} {_close_literal(block)}"
        )
        return self._checked(text, SEARCH)

    def answer_segment(self, answer: str, *, reasoning: str = "", turn: int = 0) -> str:
        """One answer turn: reasoning, then ``<answer> answer </answer>``."""
        block = self._action_block(ANSWER)
        text = self._reasoning_prefix(reasoning, turn) + f"{_open_literal(block)} {answer} {_close_literal(block)}"
        return self._checked(text, ANSWER)

    def _checked(self, text: str, kind: str) -> str:
        action = self.parse(text)
        if action.kind != kind or not action.well_formed:
            raise ValueError(
                f"{self.name}: the {kind} segment {text[:200]!r} does not parse back as a well-formed "
                f"{kind} ({action.error or action.kind}); check the query/answer text for tags"
            )
        return text
