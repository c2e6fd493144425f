"""``OwnLoopEngine``: an asyncio engine (``AsyncVLLMEngine``) on an event loop of its own thread.

vLLM's ``AsyncLLM`` is bound to the event loop it first runs on, and must be shut down from it. A
Ray ``RolloutWorker`` gives it the actor's loop for life; code in one process (the local runtime,
``raggym serve``-less scripts) runs each rollout under a fresh ``asyncio.run``. This wrapper keeps
the engine on one long-lived loop thread and offers what the rollout loop and the learner call:
``generate_async`` (awaitable from any loop), ``end_session``, ``load``, and synchronous
``update_weights`` and ``score_prompt``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Sequence

from raggym.generation import GenerationResult, SamplingParams


class OwnLoopEngine:
    """``factory()`` builds the engine on the loop thread; every call is forwarded to that loop."""

    def __init__(self, factory: Callable[[], Any]):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="raggym-engine-loop", daemon=True)
        self._thread.start()

        async def build():
            return factory()

        try:
            self.engine = self._call(build())
        except BaseException:
            self._stop_loop()
            raise
        self.tokenizer = self.engine.tokenizer

    def _call(self, coro):
        """Run ``coro`` on the engine's loop and wait for it here (a thread that is not the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    async def generate_async(self, session_id: str, context_token_ids: Sequence[int], sampling: SamplingParams | None = None,
                             stop_strings: Sequence[str] = (), max_new_tokens: int = 256) -> GenerationResult:
        future = asyncio.run_coroutine_threadsafe(
            self.engine.generate_async(session_id, context_token_ids, sampling, stop_strings, max_new_tokens), self._loop)
        return await asyncio.wrap_future(future)

    def end_session(self, session_id: str) -> None:
        self._loop.call_soon_threadsafe(self.engine.end_session, session_id)

    def load(self) -> dict:
        async def load():
            return self.engine.load()

        return self._call(load())

    def update_weights(self, named_tensors, version: int | None = None) -> int:
        return self._call(self.engine.update_weights(named_tensors, version))

    def score_prompt(self, token_ids: Sequence[int]) -> list[float]:
        return self._call(self.engine.score_prompt(token_ids))

    def info(self) -> dict:
        return self.engine.info()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def shutdown(self) -> None:
        """Shut the engine down on its own loop (elsewhere vLLM's sockets hang at exit), then the loop."""
        if not self._thread.is_alive():
            return

        async def stop():
            self.engine.shutdown()

        try:
            self._call(stop())
        finally:
            self._stop_loop()


__all__ = ["OwnLoopEngine"]
