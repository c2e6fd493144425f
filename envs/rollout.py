"""The one multi-turn rollout loop: engine turns and environment steps, token-in-token-out.

Every method's episodes run here, on a local engine or on Ray actors; a *backend* says how
generation and retrieval run:

- ``LocalBackend``: an engine object and the environments' own retrievers, in this process;
- ``RayBackend`` (``actors.env_runner``): rollout-worker actors and the retrieval-service actors.

Both implement ``RolloutBackend`` (below): ``generate`` one turn of a session, ``end_session``,
``retrieve`` a batch.

The loop drives environments only through their public batched-step protocol
(``envs.stepping``): ``begin_step`` parses a segment into a finished step or a retrieval request,
``finish_step`` applies a retrieval result, ``truncate`` ends an episode whose token budget ran
out. User wrappers survive: each env is resolved with ``envs.wrappers.batched_step_env``.

Two kinds of environment, by ``context_mode``:

- ``"append"`` (``RagSearchEnv``): one growing transcript per episode; each observation is
  appended to it, and the episode is one ``Rollout``;
- ``"replace"`` (``MultiKBRouteEnv``): each observation is the complete next prompt; every model
  call is its own ``Rollout`` (prompt + sampled ids), with ``step_index`` = the call's index, all
  sharing the episode's outcome. R1-Router's Step-GRPO resets such an env at a golden step
  (``EpisodeRequest.options``), so each of those episodes is exactly one call.

Every episode is its own asyncio coroutine that alternates an engine request
(``backend.generate``: one session per episode, or per model call in ``replace`` mode, so a
session engine such as vLLM's ``AsyncLLM`` reuses its prefix cache across turns) and an
environment step. No episode waits for another, so a continuously batching engine always sees
every episode that wants tokens. Retrieval stays batched across episodes: a ``RetrievalBatcher``
collects the episodes' requests until every live episode is waiting on retrieval, or for
``retrieval_batch_window_s`` at most, and sends them as one batched (and de-duplicated)
retrieval. Each turn samples with its own seed, ``derive_seed`` of the run's seed, the episode's
identity (prompt id, sample, step and its occurrence among identical requests) and the turn
number, so a rerun draws the same samples whatever the timing, the batching or the engine
replica (token-equal only on a batch-invariant engine: docs/runtime.md, "What reproduces").

The token rules (exact sampled ids kept, observations tokenized once, loss mask 0 on prompt and
observation tokens, response and observation caps) live in ``raggym.trajectory``. The loop adds
the budgets of ``RolloutConfig``: tokens per generation call (``max_turn_tokens``), the response
budget per episode (``max_response_tokens``) and, optionally, tokens of the whole context
(``max_sequence_tokens``: prompt, turns and observations together, as RouteRAG's 4,096).

What the response budget counts is ``response_budget_counts``:

- ``"model"`` (the default): the model's sampled tokens only, over all turns (calls) of the episode;
- ``"model_and_observations"``: the model's tokens and the observation tokens appended to the
  transcript, everything after the prompt, as verl-tool's ``max_response_length`` counts them
  (LWS trains with verl-tool). A turn samples at most what the budget has left, an observation is
  cut to it, and the episode is truncated (``"response_tokens"``) once nothing is left. In
  ``"replace"`` mode an observation is the next call's prompt, not appended to a response, so
  only the model's tokens count there, as with ``"model"``.

What the learner needs besides the tokens is recorded on each ``Rollout`` while it is known: the
builder marks the model's mode choices turn by turn, and with ``teacher_evidence_tokens`` set the
episode's start records PathRouter's teacher prompt, built from the prompt the environment's
``reset`` returned and the gold passages appended to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from envs.retrieval_memo import RetrievalMemo
from envs.session_adapter import as_session_engine
from envs.stepping import RetrievalRequest, run_retrieval
from envs.wrappers import batched_step_env
from raggym.generation import GenerationResult, SamplingParams
from raggym.seeding import derive_seed
from raggym.trajectory import Rollout, RolloutBuilder, chat_prompt_ids, teacher_prompt_ids

# What RolloutConfig.max_response_tokens counts (the module docstring says how each is applied).
RESPONSE_BUDGET_COUNTS = ("model", "model_and_observations")

@dataclass(frozen=True)
class EpisodeRequest:
    """One episode to run: a question, the id its G samples share, and extra reset options."""

    question: Any  # raggym.data.Question
    prompt_id: str
    sample_index: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)  # e.g. R1-Router's golden step
    step_index: int = 0


@dataclass
class RolloutConfig:
    max_response_tokens: int = 512  # model tokens per episode, all turns (calls) together
    max_turn_tokens: int = 256  # model tokens per segment (one generation call)
    max_observation_tokens: int = 512  # tokens kept of each observation
    # Tokens of one model context: prompt + model turns + observations (in "replace" mode, each
    # call's prompt and its sample). None: no cap beyond the response budget. A turn is cut to
    # the room left, an observation too, and the episode is truncated once the context is full.
    max_sequence_tokens: int | None = None
    # how long the first pending retrieval waits for other episodes' requests before
    # the batch goes out (it goes at once when every live episode is waiting on retrieval).
    retrieval_batch_window_s: float = 0.02
    # PathRouter's teacher KL reads each rollout's teacher prompt: the episode's prompt with its gold
    # passages, cut to this many tokens, appended (``raggym.trajectory.teacher_prompt_ids``). None: no
    # rollout records one (nothing reads it, and it would only cost a tokenization per episode).
    teacher_evidence_tokens: int | None = None
    # What max_response_tokens counts: "model" (sampled tokens only) or "model_and_observations"
    # (sampled and appended observation tokens, verl-tool's max_response_length); RESPONSE_BUDGET_COUNTS.
    response_budget_counts: str = "model"

    def __post_init__(self):
        for name in ("max_response_tokens", "max_turn_tokens", "max_observation_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_sequence_tokens is not None and self.max_sequence_tokens < 1:
            raise ValueError(f"RolloutConfig.max_sequence_tokens must be at least 1 or None, got {self.max_sequence_tokens}")
        if self.retrieval_batch_window_s < 0:
            raise ValueError(f"RolloutConfig.retrieval_batch_window_s must be >= 0, got {self.retrieval_batch_window_s}")
        if self.teacher_evidence_tokens is not None and self.teacher_evidence_tokens < 1:
            raise ValueError(f"RolloutConfig.teacher_evidence_tokens must be at least 1 or None, got "
                             f"{self.teacher_evidence_tokens}")
        if self.response_budget_counts not in RESPONSE_BUDGET_COUNTS:
            raise ValueError(f"RolloutConfig.response_budget_counts must be one of {list(RESPONSE_BUDGET_COUNTS)}, got "
                             f"{self.response_budget_counts!r}")


@dataclass
class _Slot:
    env: Any  # what reset() is called on (the outermost wrapper)
    stepper: Any  # what begin_step/finish_step/truncate are called on
    request: EpisodeRequest
    builder: RolloutBuilder
    replace_context: bool
    done: bool = False
    used: int = 0  # model tokens sampled over the whole episode
    observed: int = 0  # observation tokens appended to the episode's transcript ("append" mode)
    finished: list[RolloutBuilder] = field(default_factory=list)  # earlier calls (replace mode)
    seed: int | None = None  # the episode's own seed (turn t samples with derive_seed(seed, t))
    turn: int = 0  # model calls made so far
    teacher_prompt_ids: list[int] | None = None  # recorded on every rollout of the episode


def episode_seed(seed: int, request: EpisodeRequest, occurrence: int = 0) -> int:
    """The seed of one episode under the run's ``seed``: a function of the episode's identity only.

    ``occurrence`` tells apart requests with the same prompt id, sample and step (the k-th such
    request of a call), so two copies of one question never share a random stream.
    """
    key = f"{request.prompt_id}\x00{request.sample_index}\x00{request.step_index}\x00{occurrence}".encode()
    return derive_seed(seed, int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def run_coroutine(coro):
    """Run ``coro`` to completion from synchronous code, even when this thread runs an event loop.

    A caller inside a running loop (an async server handler that calls ``run``) cannot start a
    second loop on its thread, so the coroutine then runs on a fresh thread's own loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="raggym-rollout", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class RetrievalBatcher:
    """Gathers the retrieval requests of concurrent episodes into batched retrieval calls.

    ``submit`` returns the request's result once its batch is answered. A batch goes out when
    ``waiting_for()`` episodes (every live one) have submitted, or ``window_s`` after its first
    request. ``serial`` keeps one batch in flight at a time (in-process retrievers are not made
    for concurrent calls); requests that arrive meanwhile form the next batch.

    A ``RetrievalMemo`` (``envs.retrieval_memo``; one per batcher, that is per rollout call) makes
    every distinct (retriever, mode, k, query) one retrieval: a request identical to one already
    answered or in flight is served that answer at once, without joining a batch, and identical
    requests of one batch are sent once. ``memo.counts()`` says how many of each there were.
    """

    def __init__(self, retrieve: Callable[[list[RetrievalRequest]], Any], waiting_for: Callable[[], int],
                 window_s: float, *, serial: bool, memo: RetrievalMemo | None = None):
        self._retrieve, self._waiting_for, self.window_s, self.serial = retrieve, waiting_for, float(window_s), serial
        self.memo = RetrievalMemo() if memo is None else memo
        self._pending: list[tuple[RetrievalRequest, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self.batches: list[int] = []  # requests gathered in every batch sent (for tests and benchmarks)

    async def submit(self, request: RetrievalRequest):
        known = self.memo.lookup(request)
        if known is not None:  # an earlier batch's answer, or its retrieval in flight
            return await asyncio.shield(known)  # shielded: one episode's cancellation is not the others'
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self.poke()
        if self._pending and self._timer is None and not (self.serial and self._busy):
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._flush)
        return await future

    def poke(self) -> None:
        """Send the pending batch now if every live episode is in it (called as episodes end)."""
        if self._pending and len(self._pending) >= self._waiting_for() and not (self.serial and self._busy):
            self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending or (self.serial and self._busy):
            return
        batch, self._pending = self._pending, []
        self.batches.append(len(batch))
        owners = self.memo.fold([request for request, _ in batch])
        loop = asyncio.get_running_loop()
        shared: dict[int, asyncio.Future] = {}  # batch index of each request sent -> the memo's future
        for i, owner in enumerate(owners):
            if owner == i:
                shared[i] = loop.create_future()
                self.memo.store(batch[i][0], shared[i])
        self._busy = True
        loop.create_task(self._answer(batch, owners, shared))

    async def _answer(self, batch, owners: list[int], shared: dict[int, asyncio.Future]) -> None:
        sent = list(shared)
        try:
            results = await self._retrieve([batch[i][0] for i in sent])
            if len(results) != len(sent):
                raise RuntimeError(f"retrieval returned {len(results)} results for {len(sent)} requests")
        except BaseException as exc:  # noqa: BLE001 - every waiting episode sees the failure
            for i, future in shared.items():
                self.memo.forget(batch[i][0])  # a later identical request retrieves again
                future.set_exception(exc)
                future.exception()  # retrieved: no "never retrieved" warning when no hit awaited it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            answer = {i: result for i, result in zip(sent, results)}
            for i, future in shared.items():
                future.set_result(answer[i])
            for (_, future), owner in zip(batch, owners):
                if not future.done():
                    future.set_result(answer[owner])
        finally:
            self._busy = False
        if self._pending:  # what arrived while this batch was out goes next
            self.poke()
            if self._pending and self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.window_s, self._flush)


