"""vLLM's asynchronous engine (``AsyncLLM``) for online serving: one awaitable call per prompt.

The offline ``vllm.LLM`` (``actors.engines.vllm_engine``) takes a list of prompts and returns when
all are done, so a server must gather concurrent requests into batches itself. ``AsyncLLM`` is
what vLLM's own OpenAI server uses: every request is submitted as it arrives and vLLM's scheduler
batches all running requests continuously, token by token. ``PolicyServer`` therefore sends each
prompt straight here (no ``@serve.batch``). A request whose caller is cancelled (the HTTP client
left) is aborted inside vLLM, because ``AsyncLLM.generate`` aborts on ``CancelledError``.

The same engine is the rollout's ``SessionEngine`` (``actors.engines.base``): ``generate_async``
sends a session's whole context, and vLLM's prefix cache (on) finds the blocks of the context
it has already computed, so a turn prefills little more than the new observation. A weight
update waits for the requests in flight to finish (new ones wait for it), so every result has one
weight version, then resets the prefix cache, whose blocks were computed with the old weights.

Kept thin: vllm is imported when the engine is built, never when this module is imported. The
mapping of sampling parameters and finish reasons is the one ``VLLMEngine`` documents, written
as two plain functions that the CPU test suite checks.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Sequence

from actors.engines.base import GenerationResult, SamplingParams, derive_seed


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
    """``await engine.generate(prompt_ids, sampling, stop_strings, max_new_tokens)`` on ``AsyncLLM``,
    and the ``SessionEngine`` methods (``generate_async``, ``end_session``, ``load``)."""

    kind = "vllm-async"

    def __init__(self, model: str = "smollm2-135m", *, gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16",
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                 weight_version: int = 0, **engine_kwargs):
        from actors.engines.vllm_engine import WORKER_EXTENSION, VLLMUnavailableError, import_vllm, vllm_model_source

        _, self._VSamplingParams, self._TokensPrompt = import_vllm()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise VLLMUnavailableError(f"this vllm has no v1 AsyncLLM ({e}); serving needs vllm>=0.8") from None
        from transformers import AutoTokenizer

        model_path, tokenizer_path = vllm_model_source(model)
        kwargs = dict(model=model_path, tokenizer=tokenizer_path, dtype=dtype, seed=int(seed),
                      gpu_memory_utilization=float(gpu_memory_utilization),
                      tensor_parallel_size=int(tensor_parallel_size), enable_prefix_caching=True,
                      max_model_len=max_model_len, worker_extension_cls=WORKER_EXTENSION, **engine_kwargs)
        self.logprobs_mode = "processed"
        try:  # the sampled distribution's logprobs, as HFEngine reports (vLLM >= 0.10.2)
            args = AsyncEngineArgs(logprobs_mode="processed_logprobs", **kwargs)
        except TypeError:
            args = AsyncEngineArgs(**kwargs)
            self.logprobs_mode = "raw"
        self.engine = AsyncLLM.from_engine_args(args)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.model_path = model_path
        self.sync_ranks = int(tensor_parallel_size)
        self.weight_version = int(weight_version)
        self._open: set[str] = set()
        self._running = 0
        self._updating = 0
        self._idle: asyncio.Condition | None = None  # made on first use, on the serving loop

    def _condition(self) -> asyncio.Condition:
        if self._idle is None:
            self._idle = asyncio.Condition()
        return self._idle

    async def _run(self, prompt_ids: Sequence[int], params, request_id: str) -> GenerationResult:
        prompt = self._TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        final = None
        async for output in self.engine.generate(prompt, params, request_id=request_id):
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

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, stop_strings: Sequence[str],
                       max_new_tokens: int) -> GenerationResult:
        params = self._VSamplingParams(**vllm_sampling_kwargs(sampling, stop_strings, max_new_tokens))
        return await self._run(prompt_ids, params, uuid.uuid4().hex)

    # ------------------------------------------------------------------ sessions

    async def generate_async(self, session_id: str, context_token_ids: Sequence[int], sampling: SamplingParams | None = None,
                             stop_strings: Sequence[str] = (), max_new_tokens: int = 256) -> GenerationResult:
        """One turn of a session; the request's seed is ``derive_seed(sampling.seed, 0)``, as in ``HFEngine``."""
        sampling = sampling or SamplingParams()
        if sampling.logprobs_mode != self.logprobs_mode and not sampling.greedy:
            raise ValueError(f"this vLLM reports {self.logprobs_mode!r} logprobs; asked for {sampling.logprobs_mode!r}")
        kwargs = vllm_sampling_kwargs(sampling, stop_strings, max_new_tokens)
        kwargs["seed"] = None if sampling.seed is None else derive_seed(sampling.seed, 0)
        idle = self._condition()
        async with idle:
            await idle.wait_for(lambda: not self._updating)
            self._running += 1
        self._open.add(session_id)
        try:
            return await self._run(context_token_ids, self._VSamplingParams(**kwargs), f"{session_id}-{uuid.uuid4().hex}")
        finally:
            async with idle:
                self._running -= 1
                idle.notify_all()

    def end_session(self, session_id: str) -> None:
        self._open.discard(session_id)  # vLLM's prefix cache evicts the session's blocks when it needs room

    def load(self) -> dict:
        return {"sessions": len(self._open), "running": self._running}

    # ------------------------------------------------------------------ weights (async: AsyncLLM's RPCs are)

    async def _paused(self, update):
        idle = self._condition()
        async with idle:
            self._updating += 1
            await idle.wait_for(lambda: self._running == 0)
        try:
            version = await update()
            await self.engine.reset_prefix_cache()
            self.weight_version = int(version)
            return self.weight_version
        finally:
            async with idle:
                self._updating -= 1
                idle.notify_all()

    async def update_weights(self, named_tensors, version: int | None = None) -> int:
        """Object-store path: load ``FlatWeights`` (or named tensors) into every vLLM worker."""
        from actors.engines.vllm_engine import flat_weights_payload

        header, buffer, new_version = flat_weights_payload(named_tensors, version, self.weight_version)

        async def load():
            await self.engine.collective_rpc("raggym_load_flat_weights", args=(header, buffer))
            return new_version

        return await self._paused(load)

    async def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "pynccl") -> None:
        await self.engine.collective_rpc("raggym_init_weight_sync", args=(host, int(port), int(rank_offset), int(world_size), backend))

    async def receive_weights(self) -> int:
        """Collective path: every TP worker receives the learner's broadcast."""

        async def receive():
            versions = await self.engine.collective_rpc("raggym_receive_weights")
            if len(set(versions)) != 1:
                raise RuntimeError(f"vLLM workers received different weight versions: {versions}")
            return versions[0]

        return await self._paused(receive)

    def info(self) -> dict:
        return {"kind": self.kind, "model": self.model_path, "weight_version": self.weight_version,
                "logprobs_mode": self.logprobs_mode}
