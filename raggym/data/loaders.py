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

import dataclasses
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
    # pyarrow is imported on first use: it would add about a fifth to the time of `import raggym, envs`.
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
        self.corpus = corpus
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

    def why_unresolved(self, title: str) -> str:
        count = len(self.by_title.get(title, ()))
        if count == 0:
            return f"supporting title {title!r} is not in the corpus"
        return (f"supporting title {title!r} matches {count} passages of the corpus and the record has no text to "
                "tell them apart; gold passages named by title need a corpus with one passage per title")


def _resolve_titles(path, i, field: str, named: list[str], titles: _TitleIndex, hints: dict[str, str]) -> tuple[str, ...]:
    """Corpus ids of the passages named by title; ``named[j]`` is reported as ``field[j]``."""
    gold: list[str] = []
    for j, title in enumerate(named):
        pid = titles.resolve(title, hints.get(title))
        if pid is None:
            raise DataFormatError(path, i, f"{field}[{j}]", titles.why_unresolved(title))
        gold.append(pid)
    return tuple(dict.fromkeys(gold))


def _paragraph_passage_id(path, i, where: str, para: Any, titles: _TitleIndex | None, role: str) -> str:
    """Corpus id of a ``{title, paragraph_text | text}`` paragraph (its content hash without a corpus)."""
    if not isinstance(para, dict):
        raise DataFormatError(path, i, where, "expected an object")
    title = para.get("title")
    text = para.get("paragraph_text", para.get("text"))
    if not isinstance(title, str) or not isinstance(text, str):
        raise DataFormatError(path, i, where, f"{role} paragraph lacks title or paragraph_text")
    pid = titles.resolve(title, text) if titles else passage_id_for(title, text)
    if pid is None:
        raise DataFormatError(path, i, where, f"{role} paragraph {title!r} is not in the corpus")
    return pid


def _supporting_paragraph_ids(path, i, field: str, paragraphs: list, titles: _TitleIndex | None) -> tuple[str, ...]:
    """Ids of the paragraphs marked ``is_supporting`` (MuSiQue, and HippoRAG 2's PopQA and NQ files)."""
    gold: list[str] = []
    for j, para in enumerate(paragraphs):
        if not isinstance(para, dict):
            raise DataFormatError(path, i, f"{field}[{j}]", "expected an object")
        if para.get("is_supporting"):
            gold.append(_paragraph_passage_id(path, i, f"{field}[{j}]", para, titles, "supporting"))
    return tuple(dict.fromkeys(gold))


def _need_corpus(path, corpus):
    if corpus is None:
        raise DataFormatError(path, None, None, "this question format names gold passages by title; pass the corpus to resolve them")


def _parse_musique(path, i, rec, titles: _TitleIndex | None) -> Question:
    qid = str(_field(path, i, rec, "id", (str, int)))
    question = _field(path, i, rec, "question", str)
    answers = _answers(path, i, rec, "answer", "answer_aliases")
    paragraphs = _field(path, i, rec, "paragraphs", list)

    def paragraph_id(j: int, role: str) -> str:
        return _paragraph_passage_id(path, i, f"paragraphs[{j}]", paragraphs[j], titles, role)

    gold = _supporting_paragraph_ids(path, i, "paragraphs", paragraphs, titles)
    decomposition = rec.get("question_decomposition") or []
    hops = len(decomposition) if isinstance(decomposition, list) and decomposition else None
    if hops is None and qid[:1].isdigit() and "hop" in qid:
        hops = int(qid.split("hop")[0])
    trajectory = _musique_golden_trajectory(path, i, decomposition, paragraphs, paragraph_id)
    return Question(qid, question, answers, gold, hops=hops, kind="musique", golden_trajectory=trajectory)


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
    for j, fact in enumerate(facts):
        if not (isinstance(fact, (list, tuple)) and len(fact) >= 1 and isinstance(fact[0], str)):
            raise DataFormatError(path, i, f"supporting_facts[{j}]", "expected [title, sentence_id]")
    named = [fact[0] for fact in facts]
    gold = _resolve_titles(path, i, "supporting_facts", named, titles, _context_texts(rec.get("context"), joiner=""))
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
        gold,
        gold_triples=tuple(triples),
        hops=len(set(named)) or None,
        kind=kind if not rec.get("type") else f"{kind}:{rec['type']}",
    )


