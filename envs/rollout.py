"""The one multi-turn rollout loop: engine turns and environment steps, token-in-token-out.

Every method's episodes run here, on a local engine or on Ray actors; a *backend* says how
generation and retrieval run:

- ``LocalBackend``: an engine object and the environments' own retrievers, in this process;
- ``RayBackend`` (``actors.env_runner``): rollout-worker actors and the retrieval-service actors,
  called asynchronously so that one wave's retrieval overlaps another wave's generation.

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

The episodes are split into ``waves``. Each wave alternates: generate one segment for its
active episodes -> ``begin_step`` -> retrieve for those that searched -> ``finish_step`` ->
append observation tokens (or start the next call's prompt) -> generate again. With two or more
waves in flight the loop always has work for both the engine and the retriever.

The token rules (exact sampled ids kept, observations tokenized once, loss mask 0 on prompt and
observation tokens, response and observation caps) live in ``raggym.trajectory``. The loop adds
the budgets of ``RolloutConfig``: tokens per generation call (``max_turn_tokens``), model tokens
per episode (``max_response_tokens``) and, optionally, tokens of the whole context
(``max_sequence_tokens``: prompt, turns and observations together, as RouteRAG's 4,096).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from envs.stepping import RetrievalRequest
from envs.wrappers import batched_step_env
from raggym.seeding import derive_seed
from raggym.trajectory import Rollout, RolloutBuilder, chat_prompt_ids


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
    waves: int = 2  # sub-batches in flight (pipelining generation against retrieval)
    # Tokens of one model context: prompt + model turns + observations (in "replace" mode, each
    # call's prompt and its sample). None: no cap beyond the response budget. A turn is cut to
    # the room left, an observation too, and the episode is truncated once the context is full.
    max_sequence_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_response_tokens", "max_turn_tokens", "max_observation_tokens", "waves"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_sequence_tokens is not None and self.max_sequence_tokens < 1:
            raise ValueError(f"RolloutConfig.max_sequence_tokens must be at least 1 or None, got {self.max_sequence_tokens}")


@dataclass
class _Slot:
    env: Any  # what reset() is called on (the outermost wrapper)
    stepper: Any  # what begin_step/finish_step/truncate are called on
    request: EpisodeRequest
    builder: RolloutBuilder
    replace_context: bool
    done: bool = False
    used: int = 0  # model tokens sampled over the whole episode
    finished: list[RolloutBuilder] = field(default_factory=list)  # earlier calls (replace mode)


@dataclass
class _Wave:
    slots: list[_Slot]
    requests: list[tuple[_Slot, RetrievalRequest]] = field(default_factory=list)
    generating: list[_Slot] = field(default_factory=list)
    index: int = 0
    turn: int = 0

    def active(self) -> list[_Slot]:
        return [s for s in self.slots if not s.done]


class LocalBackend:
    """Generation by an engine object, retrieval by each request's own retriever; synchronous."""

    def __init__(self, engine):
        self.engine = engine

    def submit_generate(self, prompts, sampling, stop_strings, max_new_tokens):
        return ("value", self.engine.generate(prompts, sampling, stop_strings, max_new_tokens))

    def submit_retrieve(self, requests: Sequence[RetrievalRequest]):
        from envs.stepping import run_retrieval

        return ("value", run_retrieval(list(requests)))

    def wait_one(self, futures):
        return futures[0]

    def get(self, future):
        return future[1]