@runtime_checkable
class RolloutBackend(Protocol):
    """How the rollout loop reaches an engine and the retrievers (``LocalBackend``, ``RayBackend``).

    ``generate`` is one turn of a session (``raggym.generation.SessionEngine.generate_async``);
    ``retrieve`` answers a batch of requests, one result per request, in order. Optional:
    ``serial_retrieval`` (one retrieval batch in flight at a time).
    """

    async def generate(self, session_id: str, context_token_ids: Sequence[int], sampling: SamplingParams | None,
                       stop_strings: Sequence[str], max_new_tokens: int) -> GenerationResult: ...

    def end_session(self, session_id: str) -> None: ...

    async def retrieve(self, requests: Sequence[RetrievalRequest]) -> list: ...


class LocalBackend:
    """Generation by an engine object, retrieval by each request's own retriever, in this process.

    ``generate`` awaits the engine's ``generate_async`` when it is a ``SessionEngine``, else a
    ``BatchingSessionEngine`` that gathers concurrent requests into ``generate`` calls;
    ``retrieve`` runs on a thread, so that the engine keeps working while the retriever does.
    """

    serial_retrieval = True

    def __init__(self, engine):
        self.engine = engine
        self.sessions = as_session_engine(engine)

    async def generate(self, session_id: str, context_token_ids, sampling, stop_strings, max_new_tokens: int):
        return await self.sessions.generate_async(session_id, context_token_ids, sampling, stop_strings, max_new_tokens)

    def end_session(self, session_id: str) -> None:
        self.sessions.end_session(session_id)

    async def retrieve(self, requests: Sequence[RetrievalRequest]) -> list:
        return await asyncio.to_thread(run_retrieval, list(requests))


