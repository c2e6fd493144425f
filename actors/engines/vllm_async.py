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
engine arguments, the mapping of sampling parameters and finish reasons, and the weight payload
are ``actors.engines.vllm_engine``'s, shared with ``VLLMEngine``.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Sequence

from actors.engines.base import GenerationResult, SamplingParams, derive_seed
from actors.engines.vllm_engine import (
    VLLMUnavailableError,
    check_logprobs_mode,
    engine_arguments,
    flat_weights_file,
    import_vllm,
    prefix_cache_counters,
    prompt_logprobs_of,
    prompt_scoring_kwargs,
    result_of,
    sampling_kwargs,
)


class AsyncVLLMEngine:
    """``await engine.generate(prompt_ids, sampling, stop_strings, max_new_tokens)`` on ``AsyncLLM``,
    and the ``SessionEngine`` methods (``generate_async``, ``end_session``, ``load``).

    ``engine_kwargs`` are ``actors.engines.vllm_engine.engine_arguments``' (platform defaults:
    fp32, eager, ``kv_cache_gib`` on CPU)."""

    kind = "vllm-async"

    def __init__(self, model: str = "smollm2-135m", *, gpu_memory_utilization: float = 0.5,
                 weight_version: int = 0, **engine_kwargs):
        _, self._VSamplingParams, self._TokensPrompt = import_vllm()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.metrics.reader import get_metrics_snapshot
        except ImportError as e:
            raise VLLMUnavailableError(f"this vllm has no v1 AsyncLLM ({e}); raggym needs vllm>=0.10.2") from None
        from transformers import AutoTokenizer

        kwargs = engine_arguments(model, gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self._metrics_snapshot = get_metrics_snapshot
        self.tokenizer = AutoTokenizer.from_pretrained(kwargs["tokenizer"])
        self.logprobs_mode = "processed"
        self.model_path = kwargs["model"]
        self.dtype = kwargs["dtype"]
        self.sync_ranks = int(kwargs["tensor_parallel_size"])
        self.weight_version = int(weight_version)
        self._open: set[str] = set()
        self._running = 0
        self._updating = 0
        self._idle: asyncio.Condition | None = None  # made on first use, on the serving loop

    def _condition(self) -> asyncio.Condition:
        if self._idle is None:
            self._idle = asyncio.Condition()
        return self._idle

    async def _final_output(self, prompt_ids: Sequence[int], params, request_id: str):
        prompt = self._TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        final = None
        async for output in self.engine.generate(prompt, params, request_id=request_id):
            final = output  # cumulative: the last one holds every token
        if final is None:
            raise RuntimeError("vLLM finished the request without an output")
        return final

    async def _run(self, prompt_ids: Sequence[int], params, request_id: str) -> GenerationResult:
        final = await self._final_output(prompt_ids, params, request_id)
        return result_of(final.outputs[0], self.weight_version)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, stop_strings: Sequence[str],
                       max_new_tokens: int) -> GenerationResult:
        """One served prompt; ``sampling.seed`` (if any) is the request's own seed."""
        check_logprobs_mode(sampling)
        params = self._VSamplingParams(**sampling_kwargs(sampling, stop_strings, max_new_tokens, sampling.seed))
        return await self._run(prompt_ids, params, uuid.uuid4().hex)

    # ------------------------------------------------------------------ sessions

    async def generate_async(self, session_id: str, context_token_ids: Sequence[int], sampling: SamplingParams | None = None,
                             stop_strings: Sequence[str] = (), max_new_tokens: int = 256) -> GenerationResult:
        """One turn of a session; the request's seed is ``derive_seed(sampling.seed, 0)``, as in ``HFEngine``."""
        sampling = sampling or SamplingParams()
        check_logprobs_mode(sampling)
        seed = None if sampling.seed is None else derive_seed(sampling.seed, 0)
        params = self._VSamplingParams(**sampling_kwargs(sampling, stop_strings, max_new_tokens, seed))
        idle = self._condition()
        async with idle:
            await idle.wait_for(lambda: not self._updating)
            self._running += 1
        self._open.add(session_id)
        try:
            return await self._run(context_token_ids, params, f"{session_id}-{uuid.uuid4().hex}")
        finally:
            async with idle:
                self._running -= 1
                idle.notify_all()

    async def score_prompt(self, token_ids: Sequence[int]) -> list[float]:
        """log p(x_t | x_<t) at temperature 1 for t = 1 .. len - 1 (a weight sync's probe); waits
        for a weight update in flight, like a session's turn."""
        ids = [int(t) for t in token_ids]
        params = self._VSamplingParams(**prompt_scoring_kwargs())
        idle = self._condition()
        async with idle:
            await idle.wait_for(lambda: not self._updating)
            self._running += 1
        try:
            return prompt_logprobs_of(await self._final_output(ids, params, f"probe-{uuid.uuid4().hex}"), ids)
        finally:
            async with idle:
                self._running -= 1
                idle.notify_all()

    def end_session(self, session_id: str) -> None:
        self._open.discard(session_id)  # vLLM's prefix cache evicts the session's blocks when it needs room

    def load(self) -> dict:
        return {"sessions": len(self._open), "running": self._running}

    def prefix_cache_stats(self) -> dict[str, int]:
        """vLLM's own prefix-cache counters (tokens queried, tokens found cached) since start."""
        return prefix_cache_counters(self._metrics_snapshot())

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
        with flat_weights_file(named_tensors, version, self.weight_version) as (header, path, new_version):

            async def load():
                await self.engine.collective_rpc("raggym_load_flat_weights_file", args=(header, path))
                return new_version

            return await self._paused(load)

    async def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> None:
        await self.engine.collective_rpc("raggym_init_weight_sync", args=(host, int(port), int(rank_offset), int(world_size), backend))

    async def receive_weights(self) -> int:
        """Collective path: every TP worker receives the learner's broadcast."""

        async def receive():
            versions = await self.engine.collective_rpc("raggym_receive_weights")
            if len(set(versions)) != 1:
                raise RuntimeError(f"vLLM workers received different weight versions: {versions}")
            return versions[0]

        return await self._paused(receive)

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes now (not at garbage collection)."""
        self.engine.shutdown()

    def info(self) -> dict:
        return {"kind": self.kind, "model": self.model_path, "dtype": self.dtype, "weight_version": self.weight_version,
                "logprobs_mode": self.logprobs_mode,
                "block_size": self.engine.vllm_config.cache_config.block_size}  # the prefix cache's unit of reuse
