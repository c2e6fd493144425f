"""Serving a trained agent: request validation, the agent loop and three thin Ray Serve deployments.

The pieces, from the bottom up:

* ``AgentCore`` runs one multi-turn episode per question with the same code the trainer uses
  (``envs.RagSearchEnv`` parses and steps, ``envs.rollout.MultiTurnRollout`` keeps the exact
  token bookkeeping). It takes any engine (``generate(prompts, sampling, stop, max_new)``) and any
  retriever (``retrieve(queries, mode, k)``), so it runs without Ray on an ``HFEngine`` and a
  ``raggym.retrieval.Retriever``, and inside Serve on the handle wrappers below.
* ``HttpApi`` turns ``(method, path, content type, body bytes)`` into ``(status, JSON payload)``:
  routing (404/405), content type (415), body size (413), JSON and field validation (400) and the
  OpenAI wire format. It is plain Python as well; every error is
  ``{"error": {"message", "type", "param", "code"}}``. Model output is only parsed by the dialect,
  never executed or evaluated.
* ``PolicyServer``, ``RetrievalServer`` and ``AgentServer`` are the Ray Serve deployments (built
  by ``make_deployments``): the policy engine behind ``@serve.batch`` (concurrent episodes' turns
  become one batched ``generate``), the retriever behind ``@serve.batch`` (one ``retrieve`` per
  mode for concurrent searches), and the HTTP ingress, which runs each episode in a worker thread
  and reaches the other two through deployment handles.

``experiments/serve.py`` builds the application and the ``raggym serve`` command;
``docs/serving.md`` describes the HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Callable, Sequence

from actors.engines.base import GenerationResult, SamplingParams
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
    max_concurrent_requests: int = 256  # episodes in flight in the ingress (worker threads)
    max_batch_size: int = 16  # prompts per batched generate
    batch_wait_timeout_s: float = 0.01
    retrieval_max_batch_size: int = 32
    retrieval_batch_wait_timeout_s: float = 0.005
    # GET /v1/status (engine, index and batching details, which name files on the server's disk) is
    # off unless asked for: the API has no authentication yet, and /healthz only says "ok".
    status_endpoint: bool = False

    def __post_init__(self):
        ints = ("top_k", "default_max_turns", "max_turns_limit", "max_question_chars", "max_body_bytes",
                "max_turn_tokens", "max_response_tokens", "max_observation_tokens", "max_concurrent_requests",
                "max_batch_size", "retrieval_max_batch_size")
        for name in ints:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"serve setting {name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.default_max_turns <= self.max_turns_limit:
            raise ValueError(f"default_max_turns ({self.default_max_turns}) must lie in 1..max_turns_limit ({self.max_turns_limit})")
        if self.batch_wait_timeout_s < 0 or self.retrieval_batch_wait_timeout_s < 0 or self.request_timeout_s <= 0:
            raise ValueError("batch wait timeouts must be >= 0 and request_timeout_s > 0")
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
               request_id: str | None = None) -> dict:
        """Run the episode; returns the response body of ``POST /v1/answer``."""
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
                               max_observation_tokens=s.max_observation_tokens, waves=1)
        traj = MultiTurnRollout(LocalBackend(self.engine), self.tokenizer, s.sampling, config).run([env], [q])[0]
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


# ----------------------------------------------------------------------------- HTTP API (no Ray)


class ApiError(Exception):
    """A request the server refuses; becomes ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@dataclass
class AnswerRequest:
    question: str
    max_turns: int
    modes: tuple[str, ...] | None = None


_ANSWER_FIELDS = ("question", "max_turns", "modes")
# OpenAI chat parameters: sampling knobs are accepted and ignored (the server's sampling settings
# apply to every episode); these others ask for something the agent does not do.
_CHAT_IGNORED = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "user", "seed", "presence_penalty",
                 "frequency_penalty", "stop", "metadata", "store", "service_tier", "logit_bias", "stream_options",
                 "top_logprobs", "parallel_tool_calls", "reasoning_effort")
