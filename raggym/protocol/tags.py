"""Tag scanning shared by every dialect.

All six dialects are XML-like tag protocols. Rather than one regular expression per action (which
silently accepts nested or doubled tags and can backtrack badly on long inputs), a segment is
scanned once for every tag that *any* dialect knows. Each dialect then walks the resulting token
list with a small hand-written grammar. Knowing the other dialects' tags lets a parser reject
"tags from another dialect" explicitly instead of treating them as free text.

The scan is one linear pass of a literal-alternation regex, so megabyte-long segments cost
milliseconds, and nothing here can raise on any ``str`` (lone surrogates and control characters
are ordinary code points to ``re``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

# literal tag -> (block name, True for an opening tag). Block names are what grammars talk about;
# the R1-Searcher-style markers used by GraphRAG-R1 get block names of their own.
TAG_TABLE: dict[str, tuple[str, bool]] = {}
for _name in (
    "think",
    "search",
    "answer",
    "information",
    "query",
    "knowledge",
    "reflect",
    "sub-question",
    "ret",
):
    TAG_TABLE[f"<{_name}>"] = (_name, True)
    TAG_TABLE[f"</{_name}>"] = (_name, False)
TAG_TABLE["<|begin_of_query|>"] = ("begin_of_query", True)
TAG_TABLE["<|end_of_query|>"] = ("begin_of_query", False)
TAG_TABLE["<|begin_of_documents|>"] = ("begin_of_documents", True)
TAG_TABLE["<|end_of_documents|>"] = ("begin_of_documents", False)

# Longest literals first so that no literal shadows another that starts the same way.
_TAG_ALTERNATION = "|".join(re.escape(t) for t in sorted(TAG_TABLE, key=len, reverse=True))
_TAG_RE = re.compile(_TAG_ALTERNATION)
_TAG_SPLIT_RE = re.compile(f"({_TAG_ALTERNATION})")


class Tag(NamedTuple):
    literal: str
    block: str
    opening: bool
    start: int
    end: int


def scan_tags(text: str) -> list[Tag]:
    """Every known tag in ``text``, in order."""
    table = TAG_TABLE
    return [
        Tag(m.group(), *table[m.group()], m.start(), m.end()) for m in _TAG_RE.finditer(text)
    ]


def split_tags(text: str) -> list[str]:
    """``text`` cut at every known tag: ``[text, tag, text, tag, …, text]``.

    Even positions hold the (possibly empty) text between tags, odd positions the tag literals.
    This is the fast path for segment parsing, which needs no offsets."""
    return _TAG_SPLIT_RE.split(text)


# C0 and C1 control characters and UTF-16 surrogate halves. Tab/newline are controls too; inside
# a query they carry no meaning, so they become spaces like the rest.
_UNSAFE_RE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_inline(text: str) -> str:
    """One-line, retriever-safe text: controls and lone surrogates become spaces, runs of
    whitespace collapse to one space, ends are stripped.

    Queries reach tokenizers and embedders that may reject lone surrogates (they cannot be
    encoded as UTF-8), so model text is cleaned before it leaves the parser.
    """
    return " ".join(_UNSAFE_RE.sub(" ", text).split())


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def clean_block(text: str) -> str:
    """Multi-line text kept as written except that lone surrogates become U+FFFD and the ends are
    stripped; used for reasoning and answers, which are stored and later written to UTF-8 files."""
    if text.isascii():  # the common case; isascii is a single C scan
        return text.strip()
    return _SURROGATE_RE.sub("\ufffd", text).strip()


def is_blank(text: str) -> bool:
    return not text or text.isspace()