class MultiTurnRollout:
    """Run episodes to completion and return their ``Rollout`` records."""

    def __init__(self, backend: RolloutBackend, tokenizer, sampling: SamplingParams | None = None,
                 config: RolloutConfig | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.config = config or RolloutConfig()
        self.retrieval_batches: list[int] = []  # sizes of the last run's retrieval batches
        # the last run's retrieval counts (envs.retrieval_memo.COUNTERS): requests, sent, memo hits, folded
        self.retrieval_stats: dict[str, int] = {}

    def run(self, envs: Sequence[Any], requests: Sequence[EpisodeRequest | Any]) -> list[Rollout]:
        """One rollout per episode in request order; in ``replace`` mode, one per model call.

        A plain ``Question`` in place of a request is an episode of that question alone
        (prompt id = question id, sample 0).
        """
        return [rollout for episode in self.run_episodes(envs, requests) for rollout in episode]

    def run_episodes(self, envs: Sequence[Any], requests: Sequence[EpisodeRequest | Any]) -> list[list[Rollout]]:
        """Per request, the rollouts of its episode (one, or one per model call in ``replace`` mode)."""
        return run_coroutine(self.run_episodes_async(envs, requests))

    def _start_all(self, envs, requests) -> list[_Slot]:
        if len(envs) != len(requests):
            raise ValueError(f"{len(envs)} environments but {len(requests)} episode requests")
        requests = [r if isinstance(r, EpisodeRequest) else EpisodeRequest(r, r.id) for r in requests]
        return [self._start(env, request) for env, request in zip(envs, requests)]

    # ------------------------------------------------------------------ the async loop
    async def run_episodes_async(self, envs: Sequence[Any], requests: Sequence[EpisodeRequest | Any]) -> list[list[Rollout]]:
        """``run_episodes``, awaitable: one coroutine per episode."""
        slots = self._start_all(envs, requests)
        seed = None if self.sampling is None else self.sampling.seed
        if seed is not None:
            seen: dict[tuple, int] = {}
            for slot in slots:
                r = slot.request
                key = (r.prompt_id, r.sample_index, r.step_index)
                slot.seed = episode_seed(seed, r, seen.get(key, 0))
                seen[key] = seen.get(key, 0) + 1
        live = [len(slots)]
        batcher = RetrievalBatcher(self.backend.retrieve, lambda: live[0], self.config.retrieval_batch_window_s,
                                   serial=bool(getattr(self.backend, "serial_retrieval", False)))
        run_id = uuid.uuid4().hex[:12]  # session ids must not collide with another runner's on a shared engine

        async def episode(index: int, slot: _Slot) -> None:
            try:
                await self._run_episode(slot, f"{run_id}:{index}", batcher)
            finally:
                live[0] -= 1
                batcher.poke()

        tasks = [asyncio.ensure_future(episode(i, slot)) for i, slot in enumerate(slots)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        self.retrieval_batches = list(batcher.batches)
        self.retrieval_stats = batcher.memo.counts()
        return [self._finish(slot) for slot in slots]

    async def _run_episode(self, slot: _Slot, episode_id: str, batcher: RetrievalBatcher) -> None:
        stop = list(slot.stepper.stop_strings or ())
        session_builder, session_id = None, None
        try:
            while not slot.done:
                if slot.builder is not session_builder:  # a new model context: a new session
                    if session_id is not None:
                        self.backend.end_session(session_id)
                    session_builder, session_id = slot.builder, f"{episode_id}:{len(slot.finished)}"
                room = self._room(slot)
                if room < 1:  # nothing left to sample (the budget checks after each step normally end it first)
                    self._end_by_length(slot, "response_tokens")
                    break
                sampling = self.sampling
                if slot.seed is not None:
                    sampling = replace(sampling, seed=derive_seed(slot.seed, slot.turn))
                slot.turn += 1
                result = await self.backend.generate(session_id, list(slot.builder.rollout.token_ids), sampling, stop,
                                                     min(self.config.max_turn_tokens, room))
                outcome = self._apply_result(slot, result)
                if isinstance(outcome, RetrievalRequest):
                    outcome = slot.stepper.finish_step(outcome, await batcher.submit(outcome))
                self._after_step(slot, outcome)
        finally:
            if session_id is not None:
                self.backend.end_session(session_id)

    # ------------------------------------------------------------------ episode bookkeeping
    def _start(self, env, request: EpisodeRequest) -> _Slot:
        stepper = batched_step_env(env)
        prompt, _ = env.reset(options={"question": request.question, **dict(request.options)})
        slot = _Slot(env, stepper, request, None, stepper.context_mode == "replace")  # type: ignore[arg-type]
        evidence_cap = self.config.teacher_evidence_tokens
        if evidence_cap is not None:  # the gold passages are in the record from reset on
            gold = [str(text) for text in getattr(stepper.record, "gold_passages", ())]
            slot.teacher_prompt_ids = teacher_prompt_ids(self.tokenizer, gold, prompt, evidence_cap)
        slot.builder = self._builder(slot, prompt, request.step_index)
        return slot

    def _builder(self, slot: _Slot, prompt: str, step_index: int) -> RolloutBuilder:
        cfg, r = self.config, slot.request
        dialect = getattr(getattr(slot.stepper, "dialect", None), "name", None) or "routerag"
        room = cfg.max_response_tokens - slot.used  # replace mode: the episode's budget spans its calls
        builder = RolloutBuilder(self.tokenizer, dialect, r.prompt_id, r.sample_index, room, cfg.max_observation_tokens,
                                 step_index=step_index, teacher_prompt_ids=slot.teacher_prompt_ids)
        builder.add_prompt(chat_prompt_ids(self.tokenizer, prompt))
        return builder

    def _finish(self, slot: _Slot) -> list[Rollout]:
        record = slot.stepper.record  # one typed record for all the episode's rollouts; no dict is built here
        return [b.finish(record) for b in (*slot.finished, slot.builder)]

    # ------------------------------------------------------------------ steps of an episode
    def _apply_result(self, slot: _Slot, res):
        """Append one engine result to the episode (cut to its room) and begin the env step."""
        ids, logprobs, finish = list(res.token_ids), list(res.logprobs), res.finish_reason
        room = self._room(slot)
        if len(ids) > room:
            ids, logprobs, finish = ids[:room], logprobs[:room], "length"
        text = slot.builder.add_model_turn(ids, logprobs, finish_reason=finish,
                                           weight_version=getattr(res, "weight_version", 0))
        slot.used += len(ids)
        return slot.stepper.begin_step(text)

    def _sequence_room(self, builder: RolloutBuilder) -> int | None:
        """Tokens the model context can still take (None: no sequence cap)."""
        cap = self.config.max_sequence_tokens
        return None if cap is None else cap - len(builder.rollout.token_ids)

    def _budget_left(self, slot: _Slot) -> int:
        """What the episode's response budget has left, counted as ``response_budget_counts`` says."""
        spent = slot.used
        if self.config.response_budget_counts == "model_and_observations":
            spent += slot.observed
        return self.config.max_response_tokens - spent

    def _room(self, slot: _Slot) -> int:
        """Model tokens the next turn may sample: the response budget, within the sequence cap."""
        sequence = self._sequence_room(slot.builder)
        budget = max(0, min(slot.builder.response_budget_left, self._budget_left(slot)))
        return budget if sequence is None else max(0, min(budget, sequence))

    def _end_by_length(self, slot: _Slot, reason: str) -> None:
        slot.stepper.truncate(reason)  # the env records why and scores the episode
        slot.builder.rollout.truncated_by_length = True
        slot.done = True

    def _after_step(self, slot: _Slot, step) -> None:
        observation, _, terminated, truncated, _ = step
        if terminated or truncated:
            slot.done = True
            return
        if self._budget_left(slot) <= 0:
            self._end_by_length(slot, "response_tokens")
            return
        if slot.replace_context:  # the observation is the whole next prompt: a new call, a new rollout
            slot.finished.append(slot.builder)
            slot.builder = self._builder(slot, observation, slot.request.step_index + len(slot.finished))
            room = self._sequence_room(slot.builder)
            if room is not None and room <= 0:  # the next prompt alone fills the context: no call is made
                slot.builder = slot.finished.pop()
                self._end_by_length(slot, "sequence_tokens")
                return
        else:
            builder, room = slot.builder, self._sequence_room(slot.builder)
            observation_cap = builder.max_observation_tokens
            kept = observation_cap
            if room is not None:  # keep only the part of the observation that fits the context
                kept = min(kept, room)
            if self.config.response_budget_counts == "model_and_observations":  # and the response budget
                kept = min(kept, self._budget_left(slot))
            builder.max_observation_tokens = max(0, kept)
            try:
                slot.observed += len(builder.add_observation(observation))
            finally:
                builder.max_observation_tokens = observation_cap
        room = self._sequence_room(slot.builder)
        if room is not None and room <= 0:
            self._end_by_length(slot, "sequence_tokens")
        elif self._budget_left(slot) <= 0:  # observations filled the budget ("model_and_observations")
            self._end_by_length(slot, "response_tokens")


__all__ = ["EpisodeRequest", "LocalBackend", "MultiTurnRollout", "RESPONSE_BUDGET_COUNTS", "RetrievalBatcher",
           "RolloutBackend", "RolloutConfig", "episode_seed", "run_coroutine"]
