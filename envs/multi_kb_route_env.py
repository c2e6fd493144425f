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
   writes the sub-question ``None`` (the paper's stop condition, whatever ``<ret>`` holds), ``final``: the model sees the question with every sub-question and
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

Each observation is the complete next prompt, so ``context_mode = "replace"``; the environment
implements the batched-step protocol of ``envs.stepping``.

Teacher forcing (Step-GRPO)
---------------------------
R1-Router's Step-GRPO samples every step of a question from the same input, conditioned on the
*golden* prefix, and groups the samples by (question, step). ``reset(options={"question": q,
"golden_prefix": i, "phase": p})`` starts such a one-call episode:

* ``route``, ``0 <= i <= n`` (``n`` golden steps): the routing prompt with the golden sub-questions
  and answers of steps ``< i``. The gold is golden step ``i``; for ``i == n`` it is the stop action
  (``"None"`` sub-question and knowledge base), the only place a ``None`` gold is legitimate; Eq. 11
  has no such group, so ``golden_step_options`` lists it only on request. The environment does not
  retrieve for the sampled route: the next step's input is golden anyway.
* ``answer``, ``0 <= i < n``: the intermediate-answer prompt for golden sub-question ``i`` with the
  documents retrieved for it, at reset, from golden step ``i``'s knowledge base. The retrieval is
  counted in the record and its documents are stored on the answer step.
* ``final``, ``i == n``: the final-answer prompt with the whole golden history.

The episode ends after the one model call: terminated when the output is well formed for the
phase, truncated otherwise (``truncation_reason`` ``invalid_route``, ``invalid_intermediate_answer``
or ``invalid_final_answer``); either way ``reward_fn(record)`` is called once, with
``record.steps[0]`` holding the output and its gold values. ``golden_step_options(q)`` lists the
reset options of every step of a question (each with a ``step_index``) and, like a teacher-forced
reset, raises ``ValueError`` naming the question when a golden step lacks a sub-question,
knowledge base or answer. ``max_route_steps`` caps free-running episodes only: a golden
trajectory longer than the cap is still taught step by step. Without those options an episode
runs free, as described above.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from envs.questions import QuestionSource, gold_passage_texts
from envs.records import RouteEpisodeRecord, RouteStepRecord
from envs.retriever import Retriever, check_retriever
from envs.stepping import (
    REPLACE_CONTEXT,
    BatchedStepEnv,
    RetrievalRequest,
    StepResult,
    episode_info,
    retrieve_single,
    turn_retrieval_info,
)
from raggym.data.types import Question
from raggym.protocol import ANSWER, ROUTE, R1RouterDialect
from raggym.protocol.action import Action, invalid
from raggym.protocol.r1_router import STOP_WORD
from raggym.retrieval.base import MODES

ROUTE_PHASE = "route"
ANSWER_PHASE = "answer"
FINAL_PHASE = "final"
PHASES = (ROUTE_PHASE, ANSWER_PHASE, FINAL_PHASE)

NO_ANSWER = "unknown"  # shown in later prompts when an intermediate answer was malformed

# Why a step's output was rejected, and the truncation reason when that ends the episode.
ROUTE_EXPECTED = "this is a routing step: write a <sub-question> and a <ret>, or the sub-question None to stop"
ANSWER_EXPECTED = "expected <think>…</think><answer>…</answer>"
INVALID_OUTPUT_REASONS = {
    ROUTE_PHASE: "invalid_route",
    ANSWER_PHASE: "invalid_intermediate_answer",
    FINAL_PHASE: "invalid_final_answer",
}


class MultiKBRouteEnv(BatchedStepEnv):
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
    context_mode = REPLACE_CONTEXT

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
        self._init_shared_settings(
            questions=questions, question_order=question_order, top_k=top_k, reward_fn=reward_fn, corpus=corpus,
            max_segment_chars=max_segment_chars, max_observation_chars=max_observation_chars,
            observation_space_chars=max_observation_chars, render_mode=render_mode,
        )
        self.max_route_steps = max_route_steps

        self._record: RouteEpisodeRecord | None = None
        self._phase = ROUTE_PHASE
        self._context = ""
        self._route_steps = 0
        self._history: list[tuple[str, str]] = []
        self._open_route: RouteStepRecord | None = None
        # Teacher forcing: the validated golden steps, their knowledge bases under this
        # environment's names, and the retrieval an answer step is shown.
        self._golden: list[dict[str, str]] = []
        self._golden_knowledge_bases: list[str] = []
        self._forced_retrieval = None

    # ------------------------------------------------------------------ API

    @property
    def phase(self) -> str:
        """Phase of the next model call: ``route``, ``answer`` or ``final``."""
        return self._phase

    @staticmethod
    def golden_step_options(question: Question, *, stop_route_group: bool = False) -> list[dict[str, Any]]:
        """The ``reset`` options of every teacher-forced step of ``question``, in episode order.

        Route 0, answer 0, route 1, answer 1, …, answer n−1, final: the ``2n + 1`` step groups of
        R1-Router's Eq. 11. ``stop_route_group`` adds route n, whose gold is the stop action,
        before the final answer (``2n + 2``): it trains the decision to stop, which Eq. 11 has no
        group for (``advantage.stop_route_group`` in a training config, off by default). Each
        dict has the keys ``question``, ``phase``, ``golden_prefix`` and ``step_index`` (the dict's
        position in this list, the step part of a Step-GRPO group key). ``ValueError`` naming the
        question when it has no usable golden steps (see ``golden_steps``).
        """
        n = len(golden_steps(question))
        phases = [(phase, i) for i in range(n) for phase in (ROUTE_PHASE, ANSWER_PHASE)]
        phases += [(ROUTE_PHASE, n), (FINAL_PHASE, n)] if stop_route_group else [(FINAL_PHASE, n)]
        return [
            {"question": question, "phase": phase, "golden_prefix": i, "step_index": index}
            for index, (phase, i) in enumerate(phases)
        ]

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        question = self._questions.pick(options, self.np_random)
        self._record = RouteEpisodeRecord(question=question, gold_passages=gold_passage_texts(self.corpus, question))
        self._route_steps = 0
        self._history = []
        self._open_route = None
        self._golden, self._golden_knowledge_bases, self._forced_retrieval = [], [], None
        forcing = _teacher_forcing(options)
        if forcing is None:
            self._phase = ROUTE_PHASE
            self._context = self._fit(self.dialect.routing_prompt(question.question, self._history))
            return self._context, {"question_id": question.id, "phase": self._phase}
        phase, prefix, step_index = forcing
        try:
            self._teacher_force(question, phase, prefix, step_index)
        except BaseException:
            self._record = None  # a half-built episode must not be steppable
            raise
        info = {"question_id": question.id, "phase": phase, "golden_prefix": prefix, "step_index": step_index}
        return self._context, info

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self._record is None:
            return None
        return "\n".join(f"[{s.phase}] {s.context}{s.output}" for s in self._record.steps)

    # ------------------------------------------------------- two-phase step

    def begin_step(self, output: str) -> StepResult | RetrievalRequest:
        if len(output) > self.max_segment_chars:
            action = invalid(f"output longer than {self.max_segment_chars} characters")
        else:
            action = self.dialect.parse(output)
        if self._phase == FINAL_PHASE:
            return self._final_step(output, action)
        if self._record.teacher_forced_phase is not None:
            return self._teacher_forced_step(output, action)
        if self._phase == ROUTE_PHASE:
            return self._route_step(output, action)
        return self._intermediate_answer_step(output, action)

    def _route_step(self, output: str, action: Action) -> StepResult | RetrievalRequest:
        if action.kind == ROUTE and action.query is not None:
            kb = action.mode
            return RetrievalRequest(
                self, self.knowledge_bases[kb], self.knowledge_base_modes[kb], self.top_k, action.query, output, action
            )
        step = self._new_step(ROUTE_PHASE, output, action)
        if action.kind == ROUTE:  # sub-question None: enough information, go to the final answer
            return self._advance(step, FINAL_PHASE)
        error = ROUTE_EXPECTED if action.kind == ANSWER else action.error or "unknown error"
        self._mark_format_error(step, error)
        self._route_steps += 1
        if self._route_steps >= self.max_route_steps:
            return self._advance(step, FINAL_PHASE)
        self._record.steps.append(step)
        prompt = self.dialect.routing_prompt(self._record.question.question, self._history)
        self._context = self._fit(prompt + "\n" + self.dialect.render_error(error))
        return self._result(step, 0.0, False, False)

    def finish_step(self, request: RetrievalRequest, result) -> StepResult:
        record = self._record
        step = self._new_step(ROUTE_PHASE, request.segment, request.action)
        step.knowledge_base = request.action.mode
        step.sub_question = request.query
        self._count_retrieval(result)
        self._attach_documents(step, result)
        self._route_steps += 1
        self._open_route = step
        record.steps.append(step)
        self._phase = ANSWER_PHASE
        self._context = self._answer_context(request.query, result.hits)
        return self._result(step, 0.0, False, False)

    def _intermediate_answer_step(self, output: str, action: Action) -> StepResult:
        route = self._open_route
        step = self._new_step(ANSWER_PHASE, output, action)
        step.sub_question = route.sub_question
        step.knowledge_base = route.knowledge_base
        if action.kind == ANSWER:
            step.answer = action.answer
        else:
            self._mark_format_error(step, action.error or ANSWER_EXPECTED)
        self._history.append((route.sub_question, step.answer if step.answer is not None else NO_ANSWER))
        self._open_route = None
        next_phase = FINAL_PHASE if self._route_steps >= self.max_route_steps else ROUTE_PHASE
        return self._advance(step, next_phase)

    def _final_step(self, output: str, action: Action) -> StepResult:
        record = self._record
        step = self._new_step(FINAL_PHASE, output, action)
        if action.kind == ANSWER:
            step.answer = action.answer
            record.answer = action.answer
        return self._end_with(step, action.kind == ANSWER, action.error or ANSWER_EXPECTED)

    def _teacher_forced_step(self, output: str, action: Action) -> StepResult:
        """The one model call of a teacher-forced ``route`` or ``answer`` episode."""
        step = self._new_step(self._phase, output, action)
        if self._phase == ROUTE_PHASE:
            if action.kind == ROUTE and action.query is not None:
                step.knowledge_base = action.mode
                step.sub_question = action.query
            error = ROUTE_EXPECTED if action.kind == ANSWER else action.error or "unknown error"
            return self._end_with(step, action.kind == ROUTE, error)
        step.sub_question = step.gold_sub_question
        step.knowledge_base = step.gold_knowledge_base
        self._attach_documents(step, self._forced_retrieval)
        if action.kind == ANSWER:
            step.answer = action.answer
        return self._end_with(step, action.kind == ANSWER, action.error or ANSWER_EXPECTED)

    def _end_with(self, step: RouteStepRecord, well_formed: bool, error: str) -> StepResult:
        """Record the episode's last step: terminated if well formed, else truncated."""
        record = self._record
        record.steps.append(step)
        self._context = ""
        if well_formed:
            record.terminated = True
        else:
            self._mark_format_error(step, error)
            record.truncated = True
            record.truncation_reason = INVALID_OUTPUT_REASONS[step.phase]
        return self._result(step, self._terminal_reward(), record.terminated, record.truncated)

    # ------------------------------------------------------- teacher forcing

    def _teacher_force(self, question: Question, phase: str, prefix: int, step_index: int | None) -> None:
        steps = golden_steps(question)
        n = len(steps)
        highest = n - 1 if phase == ANSWER_PHASE else n
        lowest = n if phase == FINAL_PHASE else 0
        if not lowest <= prefix <= highest:
            raise ValueError(
                f"golden_prefix {prefix} is out of range for the {phase} phase of {describe_question(question)}, "
                f"which has {n} golden steps (route: 0..n, answer: 0..n-1, final: n)"
            )
        self._golden = steps
        self._golden_knowledge_bases = [
            self._knowledge_base_for(question, i, step["knowledge_base"]) for i, step in enumerate(steps)
        ]
        record = self._record
        record.teacher_forced_phase, record.golden_prefix, record.golden_step_index = phase, prefix, step_index
        self._history = [(step["sub_question"], step["answer"]) for step in steps[:prefix]]
        self._phase = phase
        # _new_step numbers routing steps by _route_steps and answer steps by _route_steps - 1.
        self._route_steps = prefix + 1 if phase == ANSWER_PHASE else prefix
        text = question.question
        if phase == ROUTE_PHASE:
            self._context = self._fit(self.dialect.routing_prompt(text, self._history))
        elif phase == FINAL_PHASE:
            self._context = self._fit(self.dialect.final_answer_prompt(text, self._history))
        else:
            sub_question, kb = steps[prefix]["sub_question"], self._golden_knowledge_bases[prefix]
            result = retrieve_single(self.knowledge_bases[kb], sub_question, self.knowledge_base_modes[kb], self.top_k)
            self._count_retrieval(result)
            self._forced_retrieval = result
            self._context = self._answer_context(sub_question, result.hits)

    def _knowledge_base_for(self, question: Question, index: int, label: str) -> str:
        """This environment's name for a golden step's knowledge-base label."""
        name = self.gold_knowledge_base_names.get(label, label)
        matches = [kb for kb in self.knowledge_bases if kb.lower() == name.lower()]
        if not matches:
            raise ValueError(
                f"{describe_question(question)}: golden step {index} routes to knowledge base {label!r}, which this "
                f"environment does not have ({', '.join(self.knowledge_bases)}); map it with gold_knowledge_base_names"
            )
        return matches[0]

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
        elif record.teacher_forced_phase is not None:
            if route_index == len(self._golden):  # route n: the gold is to stop
                step.gold_sub_question = step.gold_knowledge_base = STOP_WORD
            else:
                gold = self._golden[route_index]
                step.gold_sub_question, step.gold_answer = gold["sub_question"], gold["answer"]
                step.gold_knowledge_base = self._golden_knowledge_bases[route_index]
        else:
            gold = _golden_step(record.question, route_index)
            step.gold_sub_question = gold.get("sub_question", gold.get("query"))
            gold_kb = gold.get("knowledge_base", gold.get("kb"))
            step.gold_knowledge_base = self.gold_knowledge_base_names.get(gold_kb, gold_kb)
            step.gold_answer = gold.get("answer")
        return step

    def _answer_context(self, sub_question: str, hits) -> str:
        """The intermediate-answer prompt with as many of ``hits`` as fit."""
        empty = self.dialect.intermediate_answer_prompt(sub_question, "")
        documents = self.dialect.render_observation(hits, max_chars=max(0, self.max_observation_chars - len(empty)))
        return self._fit(self.dialect.intermediate_answer_prompt(sub_question, documents))

    def _count_retrieval(self, result) -> None:
        record = self._record
        record.num_retrievals += 1
        record.retrieval_seconds += float(result.seconds)
        record.retrieval_cost += float(result.cost)

    @staticmethod
    def _attach_documents(step: RouteStepRecord, result) -> None:
        hits = result.hits
        step.retrieved = True
        step.retrieved_ids = tuple([h.id for h in hits])
        step.retrieved_titles = tuple([h.title for h in hits])
        step.retrieved_texts = tuple([h.text for h in hits])
        step.seconds = float(result.seconds)
        step.cost = float(result.cost)

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

    def _result(self, step: RouteStepRecord, reward: float, terminated: bool, truncated: bool) -> StepResult:
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
            **turn_retrieval_info(step),
            "parse_error": step.error,
            "intermediate_answer": step.answer if step.phase == ANSWER_PHASE else None,
            **episode_info(self._record),
        }
        if terminated or truncated:
            info["episode"] = self._record
        return StepResult(self._context, reward, terminated, truncated, info)

    def _truncation_result(self, reward: float) -> StepResult:
        # No model call ran: the info holds the episode-level keys of a step's info and the record.
        self._context = ""
        info = {**episode_info(self._record), "next_phase": None, "episode": self._record}
        return StepResult("", reward, False, True, info)