_CHAT_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "audio", "modalities",
                     "prediction", "web_search_options")


class HttpApi:
    """Routing, validation and response shapes of the served agent, independent of Ray.

    ``answer_fn(question, max_turns, modes, request_id) -> dict`` runs an episode (``AgentCore.answer``);
    ``status_fn() -> dict`` adds engine and retrieval figures to ``/v1/status``, which exists only
    when ``settings.status_endpoint`` is on. ``/healthz`` is liveness alone: it names no model
    directory, index path or other file of the server.
    """

    ROUTES = {
        "/healthz": ("GET",),
        "/v1/models": ("GET",),
        "/v1/answer": ("POST",),
        "/v1/chat/completions": ("POST",),
    }
    STATUS_ROUTE = "/v1/status"

    def __init__(self, answer_fn: Callable[..., dict], settings: ServeSettings, supported_modes: Sequence[str],
                 multi_mode: bool = True, status_fn: Callable[[], dict] | None = None, created: int | None = None):
        self.answer_fn = answer_fn
        self.settings = settings
        self.supported_modes = tuple(supported_modes)
        self.multi_mode = multi_mode
        self.status_fn = status_fn
        self.routes = dict(self.ROUTES)
        if settings.status_endpoint:
            self.routes[self.STATUS_ROUTE] = ("GET",)
        self.created = int(created or time.time())
        self.served = 0
        self.refused = 0
        self._lock = threading.Lock()

    # -------------------------------------------------------------- entry point
    def route(self, method: str, path: str) -> str:
        """The endpoint for ``path`` or an ``ApiError`` (404 unknown path, 405 wrong method)."""
        path = "/" + path.strip("/") if path.strip("/") else "/"
        allowed = self.routes.get(path)
        if allowed is None:
            raise ApiError(404, f"no endpoint {path}; available: {', '.join(f'{m[0]} {p}' for p, m in self.routes.items())}",
                           "not_found_error", code="unknown_endpoint")
        if method.upper() not in allowed:
            raise ApiError(405, f"{path} accepts {', '.join(allowed)}, not {method.upper()}", "invalid_request_error",
                           code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
        return path

    def handle(self, method: str, path: str, content_type: str | None, body: bytes) -> tuple[int, dict, dict]:
        """One HTTP request -> ``(status, JSON payload, extra headers)``; never raises."""
        try:
            endpoint = self.route(method, path)
            if endpoint == "/healthz":
                result = self.health()
            elif endpoint == self.STATUS_ROUTE:
                result = self.status()
            elif endpoint == "/v1/models":
                result = self.models()
            else:
                payload = self.read_json(content_type, body)
                if endpoint == "/v1/answer":
                    result = self.answer(payload)
                else:
                    result = self.chat(payload)
            with self._lock:
                self.served += 1
            return 200, result, {}
        except ApiError as e:
            with self._lock:
                self.refused += 1
            return e.status, e.payload(), e.headers
        except Exception as e:  # noqa: BLE001 - an episode that failed inside the server
            return 500, ApiError(500, f"the server failed to answer: {type(e).__name__}: {e}", "server_error").payload(), {}

    # -------------------------------------------------------------- parsing
    def read_json(self, content_type: str | None, body: bytes) -> dict:
        media = (content_type or "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, f"the request body must be JSON sent with Content-Type: application/json, "
                                f"got {content_type or 'no Content-Type'}", code="unsupported_media_type")
        if len(body) > self.settings.max_body_bytes:
            raise ApiError(413, f"the request body is {len(body)} bytes; the limit is {self.settings.max_body_bytes}",
                           code="body_too_large")
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {_json_type(payload)}", code="invalid_json")
        return payload

    def parse_answer(self, payload: dict) -> AnswerRequest:
        """Validate a ``/v1/answer`` body (also the core of the chat endpoint's options)."""
        unknown = [k for k in payload if k not in _ANSWER_FIELDS]
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r}; /v1/answer accepts {', '.join(_ANSWER_FIELDS)}",
                           param=str(unknown[0]), code="unknown_field")
        if "question" not in payload:
            raise ApiError(400, "missing required field 'question'", param="question", code="missing_field")
        question = self.check_question(payload["question"], "question")
        return AnswerRequest(question, self.check_max_turns(payload.get("max_turns")), self.check_modes(payload.get("modes")))

    def check_question(self, value, param: str) -> str:
        if not isinstance(value, str):
            raise ApiError(400, f"'{param}' must be a string, got {_json_type(value)}", param=param, code="invalid_type")
        if not value.strip():
            raise ApiError(400, f"'{param}' is empty", param=param, code="invalid_value")
        limit = self.settings.max_question_chars
        if len(value) > limit:
            raise ApiError(400, f"'{param}' is {len(value)} characters long; the limit is {limit}", param=param,
                           code="too_long")
        if _has_lone_surrogate(value):
            raise ApiError(400, f"'{param}' contains an unpaired surrogate (not valid Unicode text)", param=param,
                           code="invalid_value")
        return value.strip()

    def check_max_turns(self, value, param: str = "max_turns") -> int:
        limit = self.settings.max_turns_limit
        if value is None:
            return self.settings.default_max_turns
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(400, f"'{param}' must be an integer, got {_json_type(value)}", param=param, code="invalid_type")
        if not 1 <= value <= limit:
            raise ApiError(400, f"'{param}' must lie in 1..{limit}, got {value}", param=param, code="out_of_range")
        return int(value)

    def check_modes(self, value, param: str = "modes") -> tuple[str, ...] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise ApiError(400, f"'{param}' must be an array of strings, e.g. [\"passage\"]", param=param, code="invalid_type")
        if not value:
            raise ApiError(400, f"'{param}' is empty; name at least one of {', '.join(self.supported_modes)}", param=param,
                           code="invalid_value")
        modes = tuple(dict.fromkeys(value))
        for m in modes:
            if m not in MODES:
                raise ApiError(400, f"unknown retrieval mode {m!r} in '{param}'; known modes: {', '.join(MODES)}",
                               param=param, code="unknown_mode")
            if m not in self.supported_modes:
                raise ApiError(400, f"retrieval mode {m!r} is not available: this index has no knowledge graph, so "
                                    f"only {', '.join(self.supported_modes)} can be served", param=param,
                               code="unsupported_mode")
        if not self.multi_mode and len(modes) > 1:
            raise ApiError(400, f"the {self.settings.dialect} dialect runs one retrieval mode per episode; give exactly one "
                                f"mode in '{param}'", param=param, code="invalid_value")
        return modes

    # -------------------------------------------------------------- endpoints
    def health(self) -> dict:
        """Liveness: the ingress answers. Nothing about the server's files (the model name can be one)."""
        return {"status": "ok"}

    def status(self) -> dict:
        """Details for operators (``GET /v1/status``, off by default): the index path is among them."""
        out = {"status": "ok", "model": self.settings.model_name, "dialect": self.settings.dialect,
               "modes": list(self.supported_modes), "requests": {"served": self.served, "refused": self.refused}}
        if self.status_fn is not None:
            out.update(self.status_fn())
        return out

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": self.created,
                                            "owned_by": "raggym"}]}

    def answer(self, payload: dict) -> dict:
        req = self.parse_answer(payload)
        out = self.answer_fn(req.question, req.max_turns, req.modes, "ans-" + uuid.uuid4().hex)
        out["model"] = self.settings.model_name
        return out

    def chat(self, payload: dict) -> dict:
        question, options = self.parse_chat(payload)
        rid = "chatcmpl-" + uuid.uuid4().hex
        result = self.answer_fn(question, options.max_turns, options.modes, rid)
        tokens = result["tokens"]
        prompt_tokens = tokens["prompt"] + tokens["observation"]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.settings.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result["answer"] or ""},
                         "logprobs": None, "finish_reason": "stop" if result["answer"] is not None else "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens["completion"],
                      "total_tokens": prompt_tokens + tokens["completion"]},
            "raggym": {k: v for k, v in result.items() if k != "id"},
        }

    def parse_chat(self, payload: dict) -> tuple[str, AnswerRequest]:
        known = {"model", "messages", "n", "stream", "logprobs", "raggym", *_CHAT_IGNORED, *_CHAT_UNSUPPORTED}
        unknown = [k for k in payload if k not in known]
        if unknown:
            raise ApiError(400, f"unrecognized request argument {unknown[0]!r}", param=str(unknown[0]), code="unknown_field")
        for key in _CHAT_UNSUPPORTED:
            if payload.get(key) not in (None, [], {}):
                raise ApiError(400, f"'{key}' is not supported: the agent answers with text found by retrieval", param=key,
                               code="unsupported_parameter")
        if payload.get("stream"):
            raise ApiError(400, "streaming is not supported; send stream=false", param="stream", code="unsupported_parameter")
        if payload.get("logprobs"):
            raise ApiError(400, "logprobs are not returned by the agent endpoint", param="logprobs",
                           code="unsupported_parameter")
        n = payload.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):
            raise ApiError(400, f"'n' must be 1, got {json.dumps(n)}", param="n", code="unsupported_parameter")
        if "model" not in payload:
            raise ApiError(400, "missing required field 'model'", param="model", code="missing_field")
        if payload["model"] != self.settings.model_name:
            raise ApiError(404, f"the model {payload['model']!r} does not exist; this server serves "
                                f"{self.settings.model_name!r} (GET /v1/models)", "invalid_request_error", param="model",
                           code="model_not_found")
        if "messages" not in payload:
            raise ApiError(400, "missing required field 'messages'", param="messages", code="missing_field")
        messages = payload["messages"]
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty array", param="messages", code="invalid_type")
        if len(messages) != 1:
            raise ApiError(400, f"'messages' must hold exactly one user message (the question); got {len(messages)} "
                                "messages. The agent writes its own prompt, so system messages and earlier turns are "
                                "not accepted", param="messages", code="unsupported_messages")
        msg = messages[0]
        if not isinstance(msg, dict):
            raise ApiError(400, f"'messages[0]' must be an object, got {_json_type(msg)}", param="messages",
                           code="invalid_type")
        if msg.get("role") != "user":
            raise ApiError(400, f"'messages[0].role' must be 'user', got {json.dumps(msg.get('role'))}", param="messages",
                           code="unsupported_messages")
        extra = [k for k in msg if k not in ("role", "content", "name")]
        if extra:
            raise ApiError(400, f"unsupported field {extra[0]!r} in messages[0]", param="messages", code="unknown_field")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "message content parts must be {\"type\": \"text\", \"text\": ...}",
                                   param="messages", code="invalid_type")
                texts.append(part["text"])
            content = "\n".join(texts)
        question = self.check_question(content, "messages[0].content")
        options = payload.get("raggym") or {}
        if not isinstance(options, dict):
            raise ApiError(400, f"'raggym' must be an object, got {_json_type(options)}", param="raggym", code="invalid_type")
        unknown = [k for k in options if k not in ("max_turns", "modes")]
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r} in 'raggym'; accepted: max_turns, modes",
                           param=f"raggym.{unknown[0]}", code="unknown_field")
        return question, AnswerRequest(question, self.check_max_turns(options.get("max_turns"), "raggym.max_turns"),
                                       self.check_modes(options.get("modes"), "raggym.modes"))


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
        calls = [self.handle.generate.remote(GenerationRequest(tuple(int(t) for t in p), sampling, tuple(stop_strings),
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
    from starlette.responses import JSONResponse

    class PolicyServer:
        """The policy engine; concurrent turns arrive one prompt per call and leave as one batch."""

        def __init__(self, policy: str, engine: str = "hf", engine_kwargs: dict | None = None,
                     max_batch_size: int = 16, batch_wait_timeout_s: float = 0.01, threads: int | None = None):
            from actors.engines.rollout_worker import make_engine

            _set_threads(threads)
            kwargs = dict(engine_kwargs or {})
            if engine == "hf":
                kwargs.setdefault("num_threads", threads)
            self.engine = make_engine(engine, model=policy, **kwargs)
            self.kind = engine
            self.runner = MergingRunner(lambda reqs: generate_grouped(self.engine, reqs), max_batch_size, "engine")
            self.generate.set_max_batch_size(int(max_batch_size))
            self.generate.set_batch_wait_timeout_s(float(batch_wait_timeout_s))

        @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01, max_concurrent_batches=_CONCURRENT_BATCHES)
        async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
            return await self.runner.submit(requests)

        def info(self) -> dict:
            info = self.engine.info() if hasattr(self.engine, "info") else {"kind": self.kind}
            return {**info, "batching": self.runner.stats.as_dict(),
                    "max_batch_size": self.generate._get_max_batch_size(),
                    "batch_wait_timeout_s": self.generate._get_batch_wait_timeout_s()}

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
            from envs.stepping import RetrievalRequest, run_retrieval

            requests = [RetrievalRequest(None, self.retriever, mode, k, q, "", None) for q, mode, k in items]
            return run_retrieval(requests)  # one retrieve per (mode, k), identical queries once

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005, max_concurrent_batches=_CONCURRENT_BATCHES)
        async def retrieve(self, items: list[tuple[str, str, int]]):
            return await self.runner.submit(items)

        # serve.batch flattens positional arguments into one tuple per call
        async def retrieve_one(self, query: str, mode: str, k: int):
            return await self.retrieve((query, mode, k))

        def info(self) -> dict:
            return {"index": self.index_dir, **self.retriever.describe(), "batching": self.runner.stats.as_dict()}

    class AgentServer:
        """HTTP ingress: validates requests, runs episodes in worker threads, answers in JSON."""

        def __init__(self, policy_handle, retrieval_handle, settings: dict, supported_modes: list[str], tokenizer_spec: str):
            from raggym.models import load_policy_tokenizer

            self.settings = ServeSettings.from_dict(settings)
            self.policy, self.retrieval = policy_handle, retrieval_handle
            tokenizer = load_policy_tokenizer(tokenizer_spec)
            timeout = self.settings.request_timeout_s
            self.core = AgentCore(HandleEngine(policy_handle, timeout), HandleRetriever(retrieval_handle, timeout),
                                  tokenizer, self.settings, supported_modes)
            self.api = HttpApi(self.core.answer, self.settings, self.core.supported_modes, self.core.multi_mode,
                               status_fn=self._status)
            self._pool = ThreadPoolExecutor(max_workers=self.settings.max_concurrent_requests, thread_name_prefix="episode")

        def _status(self) -> dict:
            t = self.settings.request_timeout_s
            return {"engine": self.policy.info.remote().result(timeout_s=t),
                    "retrieval": self.retrieval.info.remote().result(timeout_s=t)}

        async def __call__(self, request):
            scope = request.scope
            path = scope.get("path", "/")
            root = scope.get("root_path", "") or ""
            if root and root != "/" and path.startswith(root):
                path = path[len(root):] or "/"
            body = await request.body()
            status, payload, headers = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.api.handle, request.method, path, request.headers.get("content-type"), body)
            return JSONResponse(payload, status_code=status, headers=headers)

    return (serve.deployment(PolicyServer, name="PolicyServer"),
            serve.deployment(RetrievalServer, name="RetrievalServer"),
            serve.deployment(AgentServer, name="AgentServer"))


__all__ = [
    "AgentCore",
    "AnswerRequest",
    "ApiError",
    "BatchStats",
    "GenerationRequest",
    "HandleEngine",
    "HandleRetriever",
    "HttpApi",
    "ServeSettings",
    "generate_grouped",
    "make_deployments",
    "turn_summary",
]
