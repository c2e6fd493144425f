"""Rollout engines: one token-in/token-out interface, two backends, one Ray actor wrapper.

* ``SamplingParams``, ``GenerationResult``, ``GenerationEngine`` (the protocol) — ``base``;
* ``HFEngine`` — transformers, CPU or GPU — ``hf``;
* ``VLLMEngine`` — vLLM, GPU only, imported lazily — ``vllm_engine``;
* ``RolloutWorker`` — the Ray actor holding either — ``rollout_worker``.
"""

from actors.engines.base import GenerationEngine, GenerationResult, SamplingParams, derive_seed
from actors.engines.hf import HFEngine, process_logits
from actors.engines.rollout_worker import RolloutWorker, make_engine, register_engine
from actors.engines.vllm_engine import VLLMEngine, VLLMUnavailableError, vllm_available

__all__ = [
    "GenerationEngine",
    "GenerationResult",
    "HFEngine",
    "RolloutWorker",
    "SamplingParams",
    "VLLMEngine",
    "VLLMUnavailableError",
    "derive_seed",
    "make_engine",
    "register_engine",
    "process_logits",
    "vllm_available",
]
