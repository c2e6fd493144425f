"""Span labelling: which characters and tokens of a trajectory are think, query, answer,
observation, prompt or other — and hence which tokens the policy loss may touch.

Every method in raggym masks retrieved text out of the loss (the model did not write it; Search-R1
and GraphRAG-R1 call this "retrieved token masking"), and PathRouter's teacher KL is restricted to
think and query tokens. Both masks come from the labels computed here.

The tag sets of the six dialects are written out below, independently of ``raggym.protocol``, so
that this module needs nothing but the text:

* ``routerag``, ``search_r1``: think ``<think>``; query ``<search>``; observation
  ``<information>``; answer ``<answer>``.
* ``graph_r1`` (PathRouter): think ``<think>``; query ``<query>``; observation ``<knowledge>``;
  answer ``<answer>``.
* ``lws``: think ``<think>`` and ``<reflect>``; query ``<search>``; observation
  ``<information>``; answer ``<answer>``.
* ``graphrag_r1``: think ``<think>``; query ``<|begin_of_query|>…<|end_of_query|>``; observation
  ``<|begin_of_documents|>…<|end_of_documents|>``; answer ``<answer>``.
* ``r1_router``: think ``<think>``; query ``<sub-question>`` and ``<ret>``; answer ``<answer>``;
  no observation tag (each step's documents are part of that step's prompt).

Scanning rules (spans never nest):

* A span starts at an opening tag and includes both of its tags.
* It ends at its own closing tag if that comes before the next opening tag of the dialect;
  otherwise (an unclosed tag) it ends right before that next opening tag, or at the end of the
  text. So a missing ``</think>`` can never swallow the observation that follows it.
* Characters outside every span (whitespace between tags, stray text) are ``OTHER``.
* ``prompt_chars`` marks the first characters as ``PROMPT``; they are never scanned.
* ``observation_spans``, when given (``transcript_with_observation_spans`` builds them), are
  the exact ``(start, end)`` character ranges the environment inserted. They are labelled
  ``OBSERVATION`` and the dialect's observation tags are then *not* trusted elsewhere: an observation tag the model wrote itself is model output and is
  labelled ``OTHER`` (so it is trained on, not hidden). Spans never cross an observation range.

Token labels come from a tokenizer's offsets mapping (one ``(start, end)`` character range per
token, as Hugging Face fast tokenizers return with ``return_offsets_mapping=True``):

* a token touching any ``PROMPT`` character is ``PROMPT``; else one touching any ``OBSERVATION``
  character is ``OBSERVATION`` (the loss never sees text the environment wrote);
* otherwise the token takes the label most of its characters carry; ties go to the smaller enum
  value, so ``OTHER`` (the largest) loses ties to the tag it borders;
* an empty range (special tokens) inherits the previous token's label; a leading one is ``PROMPT``.

Loss mask = 0 on ``PROMPT`` and ``OBSERVATION``, 1 elsewhere. Teacher-KL mask = 1 on ``THINK``
and ``QUERY`` only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable, Sequence

import numpy as np
import torch


class SpanLabel(IntEnum):
    PROMPT = 0
    THINK = 1
    QUERY = 2
    ANSWER = 3
    OBSERVATION = 4
    OTHER = 5


@dataclass(frozen=True)
class TagRule:
    """One tag pair of a dialect and the label its span gets."""

    name: str
    open: str
    close: str
    label: SpanLabel


def _xml(name: str, label: SpanLabel) -> TagRule:
    return TagRule(name, f"<{name}>", f"</{name}>", label)


_THINK = _xml("think", SpanLabel.THINK)
_ANSWER = _xml("answer", SpanLabel.ANSWER)

DIALECT_TAGS: dict[str, tuple[TagRule, ...]] = {
    "routerag": (
        _THINK,
        _xml("search", SpanLabel.QUERY),
        _xml("information", SpanLabel.OBSERVATION),
        _ANSWER,
    ),
    "search_r1": (
        _THINK,
        _xml("search", SpanLabel.QUERY),
        _xml("information", SpanLabel.OBSERVATION),
        _ANSWER,
    ),
    "graph_r1": (
        _THINK,
        _xml("query", SpanLabel.QUERY),
        _xml("knowledge", SpanLabel.OBSERVATION),
        _ANSWER,
    ),
    "lws": (
        _THINK,
        _xml("search", SpanLabel.QUERY),
        _xml("information", SpanLabel.OBSERVATION),
        # Reflection is the model's own reasoning about what it read, so it trains like think.
        _xml("reflect", SpanLabel.THINK),
        _ANSWER,
    ),
    "graphrag_r1": (
        _THINK,
        TagRule("query", "<|begin_of_query|>", "<|end_of_query|>", SpanLabel.QUERY),
        TagRule(
            "documents", "<|begin_of_documents|>", "<|end_of_documents|>", SpanLabel.OBSERVATION
        ),
        _ANSWER,
    ),
    "r1_router": (
        _THINK,
        _xml("sub-question", SpanLabel.QUERY),
        _xml("ret", SpanLabel.QUERY),
        _ANSWER,
    ),
}

DIALECTS: tuple[str, ...] = tuple(DIALECT_TAGS)


@dataclass(frozen=True)
class Segment:
    """A tagged span found in the text: ``text[start:end]`` including its tags."""

    name: str
    label: SpanLabel
    start: int
    end: int
    closed: bool


def dialect_rules(dialect: str) -> tuple[TagRule, ...]:
    try:
        return DIALECT_TAGS[dialect]
    except KeyError:
        raise ValueError(
            f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}"
        ) from None


def _opening_pattern(rules: Sequence[TagRule]) -> re.Pattern:
    # Longest first so that no opening tag can shadow a longer one sharing its prefix.
    opens = sorted({r.open for r in rules}, key=len, reverse=True)
    return re.compile("|".join(re.escape(o) for o in opens))


def _scan(text: str, rules: Sequence[TagRule], start: int, end: int) -> list[Segment]:
    """Flat left-to-right scan of ``text[start:end]`` for the given tag rules."""
    if not rules or start >= end:
        return []
    by_open = {r.open: r for r in rules}
    opening = _opening_pattern(rules)
    segments: list[Segment] = []
    pos = start
    while pos < end:
        m = opening.search(text, pos, end)
        if m is None:
            break
        rule = by_open[m.group(0)]
        close_at = text.find(rule.close, m.end(), end)
        next_open = opening.search(text, m.end(), end)
        if close_at != -1 and (next_open is None or close_at < next_open.start()):
            seg_end, closed = close_at + len(rule.close), True
        else:
            seg_end, closed = (next_open.start() if next_open else end), False
        segments.append(Segment(rule.name, rule.label, m.start(), seg_end, closed))
        pos = seg_end
    return segments


def _validated_spans(spans: Iterable[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for s, e in spans:
        s, e = max(int(s), lo), min(int(e), hi)
        if e > s:
            out.append((s, e))
    out.sort()
    for (s1, e1), (s2, _) in zip(out, out[1:]):
        if s2 < e1:
            raise ValueError(f"observation spans overlap: ({s1}, {e1}) and ({s2}, …)")
    return out


def find_segments(
    text: str,
    dialect: str,
    prompt_chars: int = 0,
    observation_spans: Iterable[tuple[int, int]] | None = None,
) -> list[Segment]:
    """Tagged segments of the response part of ``text``, in order (see the module rules)."""
    rules = dialect_rules(dialect)
    start = max(0, min(int(prompt_chars), len(text)))
    if observation_spans is None:
        return _scan(text, rules, start, len(text))
    model_rules = [r for r in rules if r.label != SpanLabel.OBSERVATION]
    obs = _validated_spans(observation_spans, start, len(text))
    segments: list[Segment] = []
    pos = start
    for s, e in obs:
        segments.extend(_scan(text, model_rules, pos, s))
        segments.append(Segment("observation", SpanLabel.OBSERVATION, s, e, True))
        pos = e
    segments.extend(_scan(text, model_rules, pos, len(text)))
    return segments


def transcript_with_observation_spans(
    prompt: str, turns: Sequence[tuple[str, str]]
) -> tuple[str, int, list[tuple[int, int]]]:
    """Join ``prompt`` and ``(model segment, observation)`` turns into one transcript.

    Returns ``(text, prompt_chars, observation_spans)``: exactly the arguments the labelling
    functions take, with every character the environment wrote (including the newlines it puts
    around its observation tags) inside an observation span.
    """
    parts, spans, pos = [prompt], [], len(prompt)
    for segment, observation in turns:
        parts.append(segment)
        pos += len(segment)
        if observation:
            parts.append(observation)
            spans.append((pos, pos + len(observation)))
            pos += len(observation)
    return "".join(parts), len(prompt), spans


def tag_sequence(text: str, dialect: str, prompt_chars: int = 0) -> list[str]:
    """Names of the tagged segments in order, e.g. ``["think", "search", "information", ...]``."""
    return [seg.name for seg in find_segments(text, dialect, prompt_chars)]


def label_characters(
    text: str,
    dialect: str,
    prompt_chars: int = 0,
    observation_spans: Iterable[tuple[int, int]] | None = None,
) -> np.ndarray:
    """One ``SpanLabel`` per character of ``text`` (int8 array of length ``len(text)``)."""
    labels = np.full(len(text), int(SpanLabel.OTHER), dtype=np.int8)
    prompt_end = max(0, min(int(prompt_chars), len(text)))
    labels[:prompt_end] = int(SpanLabel.PROMPT)
    for seg in find_segments(text, dialect, prompt_end, observation_spans):
        labels[seg.start : seg.end] = int(seg.label)
    return labels


def label_tokens(char_labels: np.ndarray, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """Token labels from character labels and a tokenizer offsets mapping ([T] int64 array).

    ``offsets[i] = (start, end)`` is the character range of token ``i``; see the module docstring
    for how a token spanning several labels is resolved.
    """
    char_labels = np.asarray(char_labels, dtype=np.int64)
    n_chars, n_labels = len(char_labels), len(SpanLabel)
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts = np.clip(offs[:, 0], 0, n_chars)
    ends = np.clip(offs[:, 1], 0, n_chars)
    ends = np.maximum(ends, starts)
    # counts[i, l] = number of characters of token i labelled l, via prefix sums over one-hots.
    one_hot = np.zeros((n_chars + 1, n_labels), dtype=np.int64)
    one_hot[np.arange(1, n_chars + 1), char_labels] = 1
    prefix = np.cumsum(one_hot, axis=0)
    counts = prefix[ends] - prefix[starts]

    labels = counts.argmax(axis=1)  # majority; argmax breaks ties toward the smaller label
    labels[counts[:, SpanLabel.OBSERVATION] > 0] = SpanLabel.OBSERVATION
    labels[counts[:, SpanLabel.PROMPT] > 0] = SpanLabel.PROMPT
    empty = ends == starts
    for i in np.flatnonzero(empty):
        labels[i] = labels[i - 1] if i > 0 else SpanLabel.PROMPT
    return labels.astype(np.int64)


def label_text_tokens(
    text: str,
    offsets: Sequence[tuple[int, int]],
    dialect: str,
    prompt_chars: int = 0,
    observation_spans: Iterable[tuple[int, int]] | None = None,
) -> np.ndarray:
    """``label_tokens(label_characters(...), offsets)`` in one call."""
    return label_tokens(
        label_characters(text, dialect, prompt_chars, observation_spans), offsets
    )


def _mask_where(labels, keep: Sequence[SpanLabel], invert: bool):
    values = [int(v) for v in keep]
    if isinstance(labels, torch.Tensor):
        hit = torch.isin(labels, torch.tensor(values, dtype=labels.dtype, device=labels.device))
        return (~hit if invert else hit).to(torch.float32)
    hit = np.isin(np.asarray(labels), values)
    return (~hit if invert else hit).astype(np.float32)


def loss_mask_from_labels(labels):
    """1.0 where the policy loss applies, 0.0 on ``PROMPT`` and ``OBSERVATION`` tokens.

    Accepts and returns a numpy array or a torch tensor of any shape.
    """
    return _mask_where(labels, (SpanLabel.PROMPT, SpanLabel.OBSERVATION), invert=True)


def teacher_kl_mask_from_labels(labels):
    """1.0 on ``THINK`` and ``QUERY`` tokens (PathRouter's teacher-KL positions), else 0.0."""
    return _mask_where(labels, (SpanLabel.THINK, SpanLabel.QUERY), invert=False)
