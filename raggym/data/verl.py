"""The verl / Search-R1 / RouteRAG parquet layout: finding the question in a prompt, and writing files.

Search-R1, RouteRAG and most verl-based RAG trainers store one row per question::

    data_source   "hotpotqa"
    prompt        [{"role": "user", "content": "<instructions> ... Question: <the question>\\n"}]
    ability       "fact-reasoning"
    reward_model  {"style": "rule", "ground_truth": {"target": ["answer", "alias", ...]}}
    extra_info    {"split": ..., "index": ..., ...}   RouteRAG adds original_id and supporting_facts

The prompt already holds the trainer's whole instruction text. raggym's environments write their
own instructions around ``Question.question``, so the loader must recover the question itself;
``question_from_prompt`` does that, and the original prompt stays in the question's metadata.

``write_verl_parquet`` writes raggym questions in the same layout (the prompt is a raggym
dialect's instruction prompt), so data prepared here can be trained with verl-based code too, and
reads back to the same questions.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from raggym.atomic import atomic_write
from raggym.protocol import get_dialect

if TYPE_CHECKING:  # imported for annotations only: types imports nothing from here
    from .types import Corpus, Question

# Every template we know puts the question after "Question:" (Search-R1, RouteRAG, ZeroSearch,
# AutoRefine, raggym's dialects) or "Original question:" (R1-Router); matching is case-insensitive
# and accepts a full-width colon, which Chinese-language templates use.
QUESTION_MARKER = r"(?i)\bquestion\s*[:\uff1a]"

# Chat-template tokens that can follow the question on its own line when a file stores the
# prompt after the tokenizer's chat template was applied.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "[/INST]", "<|endoftext|>")
# A prompt without a marker counts as the bare question only if it has no tags: instruction
# prompts always describe their <tags>.
_TAG = re.compile(r"</?[A-Za-z][\w-]*>")


def prompt_messages(prompt: Any) -> list[dict] | str | None:
    """``prompt`` as a list of chat messages or one string; ``None`` when it is neither.

    Accepts a list of ``{role, content}`` messages, a single message, a plain string, and the
    stringified list some files store (JSON, or Python's ``repr`` of a list of dicts).
    """
    if isinstance(prompt, dict):
        return [prompt]
    if isinstance(prompt, (list, tuple)):
        return [m for m in prompt if isinstance(m, dict)]
    if not isinstance(prompt, str):
        return None
    stripped = prompt.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        parsed = _parse_literal_list(stripped)
        if parsed is not None and parsed and all(isinstance(m, dict) and "content" in m for m in parsed):
            return parsed
    return prompt


def _parse_literal_list(text: str) -> list | None:
    try:
        value = json.loads(text)
    except ValueError:
        try:
            # literal_eval evaluates literals only (no names, calls or attributes), so a file
            # cannot run code through it; it is how Python's repr of a list of dicts reads back.
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    except RecursionError:
        return None
    return value if isinstance(value, list) else None


def _message_text(message: dict) -> str | None:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI-style parts: [{"type": "text", "text": ...}, ...]
        parts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "\n".join(parts) if parts else None
    return None


def user_text(prompt: Any) -> str | None:
    """The text of the last user message of ``prompt`` (the whole string for a string prompt)."""
    messages = prompt_messages(prompt)
    if isinstance(messages, str) or messages is None:
        return messages
    users = [m for m in messages if m.get("role") == "user"]
    for message in reversed(users or messages):
        text = _message_text(message)
        if text is not None:
            return text
    return None


def _before_turn_end(line: str) -> str:
    cut = len(line)
    for token in _TURN_END_TOKENS:
        at = line.find(token)
        if at != -1:
            cut = min(cut, at)
    return line[:cut]


def question_from_text(text: str, marker: str | re.Pattern = QUESTION_MARKER) -> str | None:
    """The question in an instruction prompt, or ``None`` when there is no recognisable one.

    The question is the rest of the last line that contains ``marker``, counted from the first
    marker on that line (so a question that itself contains "Question:" survives), up to the end
    of the line or a chat-template end token. Few-shot examples before it are skipped because
    the last marker line wins. When the marker ends its line, the next non-empty line is the
    question. A text without any marker is the question itself only when it is a single line
    without tags; anything else (an instruction prompt that lost its question) is ``None``.
    """
    if not isinstance(text, str):
        return None
    pattern = re.compile(marker) if isinstance(marker, str) else marker
    lines = text.splitlines()
    for at in range(len(lines) - 1, -1, -1):
        found = pattern.search(lines[at])
        if found is None:
            continue
        rest = _before_turn_end(lines[at][found.end():]).strip()
        if rest:
            return rest
        for following in lines[at + 1:]:
            following = _before_turn_end(following).strip()
            if following:
                return following
        return None
    bare = [line for line in (_before_turn_end(x).strip() for x in lines) if line]
    if len(bare) == 1 and not _TAG.search(bare[0]):
        return bare[0]
    return None


def question_from_prompt(prompt: Any, marker: str | re.Pattern = QUESTION_MARKER) -> str | None:
    """The question inside a verl ``prompt`` (chat list, string or stringified list), or ``None``."""
    text = user_text(prompt)
    return None if text is None else question_from_text(text, marker)


# ----------------------------------------------------------------------------- writing


def _verl_schema():
    # pyarrow is imported on first use: it would add about a fifth to the time of `import raggym, envs`.
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()),
        ("question", pa.string()),
        ("golden_answers", pa.list_(pa.string())),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([
            ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
            ("style", pa.string()),
        ])),
        ("extra_info", pa.struct([
            ("index", pa.int64()),
            ("split", pa.string()),
            ("question_id", pa.string()),
            ("gold_passage_ids", pa.list_(pa.string())),
            ("supporting_facts", pa.string()),
            ("raggym", pa.string()),
        ])),
    ])


def verl_row(question: "Question", index: int, *, prompt: str, data_source: str, split: str,
             corpus: "Corpus | None" = None) -> dict:
    """One row of the verl layout for ``question`` (see ``write_verl_parquet``)."""
    titles = [corpus.by_id(pid).title for pid in question.gold_passage_ids] if corpus is not None else []
    # Fields verl has no column for, kept so that the file reads back to the same Question.
    extras = {"hops": question.hops, "kind": question.kind,
              "gold_triples": [list(t) for t in question.gold_triples],
              "golden_trajectory": [dict(s) for s in question.golden_trajectory]}
    return {
        # Search-R1 keeps its source columns (id, question, golden_answers) next to verl's; so do we.
        "id": question.id,
        "question": question.question,
        "golden_answers": list(question.answers),
        "data_source": data_source,
        "prompt": [{"content": prompt, "role": "user"}],
        "ability": "fact-reasoning",
        "reward_model": {"ground_truth": {"target": list(question.answers)}, "style": "rule"},
        "extra_info": {
            "index": index,
            "split": split,
            "question_id": question.id,
            "gold_passage_ids": list(question.gold_passage_ids),
            # RouteRAG stores supporting facts as a JSON string; titles only, as sentence ids are unknown here.
            "supporting_facts": json.dumps(list(dict.fromkeys(titles)), ensure_ascii=False),
            "raggym": json.dumps(extras, ensure_ascii=False),
        },
    }


# The data sources Search-R1's and RouteRAG's trainers know (their ``_select_rm_score_fn``).
VERL_DATA_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
_KIND_TO_DATA_SOURCE = {"2wiki": "2wikimultihopqa"}


def verl_data_source(question: "Question") -> str:
    """The verl ``data_source`` for a question: its ``kind`` before any ``:`` ("hotpotqa" for
    "hotpotqa:bridge", "2wikimultihopqa" for "2wiki:…"); kinds no verl trainer knows are kept as
    they are ("single" and "bridge" for the synthetic world), and a question without one is "raggym"."""
    kind = (question.kind or "raggym").split(":")[0]
    return _KIND_TO_DATA_SOURCE.get(kind, kind)


def write_verl_parquet(path: str | os.PathLike, questions: Iterable["Question"], *, dialect: str = "search_r1",
                       data_source: str | None = None, split: str = "train", corpus: "Corpus | None" = None) -> Path:
    """Write questions as a verl / Search-R1 parquet file; ``load_questions`` reads it back.

    The prompt is ``dialect``'s instruction prompt (``raggym.protocol.get_dialect(dialect)``),
    a single user message, as Search-R1 and RouteRAG store theirs. ``data_source`` defaults to
    ``verl_data_source(question)``; Search-R1's and RouteRAG's reward managers accept only
    ``VERL_DATA_SOURCES`` (all scored by exact match) and raise on anything else, so pass one of
    those for questions of other kinds. With ``corpus``, the titles of the gold passages are written to
    ``extra_info.supporting_facts`` for tools that name evidence by title; gold passage ids are
    always written to ``extra_info.gold_passage_ids``. The write is atomic.
    """
    # pyarrow is imported on first use: it would add about a fifth to the time of `import raggym, envs`.
    import pyarrow as pa
    import pyarrow.parquet as pq

    speaker = get_dialect(dialect)
    rows = []
    for index, q in enumerate(questions):
        source = data_source or verl_data_source(q)
        rows.append(verl_row(q, index, prompt=speaker.instruction_prompt(q.question), data_source=source,
                             split=split, corpus=corpus))
    table = pa.Table.from_pylist(rows, schema=_verl_schema())
    return atomic_write(path, lambda fh: pq.write_table(table, fh), mode="wb")
