"""The typed records of generation, shared by the rollout loop (``envs``) and the engines (``actors``).

``SamplingParams`` in, ``GenerationResult`` out, and ``SessionEngine``: the protocol the one rollout
loop (``envs.rollout``) drives, one request per episode turn. vLLM's ``AsyncLLM`` wrapper
(``actors.engines.vllm_async.AsyncVLLMEngine``) implements it with continuous batching and its
prefix cache; ``actors.engines.hf.HFEngine`` (the reference engine) and any engine with only a
batched ``generate`` implement it through ``envs.session_adapter.BatchingSessionEngine``. The
meaning of each result field is in ``actors.engines.base``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence, runtime_checkable

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


