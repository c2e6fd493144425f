"""The multi-turn rollout loop: engine turns and environment steps, token-in-token-out.

One loop serves every setting. A *backend* says how generation and retrieval run:

- ``LocalBackend``: an engine object and the environments' own retrievers, in this process;
- ``RayBackend`` (``actors.env_runner``): rollout-worker actors and the retrieval-service actor,
  called asynchronously so that one wave's retrieval overlaps another wave's generation.

The episodes are split into ``waves``. Each wave alternates: generate one segment for its
active episodes -> parse them (``env._begin_step``) -> retrieve for those that searched ->
apply results (``env._finish_step``) -> append observation tokens -> generate again. With two or
more waves in flight, the loop always has work for both the engine and the retriever.

The token rules (exact sampled ids kept, observations tokenized once, loss mask 0 on prompt and
observation tokens, response and observation caps) live in ``raggym.trajectory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from actors.engines.base import derive_seed
from envs.stepping import RetrievalRequest
from raggym.trajectory import Trajectory, TrajectoryBuilder


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the chat template renders a single user message, ready for generation."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class RolloutConfig:
    max_response_tokens: int = 512  # model tokens per trajectory, all turns together
    max_turn_tokens: int = 256  # model tokens per segment
    max_observation_tokens: int = 512  # tokens kept of each observation
    waves: int = 2  # sub-batches in flight (pipelining generation against retrieval)


@dataclass
class _Slot:
    env: Any
    builder: TrajectoryBuilder
    prompt_text: str
    done: bool = False
    pending: RetrievalRequest | None = None


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
    """Run episodes to completion and return their ``Trajectory`` objects."""

    def __init__(self, backend, tokenizer, sampling=None, config: RolloutConfig | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.config = config or RolloutConfig()

    def run(self, envs: Sequence[Any], questions: Sequence[Any], group_ids: Sequence[str] | None = None,
            sample_indices: Sequence[int] | None = None) -> list[Trajectory]:
        if len(envs) != len(questions):
            raise ValueError(f"{len(envs)} environments but {len(questions)} questions")
        cfg = self.config
        group_ids = list(group_ids) if group_ids is not None else [q.id for q in questions]
        sample_indices = list(sample_indices) if sample_indices is not None else [0] * len(envs)
        slots = []
        for env, question, gid, si in zip(envs, questions, group_ids, sample_indices):
            prompt, _ = env.reset(options={"question": question})
            dialect = getattr(getattr(env, "dialect", None), "name", None) or "routerag"
            builder = TrajectoryBuilder(self.tokenizer, dialect, gid, si, cfg.max_response_tokens, cfg.max_observation_tokens)
            builder.add_prompt(chat_prompt_ids(self.tokenizer, prompt))
            slots.append(_Slot(env, builder, prompt))
        n_waves = max(1, min(cfg.waves, len(slots)))
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
        return [s.builder.finish(_episode_dict(s.env)) for s in slots]

    # ------------------------------------------------------------------ steps of a wave
    def _submit_generation(self, wave: _Wave, submit) -> None:
        active = wave.active()
        if not active:
            return
        # One engine call per wave, capped by the largest remaining budget; an episode with less
        # budget left keeps only the prefix of its sample that fits (still exact sampled ids).
        cap = min(self.config.max_turn_tokens, max(s.builder.response_budget_left for s in active))
        stop = list(getattr(active[0].env, "stop_strings", ()) or ())
        wave.generating = active
        sampling = self.sampling
        if sampling is not None and sampling.seed is not None:
            # Engines seed prompt i of a call from (seed, i); key the call's seed by wave and turn
            # so two copies of a question in different waves never share a random stream, and a
            # rerun (or a resumed run) draws exactly the same samples.
            sampling = replace(sampling, seed=derive_seed(sampling.seed, 1000 * wave.index + wave.turn))
        wave.turn += 1
        submit(wave, "generate", self.backend.submit_generate([list(s.builder.traj.token_ids) for s in active], sampling, stop, cap))

    def _apply_generation(self, wave: _Wave, results) -> None:
        wave.requests = []
        group: list[_Slot] = wave.generating
        if len(results) != len(group):
            raise RuntimeError(f"engine returned {len(results)} results for {len(group)} prompts")
        for slot, res in zip(group, results):
            ids, logprobs, finish = list(res.token_ids), list(res.logprobs), res.finish_reason
            room = slot.builder.response_budget_left
            if len(ids) > room:
                ids, logprobs, finish = ids[:room], logprobs[:room], "length"
            text = slot.builder.add_model_turn(ids, logprobs, finish_reason=finish,
                                               weight_version=getattr(res, "weight_version", 0))
            outcome = slot.env._begin_step(text)
            if isinstance(outcome, RetrievalRequest):
                wave.requests.append((slot, outcome))
            else:
                self._after_step(slot, outcome)

    def _apply_retrieval(self, wave: _Wave, results) -> None:
        for (slot, request), result in zip(wave.requests, results):
            self._after_step(slot, slot.env._finish_step(request, result))
        wave.requests = []

    def _after_step(self, slot: _Slot, step) -> None:
        observation, _, terminated, truncated, _ = step
        if terminated or truncated:
            slot.done = True
            return
        if slot.builder.response_budget_left <= 0:
            # The response cap ends the episode; the record says why, as the env would.
            record = slot.env.record
            record.truncated = True
            record.truncation_reason = "response_tokens"
            if record.reward is None:
                record.reward = float(slot.env.reward_fn(record))
            slot.builder.traj.truncated_by_length = True
            slot.done = True
            return
        slot.builder.add_observation(observation)


def _episode_dict(env) -> dict:
    record = env.record
    return record.as_dict() if record is not None else {}