class MultiTurnRollout:
    """Run episodes to completion and return their ``Rollout`` records."""

    def __init__(self, backend, tokenizer, sampling=None, config: RolloutConfig | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.config = config or RolloutConfig()

    def run(self, envs: Sequence[Any], requests: Sequence[EpisodeRequest | Any]) -> list[Rollout]:
        """One rollout per episode in request order; in ``replace`` mode, one per model call.

        A plain ``Question`` in place of a request is an episode of that question alone
        (prompt id = question id, sample 0).
        """
        return [rollout for episode in self.run_episodes(envs, requests) for rollout in episode]

    def run_episodes(self, envs: Sequence[Any], requests: Sequence[EpisodeRequest | Any]) -> list[list[Rollout]]:
        """Per request, the rollouts of its episode (one, or one per model call in ``replace`` mode)."""
        if len(envs) != len(requests):
            raise ValueError(f"{len(envs)} environments but {len(requests)} episode requests")
        requests = [r if isinstance(r, EpisodeRequest) else EpisodeRequest(r, r.id) for r in requests]
        slots = [self._start(env, request) for env, request in zip(envs, requests)]
        n_waves = max(1, min(self.config.waves, len(slots)))
        waves = [_Wave(slots[i::n_waves], index=i) for i in range(n_waves)]
        outstanding: list = []
        meta: dict[int, tuple[_Wave, str]] = {}

        def submit(wave: _Wave, kind: str, fut):
            outstanding.append(fut)
            meta[id(fut)] = (wave, kind)

        for wave in waves:
            self._submit_generation(wave, submit)
        while outstanding:
            fut = self.backend.wait_one(outstanding)
            outstanding.remove(fut)
            wave, kind = meta.pop(id(fut))
            value = self.backend.get(fut)
            if kind == "generate":
                self._apply_generation(wave, value)
                if wave.requests:
                    submit(wave, "retrieve", self.backend.submit_retrieve([r for _, r in wave.requests]))
                else:
                    self._submit_generation(wave, submit)
            else:
                self._apply_retrieval(wave, value)
                self._submit_generation(wave, submit)
        return [self._finish(slot) for slot in slots]

    # ------------------------------------------------------------------ episode bookkeeping
    def _start(self, env, request: EpisodeRequest) -> _Slot:
        stepper = batched_step_env(env)
        prompt, _ = env.reset(options={"question": request.question, **dict(request.options)})
        slot = _Slot(env, stepper, request, None, stepper.context_mode == "replace")  # type: ignore[arg-type]
        slot.builder = self._builder(slot, prompt, request.step_index)
        return slot

    def _builder(self, slot: _Slot, prompt: str, step_index: int) -> RolloutBuilder:
        cfg, r = self.config, slot.request
        dialect = getattr(getattr(slot.stepper, "dialect", None), "name", None) or "routerag"
        room = cfg.max_response_tokens - slot.used  # replace mode: the episode's budget spans its calls
        builder = RolloutBuilder(self.tokenizer, dialect, r.prompt_id, r.sample_index, room, cfg.max_observation_tokens,
                                 step_index=step_index)
        builder.add_prompt(chat_prompt_ids(self.tokenizer, prompt))
        return builder

    def _finish(self, slot: _Slot) -> list[Rollout]:
        record = slot.stepper.record
        episode = record.as_dict() if record is not None else {}
        outcome = record.outcome() if record is not None else None
        return [b.finish(episode, outcome) for b in (*slot.finished, slot.builder)]

    # ------------------------------------------------------------------ steps of a wave
    def _submit_generation(self, wave: _Wave, submit) -> None:
        active = wave.active()
        if not active:
            return
        # One engine call per wave, capped by the largest remaining budget; an episode with less
        # budget left keeps only the prefix of its sample that fits (still exact sampled ids).
        cap = min(self.config.max_turn_tokens, max(self._room(s) for s in active))
        stop = list(active[0].stepper.stop_strings or ())
        wave.generating = active
        sampling = self.sampling
        if sampling is not None and sampling.seed is not None:
            # Engines seed prompt i of a call from (seed, i); key the call's seed by wave and turn
            # so two copies of a question in different waves never share a random stream, and a
            # rerun (or a resumed run) draws exactly the same samples.
            sampling = replace(sampling, seed=derive_seed(sampling.seed, 1000 * wave.index + wave.turn))
        wave.turn += 1
        prompts = [list(s.builder.rollout.token_ids) for s in active]
        submit(wave, "generate", self.backend.submit_generate(prompts, sampling, stop, cap))

    def _apply_generation(self, wave: _Wave, results) -> None:
        wave.requests = []
        group: list[_Slot] = wave.generating
        if len(results) != len(group):
            raise RuntimeError(f"engine returned {len(results)} results for {len(group)} prompts")
        for slot, res in zip(group, results):
            ids, logprobs, finish = list(res.token_ids), list(res.logprobs), res.finish_reason
            room = self._room(slot)
            if len(ids) > room:
                ids, logprobs, finish = ids[:room], logprobs[:room], "length"
            text = slot.builder.add_model_turn(ids, logprobs, finish_reason=finish,
                                               weight_version=getattr(res, "weight_version", 0))
            slot.used += len(ids)
            outcome = slot.stepper.begin_step(text)
            if isinstance(outcome, RetrievalRequest):
                wave.requests.append((slot, outcome))
            else:
                self._after_step(slot, outcome)

    def _apply_retrieval(self, wave: _Wave, results) -> None:
        for (slot, request), result in zip(wave.requests, results):
            self._after_step(slot, slot.stepper.finish_step(request, result))
        wave.requests = []

    def _sequence_room(self, builder: RolloutBuilder) -> int | None:
        """Tokens the model context can still take (None: no sequence cap)."""
        cap = self.config.max_sequence_tokens
        return None if cap is None else cap - len(builder.rollout.token_ids)

    def _room(self, slot: _Slot) -> int:
        """Model tokens the next turn may sample: the response budget, within the sequence cap."""
        sequence = self._sequence_room(slot.builder)
        budget = slot.builder.response_budget_left
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
        if self.config.max_response_tokens - slot.used <= 0:
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
            if room is not None:  # keep only the part of the observation that fits the context
                builder.max_observation_tokens = max(0, min(observation_cap, room))
            try:
                builder.add_observation(observation)
            finally:
                builder.max_observation_tokens = observation_cap
        room = self._sequence_room(slot.builder)
        if room is not None and room <= 0:
            self._end_by_length(slot, "sequence_tokens")


__all__ = ["EpisodeRequest", "LocalBackend", "MultiTurnRollout", "RolloutConfig"]
