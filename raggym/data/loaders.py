"""Loaders and writers for corpora and question sets.

Corpora: HippoRAG-style JSON (a list of ``{title, text}``; RouteRAG's ``corpus.json`` is one), JSONL
(one ``{title, text[, id]}`` per line), parquet (columns ``title``, ``text`` and optionally ``id``)
and FlashRAG's JSONL (``{id, contents}``, the title on the first line of ``contents``).

Questions: MuSiQue, HotpotQA, 2WikiMultiHopQA, HippoRAG 2's PopQA and NQ files (which RouteRAG
evaluates on), Search-R1 / RouteRAG / verl parquet, FlashRAG JSONL and raggym's own JSONL
(``Question.as_dict`` per line). Gold supporting passages are resolved to corpus ids while
loading, so every question that comes out refers to passages that exist. MuSiQue's
``question_decomposition`` becomes the question's golden trajectory (see
``_musique_golden_trajectory``), which R1-Router's teacher-forced Step-GRPO needs. verl prompts
hold a trainer's whole instruction text; the question itself is recovered from them (see
``raggym.data.verl``). docs/data.md lists every layout with an example.

Every error is a ``DataFormatError`` naming the file, the record index and the field; a loader
either returns everything or raises, never a partial list. Writers go through a temporary file and
an atomic rename, so a crash never leaves half a file behind.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from raggym.atomic import atomic_write  # re-exported: raggym.data.atomic_write is public API

from .types import Corpus, Passage, Question, passage_id_for
from .verl import QUESTION_MARKER, question_from_prompt

QUESTION_FORMATS = ("auto", "musique", "hotpotqa", "2wiki", "popqa", "nq_rear", "searchr1", "flashrag", "jsonl")
CORPUS_FORMATS = ("hipporag", "jsonl", "parquet", "flashrag")


class DataFormatError(ValueError):
    """A data file is malformed. ``path``, ``record`` and ``field`` locate the problem."""

    def __init__(self, path, record: int | None, field: str | None, reason: str):
        self.path, self.record, self.field, self.reason = str(path), record, field, reason
        where = str(path)
        if record is not None:
            where += f", record {record}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {reason}")


# ----------------------------------------------------------------------------- reading raw records


def _read_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataFormatError(path, None, None, f"cannot read file ({e.strerror or e})") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataFormatError(path, None, None, f"not UTF-8 text (byte offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataFormatError(path, None, None, f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        fh = path.open("rb")
    except OSError as e:
        raise DataFormatError(path, None, None, f"cannot read file ({e.strerror or e})") from None
    with fh:
        record = 0
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield record, json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataFormatError(path, record, None, f"malformed JSON on line {lineno}: {e}") from None
            record += 1


def _read_parquet_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several unrelated types
        raise DataFormatError(path, None, None, f"not a readable parquet file ({e})") from None
    return table.to_pylist()


def _records(path: Path) -> list[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return list(enumerate(_read_parquet_rows(path)))
    if suffix in (".jsonl", ".ndjson"):
        return list(_iter_jsonl(path))
    data = _read_json(path)
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataFormatError(path, None, None, f"expected a JSON list of records, got {type(data).__name__}")
    return list(enumerate(data))


def _field(path, i: int, rec: Any, name: str, kind=str, *, allow_empty=False):
    if not isinstance(rec, dict):
        raise DataFormatError(path, i, None, f"expected an object, got {type(rec).__name__}")
    if name not in rec or rec[name] is None:
        raise DataFormatError(path, i, name, "missing")
    value = rec[name]
    if kind is not None and not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataFormatError(path, i, name, f"expected {expected}, got {type(value).__name__}")
    if not allow_empty and isinstance(value, (str, list)) and len(value) == 0:
        raise DataFormatError(path, i, name, "empty")
    return value


# ----------------------------------------------------------------------------- corpora


def _flashrag_title_and_text(contents: str) -> tuple[str, str]:
    """Split FlashRAG's ``contents``: the title is the first line, usually in double quotes.

    The quotes come from the DPR Wikipedia dump FlashRAG's corpora derive from, which writes
    titles as CSV fields (``"Title"``, inner quotes doubled); they are removed so that titles
    match the ones question files name. The text is the rest, unchanged.
    """
    title, newline, text = contents.partition("\n")
    if not newline:
        return "", contents
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1].replace('""', '"')
    return title, text


def _corpus_record(path, i: int, rec) -> tuple[str, str]:
    if isinstance(rec, dict) and "text" not in rec and "contents" in rec:
        contents = _field(path, i, rec, "contents", str)
        if isinstance(rec.get("title"), str):
            return rec["title"], contents
        title, text = _flashrag_title_and_text(contents)
        if not text.strip():
            raise DataFormatError(path, i, "contents", "no text after the title line")
        return title, text
    return _field(path, i, rec, "title", str, allow_empty=True), _field(path, i, rec, "text", str)


def detect_corpus_format(path: Path, first: Any) -> str:
    """``flashrag`` for ``{id, contents}`` records, else the container: ``hipporag`` (a JSON list), ``jsonl`` or ``parquet``."""
    if isinstance(first, dict) and "text" not in first and "contents" in first:
        return "flashrag"
    suffix = Path(path).suffix.lower()
    return "parquet" if suffix == ".parquet" else "jsonl" if suffix in (".jsonl", ".ndjson") else "hipporag"


def load_corpus(path: str | os.PathLike, name: str | None = None) -> Corpus:
    """Load a corpus file of ``{title, text[, id]}`` records (JSON list, JSONL or parquet) or FlashRAG's ``{id, contents}`` JSONL.

    Passages without an ``id`` get a content-derived one (``passage_id_for``). Exact duplicate
    passages (same title and text, no explicit id) are kept once, as HippoRAG does.
    """
    path = Path(path)
    return _corpus_from_records(path, _records(path), name)


def _corpus_from_records(path: Path, records: list[tuple[int, Any]], name: str | None) -> Corpus:
    passages: list[Passage] = []
    seen: dict[str, int] = {}
    for i, rec in records:
        title, text = _corpus_record(path, i, rec)
        explicit = rec.get("id", rec.get("idx"))
        if explicit is not None and not isinstance(explicit, (str, int)):
            raise DataFormatError(path, i, "id", f"expected str or int, got {type(explicit).__name__}")
        pid = str(explicit) if explicit is not None else passage_id_for(title, text)
        if pid in seen:
            if explicit is None:
                continue  # identical content: the same passage
            raise DataFormatError(path, i, "id", f"duplicate id {pid!r} (first at record {seen[pid]})")
        seen[pid] = i
        passages.append(Passage(pid, title, text))
    if not passages:
        raise DataFormatError(path, None, None, "corpus has no passages")
    return Corpus(passages, name=name or path.stem)


# ----------------------------------------------------------------------------- questions


def _answers(path, i, rec, main_field: str, alias_field: str | None = None) -> tuple[str, ...]:
    main = rec.get(main_field) if isinstance(rec, dict) else None
    values: list[str] = []
    if isinstance(main, str):
        values.append(main)
    elif isinstance(main, list):
        values.extend(str(a) for a in main if a is not None)
    elif main is not None and not isinstance(main, dict):
        values.append(str(main))
    if alias_field and isinstance(rec.get(alias_field), list):
        values.extend(str(a) for a in rec[alias_field] if a is not None)
    cleaned = tuple(dict.fromkeys(v.strip() for v in values if v and v.strip()))
    if not cleaned:
        raise DataFormatError(path, i, main_field, "no non-empty gold answer")
    return cleaned


class _TitleIndex:
    """Resolve (title[, text]) references to corpus ids."""

    def __init__(self, corpus: Corpus):
        self.by_title: dict[str, list[Passage]] = {}
        self.by_content: dict[tuple[str, str], str] = {}
        for p in corpus:
            self.by_title.setdefault(p.title, []).append(p)
            self.by_content[(p.title, p.text.strip())] = p.id

    def resolve(self, title: str, text_hint: str | None = None) -> str | None:
        if text_hint is not None:
            pid = self.by_content.get((title, text_hint.strip()))
            if pid is not None:
                return pid
        candidates = self.by_title.get(title, [])
        if len(candidates) == 1:
            return candidates[0].id
        if text_hint and candidates:
            hint = " ".join(text_hint.split())[:200]
            matching = [p for p in candidates if hint and hint in " ".join(p.text.split())]
            if len(matching) == 1:
                return matching[0].id
        return None


def _need_corpus(path, corpus):
    if corpus is None:
        raise DataFormatError(path, None, None, "this question format names gold passages by title; pass the corpus to resolve them")


def _parse_musique(path, i, rec, titles: _TitleIndex | None) -> Question:
    qid = str(_field(path, i, rec, "id", (str, int)))
    question = _field(path, i, rec, "question", str)
    answers = _answers(path, i, rec, "answer", "answer_aliases")
    paragraphs = _field(path, i, rec, "paragraphs", list)

    def paragraph_id(j: int, role: str) -> str:
        para = paragraphs[j]
        title = para.get("title")
        text = para.get("paragraph_text", para.get("text"))
        if not isinstance(title, str) or not isinstance(text, str):
            raise DataFormatError(path, i, f"paragraphs[{j}]", f"{role} paragraph lacks title or paragraph_text")
        pid = titles.resolve(title, text) if titles else passage_id_for(title, text)
        if pid is None:
            raise DataFormatError(path, i, f"paragraphs[{j}]", f"{role} paragraph {title!r} is not in the corpus")
        return pid

    gold: list[str] = []
    for j, para in enumerate(paragraphs):
        if not isinstance(para, dict):
            raise DataFormatError(path, i, f"paragraphs[{j}]", "expected an object")
        if para.get("is_supporting"):
            gold.append(paragraph_id(j, "supporting"))
    decomposition = rec.get("question_decomposition") or []
    hops = len(decomposition) if isinstance(decomposition, list) and decomposition else None
    if hops is None and qid[:1].isdigit() and "hop" in qid:
        hops = int(qid.split("hop")[0])
    trajectory = _musique_golden_trajectory(path, i, decomposition, paragraphs, paragraph_id)
    return Question(qid, question, answers, tuple(dict.fromkeys(gold)), hops=hops, kind="musique",
                    golden_trajectory=trajectory)


_ANSWER_REFERENCE_RE = re.compile(r"#(\d+)")
_SPACE_BEFORE_PUNCTUATION_RE = re.compile(r"\s+([?.,!;:])")


def _musique_golden_trajectory(path, i, decomposition, paragraphs: list, paragraph_id) -> tuple[dict, ...]:
    """MuSiQue's ``question_decomposition`` as golden steps with the synthetic world's keys.

    Each ``{question, answer, paragraph_support_idx}`` becomes ``{"query", "mode": "passage",
    "kb": "text", "answer", "passage_ids"}``. Later sub-questions refer to earlier answers as
    ``#1``, ``#2``, …; those references are replaced by the answers, so that every step reads on
    its own, as the golden prefix R1-Router's Step-GRPO conditions on must. Wikidata-style
    sub-questions (``"Hello Love >> performer"``) are kept as MuSiQue writes them. A record
    without a decomposition has no golden trajectory; a malformed one is a ``DataFormatError``.
    """
    if not decomposition:
        return ()
    if not isinstance(decomposition, list):
        raise DataFormatError(path, i, "question_decomposition", f"expected a list, got {type(decomposition).__name__}")
    steps: list[dict] = []
    for j, sub in enumerate(decomposition):
        where = f"question_decomposition[{j}]"
        if not isinstance(sub, dict):
            raise DataFormatError(path, i, where, "expected an object")
        text, answer = sub.get("question"), sub.get("answer")
        if not isinstance(text, str) or not text.strip():
            raise DataFormatError(path, i, f"{where}.question", "missing or empty")
        if not isinstance(answer, str) or not answer.strip():
            raise DataFormatError(path, i, f"{where}.answer", "missing or empty")

        def earlier_answer(match: re.Match) -> str:
            k = int(match.group(1))
            if not 1 <= k <= j:
                raise DataFormatError(path, i, f"{where}.question", f"#{k} refers to no earlier sub-question")
            return steps[k - 1]["answer"]

        sub_question = " ".join(_ANSWER_REFERENCE_RE.sub(earlier_answer, text).split())
        support = sub.get("paragraph_support_idx")
        steps.append({
            "query": _SPACE_BEFORE_PUNCTUATION_RE.sub(r"\1", sub_question),
            "mode": "passage",
            "kb": "text",
            "answer": answer.strip(),
            "passage_ids": [] if support is None else [_support_passage_id(path, i, where, support, paragraphs, paragraph_id)],
        })
    return tuple(steps)


def _support_passage_id(path, i, where: str, support, paragraphs: list, paragraph_id) -> str:
    """Corpus id of the paragraph a sub-question is answered from."""
    if isinstance(support, bool) or not isinstance(support, int):
        raise DataFormatError(path, i, f"{where}.paragraph_support_idx", f"expected an int, got {support!r}")
    # The index names a paragraph's "idx", which equals its position in MuSiQue's own files.
    for j, para in enumerate(paragraphs):
        if para.get("idx") == support:
            return paragraph_id(j, "support")
    if 0 <= support < len(paragraphs):
        return paragraph_id(support, "support")
    raise DataFormatError(path, i, f"{where}.paragraph_support_idx", f"no paragraph {support}")


def _parse_hotpot_like(path, i, rec, titles: _TitleIndex, kind: str) -> Question:
    qid = str(rec.get("_id", rec.get("id"))) if isinstance(rec, dict) and (rec.get("_id") or rec.get("id")) else None
    if qid is None:
        raise DataFormatError(path, i, "_id", "missing")
    question = _field(path, i, rec, "question", str)
    answers = _answers(path, i, rec, "answer", "answer_aliases")
    facts = _field(path, i, rec, "supporting_facts", list)
    context = {}
    for c in rec.get("context") or []:
        if isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], list):
            context[c[0]] = c[1]
    gold: list[str] = []
    for j, fact in enumerate(facts):
        if not (isinstance(fact, (list, tuple)) and len(fact) >= 1 and isinstance(fact[0], str)):
            raise DataFormatError(path, i, f"supporting_facts[{j}]", "expected [title, sentence_id]")
        title = fact[0]
        sentences = context.get(title)
        hint = "".join(str(s) for s in sentences) if sentences else None
        pid = titles.resolve(title, hint)
        if pid is None:
            raise DataFormatError(path, i, f"supporting_facts[{j}]", f"supporting title {title!r} is not in the corpus")
        gold.append(pid)
    triples: list[tuple[str, str, str]] = []
    for j, ev in enumerate(rec.get("evidences") or []):  # 2Wiki: [subject, relation, object]
        if isinstance(ev, (list, tuple)) and len(ev) == 3:
            triples.append((str(ev[0]), str(ev[1]), str(ev[2])))
        else:
            raise DataFormatError(path, i, f"evidences[{j}]", "expected [subject, relation, object]")
    return Question(
        qid,
        question,
        answers,
        tuple(dict.fromkeys(gold)),
        gold_triples=tuple(triples),
        hops=len(set(f[0] for f in facts)) or None,
        kind=kind if not rec.get("type") else f"{kind}:{rec['type']}",
    )


def _searchr1_question_text(rec: dict) -> str | None:
    if isinstance(rec.get("question"), str):
        return rec["question"]
    extra = rec.get("extra_info") or {}
    if isinstance(extra, dict) and isinstance(extra.get("question"), str):
        return extra["question"]
    prompt = rec.get("prompt")
    if isinstance(prompt, list):
        for msg in reversed(prompt):
            if isinstance(msg, dict) and msg.get("role") == "user" and isinstance(msg.get("content"), str):
                return msg["content"]
    if isinstance(prompt, str):
        return prompt
    return None


def _parse_searchr1(path, i, rec, titles: _TitleIndex | None) -> Question:
    if not isinstance(rec, dict):
        raise DataFormatError(path, i, None, "expected an object")
    question = _searchr1_question_text(rec)
    if not question:
        raise DataFormatError(path, i, "prompt", "no question text (expected `question`, `extra_info.question` or a user message)")
    reward_model = rec.get("reward_model")
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if not isinstance(ground_truth, dict):
        raise DataFormatError(path, i, "reward_model.ground_truth.target", "missing")
    answers = _answers(path, i, ground_truth, "target")
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    gold: list[str] = []
    for j, fact in enumerate(extra.get("supporting_facts") or []):
        title = fact[0] if isinstance(fact, (list, tuple)) and fact else fact
        if not isinstance(title, str):
            raise DataFormatError(path, i, f"extra_info.supporting_facts[{j}]", "expected a title or [title, sentence_id]")
        if titles is None:
            continue
        pid = titles.resolve(title)
        if pid is None:
            raise DataFormatError(path, i, f"extra_info.supporting_facts[{j}]", f"supporting title {title!r} is not in the corpus")
        gold.append(pid)
    qid = str(rec.get("id", extra.get("index", i)))
    return Question(qid, question, answers, tuple(dict.fromkeys(gold)), kind=str(rec.get("data_source") or "searchr1"))


def _parse_native(path, i, rec, corpus: Corpus | None) -> Question:
    if not isinstance(rec, dict):
        raise DataFormatError(path, i, None, "expected an object")
    _field(path, i, rec, "id", (str, int))
    _field(path, i, rec, "question", str)
    if "answers" not in rec and "answer" in rec:
        rec = {**rec, "answers": rec["answer"]}
    answers = _answers(path, i, rec, "answers", "answer_aliases")
    try:
        q = Question.from_dict({**rec, "answers": list(answers)})
    except (KeyError, TypeError, ValueError) as e:
        raise DataFormatError(path, i, None, f"invalid question record ({e})") from None
    if corpus is not None:
        for j, pid in enumerate(q.gold_passage_ids):
            if pid not in corpus:
                raise DataFormatError(path, i, f"gold_passage_ids[{j}]", f"unknown passage id {pid!r}")
    return q


def detect_question_format(path: Path, first: Any) -> str:
    if path.suffix.lower() == ".parquet" or (isinstance(first, dict) and "reward_model" in first):
        return "searchr1"
    if not isinstance(first, dict):
        raise DataFormatError(path, 0, None, "cannot detect the question format: first record is not an object")
    if "paragraphs" in first:
        return "musique"
    if "evidences" in first or ("supporting_facts" in first and first.get("type") in {"compositional", "inference", "bridge_comparison"}):
        return "2wiki"
    if "supporting_facts" in first:
        return "hotpotqa"
    if "answers" in first or "answer" in first:
        return "jsonl"
    raise DataFormatError(path, 0, None, "cannot detect the question format; pass fmt= one of " + ", ".join(QUESTION_FORMATS[1:]))


def load_questions(path: str | os.PathLike, corpus: Corpus | None = None, fmt: str = "auto") -> list[Question]:
    """Load questions and resolve their gold passages against ``corpus``.

    ``fmt`` is one of ``auto, musique, hotpotqa, 2wiki, searchr1, jsonl``. Duplicate question ids
    are an error. Returns the full list or raises ``DataFormatError``.
    """
    path = Path(path)
    if fmt not in QUESTION_FORMATS:
        raise ValueError(f"unknown question format {fmt!r}; expected one of {', '.join(QUESTION_FORMATS)}")
    records = _records(path)
    if not records:
        raise DataFormatError(path, None, None, "no question records")
    if fmt == "auto":
        fmt = detect_question_format(path, records[0][1])
    titles = _TitleIndex(corpus) if corpus is not None else None
    parse: Callable[[Path, int, Any], Question]
    if fmt == "musique":
        parse = lambda p, i, r: _parse_musique(p, i, r, titles)  # noqa: E731
    elif fmt in ("hotpotqa", "2wiki"):
        _need_corpus(path, corpus)
        parse = lambda p, i, r: _parse_hotpot_like(p, i, r, titles, fmt)  # noqa: E731
    elif fmt == "searchr1":
        parse = lambda p, i, r: _parse_searchr1(p, i, r, titles)  # noqa: E731
    else:
        parse = lambda p, i, r: _parse_native(p, i, r, corpus)  # noqa: E731
    out: list[Question] = []
    seen: dict[str, int] = {}
    for i, rec in records:
        q = parse(path, i, rec)
        if q.id in seen:
            raise DataFormatError(path, i, "id", f"duplicate question id {q.id!r} (first at record {seen[q.id]})")
        seen[q.id] = i
        out.append(q)
    return out


# ----------------------------------------------------------------------------- writers


def write_jsonl(path, rows: Iterable[dict]) -> Path:
    def write(fh):
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False))
            fh.write("\n")

    return atomic_write(path, write)


def write_corpus(path, passages: Iterable[Passage]) -> Path:
    """Write a corpus as JSON list (``.json``), JSONL (``.jsonl``) or parquet (``.parquet``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return write_jsonl(path, (p.as_dict() for p in passages))
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [p.as_dict() for p in passages]
        table = pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string())]))
        return atomic_write(path, lambda fh: pq.write_table(table, fh), mode="wb")
    if suffix == ".json":
        def write(fh):
            fh.write("[")
            for n, p in enumerate(passages):
                fh.write(",\n" if n else "\n")
                fh.write(json.dumps(p.as_dict(), ensure_ascii=False))
            fh.write("\n]\n")

        return atomic_write(path, write)
    raise ValueError(f"{path}: unknown corpus extension {suffix!r}; use .json, .jsonl or .parquet")


def write_questions(path, questions: Iterable[Question]) -> Path:
    """Write questions as raggym JSONL (readable back with ``load_questions(fmt='jsonl')``)."""
    return write_jsonl(path, (q.as_dict() for q in questions))
