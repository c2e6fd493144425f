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

from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from raggym.generation import FinishReason, GenerationResult, LogprobsMode, SamplingParams, SessionEngine
from raggym.seeding import derive_seed  # noqa: F401  (engines seed prompt i of a call from it)

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


def engine_info(engine) -> dict:
    """The engine's ``info()``, optional in the protocol: an engine without one reports its kind (or
    class name) and no dtype, which the sync check reads as fp32 (``actors.sync_verify``)."""
    info = getattr(engine, "info", None)
    if info is not None:
        return info()
    return {"kind": getattr(engine, "kind", type(engine).__name__)}


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
    "engine_info",
    "derive_seed",
]
