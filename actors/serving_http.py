"""The served agent's HTTP layer: a FastAPI app with pydantic wire models, API keys and limits.

``AgentApi`` builds the app that Ray Serve mounts with ``@serve.ingress`` (``actors.serving``);
it runs just as well under plain uvicorn, which the unit tests use. What it adds to FastAPI:

* **One error shape.** Every refusal is OpenAI's ``{"error": {"message", "type", "param",
  "code"}}``: FastAPI's 422 validation bodies become 400s with a message naming the field and
  what it must be (the expected type is read from the same JSON schema that ``/docs`` shows), and
  Starlette's 404/405 become the same shape.
* **API keys** (``ApiKeys``): ``Authorization: Bearer <key>`` on every path but ``/healthz`` and
  the documentation pages (``/docs``, ``/openapi.json``). The app only holds SHA-256 digests of the
  keys; a presented key is hashed and compared with ``hmac.compare_digest`` against every digest.
  No key, presented or accepted, is ever written to a log or an error body.
* **Limits** (``EpisodeSlots``): at most ``max_episodes_in_flight`` episodes per replica; one more
  gets 503 with ``Retry-After`` at once instead of waiting in a queue. An episode that runs past
  ``request_deadline_s`` gets 504, and one whose client disconnects is stopped; either way its
  worker thread stops before its next model call, and its slot is free once the thread has stopped.
* **Body checks before parsing**: ``Content-Type`` must be JSON (415) and the body at most
  ``max_body_bytes`` (413), checked by an ASGI middleware that reads the body only up to the limit.

Validation is split: pydantic checks the shape (required fields, types, unknown fields), and
``AgentApi.check_*`` the values that depend on this server (question length, ``max_turns``
range, modes the index can serve).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal, Sequence

from fastapi import Request  # at module level: the route signatures' annotations are resolved from here
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, create_model

from raggym.retrieval.base import MODES

# ----------------------------------------------------------------------------- errors


class ApiError(Exception):
    """A request the server refuses; becomes ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class EpisodeStopped(Exception):
    """Raised in an episode's worker thread when its client left or its deadline passed."""


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ----------------------------------------------------------------------------- wire models


class _Strict(BaseModel):
    """Unknown fields are refused: a misspelt option must not be silently ignored."""

    model_config = ConfigDict(extra="forbid")


class AnswerBody(_Strict):
    question: StrictStr = Field(description="the question; at most max_question_chars characters")
    max_turns: StrictInt | None = Field(None, description="model turns for the episode, 1..max_turns_limit")
    modes: list[StrictStr] | None = Field(None, description="retrieval modes the agent may use: passage, graph, hybrid")


class AgentOptions(_Strict):
    """The ``raggym`` extension object of a chat request."""

    max_turns: StrictInt | None = None
    modes: list[StrictStr] | None = None


class ChatMessage(_Strict):
    role: StrictStr
    content: Any = Field(None, description="a string, or a list of {\"type\": \"text\", \"text\": ...} parts")
    name: StrictStr | None = None


class _ChatCore(_Strict):
    model: StrictStr = Field(description="the served model's name (GET /v1/models)")
    messages: list[ChatMessage] = Field(description="exactly one user message: the question")
    n: Any = None
    stream: Any = None
    logprobs: Any = None
    raggym: AgentOptions | None = None


# OpenAI chat parameters: sampling knobs are accepted and ignored (the server's sampling settings
# apply to every episode); the unsupported ones ask for something the agent does not do.
CHAT_IGNORED = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "user", "seed", "presence_penalty",
                "frequency_penalty", "stop", "metadata", "store", "service_tier", "logit_bias", "stream_options",
                "top_logprobs", "parallel_tool_calls", "reasoning_effort")
CHAT_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "audio", "modalities",
                    "prediction", "web_search_options")

ChatBody = create_model(
    "ChatBody", __base__=_ChatCore,
    **{name: (Any, Field(None, description="accepted and ignored")) for name in CHAT_IGNORED},
    **{name: (Any, Field(None, description="refused unless empty")) for name in CHAT_UNSUPPORTED})


class Document(BaseModel):
    id: str | int
    title: str | None