def _context_texts(context: Any, joiner: str = " ") -> dict[str, str]:
    """``title -> text`` from a HotpotQA-style context, used to tell same-titled passages apart.

    Accepts HotpotQA's ``[[title, [sentence, ...]], ...]`` and the column form the Hugging Face
    copies (and FlashRAG's ``metadata``) use: ``{"title": [...], "sentences" | "content": [[...], ...]}``.
    HotpotQA's sentences carry their own leading spaces, so its context is joined with ``""``.
    """
    pairs: list = []
    if isinstance(context, dict):
        sentences = context.get("sentences", context.get("content"))
        if isinstance(context.get("title"), list) and isinstance(sentences, list):
            pairs = list(zip(context["title"], sentences))
    elif isinstance(context, list):
        pairs = [c for c in context if isinstance(c, (list, tuple)) and len(c) == 2]
    texts: dict[str, str] = {}
    for title, body in pairs:
        if isinstance(title, str) and isinstance(body, list):
            texts[title] = joiner.join(str(s) for s in body)
        elif isinstance(title, str) and isinstance(body, str):
            texts[title] = body
    return texts


def _json_list(value: Any) -> Any:
    """A list stored as a JSON string (RouteRAG's ``supporting_facts``, PopQA's ``possible_answers``) as a list."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, list) else value
    return value


def _supporting_titles(path, i, field: str, facts: Any) -> list[str]:
    """Titles named by a supporting-facts value, in order, repeats kept (callers dedupe ids).

    Accepted: a list of titles, a list of ``[title, sentence_id]`` pairs, the same list as a JSON
    string (RouteRAG), or the column form ``{"title": [...], "sent_id": [...]}`` (Hugging Face and
    FlashRAG copies of HotpotQA).
    """
    facts = _json_list(facts)
    if facts is None:
        return []
    if isinstance(facts, dict):
        facts = facts.get("title")
    if not isinstance(facts, list):
        raise DataFormatError(path, i, field, f"expected a list of titles or [title, sentence_id] pairs, got {type(facts).__name__}")
    named: list[str] = []
    for j, fact in enumerate(facts):
        title = fact[0] if isinstance(fact, (list, tuple)) and fact else fact
        if not isinstance(title, str) or not title:
            raise DataFormatError(path, i, f"{field}[{j}]", "expected a title or [title, sentence_id]")
        named.append(title)
    return named


def _json_safe(value: Any) -> Any:
    """``value`` with anything JSON cannot hold (bytes, dates, numpy scalars) turned into strings."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def _verl_answers(path, i, rec: dict) -> tuple[str, ...]:
    reward_model = rec.get("reward_model")
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if isinstance(ground_truth, dict):
        return _answers(path, i, {"reward_model.ground_truth.target": _json_list(ground_truth.get("target"))},
                        "reward_model.ground_truth.target")
    if isinstance(ground_truth, (str, list)):  # some verl files put the answers straight in ground_truth
        return _answers(path, i, {"reward_model.ground_truth": _json_list(ground_truth)}, "reward_model.ground_truth")
    if rec.get("golden_answers") is not None:
        return _answers(path, i, rec, "golden_answers")
    raise DataFormatError(path, i, "reward_model.ground_truth.target", "missing")


def _verl_question_id(rec: dict, extra: dict, i: int) -> str:
    for value in (extra.get("question_id"), rec.get("id"), extra.get("original_id"), extra.get("id"), extra.get("index")):
        if value is not None and str(value) != "":
            return str(value)
    return str(i)


