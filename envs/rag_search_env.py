"""``RagSearchEnv``: the multi-turn search environment every search dialect runs in.

One episode answers one question. ``reset`` returns the dialect's prompt for it; each ``step``
takes one assistant segment (generation stopped at one of ``env.stop_strings``) and returns the
next observation text to append to the context:

* a search runs the retriever (top-k, default 3) with the segment's mode and query and returns the
  hits in the dialect's observation tags, for example
  ``<information>Doc 1 (Title: …) …</information>``;
* an answer terminates the episode, and the terminal reward is ``reward_fn(episode_record)``;
* anything else (think-only, malformed tags, unknown mode, empty or huge query, …) returns a
  format-error observation in the dialect's tags and sets ``info["format_error"]``.

Searches and format errors both spend the budget of ``retrieval_budget`` turns (B = 4 by default,
as in RouteRAG). The agent may always answer after its B-th search; a further search or malformed
segment truncates the episode instead of running. The episode is also truncated when the
transcript grows past ``max_episode_chars`` or, with a ``token_counter``, ``max_episode_tokens``.
A truncated episode still gets ``reward_fn(record)`` (its answer is ``None``), so timeout
penalties can be expressed there.

The environment never raises on model output. It raises on API misuse: stepping before ``reset``
or after the episode ended, or passing something other than a ``str``.

It implements the batched-step protocol of ``envs.stepping`` (``begin_step``, ``finish_step``,
``truncate``) with ``context_mode = "append"``: every observation extends the running transcript.
"""

from __future__ import annotations

from typing import Any, Callable

from envs.questions import QuestionSource, gold_passage_texts
from envs.records import EpisodeRecord, TurnRecord
from envs.retriever import Retriever, check_retriever
from envs.stepping import (
    APPEND_CONTEXT,
    BatchedStepEnv,
    RetrievalRequest,
    StepResult,
    episode_info,
    turn_retrieval_info,
)
from raggym.data.types import Question
from raggym.protocol import ANSWER, SEARCH, Action, Dialect, get_dialect
from raggym.protocol.action import invalid
from raggym.retrieval.base import MODES

# Reasons recorded in info["truncation_reason"] / EpisodeRecord.truncation_reason.
BUDGET = "retrieval_budget"
CHAR_LIMIT = "char_limit"
TOKEN_LIMIT = "token_limit"