class Turn(BaseModel):
    reasoning: str | None
    action: str
    mode: str | None
    query: str | None
    answer: str | None
    error: str | None
    documents: list[Document]


class TokenCounts(BaseModel):
    prompt: int
    completion: int
    observation: int
    total: int


class EpisodeResult(BaseModel):
    answer: str | None
    finish_reason: str
    turns: list[Turn]
    retrieval_seconds: float
    retrieval_cost: float
    tokens: TokenCounts
    latency_seconds: float
    dialect: str
    allowed_modes: list[str]


class AnswerResponse(EpisodeResult):
    id: str
    model: str


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    raggym: EpisodeResult


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


@dataclass
class AnswerRequest:
    question: str
    max_turns: int
    modes: tuple[str, ...] | None = None


# ----------------------------------------------------------------------------- validation errors


def _param(loc: Sequence) -> str | None:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _schema_at(schema: dict, path: Sequence) -> dict | None:
    """The JSON schema of the value at ``path`` inside a model's schema (``None`` when unknown)."""
    defs = schema.get("$defs", {})

    def resolve(node: dict) -> dict:
        while True:
            if "$ref" in node:
                node = defs.get(node["$ref"].rsplit("/", 1)[-1], {})
            elif "anyOf" in node:  # an optional field: the non-null alternative
                options = [n for n in node["anyOf"] if n.get("type") != "null"]
                if len(options) != 1:
                    return node
                node = options[0]
            else:
                return node

    node = resolve(schema)
    for part in path:
        if isinstance(part, int):
            node = node.get("items")
        else:
            node = (node.get("properties") or {}).get(part)
        if node is None:
            return None
        node = resolve(node)
    return node


_ARTICLE = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
            "object": "an object", "array": "an array", "null": "null"}
_PLURAL = {"string": "strings", "integer": "integers", "number": "numbers", "boolean": "booleans",
           "object": "objects", "array": "arrays"}


def _describe(node: dict | None) -> str | None:
    """``{"type": "array", "items": {"type": "string"}}`` -> ``"an array of strings"``."""
    if not node:
        return None
    kind = node.get("type") or ("object" if "properties" in node else None)
    if kind == "array" and isinstance(node.get("items"), dict):
        item = node["items"]
        item_kind = item.get("type") or ("object" if "properties" in item or "$ref" in item else None)
        return f"an array of {_PLURAL[item_kind]}" if item_kind in _PLURAL else "an array"
    return _ARTICLE.get(kind)


