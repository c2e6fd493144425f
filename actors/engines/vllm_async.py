"""vLLM's asynchronous engine (``AsyncLLM``) for online serving: one awaitable call per prompt.

The offline ``vllm.LLM`` (``actors.engines.vllm_engine``) takes a list of prompts and returns when
all are done, so a server must gather concurrent requests into batches itself. ``AsyncLLM`` is
what vLLM's own OpenAI server uses: every request is submitted as it arrives and vLLM's scheduler
batches all running requests continuously, token by token. ``PolicyServer`` therefore sends each
prompt straight here (no ``@serve.batch``). A request whose caller is cancelled (the HTTP client
left) is aborted inside vLLM, because ``AsyncLLM.generate`` aborts on ``CancelledError``.

Kept thin: vllm is imported when the engine is built, never when this module is imported. The
mapping of sampling parameters and finish reasons is the one ``VLLMEngine`` documents, written
as two plain functions that the CPU test suite checks.
"""

from __future__ import annotations

import uuid
from typing import Sequence

from actors.engines.base import GenerationResult, SamplingParams


def vllm_sampling_kwargs(sampling: SamplingParams, stop_strings: Sequence[str], max_new_tokens: int) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one served prompt."""
    return {
        "n": 1,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1,
        "seed": sampling.seed,
        "max_tokens": int(max_new_tokens),
        "stop": [s for s in stop_strings if s] or None,
        "include_stop_str_in_output": True,  # the env parses the closing tag
        "logprobs": 0,  # the sampled token's log-probability only
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }


def finish_of(finish_reason: str | None, stop_reason) -> tuple[str, str | None]:
    """vLLM's ``(finish_reason, stop_reason)`` -> raggym's ``(finish_reason, stop_string)``.

    vLLM says ``"stop"`` for EOS and for stop strings alike; a string ``stop_reason`` is the stop
    string that matched, anything else (``None``, a stop token id) is EOS.
    """
    if finish_reason == "length":
        return "length", None
    if isinstance(stop_reason, str):
        return "stop", stop_reason
    return "eos", None


class AsyncVLLMEngine:
    """``await engine.generate(prompt_ids, sampling, stop_strings, max_new_tokens)`` on ``AsyncLLM``."""

    kind = "vllm-async"

    def __init__(self, model: str = "smollm2-135m", *, gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16",
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1, **engine_kwargs):
        from actors.engines.vllm_engine import VLLMUnavailableError, import_vllm, vllm_model_source

        _, self._VSamplingParams, self._TokensPrompt = import_vllm()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise VLLMUnavailableError(f"this vllm has no v1 AsyncLLM ({e}); serving needs vllm>=0.8") from None
        model_path, tokenizer_path = vllm_model_source(model)
        args = AsyncEngineArgs(model=model_path, tokenizer=tokenizer_path, dtype=dtype, seed=int(seed),
                               gpu_memory_utilization=float(gpu_memory_utilization),
                               tensor_parallel_size=int(tensor_parallel_size), enable_prefix_caching=True,
                               max_model_len=max_model_len, **engine_kwargs)
        self.engine = AsyncLLM.from_engine_args(args)
        self.model_path = model_path
        self.weight_version = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, stop_strings: Sequence[str],
                       max_new_tokens: int) -> GenerationResult:
        params = self._VSamplingParams(**vllm_sampling_kwargs(sampling, stop_strings, max_new_tokens))
        prompt = self._TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        final = None
        async for output in self.engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            final = output  # cumulative: the last one holds every token
        if final is None:
            raise RuntimeError("vLLM finished the request without an output")
        completion = final.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
        reason, stop_string = finish_of(completion.finish_reason, completion.stop_reason)
        return GenerationResult(ids, logprobs, reason, stop_string, self.weight_version, text=completion.text)

    def info(self) -> dict:
        return {"kind": self.kind, "model": self.model_path, "weight_version": self.weight_version}
