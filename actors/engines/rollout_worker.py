"""``RolloutWorker``: a thin Ray actor around one generation engine.

Plain class, so it is usable (and testable) without Ray; ``RolloutWorker.as_remote(**options)``
returns the Ray actor class with resource options, e.g.::

    Worker = RolloutWorker.as_remote(num_cpus=1)                  # HF engine on CPU
    Worker = RolloutWorker.as_remote(num_gpus=1)                  # vLLM engine, TP=1
    w = Worker.remote(engine="hf", model="smollm2-135m")
    results = ray.get(w.generate.remote(prompt_ids, SamplingParams(seed=0), ["</search>"], 64))

Every method returns plain data (``GenerationResult`` dataclasses, ints, dicts), so nothing large
or engine-specific crosses the actor boundary.

Sessions: ``generate_async(session_id, context_ids, ...)``, ``end_session`` and ``load`` make the
worker a ``SessionEngine``. Because ``generate_async`` is ``async def``, Ray runs the worker as an
async actor, so many sessions' requests are in flight at once and the engine batches them
(``HFEngine`` continuously; an engine without sessions goes through
``envs.session_adapter.as_session_engine``). ``continue_session(session_id, keep, new_ids, ...)``
is the same turn sent as what is new since the last one: the worker keeps each open session's
context (``actors.engines.session_context``), so a turn's call carries its observation's ids, not
the whole context again.

Weight versions: a worker built with ``require_sync=True`` refuses to generate until it has
received weights once (``update_weights`` / ``receive_weights``). Ray rebuilds a restarted actor
with its original arguments, so a worker restarted mid-run cannot sample from its initial
weights and pass them off as the learner's; ``require_sync="after_restart"`` refuses only in an
actor that Ray has reconstructed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Sequence

from actors.engines.base import GenerationResult, SamplingParams, engine_info
from actors.engines.session_context import HeldContexts
from actors.weight_sync import Loaded
from envs.session_adapter import as_session_engine


# name -> factory(**kwargs) -> engine; filled by register_engine
ENGINE_FACTORIES: dict = {}
# the built-in engines, as import strings: a module is imported only when its engine is used
BUILTIN_ENGINES = {"hf": "actors.engines.hf:HFEngine", "vllm": "actors.engines.vllm_engine:VLLMEngine",
                   "vllm-async": "actors.engines.vllm_async:AsyncVLLMEngine"}


def register_engine(name: str, factory, *, replace: bool = False) -> None:
    """Make ``make_engine(name, **kwargs)`` (and so ``RolloutWorker(engine=name)``) build
    ``factory(**kwargs)``. Registration is per process; for Ray actors pass the engine as an
    import string ``"package.module:Factory"`` instead, which every process can resolve."""
    if name in BUILTIN_ENGINES or (name in ENGINE_FACTORIES and not replace):
        raise ValueError(f"engine {name!r} is already registered")
    if not callable(factory):
        raise TypeError(f"engine factory for {name!r} must be callable")
    ENGINE_FACTORIES[name] = factory


def engine_factory(engine: str):
    """What ``make_engine(engine, ...)`` calls: ``HFEngine`` for ``"hf"``, ``VLLMEngine`` for
    ``"vllm"``, ``AsyncVLLMEngine`` (the continuously batching ``SessionEngine`` on GPU) for
    ``"vllm-async"``, a factory given to ``register_engine``, or the callable an import string
    ``"module:callable"`` names. ``ValueError`` for an unknown name or an import that fails."""
    if engine in ENGINE_FACTORIES:
        return ENGINE_FACTORIES[engine]
    if engine in BUILTIN_ENGINES or (isinstance(engine, str) and ":" in engine):
        module, _, attr = BUILTIN_ENGINES.get(engine, engine).partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import engine {engine!r}: {exc}") from exc
    known = [*BUILTIN_ENGINES, *ENGINE_FACTORIES]
    raise ValueError(f"unknown engine {engine!r}; known: {known} or 'module:callable' (add one with "
                     "actors.engines.register_engine)")


def make_engine(engine: str = "hf", **kwargs):
    """Build an engine by name (``engine_factory``)."""
    return engine_factory(engine)(**kwargs)


class WeightsNotSyncedError(RuntimeError):
    """A worker that must be synced first was asked to generate."""


def _restarted_by_ray() -> bool:
    import warnings

    try:
        import ray

        with warnings.catch_warnings():  # the property reads a deprecated attribute inside Ray
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - outside an actor there is nothing to have been restarted
        return False


class RolloutWorker:
    """Holds one engine; forwards generation and weight updates to it.

    ``require_sync``: ``False`` (generate at once), ``True`` (refuse to generate until weights
    have been received once) or ``"after_restart"`` (refuse only if Ray restarted this actor).
    """

    def __init__(self, engine: str = "hf", *, require_sync: bool | str = False, **engine_kwargs):
        if require_sync not in (True, False, "after_restart"):
            raise ValueError(f"require_sync must be True, False or 'after_restart', got {require_sync!r}")
        self.engine = make_engine(engine, **engine_kwargs)
        self.sessions = as_session_engine(self.engine)
        self.contexts = HeldContexts()  # each open session's context, so a turn sends only its new ids
        self.restarted = _restarted_by_ray()
        self.synced = not (require_sync is True or (require_sync == "after_restart" and self.restarted))

    @classmethod
    def as_remote(cls, **ray_options):
        """The Ray actor class (``ray.remote(**ray_options)(RolloutWorker)``)."""
        import ray

        return ray.remote(**ray_options)(cls) if ray_options else ray.remote(cls)

    def _check_synced(self) -> None:
        if not self.synced:
            why = "was restarted" if self.restarted else "was built with require_sync=True"
            raise WeightsNotSyncedError(
                f"this rollout worker {why} and has not received weights since (it holds weight version "
                f"{self.engine.weight_version} from its start); sync it with update_weights or receive_weights "
                "before generating, so no sample comes from stale weights")

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> list[GenerationResult]:
        self._check_synced()
        return self.engine.generate(prompt_token_ids, sampling, stop_strings, max_new_tokens)

    async def generate_async(
        self,
        session_id: str,
        context_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> GenerationResult:
        """One turn of a session, its whole context sent (see ``actors.engines.base.SessionEngine``)."""
        return await self.continue_session(session_id, 0, context_token_ids, sampling, stop_strings, max_new_tokens)

    async def continue_session(
        self,
        session_id: str,
        keep: int,
        new_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
        ended: Sequence[str] = (),
    ) -> GenerationResult:
        """One turn of a session sent as what is new: the first ``keep`` ids this worker holds of
        the session (its last context and the ids it sampled then), followed by ``new_token_ids``.
        ``SessionContextLostError`` when it holds fewer (``actors.engines.session_context``).
        ``ended``: the caller's sessions that ended since its last call here, freed first (their
        ends ride on this call; ``actors.env_runner.RayBackend.end_session``)."""
        for finished in ended:
            self.end_session(finished)
        self._check_synced()
        context = self.contexts.rebuild(session_id, int(keep), new_token_ids)
        result = await self.sessions.generate_async(session_id, context, sampling, stop_strings, max_new_tokens)
        self.contexts.record(session_id, context, result.token_ids)
        return result

    def end_session(self, session_id: str) -> None:
        self.contexts.end(session_id)
        self.sessions.end_session(session_id)

    def load(self) -> dict:
        """``{"sessions": n, "running": n}`` of the engine, for least-loaded routing of new sessions."""
        return self.sessions.load()

    def _updated(self, version) -> int:
        self.synced = True
        return int(version)

    def update_weights(self, weights, version: int | None = None) -> int:
        """Load ``FlatWeights`` (from the object store), a mapping or pairs; returns the new version."""
        if inspect.iscoroutinefunction(self.engine.update_weights):
            raise TypeError(f"{type(self.engine).__name__} updates its weights asynchronously; call update_weights_async")
        return self._updated(self.engine.update_weights(weights, version))

    async def update_weights_async(self, weights, version: int | None = None,
                                   probe: Sequence[int] | None = None) -> Loaded:
        """``update_weights`` for any engine, without blocking the actor's event loop (an
        ``HFEngine`` update waits for the requests in flight to finish); with ``probe``, the new
        weights' scores of it ride back in the answer (``actors.sync_verify``)."""
        if inspect.iscoroutinefunction(self.engine.update_weights):
            loaded = self._updated(await self.engine.update_weights(weights, version))
        else:
            loaded = self._updated(await asyncio.to_thread(self.engine.update_weights, weights, version))
        return Loaded(loaded, None if probe is None else await self.score_prompt_async(probe))

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> int:
        """Join a ``WeightSyncGroup``; returns how many ranks this worker occupies in it."""
        if inspect.iscoroutinefunction(self.engine.init_weight_sync):
            raise TypeError(f"{type(self.engine).__name__} joins asynchronously; call init_weight_sync_async")
        self.engine.init_weight_sync(host, port, rank_offset, world_size, backend)
        return self.engine.sync_ranks

    async def init_weight_sync_async(self, host: str, port: int, rank_offset: int, world_size: int,
                                     backend: str = "gloo") -> int:
        args = (host, port, rank_offset, world_size, backend)
        if inspect.iscoroutinefunction(self.engine.init_weight_sync):
            await self.engine.init_weight_sync(*args)
        else:
            await asyncio.to_thread(self.engine.init_weight_sync, *args)
        return self.engine.sync_ranks

    def sync_ranks(self) -> int:
        return int(self.engine.sync_ranks)

    def receive_weights(self) -> int:
        if inspect.iscoroutinefunction(self.engine.receive_weights):
            raise TypeError(f"{type(self.engine).__name__} receives weights asynchronously; call receive_weights_async")
        return self._updated(self.engine.receive_weights())

    async def receive_weights_async(self, probe: Sequence[int] | None = None) -> Loaded:
        """Receive a broadcast; with ``probe``, the new weights' scores of it ride back in the answer."""
        if inspect.iscoroutinefunction(self.engine.receive_weights):
            received = self._updated(await self.engine.receive_weights())
        else:
            received = self._updated(await asyncio.to_thread(self.engine.receive_weights))
        return Loaded(received, None if probe is None else await self.score_prompt_async(probe))

    async def score_prompt_async(self, token_ids: Sequence[int]) -> list[float]:
        """The engine's log p(x_t | x_<t) of ``token_ids`` at temperature 1 (a sync's probe,
        ``actors.sync_verify``); an engine without weights (scripted) has no such method."""
        score = getattr(self.engine, "score_prompt", None)
        if score is None:
            raise TypeError(f"{type(self.engine).__name__} cannot score a prompt, so its weight syncs cannot be "
                            "verified; train with rollout.verify_sync.every=0")
        if inspect.iscoroutinefunction(score):
            return await score(token_ids)
        return await asyncio.to_thread(score, token_ids)

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def tokenizer_name_or_path(self) -> str:
        return str(getattr(self.engine.tokenizer, "name_or_path", ""))

    def info(self) -> dict:
        return {**engine_info(self.engine), "synced": self.synced, "restarted": self.restarted}

    def ping(self) -> bool:
        return True


__all__ = ["ENGINE_FACTORIES", "RolloutWorker", "WeightsNotSyncedError", "make_engine", "register_engine"]
