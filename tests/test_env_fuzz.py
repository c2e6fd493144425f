"""Hypothesis fuzzing: no model output can make a parser or an environment raise.

``make test`` runs a bounded number of examples per dialect; the ``slow`` tests run 10,000
segments per dialect (``pytest -m slow tests/test_env_fuzz.py``), as does
``python -m experiments.bench.env``.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs import MultiKBRouteEnv, RagSearchEnv
from raggym.protocol import ACTION_KINDS, DIALECT_NAMES, PAPER_KNOWLEDGE_BASES
from raggym.protocol.strategies import segments
from test_envs_support import QUESTIONS, make_retriever

SEARCH_DIALECTS = [d for d in DIALECT_NAMES if d != "r1_router"]
FAST_EXAMPLES = 300
SLOW_EXAMPLES = 10_000
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def check_action(dialect, segment: str) -> None:
    action = dialect.parse(segment)
    assert action.kind in ACTION_KINDS
    assert action == dialect.parse(segment)  # deterministic
    assert not _SURROGATE.search(action.reasoning)
    if action.is_valid:
        assert action.error is None
        if action.kind in ("search", "route") and action.query is not None:
            assert action.query and not _UNSAFE.search(action.query) and action.query == action.query.strip()
            assert len(action.query) <= dialect.max_query_chars
        if action.kind == "search":
            assert action.mode is None or action.mode in dialect.modes
        if action.kind == "route" and action.query is not None:
            assert action.mode in dialect.knowledge_bases
        if action.kind == "answer":
            assert action.answer and not _SURROGATE.search(action.answer)
    else:
        assert isinstance(action.error, str) and action.error
    assert isinstance(dialect.format_check(segment).ok, bool)


def check_search_episode(env: RagSearchEnv, steps: list[str]) -> None:
    env.reset(seed=0, options={"question": QUESTIONS[0]})
    budget = env.retrieval_budget
    for n, segment in enumerate(steps):
        action = env.dialect.parse(segment) if len(segment) <= env.max_segment_chars else None
        malformed = action is None or not action.is_valid
        budget_before = budget - sum(1 for t in env.record.turns if t.action.kind != "answer")
        obs, reward, terminated, truncated, info = env.step(segment)
        assert obs in env.observation_space
        assert isinstance(reward, float) and type(terminated) is bool and type(truncated) is bool
        assert info["format_error"] is malformed
        assert info["budget_left"] >= 0
        if terminated:
            assert action is not None and action.kind == "answer"
        elif budget_before == 0:
            assert truncated and info["truncation_reason"] == "retrieval_budget"
        elif not truncated or info["truncation_reason"] != "retrieval_budget":
            assert info["budget_left"] == budget_before - 1  # searches and format errors both count
            if malformed:
                assert obs.startswith(env.dialect.render_error("", 10_000)[: len(env.dialect.observation_open) + 2])
                assert env.dialect.observation_close in obs
        if terminated or truncated:
            assert n <= budget  # at most B budget-consuming turns, then an answer or a cut
            with pytest.raises(RuntimeError):
                env.step(segment)
            return


def check_route_episode(env: MultiKBRouteEnv, steps: list[str]) -> None:
    env.reset(seed=0, options={"question": QUESTIONS[0]})
    for n, segment in enumerate(steps):
        obs, reward, terminated, truncated, info = env.step(segment)
        assert obs in env.observation_space
        assert isinstance(reward, float) and type(terminated) is bool and type(truncated) is bool
        assert info["format_error"] is (info["parse_error"] is not None)
        if terminated or truncated:
            assert n <= 2 * env.max_route_steps  # route + answer per step, then the final answer
            return


# ----------------------------------------------------------------------------- bounded runs (make test)


@pytest.mark.parametrize("name", SEARCH_DIALECTS)
def test_search_dialect_fuzz(name):
    """Parser invariants on every segment, then the segments stepped as one episode."""
    env = RagSearchEnv(make_retriever(), QUESTIONS, name, retrieval_budget=2)

    @fuzz_settings(FAST_EXAMPLES)
    @given(st.lists(segments(name), min_size=1, max_size=4))
    def run(steps):
        for segment in steps:
            check_action(env.dialect, segment)
        check_search_episode(env, steps)

    run()


def test_r1_router_dialect_fuzz():
    env = MultiKBRouteEnv({kb: make_retriever() for kb in PAPER_KNOWLEDGE_BASES}, QUESTIONS, max_route_steps=2)

    @fuzz_settings(FAST_EXAMPLES)
    @given(st.lists(segments("r1_router"), min_size=1, max_size=6))
    def run(steps):
        for segment in steps:
            check_action(env.dialect, segment)
        check_route_episode(env, steps)

    run()


# ----------------------------------------------------------------------------- 10k runs (pytest -m slow)


@pytest.mark.slow
@pytest.mark.parametrize("name", SEARCH_DIALECTS)
def test_search_env_fuzz_10k(name):
    env = RagSearchEnv(make_retriever(), QUESTIONS, name)

    @fuzz_settings(SLOW_EXAMPLES)
    @given(segments(name))
    def run(segment):
        check_action(env.dialect, segment)
        check_search_episode(env, [segment])

    run()


@pytest.mark.slow
def test_route_env_fuzz_10k():
    env = MultiKBRouteEnv({kb: make_retriever() for kb in PAPER_KNOWLEDGE_BASES}, QUESTIONS)

    @fuzz_settings(SLOW_EXAMPLES)
    @given(segments("r1_router"))
    def run(segment):
        check_action(env.dialect, segment)
        check_route_episode(env, [segment])

    run()