def _parse_searchr1(path, i, rec, titles: _TitleIndex | None, corpus: Corpus | None, marker) -> Question:
    """A verl row (Search-R1, RouteRAG, raggym's ``write_verl_parquet``); see ``raggym.data.verl``."""
    if not isinstance(rec, dict):
        raise DataFormatError(path, i, None, "expected an object")
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    prompt = rec.get("prompt")
    # Search-R1 keeps FlashRAG's own `question` column next to the prompt; it is the question as is.
    question = next((q.strip() for q in (rec.get("question"), extra.get("question")) if isinstance(q, str) and q.strip()), None)
    if question is None:
        if prompt is None:
            raise DataFormatError(path, i, "prompt", "missing (and there is no `question` column)")
        question = question_from_prompt(prompt, marker)
        if question is None:
            raise DataFormatError(path, i, "prompt", "no recognisable question: expected a user message with a line "
                                  f"matching {getattr(marker, 'pattern', marker)!r} followed by the question, "
                                  "or a user message that is the bare question")
    answers = _verl_answers(path, i, rec)

    source_metadata = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
    named: list[str] = []
    if extra.get("gold_passage_ids") is not None:  # written by write_verl_parquet: ids, not titles
        if not isinstance(extra["gold_passage_ids"], list):
            raise DataFormatError(path, i, "extra_info.gold_passage_ids", "expected a list of passage ids")
        gold = tuple(str(p) for p in extra["gold_passage_ids"])
        if corpus is not None:
            for j, pid in enumerate(gold):
                if pid not in corpus:
                    raise DataFormatError(path, i, f"extra_info.gold_passage_ids[{j}]", f"unknown passage id {pid!r}")
    else:
        in_extra = extra.get("supporting_facts") is not None  # RouteRAG's place; Search-R1 keeps FlashRAG's metadata
        field = "extra_info.supporting_facts" if in_extra else "metadata.supporting_facts"
        named = _supporting_titles(path, i, field, extra["supporting_facts"] if in_extra else source_metadata.get("supporting_facts"))
        gold = () if titles is None else _resolve_titles(path, i, field, named, titles,
                                                         _context_texts(source_metadata.get("context")))

    raggym_fields = _raggym_extras(path, i, extra.get("raggym"))
    data_source = rec.get("data_source")
    metadata = {key: _json_safe(value) for key, value in (
        ("prompt", prompt), ("data_source", data_source), ("ability", rec.get("ability")),
        ("extra_info", {k: v for k, v in extra.items() if k != "raggym"} or None),
        ("source_metadata", source_metadata or None),
        ("supporting_titles", list(dict.fromkeys(named)) or None),
    ) if value is not None}
    return Question(
        _verl_question_id(rec, extra, i), question, answers, gold,
        gold_triples=tuple(tuple(str(x) for x in t) for t in raggym_fields.get("gold_triples") or ()),
        hops=raggym_fields.get("hops", len(set(named)) or None),
        kind=raggym_fields.get("kind", str(data_source or "searchr1")),
        golden_trajectory=tuple(dict(s) for s in raggym_fields.get("golden_trajectory") or ()),
        metadata=metadata,
    )