def describe_question(question: Question) -> str:
    """``question 'id'`` plus the dataset or kind it came from, for error messages."""
    text = f"question {question.id!r}"
    dataset = question.metadata.get("dataset") if isinstance(question.metadata, Mapping) else None
    if dataset:
        text += f" of dataset {dataset!r}"
    if question.kind:
        text += f" (kind {question.kind!r})"
    return text


def golden_steps(question: Question) -> list[dict[str, str]]:
    """``question.golden_trajectory`` as ``{"sub_question", "knowledge_base", "answer"}`` steps.

    Accepts the ``query``/``kb`` spellings of the synthetic world and the MuSiQue loader. Raises
    ``ValueError`` naming the question when it has no golden steps or a step lacks one of the
    three (or names ``None`` as its sub-question or knowledge base): Step-GRPO rewards every step
    against these golds, and a missing gold must never be rewarded silently.
    """
    trajectory = question.golden_trajectory
    if not trajectory:
        raise ValueError(
            f"{describe_question(question)} has no golden steps, which R1-Router's teacher-forced "
            "Step-GRPO needs (synthetic-world questions carry them; raggym.data.load_questions "
            "derives them from MuSiQue's question_decomposition)"
        )
    steps = []
    for i, raw in enumerate(trajectory):
        raw = raw if isinstance(raw, Mapping) else {}
        step = {
            "sub_question": raw.get("sub_question", raw.get("query")),
            "knowledge_base": raw.get("knowledge_base", raw.get("kb")),
            "answer": raw.get("answer"),
        }
        missing = [
            name.replace("_", " ")
            for name, value in step.items()
            if not isinstance(value, str) or not value.strip()
            or (name != "answer" and value.strip().lower() == STOP_WORD.lower())
        ]
        if missing:
            raise ValueError(
                f"{describe_question(question)}: golden step {i} has no {' and no '.join(missing)}; "
                "a None gold must never be rewarded silently"
            )
        steps.append(step)
    return steps


def _teacher_forcing(options: Mapping | None) -> tuple[str, int, int | None] | None:
    """(phase, golden_prefix, step_index) from reset options, or ``None`` for a free-running episode."""
    if not options or (options.get("phase") is None and options.get("golden_prefix") is None):
        return None
    phase, prefix, step_index = options.get("phase"), options.get("golden_prefix"), options.get("step_index")
    if phase not in PHASES:
        raise ValueError(f'options["phase"] must be one of {PHASES} with a golden_prefix, got {phase!r}')
    for name, value in (("golden_prefix", prefix), ("step_index", step_index)):
        if (value is not None or name == "golden_prefix") and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f'options["{name}"] must be an int, got {value!r}')
    return phase, prefix, step_index


def _golden_step(question: Question, index: int) -> Mapping[str, Any]:
    trajectory = question.golden_trajectory
    if 0 <= index < len(trajectory) and isinstance(trajectory[index], Mapping):
        return trajectory[index]
    return {}
