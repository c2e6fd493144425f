"""The typed records of generation, shared by the rollout loop (``envs``) and the engines (``actors``).

``SamplingParams`` in, ``GenerationResult`` out, and ``SessionEngine``: the protocol the one rollout
loop (``envs.rollout``) drives, one request per episode turn. vLLM's ``AsyncLLM`` wrapper
(``actors.engines.vllm_async.AsyncVLLMEngine``) implements it with continuous batching and its
prefix cache; ``actors.engines.hf.HFEngine`` (the reference engine) and any engine with only a
batched ``generate`` implement it through ``envs.session_adapter.BatchingSessionEngine``. The
meaning of each result field is in ``actors.engines.base``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "eos"]
LogprobsMode = Literal["processed", "raw"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k <= 0`` and ``top_p >= 1`` switch those filters off.

    ``seed`` makes a call reproducible: prompt ``i`` of a call samples from its own random stream
    seeded by ``derive_seed(seed, i)``, so a prompt's result does not depend on which other prompts
    share the batch (up to floating-point differences from padding). ``seed=None`` draws from
    torch's global generator.

    ``mode_slot_temperature`` (with ``mode_slot``, a dialect's pattern): the token right after a
    context that ends in a match of ``mode_slot`` (the search's retrieval-mode choice) is sampled at
    this temperature instead of ``temperature``, among the tokens whose probability at
    ``temperature`` is at least ``mode_slot_min_p`` times the most likely one's (a hotter draw over
    the whole vocabulary would mostly pick junk: at T 0.7 → 2 the 49k tokens of the tail outweigh
    the mode names); every other token, and greedy decoding, is as before. The reported (processed) log-probability of that token is the one it was drawn with, so
    a learner that recomputes π_old sees the exploration as a rollout-policy mismatch
    (``learner.loss.rollout_correction`` weighs it back). See ``ModeSlotDetector``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs_mode: LogprobsMode = "processed"
    mode_slot: str = ""
    mode_slot_temperature: float | None = None
    mode_slot_min_p: float = 0.001

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode must be 'processed' or 'raw', got {self.logprobs_mode!r}")
        if self.mode_slot_temperature is not None:
            if not self.mode_slot_temperature > 0:
                raise ValueError(f"mode_slot_temperature must be > 0 (or None: off), got {self.mode_slot_temperature}")
            if not self.mode_slot:
                raise ValueError("mode_slot_temperature needs mode_slot, the pattern after which the mode is chosen")
            if not 0.0 <= self.mode_slot_min_p < 1.0:
                raise ValueError(f"mode_slot_min_p must be in [0, 1), got {self.mode_slot_min_p}")
            try:
                re.compile(self.mode_slot)
            except re.error as e:
                raise ValueError(f"mode_slot {self.mode_slot!r} is not a regular expression: {e}") from None

    @property
    def slot_sampling(self) -> bool:
        """True when some tokens are sampled at ``mode_slot_temperature`` (never under greedy)."""
        return self.mode_slot_temperature is not None and not self.greedy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Tokens decoded from the context's end to look for the mode slot: RouteRAG's ``<search> [`` is
# 3-5 tokens; a slot with more whitespace inside it than this window holds goes unseen.
MODE_SLOT_WINDOW = 16


def slot_logits(scaled: torch.Tensor, temperature: float, slot_temperature: float, min_p: float) -> torch.Tensor:
    """The mode slot's logits from ``scaled`` = z / T (one row or a batch of rows, last dim the
    vocabulary): tokens below ``min_p`` times the most likely one's probability at T are dropped
    (-inf), the rest rescaled to z / T_slot. Both engines call it, so they draw from one μ."""
    floor = scaled.max(dim=-1, keepdim=True).values + math.log(min_p) if min_p > 0 else None
    rescaled = scaled * (float(temperature) / float(slot_temperature))
    return rescaled if floor is None else rescaled.masked_fill(scaled < floor, float("-inf"))


class ModeSlotDetector:
    """Whether a context ends exactly where a search names its retrieval mode: the decoded last
    ``MODE_SLOT_WINDOW`` ids end in a match of the dialect's ``mode_slot``. The next token then holds
    the first character after the match, the token ``raggym.trajectory.mode_choice_token_indices``
    marks as the mode choice, so both engines sample exactly the marked tokens at the slot
    temperature (a token that merges the slot's last character with the mode name is neither)."""

    def __init__(self, mode_slot: str, decode: Callable[[Sequence[int]], str]):
        self.at_end = re.compile(f"(?:{mode_slot})\\Z")
        self.decode = decode

    def at_slot(self, context_ids: Sequence[int], continuation: Sequence[int] = ()) -> bool:
        """Whether ``context_ids`` followed by ``continuation`` (an engine's prompt and the ids it has
        sampled so far) ends at the slot; only their last ``MODE_SLOT_WINDOW`` ids are read."""
        tail = (list(context_ids[-MODE_SLOT_WINDOW:]) + list(continuation[-MODE_SLOT_WINDOW:]))[-MODE_SLOT_WINDOW:]
        return bool(tail) and self.at_end.search(self.decode(tail)) is not None


@dataclass
class GenerationResult:
    """What one prompt produced (see the module docstring for the exact meaning of each field)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None
    weight_version: int = 0
    text: str = field(default="", repr=False)

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")

    def to_dict(self) -> dict:
        return {
            "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs),
            "finish_reason": self.finish_reason,
            "stop_string": self.stop_string,
            "weight_version": self.weight_version,
            "text": self.text,
        }


@runtime_checkable
class SessionEngine(Protocol):
    """What the rollout loop asks of an engine: one turn of a session (an episode's model context).

    ``context_token_ids`` is the session's whole context so far: prompt, then every earlier
    turn's sampled ids and observation ids. An engine may reuse what it computed for earlier turns
    (vLLM's prefix cache does; after a weight update nothing is reused). Requests from different
    sessions are batched together as they arrive (continuous batching); a request with ``sampling.seed``
    samples from its own generator seeded by ``derive_seed(sampling.seed, 0)`` (the stream of
    prompt 0 in ``generate``), so its tokens do not depend on what else is batched. A session has
    at most one request in flight. ``GenerationResult.weight_version`` is the version of the
    weights that produced the tokens; a weight update waits for the requests in flight.
    """

    weight_version: int
    tokenizer: object

    async def generate_async(
        self,
        session_id: str,
        context_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> GenerationResult: ...

    def end_session(self, session_id: str) -> None: ...

    def load(self) -> dict: ...  # {"sessions": open sessions, "running": requests in flight}


