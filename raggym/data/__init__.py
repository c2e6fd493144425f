"""Data model, loaders and writers (raggym's own layouts and the anchors'), and the synthetic multi-hop world.

docs/data.md lists every file layout read and written.
"""

from .golden import GoldenTrajectoryError, golden_trajectory_for, with_golden_trajectories
from .loaders import (
    CORPUS_FORMATS,
    DataFormatError,
    QUESTION_FORMATS,
    atomic_write,
    detect_corpus_format,
    detect_question_format,
    load_corpus,
    load_questions,
    write_corpus,
    write_jsonl,
    write_questions,
)
from .types import Corpus, Passage, Question, Triple, passage_id_for
from .verl import QUESTION_MARKER, question_from_prompt, write_verl_parquet

__all__ = [
    "CORPUS_FORMATS",
    "Corpus",
    "DataFormatError",
    "GoldenTrajectoryError",
    "Passage",
    "QUESTION_FORMATS",
    "QUESTION_MARKER",
    "Question",
    "Triple",
    "atomic_write",
    "detect_corpus_format",
    "detect_question_format",
    "golden_trajectory_for",
    "load_corpus",
    "load_questions",
    "passage_id_for",
    "question_from_prompt",
    "with_golden_trajectories",
    "write_corpus",
    "write_jsonl",
    "write_questions",
    "write_verl_parquet",
]
