"""LLM open information extraction: named entities, then triples given those entities.

Two generation passes per passage, as in HippoRAG: first the model lists the named entities of
the paragraph, then it lists ``[subject, relation, object]`` triples, with the entities from the
first pass in the prompt so the triples reuse the same surface forms (that is what makes phrase
nodes of different passages meet in the graph). Both answers are requested as JSON and parsed
leniently (``parse_entities``/``parse_triples``): small models wrap JSON in prose, stop mid-way
at the token limit, or use single quotes, and whatever complete items can be recovered are kept.

Generation runs through ``HFGenerator`` (transformers ``generate`` on CPU or GPU, greedy, left
padding, batched); anything with the same ``__call__`` can replace it (a vLLM engine later, a
stub in tests).

Results are cached per passage in an append-only JSONL file keyed by SHA-1 of (model, prompt
version, title, text). Each finished batch is appended and flushed, so an interrupted run
resumes where it stopped; a torn last line from a crash is ignored on reload.

Quality note: the embedded default policy (SmolLM2-135M) runs the pipeline end to end on a CPU,
but its extractions are poor; use a larger instruct model (any HF id or path) for real graphs.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from raggym.data import atomic_write
from raggym.models import cache_dir, load_policy
from raggym.retrieval.openie_io import PassageTriples, openie_docs

PROMPT_VERSION = "v1"

NER_INSTRUCTIONS = (
    "Read the paragraph and list every named entity in it: people, places, organisations, works, "
    "dates and numbers that matter. Answer with JSON only, in the form "
    '{"named_entities": ["...", "..."]}.'
)
NER_EXAMPLE_PARAGRAPH = (
    "Lake Vostok\nLake Vostok is the largest known subglacial lake in Antarctica. It lies beneath the "
    "Russian Vostok Station, about 4,000 metres under the ice, and was confirmed in 1996."
)
NER_EXAMPLE_ANSWER = '{"named_entities": ["Lake Vostok", "Antarctica", "Vostok Station", "Russian", "4,000 metres", "1996"]}'

TRIPLE_INSTRUCTIONS = (
    "Read the paragraph and write down the facts it states as [subject, relation, object] triples. "
    "Use the listed named entities as subjects and objects wherever they fit, spelled exactly as listed. "
    'Answer with JSON only, in the form {"triples": [["subject", "relation", "object"], ...]}.'
)
TRIPLE_EXAMPLE_ANSWER = (
    '{"triples": [["Lake Vostok", "is the largest subglacial lake in", "Antarctica"], '
    '["Lake Vostok", "lies beneath", "Vostok Station"], ["Vostok Station", "is operated by", "Russian"], '
    '["Lake Vostok", "lies under ice of depth", "4,000 metres"], ["Lake Vostok", "confirmed in", "1996"]]}'
)

MAX_ITEM_CHARS = 200


def _paragraph(title: str, text: str) -> str:
    return f"{title}\n{text}" if title else text


def ner_messages(title: str, text: str) -> list[dict]:
    return [
        {"role": "system", "content": NER_INSTRUCTIONS},
        {"role": "user", "content": NER_EXAMPLE_PARAGRAPH},
        {"role": "assistant", "content": NER_EXAMPLE_ANSWER},
        {"role": "user", "content": _paragraph(title, text)},
    ]


def triple_messages(title: str, text: str, entities: Sequence[str]) -> list[dict]:
    def user(paragraph: str, ents: str) -> str:
        return f"Paragraph:\n{paragraph}\n\nNamed entities: {ents}"

    return [
        {"role": "system", "content": TRIPLE_INSTRUCTIONS},
        {"role": "user", "content": user(NER_EXAMPLE_PARAGRAPH, NER_EXAMPLE_ANSWER)},
        {"role": "assistant", "content": TRIPLE_EXAMPLE_ANSWER},
        {"role": "user", "content": user(_paragraph(title, text), json.dumps({"named_entities": list(entities)}, ensure_ascii=False))},
    ]


# ----------------------------------------------------------------------------- lenient parsing

_QUOTED = re.compile(r'"((?:[^"\\\n]|\\.){1,%d})"' % MAX_ITEM_CHARS)
_TRIPLE = re.compile(r'\[\s*"((?:[^"\\\n]|\\.)*)"\s*,\s*"((?:[^"\\\n]|\\.)*)"\s*,\s*"((?:[^"\\\n]|\\.)*)"\s*\]')


def _balanced_end(text: str, start: int) -> int | None:
    """Index just past the bracket that closes ``text[start]`` (quotes respected), or None."""
    depth, quote, escaped = 0, None, False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _json_values(text: str):
    """Every JSON value that starts at a '{' or '[' in ``text`` and decodes, in order.

    Python-style literals with single quotes (a common small-model slip) are accepted through
    ``ast.literal_eval``, which only evaluates literals and never runs code.
    """
    decoder = json.JSONDecoder()
    i = 0
    while True:
        positions = [p for p in (text.find("{", i), text.find("[", i)) if p >= 0]
        if not positions:
            return
        start = min(positions)
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            end = _balanced_end(text, start)
            value = None
            if end is not None and end - start <= 100_000:
                try:
                    value = ast.literal_eval(text[start:end])
                except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
                    value = None
            if value is None or not isinstance(value, (dict, list)):
                i = start + 1
                continue
        yield value
        i = end


def _unescape(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except json.JSONDecodeError:
        return s


def _clean_item(x) -> str | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        x = str(x)
    if not isinstance(x, str):
        return None
    x = " ".join(x.split())
    return x if 0 < len(x) <= MAX_ITEM_CHARS else None


def parse_entities(text: str) -> list[str]:
    """Entities from a model answer; tolerant of prose around the JSON and of truncation."""
    found = None
    for value in _json_values(text or ""):
        if isinstance(value, dict):
            for key in ("named_entities", "entities", "named entities"):
                if isinstance(value.get(key), list):
                    found = value[key]
                    break
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            found = value
        if found is not None:
            break
    if found is None:  # truncated or malformed JSON: take the complete quoted strings after the key
        tail = text or ""
        m = re.search(r'named[_ ]entities"?\s*:\s*\[', tail)
        tail = tail[m.end():] if m else tail
        found = [_unescape(s) for s in _QUOTED.findall(tail)]
    out = []
    for e in found:
        e = _clean_item(e)
        if e is not None and e not in out:
            out.append(e)
    return out


def parse_triples(text: str) -> list[tuple[str, str, str]]:
    """Triples from a model answer; keeps only complete 3-item string triples."""
    found = None
    for value in _json_values(text or ""):
        if isinstance(value, dict) and isinstance(value.get("triples"), list):
            found = value["triples"]
            break
        if isinstance(value, list) and value and all(isinstance(t, list) for t in value):
            found = value
            break
    if found is None:
        found = [[_unescape(a), _unescape(b), _unescape(c)] for a, b, c in _TRIPLE.findall(text or "")]
    out: list[tuple[str, str, str]] = []
    for t in found:
        if not isinstance(t, (list, tuple)) or len(t) != 3:
            continue
        items = [_clean_item(x) for x in t]
        if any(x is None for x in items):
            continue
        triple = (items[0], items[1], items[2])
        if triple not in out:
            out.append(triple)
    return out


# ----------------------------------------------------------------------------- generation


class HFGenerator:
    """Greedy batched chat generation with a transformers causal LM (left padding)."""

    def __init__(self, model=None, tokenizer=None, *, spec: str = "smollm2-135m", device: str = "cpu",
                 threads: int | None = None, repetition_penalty: float = 1.0):
        if model is None or tokenizer is None:
            model, tokenizer = load_policy(spec, device=device)
            self.name = spec
        else:
            self.name = getattr(getattr(model, "config", None), "_name_or_path", None) or spec
        self.model, self.tokenizer = model, tokenizer
        self.threads = threads  # pin torch threads during generation (a shared CPU stalls with too many)
        self.repetition_penalty = repetition_penalty

    def __call__(self, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
        tok = self.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        old_side = tok.padding_side
        tok.padding_side = "left"
        try:
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tok.padding_side = old_side
        enc = {k: v.to(self.model.device) for k, v in enc.items()}
        old_threads = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                out = self.model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    repetition_penalty=self.repetition_penalty,
                    pad_token_id=tok.pad_token_id,
                )
        finally:
            if self.threads:
                torch.set_num_threads(old_threads)
        new = out[:, enc["input_ids"].shape[1]:]
        return tok.batch_decode(new, skip_special_tokens=True)


# ----------------------------------------------------------------------------- the extractor


@dataclass(frozen=True)
class OpenIEConfig:
    ner_max_new_tokens: int = 128
    triple_max_new_tokens: int = 384
    batch_size: int = 8
    max_passage_chars: int = 3000  # longer passages are cut before prompting


class LLMOpenIE:
    """NER then triple extraction over passages, cached per passage, resumable."""

    def __init__(
        self,
        generator: Callable[[list[list[dict]], int], list[str]] | None = None,
        *,
        model: str = "smollm2-135m",
        cache_path: str | os.PathLike | None = None,
        config: OpenIEConfig | None = None,
    ):
        self.config = config or OpenIEConfig()
        self._generator = generator
        self.model_name = getattr(generator, "name", None) or model
        self._spec = model
        if cache_path is None:
            safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(self.model_name))[:60]
            cache_path = cache_dir() / "openie" / f"{safe}-{PROMPT_VERSION}.jsonl"
        self.cache_path = Path(cache_path)
        self._cache: dict[str, PassageTriples] | None = None

    @property
    def generator(self):
        if self._generator is None:
            self._generator = HFGenerator(spec=self._spec)
        return self._generator

    def key(self, title: str, text: str) -> str:
        h = hashlib.sha1(f"{self.model_name}\x00{PROMPT_VERSION}\x00{title}\x00{text}".encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def _load_cache(self) -> dict[str, PassageTriples]:
        if self._cache is None:
            self._cache = {}
            if self.cache_path.is_file():
                with self.cache_path.open("rb") as fh:
                    for line in fh:
                        try:
                            rec = json.loads(line.decode("utf-8"))
                            self._cache[rec["key"]] = PassageTriples(
                                tuple(rec["entities"]), tuple(tuple(t) for t in rec["triples"])
                            )
                        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
                            continue  # a torn line from an interrupted run
        return self._cache

    def _append(self, records: list[dict]) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        with self.cache_path.open("ab+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a torn line from a crash: never glue a record onto it
                    fh.write(b"\n")
            for rec in records:
                fh.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())

    def extract(self, passages: Sequence, *, show_progress: bool = True) -> list[PassageTriples]:
        """Entities and triples for each passage (objects with ``title`` and ``text``), in order."""
        cache = self._load_cache()
        keys = [self.key(p.title, p.text) for p in passages]
        todo = list(dict.fromkeys(i for i, k in enumerate(keys) if k not in cache))
        first_of_key: dict[str, int] = {}
        todo = [i for i in todo if first_of_key.setdefault(keys[i], i) == i]
        bar = tqdm(total=len(passages), initial=len(passages) - len(todo), desc="openie", unit="passage",
                   disable=not show_progress)
        limit = self.config.max_passage_chars
        for start in range(0, len(todo), self.config.batch_size):
            batch = todo[start : start + self.config.batch_size]
            items = [(passages[i].title, passages[i].text[:limit]) for i in batch]
            ner_out = self.generator([ner_messages(t, x) for t, x in items], self.config.ner_max_new_tokens)
            entities = [parse_entities(o) for o in ner_out]
            tri_out = self.generator([triple_messages(t, x, e) for (t, x), e in zip(items, entities)],
                                     self.config.triple_max_new_tokens)
            records = []
            for i, ents, out in zip(batch, entities, tri_out):
                triples = parse_triples(out)
                cache[keys[i]] = PassageTriples(tuple(ents), tuple(triples))
                records.append({"key": keys[i], "entities": ents, "triples": [list(t) for t in triples]})
            self._append(records)
            bar.update(len(batch))
        bar.close()
        return [cache[k] for k in keys]


def run_openie(corpus, out_path: str | os.PathLike, *, extractor: LLMOpenIE | None = None,
               show_progress: bool = True) -> Path:
    """Extract triples for a whole corpus and write a HippoRAG-format OpenIE file (atomically)."""
    extractor = extractor or LLMOpenIE()
    per_passage = extractor.extract(list(corpus), show_progress=show_progress)
    doc = openie_docs(corpus, per_passage)
    doc["model"] = extractor.model_name
    doc["prompt_version"] = PROMPT_VERSION
    return atomic_write(out_path, lambda fh: json.dump(doc, fh, ensure_ascii=False))


__all__ = [
    "HFGenerator",
    "LLMOpenIE",
    "OpenIEConfig",
    "PROMPT_VERSION",
    "ner_messages",
    "parse_entities",
    "parse_triples",
    "run_openie",
    "triple_messages",
]
