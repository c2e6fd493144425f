"""The rollout measurements that ``experiments/bench/runtime.py`` and ``experiments/bench/gpu.py``
share: episodes timed under the rollout loop of ``envs.rollout`` (``run_timed_rollout``), plain
generate of the same prompts at equal tokens on the HF engine or vLLM, and vLLM's own counters.

Free of Ray, so that the GPU bench runs where Ray is not installed; vLLM is imported on use. Not a
benchmark itself (the leading underscore keeps it out of ``raggym bench``'s list).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import uuid

import psutil

from actors.engines.base import SamplingParams, derive_seed
from actors.engines.vllm_async import AsyncVLLMEngine
from actors.engines.vllm_engine import import_vllm, sampling_kwargs
from envs.rollout import LocalBackend, MultiTurnRollout, RolloutConfig


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """``a / b`` rounded, or None when either side is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, digits)


def cpu_seconds_by_process(process: psutil.Process | None = None) -> dict[str, float]:
    """CPU seconds (user + system) so far of a process (``"main"``) and of its live descendants,
    summed by process name (vLLM names its own: ``VLLM::EngineCore``, ``VLLM::Worker``)."""
    process = process or psutil.Process()
    out = {"main": sum(process.cpu_times()[:2])}
    for child in process.children(recursive=True):
        try:
            name, seconds = child.name(), sum(child.cpu_times()[:2])
        except psutil.Error:  # it exited meanwhile
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def cpu_seconds_since(before: dict[str, float]) -> dict[str, float]:
    """Per process name, the CPU seconds spent since ``before`` (``cpu_seconds_by_process()``)."""
    return {name: round(seconds - before.get(name, 0.0), 3) for name, seconds in cpu_seconds_by_process().items()}


ENGINE_COUNTERS = {"vllm:iteration_tokens_total": "steps", "vllm:prompt_tokens": "prompt_tokens",
                   "vllm:prompt_tokens_cached": "prompt_tokens_cached", "vllm:generation_tokens": "generation_tokens",
                   "vllm:num_preemptions": "preemptions"}


def engine_counters(metrics) -> dict[str, int]:
    """vLLM's own counters from a metrics snapshot: engine steps (iterations), prompt tokens (and how
    many of them came from the prefix cache), generated tokens, preemptions."""
    out = dict.fromkeys(ENGINE_COUNTERS.values(), 0)
    for metric in metrics:
        key = ENGINE_COUNTERS.get(metric.name)
        if key is not None:
            out[key] += int(metric.count if key == "steps" else metric.value)  # a histogram counts its steps
    return out


class TimedRetrieval:
    """The local rollout backend, adding up the seconds its retrieval batches take."""

    def __init__(self, inner):
        self.inner = inner
        self.retrieval_seconds = 0.0
        self.serial_retrieval = inner.serial_retrieval

    async def generate(self, *args):
        return await self.inner.generate(*args)

    def end_session(self, session_id):
        self.inner.end_session(session_id)

    async def retrieve(self, requests):
        t = time.perf_counter()
        try:
            return await self.inner.retrieve(requests)
        finally:
            self.retrieval_seconds += time.perf_counter() - t


def observation_tokens(rollout) -> int:
    """Tokens after the prompt that the model did not write (observations, the env's turn text):
    what a multi-turn rollout prefills and a single-turn generate does not."""
    return sum(1 for trained in rollout.loss_mask[rollout.prompt_length:] if not trained)


def rollout_summary(trajs, seconds: float, cpu_seconds: float, retrieval_seconds: float) -> dict:
    tokens = sum(r.response_length for r in trajs)
    return {"episodes": len(trajs), "model_tokens": tokens, "seconds": round(seconds, 3),
            "observation_tokens": sum(observation_tokens(r) for r in trajs),
            "episode_tokens": [r.response_length for r in trajs],
            "cpu_seconds": round(cpu_seconds, 3),
            "tok_s": round(tokens / seconds, 2), "retrieval_seconds": round(retrieval_seconds, 3),
            "turns_mean": round(sum(len(r.turns) for r in trajs) / len(trajs), 2),
            "searches": sum(r.episode.get("num_retrievals", 0) for r in trajs),
            "prompts": [list(r.token_ids[: r.prompt_length]) for r in trajs]}


async def run_timed_rollout(engine, envs, requests, seed: int, config: RolloutConfig) -> tuple[dict, list]:
    """``envs``' episodes under the rollout loop, awaited on the caller's event loop (an ``AsyncLLM``
    engine must stay on its loop), temperature 1 with ``seed``: ``rollout_summary``'s figures and the loop's
    retrieval counts (``MultiTurnRollout.retrieval_stats``)."""
    backend = TimedRetrieval(LocalBackend(engine))
    rollout = MultiTurnRollout(backend, engine.tokenizer, SamplingParams(temperature=1.0, seed=seed), config)
    t, cpu = time.perf_counter(), cpu_seconds_by_process()
    episodes = await rollout.run_episodes_async(envs, requests)
    seconds, cpu = time.perf_counter() - t, cpu_seconds_since(cpu)
    trajs = [r for episode in episodes for r in episode]
    summary = rollout_summary(trajs, seconds, sum(cpu.values()), backend.retrieval_seconds)
    return {**summary, "cpu_seconds_by_process": cpu, "retrieval_counts": dict(rollout.retrieval_stats)}, trajs


