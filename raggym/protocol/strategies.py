"""Hypothesis strategies for adversarial assistant segments (needs the ``dev`` extra).

The fuzz tests and ``experiments/bench/env.py`` draw segments from ``segments(dialect)``. A
segment is a concatenation of pieces chosen to break parsers:

* every tag of every dialect (so foreign tags, nesting, doubling and unclosed tags all occur),
  truncated tags (``<sear``, ``<|begin_of_``), and the dialect's own well-formed actions;
* RouteRAG mode tags, including unknown (``[hybrid]``) and wrongly cased (``[Graph]``) ones,
  R1-Router's ``None`` and knowledge-base names, JSON fragments for Graph-R1 queries;
* arbitrary Unicode including lone surrogates, C0/C1 controls, line and paragraph separators;
* occasionally a megabyte of repeated text.

Well-formed actions are mixed in so that both the valid and the invalid paths are exercised.
"""

from __future__ import annotations

from hypothesis import strategies as st

from raggym.protocol.r1_router import PAPER_KNOWLEDGE_BASES
from raggym.protocol.tags import TAG_TABLE

ALL_TAGS = tuple(TAG_TABLE)
BROKEN_TAGS = (
    "<sear", "</", "<", ">", "<|begin_of_", "<|end_of", "|>", "<think", "answer>", "</ret", "<sub-question",
)
MODE_TAGS = (
    "[passage]", "[graph]", "[graph][passage]", "[passage][graph]",  # valid
    "[hybrid]", "[Graph]", "[graph][graph]", "[", "]", "[]",  # not
)
ODD_CHARACTERS = (
    "\x00", "\x07", "\x1b", "\x7f", "\x85", "\u2028", "\u2029", "\ufeff",
    "\ud800", "\udfff", "\udc80", "\r\n", "\t",
)
WORDS = (
    "None", "none", *PAPER_KNOWLEDGE_BASES, '{"query": "x"}', '{"query": 3}', "{", "}",
    "Doc 1 (Title: x)", "who", "capital of France",
)

_unicode_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)


def _well_formed(dialect_name: str) -> st.SearchStrategy[str]:
    """A valid action of ``dialect_name`` with random (possibly odd) inner text."""
    t = _unicode_text
    answer = st.builds(lambda r, a: f"<think>{r}</think><answer>{a}</answer>", t, t)
    if dialect_name == "routerag":
        search = st.builds(
            lambda r, m, q: f"<think>{r}</think><search> {m} {q} </search>", t, st.sampled_from(MODE_TAGS[:4]), t
        )
        return st.one_of(search, answer)
    if dialect_name in ("search_r1", "lws"):
        openers = ["<think>{}</think>", "<reflect>{}</reflect>"] if dialect_name == "lws" else ["<think>{}</think>"]
        opener = st.sampled_from(openers)
        return st.one_of(
            st.builds(lambda o, r, q: o.format(r) + f"<search>{q}</search>", opener, t, t),
            st.builds(lambda o, r, a: o.format(r) + f"<answer>{a}</answer>", opener, t, t),
        )
    if dialect_name == "graph_r1":
        return st.one_of(
            st.builds(lambda r, q: f"<think>{r}</think><query>{q}</query>", t, t),
            st.builds(lambda r, q: f'<think>{r}</think><query>{{"query": "{q}"}}</query>', t, t),
            answer,
        )
    if dialect_name == "graphrag_r1":
        return st.one_of(
            st.builds(lambda r, q: f"<think>{r}<|begin_of_query|>{q}<|end_of_query|>", t, t),
            st.builds(lambda r, a: f"{r}</think><answer>{a}</answer>", t, t),
        )
    if dialect_name == "r1_router":
        route = st.builds(
            lambda r, q, kb: f"<think>{r}</think><sub-question>{q}</sub-question><ret>{kb}</ret>",
            t,
            st.one_of(t, st.just("None")),
            st.sampled_from((*PAPER_KNOWLEDGE_BASES, "None", "Web")),
        )
        return st.one_of(route, answer)
    raise ValueError(f"no strategy for dialect {dialect_name!r}")


def pieces(dialect_name: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(ALL_TAGS),
        st.sampled_from(BROKEN_TAGS),
        st.sampled_from(MODE_TAGS),
        st.sampled_from(ODD_CHARACTERS),
        st.sampled_from(WORDS),
        _unicode_text,
        _well_formed(dialect_name),
    )


def megabyte_text() -> st.SearchStrategy[str]:
    """About a megabyte: a short piece repeated, sometimes inside an otherwise valid action."""
    filler = st.sampled_from(["a", "<think>", "[graph]", "\ud800", "x </search>", "<search>"])
    wrapper = st.sampled_from(
        ["{}", "<think>{}</think><search> [graph] q </search>", "<search> [passage] {} </search>", "<answer>{}</answer>"]
    )
    return st.builds(lambda piece, wrap: wrap.format(piece * (2**20 // len(piece))), filler, wrapper)


def segments(dialect_name: str, *, allow_megabyte: bool = True) -> st.SearchStrategy[str]:
    """Adversarial segments for one dialect (see the module docstring)."""
    mixed = st.lists(pieces(dialect_name), max_size=12).map("".join)
    options = [mixed, _well_formed(dialect_name)]
    if allow_megabyte:
        # Rare on purpose: a few megabyte segments per thousand keep the fuzz run fast.
        options.append(st.integers(0, 199).flatmap(lambda n: megabyte_text() if n == 0 else mixed))
    return st.one_of(*options)
