"""Reading OpenIE results (entities and triples per passage) and aligning them with a corpus.

Accepted sources, all in the HippoRAG OpenIE output format (``{"docs": [{..., "extracted_entities":
[...], "extracted_triples": [[s, r, o], ...]}]}``):

- a path to such a JSON file (HippoRAG's own files, the synthetic world's ``openie.json``, or the
  file ``raggym.openie`` writes);
- the parsed dict, or just its ``docs`` list;
- a list of ``PassageTriples`` already aligned with the corpus.

Alignment is by content whenever a doc carries it: ``title`` + ``text``, or HippoRAG's ``passage``
(title, newline, text), or an ``idx``/``id`` equal to a corpus passage id. Only when no doc carries
content does alignment fall back to position, and then the doc count must equal the corpus size.
Docs that name passages absent from the corpus mean the file belongs to another corpus: that is a
``ValueError``, not a silent partial graph. Malformed triples (not three strings) are skipped
and counted in ``OpenIEAlignment.skipped_triples``; HippoRAG's shipped MuSiQue file has 185 such
triples among 17,419.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .encoding import passage_text

Triple = tuple[str, str, str]


@dataclass(frozen=True)
class PassageTriples:
    entities: tuple[str, ...] = ()
    triples: tuple[Triple, ...] = ()


@dataclass
class OpenIEAlignment:
    per_passage: list[PassageTriples]
    matched: int = 0
    skipped_triples: int = 0
    aligned_by: str = "content"
    source: str = "<memory>"
    missing: list[int] = field(default_factory=list)  # corpus rows without any OpenIE doc


def _clean_triples(raw) -> tuple[tuple[Triple, ...], int]:
    good: list[Triple] = []
    skipped = 0
    if not isinstance(raw, list):
        return (), (0 if raw is None else 1)
    for t in raw:
        if isinstance(t, (list, tuple)) and len(t) == 3 and all(isinstance(x, str) for x in t):
            good.append((t[0], t[1], t[2]))
        else:
            skipped += 1
    return tuple(good), skipped


def _clean_entities(raw) -> tuple[str, ...]:
    if not isinstance(raw, list):
        return ()
    return tuple(e for e in raw if isinstance(e, str))


def _read_docs(source, label: str) -> list:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as e:
            raise ValueError(f"cannot read OpenIE file {str(path)!r} ({e.strerror or e})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"OpenIE file {str(path)!r} is not valid UTF-8 JSON ({e})") from None
        source = data
    if isinstance(source, dict):
        if not isinstance(source.get("docs"), list):
            raise ValueError(f"{label}: expected a HippoRAG OpenIE object with a 'docs' list")
        return source["docs"]
    if isinstance(source, list):
        return source
    raise ValueError(f"{label}: unsupported OpenIE source of type {type(source).__name__}")


def align_openie(source, corpus) -> OpenIEAlignment:
    """Return entities and triples for every corpus passage, in corpus order."""
    label = str(source) if isinstance(source, (str, os.PathLike)) else "<openie>"
    if isinstance(source, list) and source and all(isinstance(x, PassageTriples) for x in source):
        if len(source) != len(corpus):
            raise ValueError(f"{label}: {len(source)} PassageTriples for a corpus of {len(corpus)} passages")
        return OpenIEAlignment(list(source), matched=len(source), aligned_by="position", source=label)
    docs = _read_docs(source, label)
    by_content: dict[tuple[str, str], int] = {}
    by_passage: dict[str, int] = {}
    for i, p in enumerate(corpus):
        by_content.setdefault((p.title, p.text.strip()), i)
        by_passage.setdefault(passage_text(p.title, p.text).strip(), i)
    rows: list[int | None] = []
    has_content = 0
    for j, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ValueError(f"{label}: docs[{j}] is not an object")
        row = None
        carries_content = False
        if isinstance(doc.get("title"), str) and isinstance(doc.get("text"), str):
            carries_content = True
            row = by_content.get((doc["title"], doc["text"].strip()))
        if row is None and isinstance(doc.get("passage"), str):
            carries_content = True
            row = by_passage.get(doc["passage"].strip())
        if row is None:
            for key in ("id", "idx"):
                if isinstance(doc.get(key), str):
                    carries_content = True
                    if doc[key] in corpus:
                        row = corpus.index_of(doc[key])
                        break
        has_content += carries_content
        rows.append(row)
    aligned_by = "content"
    if has_content == 0:
        if len(docs) != len(corpus):
            raise ValueError(
                f"{label}: OpenIE docs carry no passage content, so they must align by position, but there are "
                f"{len(docs)} docs for {len(corpus)} passages"
            )
        rows = list(range(len(docs)))
        aligned_by = "position"
    unmatched = [j for j, r in enumerate(rows) if r is None]
    if unmatched:
        j = unmatched[0]
        title = docs[j].get("title") or str(docs[j].get("passage", ""))[:60]
        raise ValueError(
            f"{label}: {len(unmatched)} of {len(docs)} OpenIE docs match no corpus passage "
            f"(first: docs[{j}] {title!r}); was the file extracted from a different corpus?"
        )
    per_passage: list[PassageTriples | None] = [None] * len(corpus)
    skipped = 0
    for doc, row in zip(docs, rows):
        triples, bad = _clean_triples(doc.get("extracted_triples"))
        skipped += bad
        entry = PassageTriples(_clean_entities(doc.get("extracted_entities")), triples)
        prev = per_passage[row]
        if prev is not None:  # duplicate passages in the file: keep the union
            entry = PassageTriples(
                tuple(dict.fromkeys(prev.entities + entry.entities)), tuple(dict.fromkeys(prev.triples + entry.triples))
            )
        per_passage[row] = entry
    missing = [i for i, e in enumerate(per_passage) if e is None]
    if len(missing) == len(corpus):
        raise ValueError(f"{label}: no OpenIE doc matches the corpus")
    out = [e if e is not None else PassageTriples() for e in per_passage]
    return OpenIEAlignment(out, matched=len(corpus) - len(missing), skipped_triples=skipped, aligned_by=aligned_by,
                           source=label, missing=missing)


def openie_docs(corpus, per_passage: list[PassageTriples]) -> dict:
    """The HippoRAG OpenIE file structure for ``per_passage`` (aligned with ``corpus``)."""
    docs = []
    for i, (p, pt) in enumerate(zip(corpus, per_passage)):
        docs.append({
            "idx": p.id,
            "title": p.title,
            "text": p.text,
            "passage": passage_text(p.title, p.text),
            "extracted_entities": list(pt.entities),
            "extracted_triples": [list(t) for t in pt.triples],
        })
    return {"docs": docs}
