"""The engine interface every rollout backend implements (HF transformers on CPU/GPU, vLLM on GPU).

Token in, token out: an engine receives prompt token ids and returns the ids it sampled, never
text that somebody would have to re-tokenize. For each prompt it returns a ``GenerationResult``:

* ``token_ids`` — exactly the sampled ids, in order. With a stop string, they end at the token
  that completed the stop string (that token is kept, even when its text runs past the stop
  string); with EOS they end with the EOS id; otherwise there are ``max_new_tokens`` of them.
* ``logprobs`` — one float per sampled id: log-probability of that id under the distribution it
  was drawn from. By default (``logprobs_mode="processed"``) that is the temperature-scaled,
  top-k/top-p-truncated and renormalised distribution. With ``top_k`` and ``top_p`` disabled it
  equals ``log_softmax(logits / temperature)``, which is what ``Learner.compute_logprobs`` with the
  same temperature returns, so the on-policy importance ratio is 1. ``logprobs_mode="raw"`` gives
  ``log_softmax(logits)`` instead. Greedy decoding (``temperature == 0``) always reports raw logprobs.
* ``finish_reason`` — ``"eos"`` (an end-of-sequence id was sampled), ``"stop"`` (a stop string
  appeared in the decoded continuation; ``stop_string`` says which) or ``"length"``.
* ``weight_version`` — the version of the weights that produced it (see ``actors.weight_sync``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch

from raggym.seeding import derive_seed  # noqa: F401  (engines seed prompt i of a call from it)

FinishReason = Literal["stop", "length", "eos"]
LogprobsMode = Literal["processed", "raw"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k <= 0`` and ``top_p >= 1`` switch those filters off.

    ``seed`` makes a call reproducible: prompt ``i`` of a call samples from its own random stream
    seeded by ``derive_seed(seed, i)``, so a prompt's result does not depend on which other prompts
    share the batch (up to floating-point differences from padding). ``seed=None`` draws from
    torch's global generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs_mode: LogprobsMode = "processed"

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode must be 'processed' or 'raw', got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class GenerationEngine(Protocol):
    """What the rollout loop needs from an engine."""

    weight_version: int
    tokenizer: object

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> list[GenerationResult]: ...

    def update_weights(self, named_tensors, version: int | None = None) -> int: ...


@runtime_checkable
class SessionEngine(Protocol):
    """An engine that keeps one KV cache per session (an episode), for multi-turn rollout.

    ``context_token_ids`` is the session's whole context so far: prompt, then every earlier
    turn's sampled ids and observation ids. When it extends the context the session's cache
    already holds, only the new suffix is prefilled; a context that diverges reuses at most the
    common prefix, and after a weight update nothing is reused. Requests from different sessions
    are batched together as they arrive (continuous batching); a request with ``sampling.seed``
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


def check_prompts(prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = [list(map(int, p)) for p in prompt_token_ids]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    return prompts


__all__ = [
    "FinishReason",
    "GenerationEngine",
    "GenerationResult",
    "LogprobsMode",
    "NamedTensors",
    "SamplingParams",
    "SessionEngine",
    "check_prompts",
    "derive_seed",
]
