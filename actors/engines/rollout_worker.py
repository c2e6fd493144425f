"""``RolloutWorker``: a thin Ray actor around one generation engine.

Plain class, so it is usable (and testable) without Ray; ``RolloutWorker.as_remote(**options)``
returns the Ray actor class with resource options, e.g.::

    Worker = RolloutWorker.as_remote(num_cpus=1)                  # HF engine on CPU
    Worker = RolloutWorker.as_remote(num_gpus=1)                  # vLLM engine, TP=1
    w = Worker.remote(engine="hf", model="smollm2-135m")
    results = ray.get(w.generate.remote(prompt_ids, SamplingParams(seed=0), ["</search>"], 64))

Every method returns plain data (``GenerationResult`` dataclasses, ints, dicts), so nothing large
or engine-specific crosses the actor boundary.
"""

from __future__ import annotations

from typing import Sequence

from actors.engines.base import GenerationResult, SamplingParams


def make_engine(engine: str = "hf", **kwargs):
    """Build an engine by name: ``"hf"`` (``HFEngine``) or ``"vllm"`` (``VLLMEngine``)."""
    if engine == "hf":
        from actors.engines.hf import HFEngine

        return HFEngine(**kwargs)
    if engine == "vllm":
        from actors.engines.vllm_engine import VLLMEngine

        return VLLMEngine(**kwargs)
    raise ValueError(f"unknown engine {engine!r}; expected 'hf' or 'vllm'")


class RolloutWorker:
    """Holds one engine; forwards generation and weight updates to it."""

    def __init__(self, engine: str = "hf", **engine_kwargs):
        self.engine = make_engine(engine, **engine_kwargs)

    @classmethod
    def as_remote(cls, **ray_options):
        """The Ray actor class (``ray.remote(**ray_options)(RolloutWorker)``)."""
        import ray

        return ray.remote(**ray_options)(cls) if ray_options else ray.remote(cls)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> list[GenerationResult]:
        return self.engine.generate(prompt_token_ids, sampling, stop_strings, max_new_tokens)

    def update_weights(self, weights, version: int | None = None) -> int:
        """Load ``FlatWeights`` (from the object store), a mapping or pairs; returns the new version."""
        return self.engine.update_weights(weights, version)

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> int:
        """Join a ``WeightSyncGroup``; returns how many ranks this worker occupies in it."""
        self.engine.init_weight_sync(host, port, rank_offset, world_size, backend)
        return self.engine.sync_ranks

    def sync_ranks(self) -> int:
        return int(self.engine.sync_ranks)

    def receive_weights(self) -> int:
        return self.engine.receive_weights()

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def tokenizer_name_or_path(self) -> str:
        return str(getattr(self.engine.tokenizer, "name_or_path", ""))

    def info(self) -> dict:
        return self.engine.info()

    def ping(self) -> bool:
        return True


__all__ = ["RolloutWorker", "make_engine"]