def validation_error(errors: Sequence[dict], model: type[BaseModel], where: str = "the request body") -> ApiError:
    """The ``ApiError`` for pydantic's (or FastAPI's) error list: the first error, in plain words.

    Locations may start with FastAPI's ``"body"``; they are relative to ``model`` after it.
    """
    if not errors:
        return ApiError(400, f"{where} is not valid", code="invalid_value")
    err = errors[0]
    kind = err.get("type", "")
    loc = list(err.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    if not loc:  # the body itself: absent, or not an object
        if kind == "missing":
            return ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
        return ApiError(400, f"the request body must be a JSON object, got {_json_type(err.get('input'))}",
                        code="invalid_json")
    param = _param(loc)
    if kind == "missing":
        return ApiError(400, f"missing required field '{param}'", param=param, code="missing_field")
    if kind == "extra_forbidden":
        parent = _param(loc[:-1])
        node = _schema_at(model.model_json_schema(), loc[:-1]) or {}
        accepted = ", ".join(node.get("properties") or ())
        inside = f" in '{parent}'" if parent else ""
        return ApiError(400, f"unknown field {str(loc[-1])!r}{inside}; accepted: {accepted}", param=param,
                        code="unknown_field")
    schema = model.model_json_schema()
    # An element of a list of strings: report the list ("'modes' must be an array of strings").
    if loc and isinstance(loc[-1], int) and (_schema_at(schema, loc) or {}).get("type") not in (None, "object"):
        parent = _describe(_schema_at(schema, loc[:-1]))
        if parent and kind.endswith("_type"):
            name = _param(loc[:-1])
            return ApiError(400, f"'{name}' must be {parent}", param=name, code="invalid_type")
    expected = _describe(_schema_at(schema, loc))
    if expected and (kind.endswith("_type") or kind.endswith("_parsing")):
        return ApiError(400, f"'{param}' must be {expected}, got {_json_type(err.get('input'))}", param=param,
                        code="invalid_type")
    return ApiError(400, f"'{param}': {err.get('msg', 'invalid value')}", param=param, code="invalid_value")


# ----------------------------------------------------------------------------- API keys


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeys:
    """The accepted keys as SHA-256 digests; the keys themselves are never held by the server.

    Hashing first gives every comparison the same length, so ``hmac.compare_digest`` takes the
    same time whatever the presented key is; every digest is compared (no early exit), so the
    time does not tell which of several keys came close either.
    """

    def __init__(self, digests: Sequence[str] = ()):
        self._digests = tuple(bytes.fromhex(d) for d in digests)

    @classmethod
    def from_keys(cls, keys: Sequence[str]) -> "ApiKeys":
        return cls([key_digest(k) for k in keys])

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        presented = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(presented, digest)
        return ok


# ----------------------------------------------------------------------------- limits


class EpisodeSlots:
    """At most ``capacity`` episodes at once, each in its own worker thread, each with a deadline.

    ``run`` refuses with 503 when every slot is taken. A slot is held until the episode's thread
    has returned, so the cap bounds the work really going on, not just the open requests. The
    thread gets a ``threading.Event``; setting it (deadline passed, client gone) makes the episode
    raise ``EpisodeStopped`` before its next model call.
    """

    def __init__(self, capacity: int, deadline_s: float, retry_after_s: int):
        self.capacity, self.deadline_s, self.retry_after_s = int(capacity), float(deadline_s), int(retry_after_s)
        self.in_flight = 0
        self.counts = {"overloaded": 0, "deadline_exceeded": 0, "client_disconnected": 0}
        self._pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="episode")

    def _release(self, future: asyncio.Future) -> None:
        self.in_flight -= 1
        if not future.cancelled():
            future.exception()  # retrieved, so asyncio does not report it as never retrieved

    async def run(self, fn: Callable[[threading.Event], dict], disconnected: Callable[[], Awaitable[bool]] | None = None,
                  poll_s: float = 0.25) -> dict:
        if self.in_flight >= self.capacity:
            self.counts["overloaded"] += 1
            raise ApiError(503, f"the server is at its limit of {self.capacity} episodes in flight; retry after "
                                f"{self.retry_after_s} s", "server_overloaded", code="server_overloaded",
                           headers={"Retry-After": str(self.retry_after_s)})
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        self.in_flight += 1  # the event loop is one thread: no lock needed
        future = loop.run_in_executor(self._pool, fn, stop)
        future.add_done_callback(self._release)
        deadline = loop.time() + self.deadline_s
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    stop.set()
                    self.counts["deadline_exceeded"] += 1
                    raise ApiError(504, f"the episode did not finish within the request deadline of {self.deadline_s:g} s",
                                   "timeout_error", code="deadline_exceeded")
                done, _ = await asyncio.wait({future}, timeout=min(poll_s, left))
                if done:
                    return _episode_result(future)
                if disconnected is not None and await disconnected():
                    stop.set()
                    self.counts["client_disconnected"] += 1
                    raise ApiError(499, "the client disconnected", code="client_disconnected")
        except asyncio.CancelledError:  # Ray Serve cancels the handler when the client disconnects
            stop.set()
            self.counts["client_disconnected"] += 1
            raise


def _episode_result(future: asyncio.Future) -> dict:
    """The episode's response body, or the ``ApiError`` its failure becomes (a 5xx here, in the error shape)."""
    try:
        return future.result()
    except ApiError:
        raise
    except TimeoutError as e:  # Ray's GetTimeoutError is one: a model or search call outlasted request_timeout_s
        raise ApiError(504, f"a model or retrieval call did not answer within request_timeout_s ({type(e).__name__}); "
                            "the server is overloaded", "timeout_error", code="upstream_timeout") from None
    except Exception as e:  # noqa: BLE001 - an episode that failed inside the server
        raise ApiError(500, f"the server failed to answer: {type(e).__name__}: {e}", "server_error",
                       code="internal_error") from None


# ----------------------------------------------------------------------------- the app