class RagSearchEnv(BatchedStepEnv):
    """Gymnasium environment for multi-turn retrieval-augmented question answering.

    Parameters
    ----------
    retriever:
        Anything with ``retrieve(queries, mode, k) -> list[QueryResult]``.
    questions:
        Where ``reset()`` draws questions when ``options["question"]`` is not given: a sequence
        of ``Question`` (drawn at random with the env's seeded generator, or in order with
        ``question_order="cycle"``) or a callable ``rng -> Question``.
    dialect:
        A dialect name (``routerag``, ``search_r1``, ``graph_r1``, ``lws``, ``graphrag_r1``) or a
        ``Dialect`` instance.
    search_mode:
        Retrieval mode for dialects whose searches carry no mode; defaults to the dialect's own
        (passage for Search-R1 and LWS, graph for Graph-R1 and GraphRAG-R1). RouteRAG searches
        always name their mode.
    allowed_modes:
        Optional subset of ``passage``/``graph``/``hybrid`` the agent may use (single-mode
        ablations, a served request's ``modes``). The prompt describes only these. With exactly
        one allowed mode every search runs in it, whatever mode tag the segment carries (the
        record keeps the mode that ran); with several, a search naming another mode is a format
        error that lists the allowed ones. Dialects without mode syntax accept one mode only.
    top_k, retrieval_budget:
        Hits per search (3) and the budget B of search or format-error turns (4).
    reward_fn:
        ``reward_fn(EpisodeRecord) -> float``, called once when the episode ends; exact match by
        default.
    corpus:
        Optional ``raggym.data.Corpus``; when given, the texts of the question's gold passages are
        stored in the record (``gold_passages``) for evidence-overlap rewards.
    prompt_fn:
        Optional ``prompt_fn(question, dialect) -> str`` replacing the dialect's prompt.
    max_segment_chars, max_observation_chars, max_prompt_chars:
        Bounds of the text spaces. A longer segment is a format error; observations are cut to
        fit; a longer prompt is a data error (``ValueError`` at reset).
    max_episode_chars, max_episode_tokens, token_counter:
        Truncation limits on the whole transcript; tokens are counted with
        ``token_counter(text) -> int`` only when one is given.
    """

    metadata = {"render_modes": ["ansi"]}
    context_mode = APPEND_CONTEXT

    def __init__(
        self,
        retriever: Retriever,
        questions: QuestionSource | None = None,
        dialect: str | Dialect = "routerag",
        *,
        search_mode: str | None = None,
        allowed_modes: Any = None,
        top_k: int = 3,
        retrieval_budget: int = 4,
        reward_fn: Callable[[EpisodeRecord], float] | None = None,
        corpus: Any = None,
        prompt_fn: Callable[[Question, Dialect], str] | None = None,
        question_order: str = "random",
        max_segment_chars: int = 16_384,
        max_observation_chars: int = 8_192,
        max_prompt_chars: int = 16_384,
        max_episode_chars: int = 65_536,
        max_episode_tokens: int | None = None,
        token_counter: Callable[[str], int] | None = None,
        render_mode: str | None = None,
    ):
        check_retriever(retriever)
        self.dialect = get_dialect(dialect)
        if self.dialect.name == "r1_router":
            raise ValueError("the r1_router dialect routes between knowledge bases; use MultiKBRouteEnv")
        self.search_mode = search_mode or self.dialect.default_mode
        if self.search_mode not in MODES:
            raise ValueError(f"unknown search_mode {self.search_mode!r}; expected one of {MODES}")
        self.allowed_modes = self._check_allowed_modes(allowed_modes)
        if self.allowed_modes is not None and not self.dialect.modes:
            self.search_mode = self.allowed_modes[0]
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        if retrieval_budget < 0:
            raise ValueError(f"retrieval_budget must be non-negative, got {retrieval_budget}")
        if (max_episode_tokens is None) != (token_counter is None):
            raise ValueError("max_episode_tokens and token_counter go together")
        self._init_shared_settings(
            questions=questions, question_order=question_order, top_k=top_k, reward_fn=reward_fn, corpus=corpus,
            max_segment_chars=max_segment_chars, max_observation_chars=max_observation_chars,
            observation_space_chars=max(max_observation_chars, max_prompt_chars),  # reset returns the prompt
            render_mode=render_mode,
        )
        self.retriever = retriever
        self.retrieval_budget = retrieval_budget
        self.prompt_fn = prompt_fn
        self.max_prompt_chars = max_prompt_chars
        self.max_episode_chars = max_episode_chars
        self.max_episode_tokens = max_episode_tokens
        self.token_counter = token_counter

        self._record: EpisodeRecord | None = None
        self._budget_used = 0
        self._chars = 0
        self._tokens = 0

    def _check_allowed_modes(self, allowed) -> tuple[str, ...] | None:
        if allowed is None:
            return None
        if isinstance(allowed, str):
            allowed = (allowed,)
        modes = tuple(dict.fromkeys(allowed))
        unknown = [m for m in modes if m not in MODES]
        if not modes or unknown:
            raise ValueError(f"allowed_modes must be a non-empty subset of {MODES}, got {list(allowed)}")
        if not self.dialect.modes and len(modes) > 1:
            raise ValueError(f"the {self.dialect.name} dialect has no mode syntax; allow exactly one mode, got {list(modes)}")
        return modes

    # ------------------------------------------------------------------ API

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        question = self._questions.pick(options, self.np_random)
        if self.prompt_fn is not None:
            prompt = self.prompt_fn(question, self.dialect)
        elif self.allowed_modes is not None and self.dialect.modes:
            prompt = self.dialect.instruction_prompt(question.question, modes=self.allowed_modes)
        else:
            prompt = self.dialect.instruction_prompt(question.question)
        if not isinstance(prompt, str) or len(prompt) > self.max_prompt_chars:
            raise ValueError(
                f"prompt for question {question.id!r} is not a str of at most "
                f"{self.max_prompt_chars} characters"
            )
        self._record = EpisodeRecord(
            question=question,
            dialect=self.dialect,
            prompt=prompt,
            gold_passages=gold_passage_texts(self.corpus, question),
        )
        self._budget_used = 0
        self._chars = len(prompt)
        self._tokens = self.token_counter(prompt) if self.token_counter else 0
        return prompt, {"question_id": question.id, "budget_left": self.retrieval_budget}

    def render(self) -> str | None:
        if self.render_mode == "ansi" and self._record is not None:
            return self._record.transcript()
        return None

    # ------------------------------------------------------- two-phase step

    def begin_step(self, segment: str) -> StepResult | RetrievalRequest:
        if len(segment) > self.max_segment_chars:
            action = invalid(f"segment longer than {self.max_segment_chars} characters")
        else:
            action = self.dialect.parse(segment)
        if action.kind == ANSWER:
            return self._answer_turn(segment, action)
        if self._budget_used >= self.retrieval_budget:
            return self._budget_exhausted_turn(segment, action)
        if action.kind == SEARCH:
            mode = action.mode or self.search_mode
            if self.allowed_modes is not None and mode not in self.allowed_modes:
                if len(self.allowed_modes) == 1:
                    mode = self.allowed_modes[0]
                else:
                    action = invalid(
                        f"retrieval mode {mode} is not available here; use one of {', '.join(self.allowed_modes)}",
                        action.reasoning,
                    )
            if action.kind == SEARCH:
                return RetrievalRequest(self, self.retriever, mode, self.top_k, action.query, segment, action)
        # think-only or invalid: tell the model what went wrong, in the dialect's own tags
        observation = self.dialect.render_error(action.error or "unknown error", self.max_observation_chars)
        turn = TurnRecord(
            index=len(self._record.turns), segment=segment, action=action, observation=observation, format_error=True
        )
        self._budget_used += 1
        self._record.num_format_errors += 1
        return self._close_turn(turn)

    def finish_step(self, request: RetrievalRequest, result) -> StepResult:
        record = self._record
        hits = result.hits
        facts = tuple(result.facts)
        observation = self.dialect.render_observation(hits, facts, self.max_observation_chars)
        turn = TurnRecord(
            index=len(record.turns),
            segment=request.segment,
            action=request.action,
            observation=observation,
            mode=request.mode,
            query=request.query,
            retrieved_ids=tuple([h.id for h in hits]),
            retrieved_titles=tuple([h.title for h in hits]),
            retrieved_texts=tuple([h.text for h in hits]),
            facts=facts,
            seconds=float(result.seconds),
            cost=float(result.cost),
        )
        self._budget_used += 1
        record.num_retrievals += 1
        record.retrieval_seconds += turn.seconds
        record.retrieval_cost += turn.cost
        return self._close_turn(turn)

    def _answer_turn(self, segment: str, action: Action) -> StepResult:
        record = self._record
        turn = TurnRecord(index=len(record.turns), segment=segment, action=action, observation="")
        record.turns.append(turn)
        record.answer = action.answer
        record.terminated = True
        return self._result(turn, self._terminal_reward(), terminated=True, truncated=False)

    def _budget_exhausted_turn(self, segment: str, action: Action) -> StepResult:
        record = self._record
        turn = TurnRecord(
            index=len(record.turns), segment=segment, action=action, observation="", format_error=not action.is_valid
        )
        record.turns.append(turn)
        if turn.format_error:
            record.num_format_errors += 1
        record.truncated = True
        record.truncation_reason = BUDGET
        return self._result(turn, self._terminal_reward(), terminated=False, truncated=True)

    def _close_turn(self, turn: TurnRecord) -> StepResult:
        """Append a non-terminal turn and truncate if the transcript outgrew its limits."""
        record = self._record
        record.turns.append(turn)
        self._chars += len(turn.segment) + len(turn.observation)
        if self.token_counter is not None:
            self._tokens += self.token_counter(turn.segment) + self.token_counter(turn.observation)
        reason = None
        if self._chars > self.max_episode_chars:
            reason = CHAR_LIMIT
        elif self.max_episode_tokens is not None and self._tokens > self.max_episode_tokens:
            reason = TOKEN_LIMIT
        if reason is None:
            return self._result(turn, 0.0, terminated=False, truncated=False)
        record.truncated = True
        record.truncation_reason = reason
        return self._result(turn, self._terminal_reward(), terminated=False, truncated=True)

    def _result(self, turn: TurnRecord, reward: float, terminated: bool, truncated: bool) -> StepResult:
        record = self._record
        info = {
            "turn": turn.index,
            "action_kind": turn.action.kind,
            "mode": turn.mode,
            "query": turn.query,
            **turn_retrieval_info(turn),
            "parse_error": turn.action.error,
            **self._episode_info(),
        }
        if terminated or truncated:
            info["episode"] = record
        return StepResult(turn.observation, reward, terminated, truncated, info)

    def _episode_info(self) -> dict[str, Any]:
        return episode_info(self._record, budget_left=self.retrieval_budget - self._budget_used)

    def _truncation_result(self, reward: float) -> StepResult:
        # No turn ran: the info holds the episode-level keys of a step's info and the record.
        return StepResult("", reward, False, True, {**self._episode_info(), "episode": self._record})
