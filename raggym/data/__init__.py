"""Data model, loaders and the synthetic multi-hop world."""

from .loaders import (
    DataFormatError,
    QUESTION_FORMATS,
    atomic_write,
    load_corpus,
    load_questions,
    write_corpus,
    write_jsonl,
    write_questions,
)
from .types import Corpus, Passage, Question, Triple, passage_id_for

__all__ = [
    "Corpus",
    "DataFormatError",
    "Passage",
    "QUESTION_FORMATS",
    "Question",
    "Triple",
    "atomic_write",
    "load_corpus",
    "load_questions",
    "passage_id_for",
    "write_corpus",
    "write_jsonl",
    "write_questions",
]