_JSON_ROUTES = ("/v1/answer", "/v1/chat/completions")
_OPEN_PATHS = ("/healthz", "/docs", "/docs/oauth2-redirect", "/openapi.json")
_ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 415, 503, 504)}


class AgentApi:
    """Routes, validation, authentication and limits of the served agent; ``build()`` gives the app.

    ``answer_fn(question, max_turns, modes, request_id, stop_event) -> dict`` runs one episode
    (``AgentCore.answer``) and is called in a worker thread. ``status_fn`` (async, optional) adds
    engine and retrieval figures to ``/v1/status``, which exists only when
    ``settings.status_endpoint`` is on. ``/healthz`` is liveness alone.
    """

    def __init__(self, answer_fn: Callable[..., dict], settings, supported_modes: Sequence[str],
                 multi_mode: bool = True, *, api_keys: ApiKeys | None = None,
                 status_fn: Callable[[], Awaitable[dict]] | None = None, created: int | None = None):
        self.answer_fn = answer_fn
        self.settings = settings
        self.supported_modes = tuple(supported_modes)
        self.multi_mode = multi_mode
        self.api_keys = api_keys or ApiKeys()
        self.status_fn = status_fn
        self.created = int(created or time.time())
        self.slots = EpisodeSlots(settings.max_episodes_in_flight, settings.request_deadline_s, settings.retry_after_s)
        self.responses = {"served": 0, "refused": 0, "failed": 0}
        self.routes: dict[str, tuple[str, ...]] = {"/healthz": ("GET",), "/v1/models": ("GET",),
                                                   "/v1/answer": ("POST",), "/v1/chat/completions": ("POST",)}
        if settings.status_endpoint:
            self.routes["/v1/status"] = ("GET",)

    # -------------------------------------------------------------- value checks
    def check_question(self, value: str, param: str) -> str:
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

    def check_max_turns(self, value: int | None, param: str = "max_turns") -> int:
        limit = self.settings.max_turns_limit
        if value is None:
            return self.settings.default_max_turns
        if not 1 <= value <= limit:
            raise ApiError(400, f"'{param}' must lie in 1..{limit}, got {value}", param=param, code="out_of_range")
        return int(value)

    def check_modes(self, value: Sequence[str] | None, param: str = "modes") -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ApiError(400, f"'{param}' is empty; name at least one of {', '.join(self.supported_modes)}",
                           param=param, code="invalid_value")
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
            raise ApiError(400, f"the {self.settings.dialect} dialect runs one retrieval mode per episode; give exactly "
                                f"one mode in '{param}'", param=param, code="invalid_value")
        return modes

    def parse_answer(self, payload: Any) -> AnswerRequest:
        """A ``/v1/answer`` body (decoded JSON) -> ``AnswerRequest``, or ``ApiError`` (what the route does)."""
        try:
            body = AnswerBody.model_validate(payload)
        except ValidationError as e:
            raise validation_error(e.errors(), AnswerBody) from None
        return self.answer_request(body)

    def answer_request(self, body: AnswerBody) -> AnswerRequest:
        return AnswerRequest(self.check_question(body.question, "question"), self.check_max_turns(body.max_turns),
                             self.check_modes(body.modes))

    def chat_request(self, body) -> AnswerRequest:
        for key in CHAT_UNSUPPORTED:
            if getattr(body, key) not in (None, [], {}):
                raise ApiError(400, f"'{key}' is not supported: the agent answers with text found by retrieval",
                               param=key, code="unsupported_parameter")
        if body.stream:
            raise ApiError(400, "streaming is not supported; send stream=false", param="stream",
                           code="unsupported_parameter")
        if body.logprobs:
            raise ApiError(400, "logprobs are not returned by the agent endpoint", param="logprobs",
                           code="unsupported_parameter")
        if body.n is not None and (isinstance(body.n, bool) or body.n != 1):
            raise ApiError(400, f"'n' must be 1, got {json.dumps(body.n)}", param="n", code="unsupported_parameter")
        if body.model != self.settings.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.settings.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
        if not body.messages:
            raise ApiError(400, "'messages' must be a non-empty array", param="messages", code="invalid_value")
        if len(body.messages) != 1:
            raise ApiError(400, f"'messages' must hold exactly one user message (the question); got "
                                f"{len(body.messages)} messages. The agent writes its own prompt, so system messages "
                                "and earlier turns are not accepted", param="messages", code="unsupported_messages")
        msg = body.messages[0]
        if msg.role != "user":
            raise ApiError(400, f"'messages[0].role' must be 'user', got {json.dumps(msg.role)}", param="messages",
                           code="unsupported_messages")
        content = msg.content
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, "message content parts must be {\"type\": \"text\", \"text\": ...}",
                               param="messages[0].content", code="invalid_type")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"'messages[0].content' must be a string or an array of text parts, got "
                                f"{_json_type(content)}", param="messages[0].content", code="invalid_type")
        options = body.raggym or AgentOptions()
        return AnswerRequest(self.check_question(content, "messages[0].content"),
                             self.check_max_turns(options.max_turns, "raggym.max_turns"),
                             self.check_modes(options.modes, "raggym.modes"))

    # -------------------------------------------------------------- endpoints
    async def run_episode(self, req: AnswerRequest, request_id: str, request) -> dict:
        return await self.slots.run(lambda stop: self.answer_fn(req.question, req.max_turns, req.modes, request_id, stop),
                                    request.is_disconnected)

    def status(self) -> dict:
        return {"status": "ok", "model": self.settings.model_name, "dialect": self.settings.dialect,
                "modes": list(self.supported_modes),
                "requests": {**self.responses, "in_flight": self.slots.in_flight, **self.slots.counts},
                "limits": {"max_episodes_in_flight": self.slots.capacity, "request_deadline_s": self.slots.deadline_s,
                           "api_keys": self.api_keys.enabled}}

    def build(self):
        """The FastAPI app (OpenAPI page at ``/docs``)."""
        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="raggym agent", version="1", description="A multi-turn retrieval-augmented agent: "
                      "POST /v1/answer, OpenAI-compatible POST /v1/chat/completions. See docs/serving.md.")
        api = self
        body_models = {"/v1/answer": AnswerBody, "/v1/chat/completions": ChatBody}

        def error_response(e: ApiError) -> JSONResponse:
            return JSONResponse(e.payload(), status_code=e.status, headers=e.headers)

        @app.exception_handler(ApiError)
        async def on_api_error(request: Request, e: ApiError):
            return error_response(e)

        @app.exception_handler(RequestValidationError)
        async def on_validation_error(request: Request, e: RequestValidationError):
            model = body_models.get(_route_path(request.scope), AnswerBody)
            return error_response(validation_error(e.errors(), model))

        @app.exception_handler(HTTPException)
        async def on_http_error(request: Request, e: HTTPException):
            path = _route_path(request.scope)
            allowed = api.routes.get(path)
            if e.status_code == 405 and allowed:
                return error_response(ApiError(405, f"{path} accepts {', '.join(allowed)}, not {request.method}",
                                               code="method_not_allowed", headers={"Allow": ", ".join(allowed)}))
            if e.status_code == 404:
                listed = ", ".join(f"{m[0]} {p}" for p, m in api.routes.items())
                return error_response(ApiError(404, f"no endpoint {path}; available: {listed}", "not_found_error",
                                               code="unknown_endpoint"))
            return error_response(ApiError(e.status_code, str(e.detail), code="http_error"))

        @app.exception_handler(Exception)
        async def on_failure(request: Request, e: Exception):
            return error_response(ApiError(500, f"the server failed to answer: {type(e).__name__}: {e}", "server_error"))

        @app.get("/healthz", response_model=Health, tags=["operations"])
        async def healthz():
            """Liveness: the ingress answers. Open without a key; names nothing on the server's disk."""
            return {"status": "ok"}

        @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
        async def models():
            return {"object": "list", "data": [{"id": api.settings.model_name, "object": "model",
                                                "created": api.created, "owned_by": "raggym"}]}

        @app.post("/v1/answer", response_model=AnswerResponse, responses=_ERROR_RESPONSES)
        async def answer(body: AnswerBody, request: Request):
            """Answer a question with a whole episode; returns the answer and the trajectory."""
            req = api.answer_request(body)
            out = await api.run_episode(req, "ans-" + uuid.uuid4().hex, request)
            return {**out, "model": api.settings.model_name}

        @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERROR_RESPONSES)
        async def chat(body: ChatBody, request: Request):  # type: ignore[valid-type]
            """OpenAI chat completions: one user message (the question); the answer is the assistant message."""
            req = api.chat_request(body)
            rid = "chatcmpl-" + uuid.uuid4().hex
            result = await api.run_episode(req, rid, request)
            tokens = result["tokens"]
            prompt_tokens = tokens["prompt"] + tokens["observation"]
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": api.settings.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result["answer"] or ""},
                                 "logprobs": None, "finish_reason": "stop" if result["answer"] is not None else "length"}],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens["completion"],
                              "total_tokens": prompt_tokens + tokens["completion"]},
                    "raggym": {k: v for k, v in result.items() if k != "id"}}

        if self.settings.status_endpoint:
            @app.get("/v1/status", responses=_ERROR_RESPONSES, tags=["operations"])
            async def status():
                """Operator details (on with status_endpoint): counters, limits, engine, index and batching figures."""
                out = api.status()
                if api.status_fn is not None:
                    out.update(await api.status_fn())
                return out

        _declare_bearer_auth(app, self.api_keys.enabled)
        app.add_middleware(_RequestGate, api=self)
        return app


