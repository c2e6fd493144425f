"""``BatchingSessionEngine``: the ``SessionEngine`` interface over an engine that only has ``generate``.

The async rollout loop sends one request per episode turn (``generate_async(session_id, context,
...)``). An engine without sessions (vLLM's offline ``LLM``, an engine written before sessions,
a remote worker that only exposes ``generate``) takes a list of prompts per call and returns when
all are done. This adapter gathers the requests that are pending together into such calls:

- while a call runs, new requests queue; when it returns, everything queued goes in the next call
  (at most one call in flight: a batch engine is busy until its call returns);
- requests are grouped by sampling parameters and stop strings; a group's call uses the largest
  ``max_new_tokens`` of its requests and each result is cut to its own request's cap, which is
  exact (the first ``n`` sampled ids, ``finish_reason="length"``) because every prompt of a call
  samples from its own stream;
- a seeded request must sample the same tokens whatever else is pending, and an engine seeds
  prompt ``i`` of a call from ``derive_seed(seed, i)``: so a seeded request goes in a call of its
  own with its seed, i.e. it samples what ``generate([context], sampling)`` samples. Unseeded and
  greedy requests share calls. With per-turn seeds (the rollout loop's default when the sampling
  has a seed) this adapter therefore gives up batching, which is why session engines implement
  ``generate_async`` themselves.

Sessions carry no cache here; ``end_session`` only forgets the id (``load`` counts open ones).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any, Awaitable, Callable, Sequence

from raggym.generation import GenerationResult, SamplingParams

BatchGenerate = Callable[[list[list[int]], Any, list[str], int], Awaitable[list[GenerationResult]]]


def is_session_engine(engine) -> bool:
    """Whether ``engine`` serves per-session requests itself (has a coroutine ``generate_async``)."""
    return asyncio.iscoroutinefunction(getattr(engine, "generate_async", None))


def as_session_engine(engine):
    """``engine`` itself when it is a session engine, else a ``BatchingSessionEngine`` over it."""
    return engine if is_session_engine(engine) else BatchingSessionEngine(engine)


def cut_result(result: GenerationResult, max_new_tokens: int, tokenizer=None) -> GenerationResult:
    """The result of the same sample with a smaller ``max_new_tokens``: its first ids, ``"length"``."""
    if len(result.token_ids) <= max_new_tokens:
        return result
    ids = list(result.token_ids[:max_new_tokens])
    text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""
    return dataclasses.replace(result, token_ids=ids, logprobs=list(result.logprobs[:max_new_tokens]),
                               finish_reason="length", stop_string=None, text=text)


class BatchingSessionEngine:
    """``SessionEngine`` over a batch engine (see the module docstring).

    ``engine`` is the wrapped engine (its ``generate`` runs on a worker thread, so the event loop
    stays free for retrieval and environment steps); ``generate_batch``, an async callable with
    ``generate``'s arguments, replaces that call (e.g. a remote worker's ``generate.remote``).
    """

    def __init__(self, engine=None, *, generate_batch: BatchGenerate | None = None, tokenizer=None):
        if (engine is None) == (generate_batch is None):
            raise ValueError("give exactly one of engine and generate_batch")
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if generate_batch is None:
            async def generate_batch(prompts, sampling, stop_strings, max_new_tokens):
                return await asyncio.to_thread(engine.generate, prompts, sampling, stop_strings, max_new_tokens)
        self._generate_batch = generate_batch
        self._queue: list[tuple[tuple, list[int], SamplingParams | None, list[str], int, asyncio.Future]] = []
        self._sessions: set[str] = set()
        self._request_numbers = itertools.count()
        self._running = 0
        self._driver: asyncio.Task | None = None
        self.calls: list[int] = []  # prompts per generate call (for tests and benchmarks)

    @property
    def weight_version(self) -> int:
        return int(getattr(self.engine, "weight_version", 0))

    async def generate_async(self, session_id: str, context_token_ids: Sequence[int], sampling: SamplingParams | None = None,
                             stop_strings: Sequence[str] = (), max_new_tokens: int = 256) -> GenerationResult:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self._sessions.add(session_id)
        stops = [s for s in stop_strings if s]
        seeded = sampling is not None and sampling.seed is not None and not sampling.greedy
        # A seeded request gets a call of its own (see the module docstring): its key is unique.
        key = ("alone", next(self._request_numbers)) if seeded else (sampling, tuple(stops))
        future = asyncio.get_running_loop().create_future()
        self._queue.append((key, [int(t) for t in context_token_ids], sampling, stops, int(max_new_tokens), future))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        return await future

    async def _drive(self) -> None:
        await asyncio.sleep(0)  # let the episodes resumed in this tick queue their requests too
        while self._queue:
            batch, self._queue = self._queue, []
            groups: dict[tuple, list] = {}
            for item in batch:
                groups.setdefault(item[0], []).append(item)
            for members in groups.values():
                _, _, sampling, stops, _, _ = members[0]
                cap = max(m[4] for m in members)
                self._running += len(members)
                try:
                    results = await self._generate_batch([m[1] for m in members], sampling, stops, cap)
                    if len(results) != len(members):
                        raise RuntimeError(f"engine returned {len(results)} results for {len(members)} prompts")
                except Exception as exc:  # noqa: BLE001 - the waiting requests see the failure
                    for m in members:
                        if not m[5].done():
                            m[5].set_exception(exc)
                    continue
                finally:
                    self._running -= len(members)
                self.calls.append(len(members))
                for m, result in zip(members, results):
                    if not m[5].done():
                        m[5].set_result(cut_result(result, m[4], self.tokenizer))

    def end_session(self, session_id: str) -> None:
        self._sessions.discard(session_id)

    def load(self) -> dict:
        return {"sessions": len(self._sessions), "running": self._running + len(self._queue)}


__all__ = ["BatchingSessionEngine", "as_session_engine", "cut_result", "is_session_engine"]
