"""Token-level rollouts for multi-turn RL: exact ids, loss mask, sampled logprobs, span labels.

A rollout is built turn by turn, token-in-token-out:

- the prompt's ids come from the chat template once (``add_prompt``);
- each model turn appends the *exact* ids the engine sampled, with their logprobs
  (``add_model_turn``), never ids obtained by re-tokenizing decoded text;
- each observation is tokenized once and appended (``add_observation``), truncated to a token cap.

Loss mask: 1 on model tokens, 0 on prompt and observation tokens. Span labels
(``raggym.algorithms.spans.SpanLabel``): PROMPT, OBSERVATION, and for model tokens THINK, QUERY,
ANSWER or OTHER from the dialect's tags inside that turn's text.

What the learner needs beyond the tokens is recorded when it is known, so that nothing downstream
decodes the model's output again:

- each model turn records where in it the model named a search's retrieval mode (the tokens the
  dialect's ``mode_slot`` points at, found in the text the turn is decoded to for the environment
  anyway): ``Rollout.mode_choice_positions``;
- a builder given PathRouter's teacher prompt (``teacher_prompt_ids``, which the rollout loop
  builds at the episode's start from the gold passages and the prompt when the teacher KL is on)
  records it: ``Rollout.teacher_prompt_ids``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from raggym.algorithms.spans import SpanLabel, label_characters, label_tokens
from raggym.protocol import get_dialect


def token_char_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """Decode ``ids`` and return (text, per-token character offsets into that text).

    Tokens are decoded one at a time; when a token does not decode on its own (a multi-byte
    character split across byte-level tokens), prefix decoding finds where the text grows.
    """
    ids = [int(t) for t in ids]
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pieces = [tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in ids]
    if "".join(pieces) == text:
        offsets, pos = [], 0
        for piece in pieces:
            offsets.append((pos, pos + len(piece)))
            pos += len(piece)
        return text, offsets
    offsets, prev = [], 0
    for i in range(len(ids)):
        prefix = tokenizer.decode(ids[: i + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # An incomplete UTF-8 sequence decodes to U+FFFD; it becomes real text once completed.
        end = len(prefix.rstrip("\ufffd")) if i + 1 < len(ids) else len(text)
        end = max(prev, min(end, len(text)))
        offsets.append((prev, end))
        prev = end
    return text, offsets


def mode_choice_token_indices(text: str, offsets: Sequence[tuple[int, int]], slot: re.Pattern[str]) -> list[int]:
    """Indices into ``offsets`` of the tokens where ``text`` names a search's retrieval mode.

    ``slot`` is a dialect's compiled ``mode_slot``; the choice is the token holding the first
    character after each match (RouteRAG's marks the ``graph`` of ``<search> [graph]``). A slot
    the text leaves unfinished (a match at its very end) names nothing.
    """
    chosen: dict[int, None] = {}  # ordered and without repeats: a token is a choice once
    for match in slot.finditer(text):
        index = next((j for j, (start, end) in enumerate(offsets) if start <= match.end() < end), None)
        if index is not None:
            chosen[index] = None
    return list(chosen)


@dataclass
class Rollout:
    """One sampled sequence, the record that flows unchanged from the rollout loop to the learner.

    Token arrays (all of one length): ``token_ids`` (the prompt, then the exact sampled ids and the
    observation ids), ``loss_mask`` (1 on sampled tokens), ``sampled_logprobs`` (the engine's
    log-probabilities of the sampled tokens, 0 elsewhere; the learner logs how far its own
    recomputation drifts from them) and ``span_labels`` (``SpanLabel`` per token).

    Grouping: ``group_key = (prompt_id, step_index)``. ``prompt_id`` names one draw of a question
    in one step (its G samples share it); ``step_index`` is 0 except for Step-GRPO's teacher-forced
    steps, where it is the step's position in the golden trajectory.

    ``record`` is the environment's typed episode record (``envs.records``; one object for all the
    rollouts of an episode) and ``outcome`` the ``EpisodeOutcome`` it closed with, which every
    reward reads; ``episode`` is the record as a plain dict, built only when it is read (trajectory
    dumps, evaluation tables); ``turns`` holds per
    model turn its span of the flat arrays (``start``, ``end``), its text, finish reason and the
    policy weight version that sampled it. A turn's ids and log-probs live once, in the flat
    arrays: ``turn_token_ids()`` and ``turn_logprobs()`` read them through the spans.

    Recorded for the learner while the rollout ran: ``mode_choice_positions`` (indices into
    ``token_ids``, ascending, of the model tokens that name a search's retrieval mode; the mode
    entropy bonus acts there) and ``teacher_prompt_ids`` (PathRouter's teacher prompt, the episode's
    prompt with the gold evidence appended; ``None`` when the rollout was not asked for it).
    """

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    span_labels: list[int] = field(default_factory=list)
    prompt_length: int = 0
    prompt_id: str = ""
    step_index: int = 0
    sample_index: int = 0
    outcome: Any = None  # raggym.rewards.EpisodeOutcome once the episode is over
    record: Any = None  # the environment's episode record (as_dict() and outcome()), once it is over
    turns: list[dict[str, Any]] = field(default_factory=list)
    truncated_by_length: bool = False
    mode_choice_positions: list[int] = field(default_factory=list)
    teacher_prompt_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def group_key(self) -> tuple[str, int]:
        return (self.prompt_id, self.step_index)

    @property
    def episode(self) -> dict[str, Any]:
        """The environment's record as a plain dict (``{}`` without one), built on each read."""
        return {} if self.record is None else self.record.as_dict()

    @property
    def response_length(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def weight_versions(self) -> list[int]:
        return [t["weight_version"] for t in self.turns]

    def turn_token_ids(self) -> list[list[int]]:
        """Each model turn's sampled ids, in order (slices of ``token_ids``)."""
        return [self.token_ids[t["start"]:t["end"]] for t in self.turns]

    def turn_logprobs(self) -> list[list[float]]:
        """Each model turn's sampling log-probs, in order (slices of ``sampled_logprobs``)."""
        return [self.sampled_logprobs[t["start"]:t["end"]] for t in self.turns]

    def check(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.sampled_logprobs) == len(self.span_labels) == n):
            raise ValueError("rollout arrays differ in length")
        previous_end = self.prompt_length
        for t in self.turns:
            start, end = t["start"], t["end"]
            if not (previous_end <= start <= end <= n) or not all(self.loss_mask[start:end]):
                raise ValueError(f"a turn's span [{start}, {end}) is not a run of model tokens after the last one")
            previous_end = end
        if any(not (0 <= p < n and self.loss_mask[p]) for p in self.mode_choice_positions):
            raise ValueError("a recorded mode choice is not a model token of the rollout")

    def model_token_spans(self) -> list[list[int]]:
        """The ids of each model turn, recovered from the flat arrays via the mask."""
        spans, current = [], []
        for tok, m in zip(self.token_ids, self.loss_mask):
            if m:
                current.append(tok)
            elif current:
                spans.append(current)
                current = []
        if current:
            spans.append(current)
        return spans

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (trajectory dumps, evaluation files)."""
        return {
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "sampled_logprobs": list(self.sampled_logprobs),
            "span_labels": list(self.span_labels),
            "prompt_length": self.prompt_length,
            "prompt_id": self.prompt_id,
            "step_index": self.step_index,
            "sample_index": self.sample_index,
            "outcome": None if self.outcome is None else self.outcome.as_dict(),
            "episode": self.episode,
            "turns": self.turns,
            "truncated_by_length": self.truncated_by_length,
            "mode_choice_positions": list(self.mode_choice_positions),
            "teacher_prompt_ids": None if self.teacher_prompt_ids is None else list(self.teacher_prompt_ids),
        }


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the chat template renders a single user message, ready for generation."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = prompt
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def teacher_prompt_ids(tokenizer, gold_passages: Sequence[str], prompt: str, max_evidence_tokens: int) -> list[int]:
    """PathRouter's teacher prompt: ``prompt`` followed by the gold evidence, in the chat template.

    The paper appends the gold passages to the teacher's prompt, so the evidence comes after the
    episode's prompt, inside the same user message. The evidence is the gold passages joined by
    newlines, cut to its first ``max_evidence_tokens`` tokens (the cut is raggym's, to bound the
    teacher's sequence; the paper states none). The cut is made on the evidence's characters, where
    its last kept token ends (the tokenizer's offsets), not by decoding the kept ids, because the
    teacher reads the evidence inside one chat message, tokenized once as a whole like any prompt.
    The student's response tokens follow the whole teacher prompt (the chat template's generation
    header included), so where the evidence sits inside it does not move them.
    """
    evidence = "\n".join(gold_passages)
    offsets = tokenizer(evidence, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) > max_evidence_tokens:
        evidence = evidence[: offsets[max_evidence_tokens - 1][1]] if max_evidence_tokens > 0 else ""
    return chat_prompt_ids(tokenizer, f"{prompt}\n\nEvidence:\n{evidence}")


class RolloutBuilder:
    """Accumulates one episode's tokens; see the module docstring for the rules.

    ``teacher_prompt_ids``: the episode's teacher prompt, recorded on the rollout as given.
    """

    def __init__(self, tokenizer, dialect: str, prompt_id: str = "", sample_index: int = 0,
                 max_response_tokens: int = 512, max_observation_tokens: int = 512, step_index: int = 0,
                 teacher_prompt_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.dialect = dialect
        slot = get_dialect(dialect).mode_slot
        self.mode_slot = re.compile(slot) if slot else None  # None: this dialect's searches name no mode
        self.max_response_tokens = int(max_response_tokens)
        self.max_observation_tokens = int(max_observation_tokens)
        teacher = None if teacher_prompt_ids is None else [int(t) for t in teacher_prompt_ids]
        self.rollout = Rollout(prompt_id=prompt_id, step_index=step_index, sample_index=sample_index,
                               teacher_prompt_ids=teacher)

    @property
    def response_budget_left(self) -> int:
        return self.max_response_tokens - self.rollout.response_length

    def add_prompt(self, prompt_ids: Sequence[int]) -> None:
        if self.rollout.token_ids:
            raise RuntimeError("the prompt must come first")
        ids = [int(t) for t in prompt_ids]
        self._extend(ids, 0, [0.0] * len(ids), [int(SpanLabel.PROMPT)] * len(ids))
        self.rollout.prompt_length = len(ids)

    def add_model_turn(self, ids: Sequence[int], logprobs: Sequence[float], *, finish_reason: str = "stop",
                       weight_version: int = 0) -> str:
        """Append sampled ids; returns the decoded text (for the environment only)."""
        ids = [int(t) for t in ids]
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} logprobs")
        if len(ids) > self.response_budget_left:
            raise ValueError(f"turn of {len(ids)} tokens exceeds the response budget ({self.response_budget_left} left)")
        text, offsets = token_char_offsets(self.tokenizer, ids)
        labels = label_tokens(label_characters(text, self.dialect), offsets) if ids else np.zeros(0, dtype=np.int64)
        start = len(self.rollout.token_ids)
        if self.mode_slot is not None:  # found in this turn's own text: a turn is where a choice is made
            chosen = mode_choice_token_indices(text, offsets, self.mode_slot)
            self.rollout.mode_choice_positions.extend(start + j for j in chosen)
        self._extend(ids, 1, [float(x) for x in logprobs], [int(x) for x in labels])
        self.rollout.turns.append({"start": start, "end": start + len(ids), "text": text,
                                   "finish_reason": finish_reason, "weight_version": int(weight_version)})
        return text

    def add_observation(self, text: str) -> list[int]:
        """Tokenize the observation once (capped at ``max_observation_tokens``) and append it."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_observation_tokens]
        self._extend(ids, 0, [0.0] * len(ids), [int(SpanLabel.OBSERVATION)] * len(ids))
        return list(ids)

    def _extend(self, ids, mask, logprobs, labels):
        t = self.rollout
        t.token_ids.extend(ids)
        t.loss_mask.extend([mask] * len(ids))
        t.sampled_logprobs.extend(logprobs)
        t.span_labels.extend(labels)

    def finish(self, record: Any = None) -> Rollout:
        """The finished rollout, carrying the episode's record and the outcome it closed with."""
        self.rollout.record = record
        self.rollout.outcome = None if record is None else record.outcome()
        self.rollout.check()
        return self.rollout