def _raggym_extras(path, i, encoded: Any) -> dict:
    if encoded is None:
        return {}
    try:
        value = json.loads(encoded) if isinstance(encoded, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise DataFormatError(path, i, "extra_info.raggym", "expected a JSON object (as write_verl_parquet writes)")
    return value


def _qualify_mixed_source_ids(records: list[tuple[int, Any]], questions: list[Question]) -> list[Question]:
    """Prefix ids with ``data_source/`` when a verl file mixes data sources.

    Search-R1's NQ + HotpotQA training file keeps each source's own ids (``train_0``, … in both),
    so ids repeat across sources. Ids raggym wrote (``extra_info.question_id``) are unique already.
    """
    def source(rec) -> str | None:
        extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
        return None if extra.get("question_id") is not None else rec.get("data_source")

    sources = {source(rec) for _, rec in records} - {None}
    if len(sources) < 2:
        return questions
    out = []
    for (_, rec), q in zip(records, questions):
        prefix = source(rec)
        out.append(q if prefix is None else dataclasses.replace(q, id=f"{prefix}/{q.id}"))
    return out


def _parse_flashrag(path, i, rec, titles: _TitleIndex | None) -> Question:
    """FlashRAG's ``{id, question, golden_answers, metadata}``.

    Gold evidence, when the source dataset has any, sits in ``metadata``: HotpotQA-style
    ``supporting_facts`` (resolved by title against the corpus, with ``context`` to tell
    same-titled passages apart) or MuSiQue-style ``paragraphs`` with ``is_supporting``.
    """
    qid = str(_field(path, i, rec, "id", (str, int)))
    question = _field(path, i, rec, "question", str)
    answers = _answers(path, i, rec, "golden_answers")
    meta = rec.get("metadata") if rec.get("metadata") is not None else {}
    if not isinstance(meta, dict):
        raise DataFormatError(path, i, "metadata", f"expected an object, got {type(meta).__name__}")
    named = _supporting_titles(path, i, "metadata.supporting_facts", meta.get("supporting_facts"))
    gold: tuple[str, ...] = ()
    if isinstance(meta.get("paragraphs"), list):
        gold = _supporting_paragraph_ids(path, i, "metadata.paragraphs", meta["paragraphs"], titles)
    elif named and titles is not None:
        gold = _resolve_titles(path, i, "metadata.supporting_facts", named, titles, _context_texts(meta.get("context")))
    metadata = {"source_metadata": _json_safe(meta)} if meta else {}
    if named and titles is None:
        metadata["supporting_titles"] = list(dict.fromkeys(named))
    kind = "flashrag" if not isinstance(meta.get("type"), str) else f"flashrag:{meta['type']}"
    return Question(qid, question, answers, gold, hops=len(set(named)) or None, kind=kind, metadata=metadata)


def _parse_popqa(path, i, rec, titles: _TitleIndex | None) -> Question:
    """HippoRAG 2's ``popqa.json`` (RouteRAG's PopQA test set).

    The accepted answers are the ones RouteRAG scores against: the object ``obj``, the
    ``possible_answers`` list, the object's Wikipedia title and its aliases (the two lists are
    JSON strings in the file).
    """
    qid = str(_field(path, i, rec, "id", (str, int)))
    question = _field(path, i, rec, "question", str)
    values: list = []
    for name in ("obj", "possible_answers", "o_wiki_title", "o_aliases"):
        value = _json_list(rec.get(name))
        values.extend(value if isinstance(value, list) else [value] if value is not None else [])
    answers = _answers(path, i, {"possible_answers": values}, "possible_answers")
    paragraphs = _field(path, i, rec, "paragraphs", list)
    gold = _supporting_paragraph_ids(path, i, "paragraphs", paragraphs, titles)
    return Question(qid, question, answers, gold, hops=1, kind="popqa")


def _parse_nq_rear(path, i, rec, titles: _TitleIndex | None) -> Question:
    """HippoRAG 2's ``nq_rear.json`` (RouteRAG's NQ test set): ``{question, reference, contexts}``, no id.

    Records have no id, so the record number is the id.
    """
    question = _field(path, i, rec, "question", str)
    answers = _answers(path, i, rec, "reference")
    contexts = _field(path, i, rec, "contexts", list)
    gold = _supporting_paragraph_ids(path, i, "contexts", contexts, titles)
    qid = rec.get("id")
    return Question(str(qid) if qid is not None else str(i), question, answers, gold, hops=1, kind="nq")


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
    """The question format of a file whose first record is ``first`` (see ``QUESTION_FORMATS``)."""
    if not isinstance(first, dict):
        raise DataFormatError(path, 0, None, "cannot detect the question format: first record is not an object")
    if "reward_model" in first or "prompt" in first:
        return "searchr1"
    if "golden_answers" in first:
        return "flashrag"
    if "paragraphs" in first:
        return "popqa" if "possible_answers" in first or "obj" in first else "musique"
    if "contexts" in first and "reference" in first:
        return "nq_rear"
    if "evidences" in first or ("supporting_facts" in first and first.get("type") in {"compositional", "inference", "bridge_comparison"}):
        return "2wiki"
    if "supporting_facts" in first:
        return "hotpotqa"
    if "answers" in first or "answer" in first:
        return "jsonl"
    raise DataFormatError(path, 0, None, "cannot detect the question format; pass fmt= one of " + ", ".join(QUESTION_FORMATS[1:]))


def load_questions(path: str | os.PathLike, corpus: Corpus | None = None, fmt: str = "auto", *,
                   question_marker: str = QUESTION_MARKER) -> list[Question]:
    """Load questions and resolve their gold passages against ``corpus``.

    ``fmt`` is one of ``QUESTION_FORMATS`` (``auto`` detects it from the first record).
    ``question_marker`` is the regular expression that precedes the question in verl prompts.
    Duplicate question ids are an error. Returns the full list or raises ``DataFormatError``.
    """
    path = Path(path)
    return _questions_from_records(path, _records(path), corpus, fmt, question_marker)[1]


def _questions_from_records(path: Path, records: list[tuple[int, Any]], corpus: Corpus | None, fmt: str,
                            marker: str = QUESTION_MARKER) -> tuple[str, list[Question]]:
    """``(format, questions)``; ``load_questions`` and ``raggym data inspect`` share it."""
    if fmt not in QUESTION_FORMATS:
        raise ValueError(f"unknown question format {fmt!r}; expected one of {', '.join(QUESTION_FORMATS)}")
    if not records:
        raise DataFormatError(path, None, None, "no question records")
    if fmt == "auto":
        fmt = detect_question_format(path, records[0][1])
    titles = _TitleIndex(corpus) if corpus is not None else None
    compiled_marker = re.compile(marker)
    parse: Callable[[Path, int, Any], Question]
    if fmt == "musique":
        parse = lambda p, i, r: _parse_musique(p, i, r, titles)  # noqa: E731
    elif fmt in ("hotpotqa", "2wiki"):
        _need_corpus(path, corpus)
        parse = lambda p, i, r: _parse_hotpot_like(p, i, r, titles, fmt)  # noqa: E731
    elif fmt == "searchr1":
        parse = lambda p, i, r: _parse_searchr1(p, i, r, titles, corpus, compiled_marker)  # noqa: E731
    elif fmt == "flashrag":
        parse = lambda p, i, r: _parse_flashrag(p, i, _object(p, i, r), titles)  # noqa: E731
    elif fmt == "popqa":
        parse = lambda p, i, r: _parse_popqa(p, i, _object(p, i, r), titles)  # noqa: E731
    elif fmt == "nq_rear":
        parse = lambda p, i, r: _parse_nq_rear(p, i, _object(p, i, r), titles)  # noqa: E731
    else:
        parse = lambda p, i, r: _parse_native(p, i, r, corpus)  # noqa: E731
    out = [parse(path, i, rec) for i, rec in records]
    if fmt == "searchr1":
        out = _qualify_mixed_source_ids(records, out)
    seen: dict[str, int] = {}
    for (i, _), q in zip(records, out):
        if q.id in seen:
            raise DataFormatError(path, i, "id", f"duplicate question id {q.id!r} (first at record {seen[q.id]})")
        seen[q.id] = i
    return fmt, out


def _object(path, i, rec) -> dict:
    if not isinstance(rec, dict):
        raise DataFormatError(path, i, None, f"expected an object, got {type(rec).__name__}")
    return rec


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
        # pyarrow is imported on first use: it would add about a fifth to the time of `import raggym, envs`.
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