def _route_path(scope) -> str:
    from starlette._utils import get_route_path

    path = get_route_path(scope)
    return "/" + path.strip("/") if path.strip("/") else "/"


def _declare_bearer_auth(app, enabled: bool) -> None:
    """Show the bearer scheme in the OpenAPI document (``/docs`` then offers an Authorize button)."""
    if not enabled:
        return
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema.get("paths", {}).items():
                if path not in _OPEN_PATHS:
                    for op in operations.values():
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class _RequestGate:
    """ASGI middleware in front of routing: API key (401), ``Content-Type`` (415), body size (413).

    It also counts responses by class for ``/v1/status``. The body of a JSON route is read here,
    at most ``max_body_bytes + 1`` of it, and handed on unchanged.
    """

    def __init__(self, app, api: AgentApi):
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        api = self.api
        path = _route_path(scope)
        counted = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status = int(message["status"])
                # refused: 4xx and the overload 503 (the client may retry); failed: any other 5xx
                key = "served" if status < 400 else ("failed" if status >= 500 and status != 503 else "refused")
                api.responses[key] += 1
                counted["status"] = status
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if api.api_keys.enabled and path not in _OPEN_PATHS and not api.api_keys.accepts(headers.get("authorization")):
            missing = not headers.get("authorization")
            message = ("no API key: send it as 'Authorization: Bearer <key>'" if missing else
                       "incorrect API key (send 'Authorization: Bearer <key>' with a key this server accepts)")
            return await _send_error(counting_send, ApiError(401, message, code="missing_api_key" if missing else
                                                             "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        if scope["method"] == "POST" and path in _JSON_ROUTES:
            ctype = headers.get("content-type")
            if (ctype or "").split(";")[0].strip().lower() != "application/json":
                return await _send_error(counting_send, ApiError(
                    415, "the request body must be JSON sent with Content-Type: application/json, got "
                         f"{ctype or 'no Content-Type'}", code="unsupported_media_type"))
            limit = api.settings.max_body_bytes
            declared = headers.get("content-length", "")
            body, more = b"", True
            if declared.isdigit() and int(declared) > limit:
                size = int(declared)
            else:
                while more and len(body) <= limit:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                size = len(body)
            if size > limit:
                return await _send_error(counting_send, ApiError(
                    413, f"the request body is {'at least ' if more else ''}{size} bytes; the limit is {limit}",
                    code="body_too_large"))
            receive = _replay(body, receive)
        await self.app(scope, receive, counting_send)


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` once, then whatever the client sends next (its disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send, error: ApiError) -> None:
    payload = json.dumps(error.payload()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


__all__ = [
    "AgentApi", "AgentOptions", "AnswerBody", "AnswerRequest", "AnswerResponse", "ApiError", "ApiKeys", "ChatBody",
    "ChatCompletion", "EpisodeSlots", "EpisodeStopped", "ErrorResponse", "key_digest", "validation_error",
]
