"""Token-level trajectories for multi-turn RL: exact ids, loss mask, logprobs, span labels.

A trajectory is built turn by turn, token-in-token-out:

- the prompt's ids come from the chat template once (``add_prompt``);
- each model turn appends the *exact* ids the engine sampled, with their logprobs
  (``add_model_turn``), never ids obtained by re-tokenizing decoded text;
- each observation is tokenized once and appended (``add_observation``), truncated to a token cap.

Loss mask: 1 on model tokens, 0 on prompt and observation tokens. Span labels
(``raggym.algorithms.spans.SpanLabel``): PROMPT, OBSERVATION, and for model tokens THINK, QUERY,
ANSWER or OTHER from the dialect's tags inside that turn's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from raggym.algorithms.spans import SpanLabel, label_characters, label_tokens


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


@dataclass
class Trajectory:
    """One episode as the learner sees it (all lists have the same length except ``turns``)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    span_labels: list[int] = field(default_factory=list)
    prompt_length: int = 0
    group_id: str = ""
    sample_index: int = 0
    episode: dict[str, Any] = field(default_factory=dict)
    turns: list[dict[str, Any]] = field(default_factory=list)  # per model turn: ids, text, finish, version
    truncated_by_length: bool = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def response_length(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def weight_versions(self) -> list[int]:
        return [t["weight_version"] for t in self.turns]

    def check(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.rollout_logprobs) == len(self.span_labels) == n):
            raise ValueError("trajectory arrays differ in length")

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
        return {
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "rollout_logprobs": list(self.rollout_logprobs),
            "span_labels": list(self.span_labels),
            "prompt_length": self.prompt_length,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "episode": self.episode,
            "turns": self.turns,
            "truncated_by_length": self.truncated_by_length,
        }


class TrajectoryBuilder:
    """Accumulates one episode's tokens; see the module docstring for the rules."""

    def __init__(self, tokenizer, dialect: str, group_id: str = "", sample_index: int = 0,
                 max_response_tokens: int = 512, max_observation_tokens: int = 512):
        self.tokenizer = tokenizer
        self.dialect = dialect
        self.max_response_tokens = int(max_response_tokens)
        self.max_observation_tokens = int(max_observation_tokens)
        self.traj = Trajectory(group_id=group_id, sample_index=sample_index)

    @property
    def response_budget_left(self) -> int:
        return self.max_response_tokens - self.traj.response_length

    def add_prompt(self, prompt_ids: Sequence[int]) -> None:
        if self.traj.token_ids:
            raise RuntimeError("the prompt must come first")
        ids = [int(t) for t in prompt_ids]
        self._extend(ids, 0, [0.0] * len(ids), [int(SpanLabel.PROMPT)] * len(ids))
        self.traj.prompt_length = len(ids)

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
        self._extend(ids, 1, [float(x) for x in logprobs], [int(x) for x in labels])
        self.traj.turns.append({"token_ids": ids, "text": text, "finish_reason": finish_reason,
                                "weight_version": int(weight_version), "logprobs": [float(x) for x in logprobs]})
        return text

    def add_observation(self, text: str) -> list[int]:
        """Tokenize the observation once (capped at ``max_observation_tokens``) and append it."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_observation_tokens]
        self._extend(ids, 0, [0.0] * len(ids), [int(SpanLabel.OBSERVATION)] * len(ids))
        return list(ids)

    def _extend(self, ids, mask, logprobs, labels):
        t = self.traj
        t.token_ids.extend(ids)
        t.loss_mask.extend([mask] * len(ids))
        t.rollout_logprobs.extend(logprobs)
        t.span_labels.extend(labels)

    def finish(self, episode: dict[str, Any]) -> Trajectory:
        self.traj.episode = episode
        self.traj.check()
        return self.traj
