"""``MultiKBRouteEnv``: R1-Router's step-wise routing across several knowledge bases.

R1-Router (Peng et al., 2025) calls the model with a fresh prompt at every step rather than
growing one transcript, so each observation here is the *complete* input for the next model
call. An episode cycles through three phases:

1. ``route``: given the question and the sub-questions answered so far, the model writes
   ``<think>…</think><sub-question>…</sub-question><ret>KB</ret>``. The environment retrieves the
   top-k documents for the sub-question from that knowledge base.
2. ``answer``: the model sees only the sub-question and this step's documents and writes
   ``<think>…</think><answer>…</answer>``, the intermediate answer.
3. after at most ``max_route_steps`` routing steps (3, as in the paper), or as soon as the model
   routes ``None``/``None``, ``final``: the model sees the question with every sub-question and
   intermediate answer and writes the final ``<answer>``. That terminates the episode.

Malformed output never raises. In the ``route`` phase it costs one routing step and the same
prompt is shown again with a note on what was wrong; in the ``answer`` phase the intermediate
answer is recorded as missing and routing continues; in the ``final`` phase the episode is
truncated without an answer. Every model call is kept as a ``RouteStepRecord`` (context, output,
knowledge base, documents, gold values where the question's golden trajectory has them), which is
what Step-GRPO groups by step.

Gold values are read from ``Question.golden_trajectory[i]`` for routing step ``i``: the
sub-question from ``"sub_question"`` (or ``"query"``), the knowledge base from
``"knowledge_base"`` (or ``"kb"``) and the intermediate answer from ``"answer"``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import gymnasium as gym

from envs.questions import QuestionPicker, QuestionSource, gold_passage_texts
from envs.records import RouteEpisodeRecord, RouteStepRecord
from envs.retriever import Retriever, check_retriever
from envs.rewards import exact_match_reward
from envs.spaces import UnicodeText
from envs.stepping import RetrievalRequest, StepResult, retrieve_one
from raggym.data.types import Question
from raggym.protocol import ANSWER, ROUTE, R1RouterDialect
from raggym.protocol.action import Action, invalid
from raggym.retrieval.base import MODES

ROUTE_PHASE = "route"
ANSWER_PHASE = "answer"
FINAL_PHASE = "final"

NO_ANSWER = "unknown"  # shown in later prompts when an intermediate answer was malformed


class MultiKBRouteEnv(gym.Env):
    """Gymnasium environment for R1-Router-style routing between knowledge bases.

    Parameters
    ----------
    knowledge_bases:
        Knowledge-base name -> retriever over that base's own corpus, for example
        ``{"Text Retriever": text_retriever, "Table Retriever": table_retriever}``. The names are
        what the model writes inside ``<ret>``.
    questions:
        As for ``RagSearchEnv``: a sequence of ``Question`` or a callable ``rng -> Question``.
    knowledge_base_modes:
        Retrieval mode per knowledge base (default ``passage`` for all; a table base holds
        flattened tables as passages).
    gold_knowledge_base_names:
        Maps the knowledge-base labels of golden trajectories to this environment's names (the
        synthetic world labels steps ``"text"`` and ``"table"``), for the recorded gold routes.
    top_k, max_route_steps:
        Documents per routing step (3) and the cap on routing steps (3).
    reward_fn:
        ``reward_fn(RouteEpisodeRecord) -> float`` at the end; exact match by default.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self,
        knowledge_bases: Mapping[str, Retriever],
        questions: QuestionSource | None = None,
        *,
        knowledge_base_modes: Mapping[str, str] | None = None,
        gold_knowledge_base_names: Mapping[str, str] | None = None,
        top_k: int = 3,
        max_route_steps: int = 3,
        reward_fn: Callable[[RouteEpisodeRecord], float] | None = None,
        corpus: Any = None,
        question_order: str = "random",
        max_segment_chars: int = 16_384,
        max_observation_chars: int = 16_384,
        render_mode: str | None = None,
    ):
        if not knowledge_bases:
            raise ValueError("MultiKBRouteEnv needs at least one knowledge base")
        for name, retriever in knowledge_bases.items():
            check_retriever(retriever, f"knowledge base {name!r}")
        self.dialect = R1RouterDialect(tuple(knowledge_bases))
        self.knowledge_bases = dict(knowledge_bases)
        modes = {name: "passage" for name in knowledge_bases}
        for name, mode in (knowledge_base_modes or {}).items():
            if name not in modes:
                raise ValueError(f"knowledge_base_modes names unknown knowledge base {name!r}")
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r} for knowledge base {name!r}")
            modes[name] = mode
        self.knowledge_base_modes = modes
        self.gold_knowledge_base_names = dict(gold_knowledge_base_names or {})
        if top_k < 1 or max_route_steps < 1:
            raise ValueError("top_k and max_route_steps must be at least 1")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"unsupported render_mode {render_mode!r}")
        self.questions = questions
        self._questions = QuestionPicker(questions, question_order)
        self.top_k = top_k
        self.max_route_steps = max_route_steps
        self.reward_fn = reward_fn or exact_match_reward
        self.corpus = corpus
        self.max_segment_chars = max_segment_chars
        self.max_observation_chars = max_observation_chars
        self.render_mode = render_mode
        self.observation_space = UnicodeText(max_observation_chars)
        self.action_space = UnicodeText(max_segment_chars, allow_surrogates=True)

        self._record: RouteEpisodeRecord | None = None
        self._phase = ROUTE_PHASE
        self._context = ""
        self._route_steps = 0
        self._history: list[tuple[str, str]] = []
        self._open_route: RouteStepRecord | None = None

    # ------------------------------------------------------------------ API

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.dialect.stop_strings

    @property
    def record(self) -> RouteEpisodeRecord | None:
        return self._record

    @property
    def phase(self) -> str:
        """Phase of the next model call: ``route``, ``answer`` or ``final``."""
        return self._phase

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        question = self._questions.pick(options, self.np_random)
        self._record = RouteEpisodeRecord(question=question, gold_passages=gold_passage_texts(self.corpus, question))
        self._phase = ROUTE_PHASE
        self._route_steps = 0
        self._history = []
        self._open_route = None
        self._context = self._fit(self.dialect.routing_prompt(question.question, self._history))
        return self._context, {"question_id": question.id, "phase": self._phase}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self._check_step_call(action)
        outcome = self._begin_step(action)
        if isinstance(outcome, RetrievalRequest):
            outcome = self._finish_step(outcome, retrieve_one(outcome))
        return tuple(outcome)  # type: ignore[return-value]

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self._record is None:
            return None
        return "\n".join(f"[{s.phase}] {s.context}{s.output}" for s in self._record.steps)

    # ------------------------------------------------------- two-phase step

    def _check_step_call(self, action: Any) -> None:
        if self._record is None:
            raise RuntimeError("call reset() before step()")
        if self._record.terminated or self._record.truncated:
            raise RuntimeError("the episode is over (terminated or truncated); call reset() first")
        if not isinstance(action, str):
            raise TypeError(f"step() expects the model output as str, got {type(action).__name__}")

    def _begin_step(self, output: str) -> StepResult | RetrievalRequest:
        if len(output) > self.max_segment_chars:
            action = invalid(f"output longer than {self.max_segment_chars} characters")
        else:
            action = self.dialect.parse(output)
        if self._phase == ROUTE_PHASE:
            return self._route_step(output, action)
        if self._phase == ANSWER_PHASE:
            return self._intermediate_answer_step(output, action)
        return self._final_step(output, action)

    def _route_step(self, output: str, action: Action) -> StepResult | RetrievalRequest:
        if action.kind == ROUTE and action.query is not None:
            kb = action.mode
            return RetrievalRequest(
                self, self.knowledge_bases[kb], self.knowledge_base_modes[kb], self.top_k, action.query, output, action
            )
        step = self._new_step(ROUTE_PHASE, output, action)
        if action.kind == ROUTE:  # None/None: enough information, go to the final answer
            return self._advance(step, FINAL_PHASE)
        error = action.error or "unknown error"
        if action.kind == ANSWER:
            error = "this is a routing step: write a <sub-question> and a <ret>, or None for both"
        self._mark_format_error(step, error)
        self._route_steps += 1
        if self._route_steps >= self.max_route_steps:
            return self._advance(step, FINAL_PHASE)
        self._record.steps.append(step)
        prompt = self.dialect.routing_prompt(self._record.question.question, self._history)
        self._context = self._fit(prompt + "\n" + self.dialect.render_error(error))
        return self._result(step, 0.0, False, False)

    def _finish_step(self, request: RetrievalRequest, result) -> StepResult:
        record = self._record
        hits = result.hits
        step = self._new_step(ROUTE_PHASE, request.segment, request.action)
        step.knowledge_base = request.action.mode
        step.sub_question = request.query
        step.retrieved_ids = tuple([h.id for h in hits])
        step.retrieved_titles = tuple([h.title for h in hits])
        step.retrieved_texts = tuple([h.text for h in hits])
        step.seconds = float(result.seconds)
        step.cost = float(result.cost)
        record.num_retrievals += 1
        record.retrieval_seconds += step.seconds
        record.retrieval_cost += step.cost
        self._route_steps += 1
        self._open_route = step
        record.steps.append(step)
        self._phase = ANSWER_PHASE
        empty = self.dialect.intermediate_answer_prompt(request.query, "")
        documents = self.dialect.render_observation(hits, max_chars=max(0, self.max_observation_chars - len(empty)))
        self._context = self._fit(self.dialect.intermediate_answer_prompt(request.query, documents))
        return self._result(step, 0.0, False, False)

    def _intermediate_answer_step(self, output: str, action: Action) -> StepResult:
        route = self._open_route
        step = self._new_step(ANSWER_PHASE, output, action)
        step.sub_question = route.sub_question
        step.knowledge_base = route.knowledge_base
        if action.kind == ANSWER:
            step.answer = action.answer
        else:
            self._mark_format_error(step, action.error or "expected <think>…</think><answer>…</answer>")
        self._history.append((route.sub_question, step.answer if step.answer is not None else NO_ANSWER))
        self._open_route = None
        next_phase = FINAL_PHASE if self._route_steps >= self.max_route_steps else ROUTE_PHASE
        return self._advance(step, next_phase)

    def _final_step(self, output: str, action: Action) -> StepResult:
        record = self._record
        step = self._new_step(FINAL_PHASE, output, action)
        record.steps.append(step)
        if action.kind == ANSWER:
            step.answer = action.answer
            record.answer = action.answer
            record.terminated = True
            self._context = ""
            return self._result(step, self._final_reward(), True, False)
        self._mark_format_error(step, action.error or "expected <think>…</think><answer>…</answer>")
        record.truncated = True
        record.truncation_reason = "invalid_final_answer"
        self._context = ""
        return self._result(step, self._final_reward(), False, True)

    # -------------------------------------------------------------- helpers

    def _new_step(self, phase: str, output: str, action: Action) -> RouteStepRecord:
        record = self._record
        # Answer steps belong to the routing step they answer; routing steps to the next one.
        route_index = self._route_steps - 1 if phase == ANSWER_PHASE else self._route_steps
        step = RouteStepRecord(
            index=len(record.steps),
            phase=phase,
            route_step=route_index,
            context=self._context,
            output=output,
            action=action,
        )
        if phase == FINAL_PHASE:
            step.gold_answer = record.question.answer
        else:
            gold = _golden_step(record.question, route_index)
            step.gold_sub_question = gold.get("sub_question", gold.get("query"))
            gold_kb = gold.get("knowledge_base", gold.get("kb"))
            step.gold_knowledge_base = self.gold_knowledge_base_names.get(gold_kb, gold_kb)
            step.gold_answer = gold.get("answer")
        return step

    def _mark_format_error(self, step: RouteStepRecord, error: str) -> None:
        step.format_error = True
        step.error = error
        self._record.num_format_errors += 1

    def _advance(self, step: RouteStepRecord, next_phase: str) -> StepResult:
        """Record ``step`` and show the prompt of ``next_phase``."""
        self._record.steps.append(step)
        self._phase = next_phase
        question = self._record.question.question
        if next_phase == FINAL_PHASE:
            prompt = self.dialect.final_answer_prompt(question, self._history)
        else:
            prompt = self.dialect.routing_prompt(question, self._history)
        self._context = self._fit(prompt)
        return self._result(step, 0.0, False, False)

    def _fit(self, text: str) -> str:
        return text[: self.max_observation_chars]

    def _final_reward(self) -> float:
        reward = float(self.reward_fn(self._record))
        self._record.reward = reward
        return reward

    def _result(self, step: RouteStepRecord, reward: float, terminated: bool, truncated: bool) -> StepResult:
        record = self._record
        info = {
            "turn": step.index,
            "phase": step.phase,
            "next_phase": self._phase if not (terminated or truncated) else None,
            "route_step": step.route_step,
            "action_kind": step.action.kind,
            "knowledge_base": step.knowledge_base,
            "mode": step.knowledge_base,
            "sub_question": step.sub_question,
            "query": step.sub_question if step.phase == ROUTE_PHASE else None,
            "retrieved_ids": step.retrieved_ids,
            "retrieved_titles": step.retrieved_titles,
            "retrieved_texts": step.retrieved_texts,
            "retrieval_seconds": step.seconds,
            "retrieval_cost": step.cost,
            "format_valid": not step.format_error,
            "format_error": step.format_error,
            "parse_error": step.error,
            "intermediate_answer": step.answer if step.phase == ANSWER_PHASE else None,
            "answer": record.answer,
            "total_retrieval_seconds": record.retrieval_seconds,
            "total_retrieval_cost": record.retrieval_cost,
            "num_retrievals": record.num_retrievals,
            "truncation_reason": record.truncation_reason,
            "question_id": record.question.id,
        }
        if terminated or truncated:
            info["episode"] = record
        return StepResult(self._context, reward, terminated, truncated, info)


def _golden_step(question: Question, index: int) -> Mapping[str, Any]:
    trajectory = question.golden_trajectory
    if 0 <= index < len(trajectory) and isinstance(trajectory[index], Mapping):
        return trajectory[index]
    return {}
