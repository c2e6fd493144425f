"""Core data model: passages, questions and corpora.

These are plain dataclasses so that every layer (retrieval, environments, rewards, actors) can
pass them around without pulling in heavy dependencies. Identifiers are strings and are stable:
a passage without an explicit id gets one derived from its content (see ``passage_id_for``), so
the same corpus file yields the same ids on every machine and in every order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

Triple = tuple[str, str, str]


def passage_id_for(title: str, text: str) -> str:
    """Content-derived passage id: ``p`` + the first 16 hex digits of sha1(title, NUL, text).

    Hashing the content rather than using the row number keeps ids stable when a corpus is
    reordered, filtered or sharded, which matters because gold passage ids are stored in
    question files and in trajectories.
    """
    digest = hashlib.sha1(f"{title}\x00{text}".encode("utf-8", "surrogatepass")).hexdigest()
    return "p" + digest[:16]


@dataclass(frozen=True)
class Passage:
    """One retrievable unit of text."""

    id: str
    title: str
    text: str

    @classmethod
    def from_content(cls, title: str, text: str) -> "Passage":
        return cls(id=passage_id_for(title, text), title=title, text=text)

    def as_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "text": self.text}


@dataclass(frozen=True)
class Question:
    """A question with its gold answer(s) and gold evidence.

    ``answers`` holds the main answer first, then aliases; metrics take the maximum over all of
    them. ``gold_passage_ids`` refer to ``Passage.id`` in the corpus the question was loaded
    against. ``gold_triples`` is the evidence path when it is known (the synthetic world always
    knows it). ``golden_trajectory`` lists the steps that answer the question, each
    ``{"query": sub-question, "mode": retrieval mode, "kb": knowledge-base label, "answer":
    intermediate answer}``; the synthetic world writes them, the MuSiQue loader derives them from
    ``question_decomposition`` (adding ``"passage_ids"``), other formats have none.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    gold_passage_ids: tuple[str, ...] = ()
    gold_triples: tuple[Triple, ...] = ()
    hops: int | None = None
    kind: str | None = None
    golden_trajectory: tuple[dict, ...] = ()
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not self.answers:
            raise ValueError(f"question {self.id!r} has no gold answer")

    @property
    def answer(self) -> str:
        return self.answers[0]

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "question": self.question,
            "answers": list(self.answers),
            "gold_passage_ids": list(self.gold_passage_ids),
            "gold_triples": [list(t) for t in self.gold_triples],
            "hops": self.hops,
            "kind": self.kind,
            "golden_trajectory": [dict(s) for s in self.golden_trajectory],
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Question":
        return cls(
            id=str(d["id"]),
            question=str(d["question"]),
            answers=tuple(str(a) for a in d["answers"]),
            gold_passage_ids=tuple(str(p) for p in d.get("gold_passage_ids") or ()),
            gold_triples=tuple(tuple(str(x) for x in t) for t in d.get("gold_triples") or ()),
            hops=d.get("hops"),
            kind=d.get("kind"),
            golden_trajectory=tuple(dict(s) for s in d.get("golden_trajectory") or ()),
            metadata=dict(d.get("metadata") or {}),
        )


class Corpus(Sequence[Passage]):
    """An ordered list of passages with an id -> position map.

    Duplicate ids are rejected: two passages with identical title and text are the same passage,
    and a file that repeats an explicit id is ambiguous.
    """

    def __init__(self, passages: Iterable[Passage], name: str = "corpus"):
        self.name = name
        self._passages: list[Passage] = list(passages)
        self._index: dict[str, int] = {}
        for i, p in enumerate(self._passages):
            if p.id in self._index:
                raise ValueError(
                    f"{name}: duplicate passage id {p.id!r} at positions {self._index[p.id]} and {i}"
                )
            self._index[p.id] = i

    def __len__(self) -> int:
        return len(self._passages)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self._passages[i]
        return self._passages[i]

    def __iter__(self) -> Iterator[Passage]:
        return iter(self._passages)

    def __contains__(self, pid) -> bool:  # type: ignore[override]
        return pid in self._index

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self._passages]

    def index_of(self, pid: str) -> int:
        try:
            return self._index[pid]
        except KeyError:
            raise KeyError(f"{self.name}: unknown passage id {pid!r}") from None

    def by_id(self, pid: str) -> Passage:
        return self._passages[self.index_of(pid)]

    def get(self, pid: str) -> Passage | None:
        i = self._index.get(pid)
        return None if i is None else self._passages[i]

    def content_hash(self) -> str:
        """sha1 over ids in order; used to key embedding caches."""
        h = hashlib.sha1()
        for p in self._passages:
            h.update(p.id.encode())
            h.update(b"\n")
        return h.hexdigest()[:20]

    def __repr__(self) -> str:
        return f"Corpus(name={self.name!r}, passages={len(self)})"
