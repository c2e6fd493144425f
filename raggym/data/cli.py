"""``raggym data inspect FILE``: what raggym reads in a question or corpus file.

Prints the detected format, the counts, how many questions have their gold passages resolved
(and how many name them by title but could not be resolved for want of a corpus), and a few
sample records; ``--json`` prints the same as one JSON object. It runs the real loaders, so a
file it reports on is a file ``load_questions`` / ``load_corpus`` accept, and a bad file fails
with the same ``DataFormatError`` (file, record, field).

``python -m raggym.data inspect FILE`` runs it on its own; ``add_data_arguments`` and
``run_data`` plug it into the ``raggym`` console script as the ``data`` subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .loaders import (
    QUESTION_FORMATS,
    DataFormatError,
    _corpus_from_records,
    _questions_from_records,
    _records,
    detect_corpus_format,
    load_corpus,
)
from .types import Corpus, Question
from .verl import QUESTION_MARKER

_QUESTION_KEYS = ("question", "prompt", "reward_model", "golden_answers", "answers", "answer")
_SAMPLE_CHARS = 200


def detect_file_kind(first: Any) -> str:
    """``corpus`` for passage records (``{title, text}`` or FlashRAG's ``{id, contents}``), else ``questions``."""
    if isinstance(first, dict) and not any(k in first for k in _QUESTION_KEYS):
        if "contents" in first or ("text" in first and "title" in first):
            return "corpus"
    return "questions"


def _clip(text: str, limit: int = _SAMPLE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _question_sample(q: Question, corpus: Corpus | None) -> dict:
    sample = {"id": q.id, "question": _clip(q.question), "answers": list(q.answers), "kind": q.kind, "hops": q.hops,
              "gold_passage_ids": list(q.gold_passage_ids)}
    if corpus is not None:
        sample["gold_titles"] = [corpus.by_id(pid).title for pid in q.gold_passage_ids]
    if q.metadata.get("supporting_titles"):
        sample["supporting_titles"] = list(q.metadata["supporting_titles"])
    if q.golden_trajectory:
        sample["golden_steps"] = len(q.golden_trajectory)
    return sample


def inspect_data_file(path, corpus_path=None, *, fmt: str = "auto", samples: int = 3,
                      question_marker: str = QUESTION_MARKER) -> dict:
    """The report ``raggym data inspect`` prints, as a dict (see the module docstring)."""
    path = Path(path)
    records = _records(path)
    if not records:
        raise DataFormatError(path, None, None, "no records")
    first = records[0][1]
    if fmt == "auto" and detect_file_kind(first) == "corpus":
        passages = _corpus_from_records(path, records, None)
        return {
            "path": str(path), "kind": "corpus", "format": detect_corpus_format(path, first),
            "records": len(records), "passages": len(passages),
            "distinct_titles": len({p.title for p in passages}),
            "samples": [{"id": p.id, "title": p.title, "text": _clip(p.text)} for p in passages[:samples]],
        }
    corpus = load_corpus(corpus_path) if corpus_path is not None else None
    detected, questions = _questions_from_records(path, records, corpus, fmt, question_marker)
    with_gold = sum(1 for q in questions if q.gold_passage_ids)
    by_title_unresolved = sum(1 for q in questions if q.metadata.get("supporting_titles") and not q.gold_passage_ids)
    return {
        "path": str(path), "kind": "questions", "format": detected, "records": len(records),
        "questions": len(questions),
        "with_gold_passages": with_gold,
        "gold_named_by_title_unresolved": by_title_unresolved,
        "with_golden_trajectory": sum(1 for q in questions if q.golden_trajectory),
        "answers_per_question": round(sum(len(q.answers) for q in questions) / len(questions), 3),
        "corpus": None if corpus is None else {"path": str(corpus_path), "passages": len(corpus)},
        "samples": [_question_sample(q, corpus) for q in questions[:samples]],
    }


def format_report(report: dict) -> str:
    """The human-readable form of ``inspect_data_file``'s report."""
    lines = [f"file:    {report['path']}", f"format:  {report['format']} ({report['kind']})"]
    if report["kind"] == "corpus":
        lines.append(f"passages: {report['passages']:,} ({report['distinct_titles']:,} distinct titles)")
        lines.append("samples:")
        lines += [f"  [{s['id']}] {s['title']}: {s['text']}" for s in report["samples"]]
        return "\n".join(lines)
    n = report["questions"]
    lines.append(f"questions: {n:,}")
    corpus = report["corpus"]
    against = f" against {corpus['path']} ({corpus['passages']:,} passages)" if corpus else ""
    lines.append(f"gold passages resolved: {report['with_gold_passages']:,} of {n:,}{against}")
    if report["gold_named_by_title_unresolved"]:
        lines.append(f"  {report['gold_named_by_title_unresolved']:,} name their gold passages by title; "
                     "pass --corpus to resolve them")
    if report["with_golden_trajectory"]:
        lines.append(f"golden trajectories: {report['with_golden_trajectory']:,} of {n:,}")
    lines.append(f"answers per question: {report['answers_per_question']}")
    lines.append("samples:")
    for s in report["samples"]:
        gold = s.get("gold_titles") or s.get("supporting_titles") or s["gold_passage_ids"]
        lines.append(f"  [{s['id']}] {s['question']}")
        lines.append(f"      answers: {' | '.join(s['answers'])}; gold: {', '.join(gold) if gold else '-'}")
    return "\n".join(lines)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``data`` subcommands (``inspect``) to ``parser``."""
    sub = parser.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    sub.required = True
    p = sub.add_parser("inspect", help="detected format, counts, gold-passage resolution and sample records of a data file",
                       description="Read a question or corpus file with raggym's loaders and report what came out.")
    p.add_argument("file", help="question or corpus file (.json, .jsonl or .parquet)")
    p.add_argument("--corpus", default=None, help="corpus to resolve gold passages against")
    p.add_argument("--format", dest="fmt", default="auto", choices=QUESTION_FORMATS,
                   help="question format (default: detected from the first record)")
    p.add_argument("--question-marker", default=QUESTION_MARKER,
                   help="regular expression before the question in verl prompts (default: %(default)s)")
    p.add_argument("--samples", type=int, default=3, help="sample records shown (default 3)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run_data(args: argparse.Namespace) -> int:
    report = inspect_data_file(args.file, args.corpus, fmt=args.fmt, samples=args.samples,
                               question_marker=args.question_marker)
    print(json.dumps(report, ensure_ascii=False) if args.json else format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raggym data", description="Inspect raggym data files.")
    add_data_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_data(args)
    except (DataFormatError, ValueError) as e:
        print(f"raggym data: error: {e}", file=sys.stderr)
        return 2
