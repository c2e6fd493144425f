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


# name -> factory(**kwargs) -> engine; filled by register_engine
ENGINE_FACTORIES: dict = {}


def register_engine(name: str, factory, *, replace: bool = False) -> None:
    """Make ``make_engine(name, **kwargs)`` (and so ``RolloutWorker(engine=name)``) build
    ``factory(**kwargs)``. Registration is per process; for Ray actors pass the engine as an
    import string ``"package.module:Factory"`` instead, which every process can resolve."""
    if name in ("hf", "vllm") or (name in ENGINE_FACTORIES and not replace):
        raise ValueError(f"engine {name!r} is already registered")
    if not callable(factory):
        raise TypeError(f"engine factory for {name!r} must be callable")
    ENGINE_FACTORIES[name] = factory


def make_engine(engine: str = "hf", **kwargs):
    """Build an engine by name: ``"hf"`` (``HFEngine``), ``"vllm"`` (``VLLMEngine``), a name
    given to ``register_engine``, or an import string ``"module:callable"``."""
    if engine == "hf":
        from actors.engines.hf import HFEngine

        return HFEngine(**kwargs)
    if engine == "vllm":
        from actors.engines.vllm_engine import VLLMEngine

        return VLLMEngine(**kwargs)
    if engine in ENGINE_FACTORIES:
        return ENGINE_FACTORIES[engine](**kwargs)
    if isinstance(engine, str) and ":" in engine:
        import importlib

        module, _, attr = engine.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import engine {engine!r}: {exc}") from exc
        return factory(**kwargs)
    known = ", ".join(["'hf'", "'vllm'", *(repr(n) for n in ENGINE_FACTORIES)])
    raise ValueError(f"unknown engine {engine!r}; expected {known} or 'module:callable'")


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


__all__ = ["ENGINE_FACTORIES", "RolloutWorker", "make_engine", "register_engine"]