def plain_spec(async_run: dict) -> dict:
    """What plain generate repeats of a rollout: its prompts, each run to the rollout's mean length
    (``tokens_per_prompt``), or each to its own episode's length (``episode_tokens``)."""
    prompts = async_run["prompts"]
    return {"prompts": prompts, "tokens_per_prompt": max(1, round(async_run["model_tokens"] / len(prompts))),
            "episode_tokens": [max(1, n) for n in async_run["episode_tokens"]]}


def hf_plain_generate(engine, spec: dict, seed: int) -> dict:
    """HF plain generate of ``spec``'s prompts with EOS off, so every prompt makes exactly as many tokens."""
    eos, engine.eos_token_ids = engine.eos_token_ids, set()  # run every prompt to max_new_tokens
    try:
        t, cpu = time.perf_counter(), time.process_time()
        plain = engine.generate(spec["prompts"], SamplingParams(temperature=1.0, seed=seed), (), spec["tokens_per_prompt"])
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    finally:
        engine.eos_token_ids = eos
    return {"tokens": sum(len(r.token_ids) for r in plain), "seconds": seconds, "cpu_seconds": cpu_seconds}


async def vllm_plain_generate(engine: AsyncVLLMEngine, spec: dict, seed: int, episode_lengths: bool = False) -> dict:
    """vLLM plain generate of ``spec``: every prompt submitted at once, ``ignore_eos``, prompt i seeded
    with ``derive_seed(seed, i)`` as ``HFEngine.generate`` does. Every prompt makes
    ``tokens_per_prompt`` tokens, or with ``episode_lengths`` as many as its episode's model wrote,
    so that the rollout and this run differ only in the turns (not in how their lengths spread)."""
    from vllm import SamplingParams as VLLMSamplingParams  # vLLM on use: optional (the gpu/cpu extra)
    from vllm.inputs import TokensPrompt

    lengths = spec["episode_tokens"] if episode_lengths else [spec["tokens_per_prompt"]] * len(spec["prompts"])

    async def one(i: int, prompt: list[int]) -> int:
        n = lengths[i]
        params = VLLMSamplingParams(**sampling_kwargs(SamplingParams(temperature=1.0), (), n, derive_seed(seed, i)),
                                    ignore_eos=True)
        final = None
        async for output in engine.engine.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                                   request_id=f"plain-{uuid.uuid4().hex}"):
            final = output
        return len(final.outputs[0].token_ids)

    t, cpu = time.perf_counter(), cpu_seconds_by_process()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(spec["prompts"])))
    seconds, cpu = time.perf_counter() - t, cpu_seconds_since(cpu)
    return {"tokens": sum(counts), "seconds": seconds, "cpu_seconds": sum(cpu.values()), "cpu_seconds_by_process": cpu}


def counters_since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


async def counted_on_vllm(engine: AsyncVLLMEngine, work) -> tuple[object, dict]:
    """``await work`` (a coroutine not yet started) on an empty prefix cache, and vLLM's counters of
    what it ran: ``prefix_cache`` (tokens looked up and found) and ``engine_counters``."""
    from vllm.v1.metrics.reader import get_metrics_snapshot  # vLLM on use: optional (the gpu/cpu extra)

    await engine.engine.reset_prefix_cache()
    before, counters = engine.prefix_cache_stats(), engine_counters(get_metrics_snapshot())
    result = await work
    after = engine.prefix_cache_stats()
    return result, {"prefix_cache": {k: after[k] - before[k] for k in after},
                    "engine_counters": counters_since(counters, engine_counters(get_metrics_snapshot()))}


def run_with_vllm(make_coroutine):
    """``asyncio.run(make_coroutine())`` for a coroutine that builds and shuts down an ``AsyncVLLMEngine``."""
    # vLLM logs to stdout by default, which must stay JSON; its engine processes inherit this.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # Import vLLM here, not first inside the engine's constructor: the import keeps a caught
    # exception whose traceback holds the importing frames, and so an engine built in one of them
    # would outlive its shutdown (AsyncLLM.__del__ then fails at interpreter exit).
    import_vllm()
    import vllm.v1.engine.async_llm  # noqa: F401
    try:
        return asyncio.run(make_coroutine())
    finally:
        gc.collect()  # the shut-down AsyncLLM sits in reference cycles; collect it now, not at interpreter exit
