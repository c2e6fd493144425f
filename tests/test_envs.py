"""RagSearchEnv: reset/step semantics, info, budget, limits, records, batching and conformance."""

from __future__ import annotations

import json
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import SyncVectorEnv
from hypothesis import given, settings, strategies as st

import envs
from envs import EpisodeRecord, RagSearchEnv, UnicodeText, step_batch
from raggym.data.types import Corpus, Question
from raggym.protocol import get_dialect
from raggym.retrieval.base import QueryResult
from raggym.rewards.outcome import EpisodeOutcome
from test_envs_support import PASSAGES, QUESTIONS, KeywordRetriever, make_retriever, play_to_the_end

NOLAN, FRANCE = QUESTIONS

SEARCH_GRAPH = "<think>Who directed Inception?</think><search> [graph] director of Inception </search>"
SEARCH_PASSAGE = "<think>Where was he born?</think><search> [passage] Christopher Nolan born </search>"
ANSWER_LONDON = "<think>He was born in London.</think><answer> London </answer>"


def make_env(**kwargs) -> RagSearchEnv:
    kwargs.setdefault("retriever", make_retriever())
    kwargs.setdefault("questions", QUESTIONS)
    return RagSearchEnv(**kwargs)


def run(env, question, segments):
    env.reset(seed=0, options={"question": question})
    return [env.step(s) for s in segments]


# ----------------------------------------------------------------------------- episodes


def test_reset_returns_the_dialect_prompt_for_the_question():
    env = make_env()
    prompt, info = env.reset(seed=0, options={"question": NOLAN})
    assert prompt == get_dialect("routerag").instruction_prompt(NOLAN.question)
    assert info == {"question_id": "q-nolan", "budget_left": 4}
    assert prompt in env.observation_space
    assert env.stop_strings == ("</search>", "</answer>")


def test_search_then_answer_episode_records_everything():
    env = make_env(corpus=Corpus(PASSAGES))
    (obs1, r1, term1, trunc1, info1), (obs2, r2, term2, trunc2, info2), (obs3, r3, term3, trunc3, info3) = run(
        env, NOLAN, [SEARCH_GRAPH, SEARCH_PASSAGE, ANSWER_LONDON]
    )
    assert obs1.startswith("\n\n<information>Doc 1 (Title: Inception) Inception is a 2010 film directed by Christopher Nolan.")
    assert (r1, term1, trunc1) == (0.0, False, False)
    assert info1["turn"] == 0 and info1["action_kind"] == "search"
    assert (info1["mode"], info1["query"]) == ("graph", "director of Inception")
    assert info1["retrieved_ids"] == (PASSAGES[0].id,)
    assert info1["retrieved_texts"] == (PASSAGES[0].text,)
    assert info1["retrieval_cost"] == 8.0 and info1["retrieval_seconds"] >= 0.0
    assert info1["format_valid"] and not info1["format_error"] and info1["parse_error"] is None
    assert info1["num_retrievals"] == 1 and info1["budget_left"] == 3 and info1["answer"] is None
    assert info2["mode"] == "passage" and info2["retrieved_ids"][0] == PASSAGES[1].id
    assert info2["total_retrieval_cost"] == 8.0 + 5.0 and info2["num_retrievals"] == 2
    assert info2["total_retrieval_seconds"] == pytest.approx(info1["retrieval_seconds"] + info2["retrieval_seconds"])

    assert (obs3, r3, term3, trunc3) == ("", 1.0, True, False)
    assert info3["answer"] == "London" and info3["action_kind"] == "answer"
    record: EpisodeRecord = info3["episode"]
    assert record is env.record and record.reward == 1.0 and record.terminated and not record.truncated
    assert record.segments == [SEARCH_GRAPH, SEARCH_PASSAGE, ANSWER_LONDON]
    assert record.observations == [obs1, obs2, ""]
    assert [t.mode for t in record.turns] == ["graph", "passage", None]
    assert record.all_retrieved_ids() == list(info1["retrieved_ids"] + info2["retrieved_ids"])
    assert record.retrieval_cost == 13.0 and record.num_retrievals == 2
    assert record.gold_passages == (PASSAGES[0].text, PASSAGES[1].text)
    assert record.transcript() == record.prompt + SEARCH_GRAPH + obs1 + SEARCH_PASSAGE + obs2 + ANSWER_LONDON
    assert record.format_check().ok

    data = record.as_dict()
    json.dumps(data)  # plain data all the way down
    assert data["queries"] == ["director of Inception", "Christopher Nolan born"]
    assert data["modes"] == ["graph", "passage"]
    assert data["format_ok"] and data["answer"] == "London" and data["gold_answers"] == ["London"]
    outcome = record.outcome()
    assert outcome.retrieval_count == 2 and outcome.retrieval_cost == 13.0 and outcome.prompt_id == "q-nolan"
    assert outcome.gold_passages == (PASSAGES[0].text, PASSAGES[1].text)


def test_wrong_answer_scores_zero_and_reward_fn_is_pluggable():
    env = make_env()
    (*_, (obs, reward, terminated, _, info)) = run(env, NOLAN, ["<think>x</think><answer> Paris </answer>"])
    assert terminated and reward == 0.0
    seen = []

    def efficiency(record):
        seen.append(record)
        return 1.0 - 0.1 * record.num_retrievals

    env = make_env(reward_fn=efficiency)
    results = run(env, NOLAN, [SEARCH_GRAPH, ANSWER_LONDON])
    assert [r[1] for r in results] == [0.0, pytest.approx(0.9)]
    assert seen == [env.record]


def test_modeless_dialects_use_their_default_or_configured_mode():
    retriever = make_retriever()
    env = make_env(retriever=retriever, dialect="search_r1")
    env.reset(options={"question": NOLAN})
    env.step("<think>x</think><search> Inception director </search>")
    env = make_env(retriever=retriever, dialect="graph_r1")
    env.reset(options={"question": NOLAN})
    env.step("<think>x</think><query> Inception director </query>")
    env = make_env(retriever=retriever, dialect="lws", search_mode="hybrid")
    env.reset(options={"question": NOLAN})
    env.step("<think>x</think><search> Inception director </search>")
    assert [mode for _, mode, _ in retriever.calls] == ["passage", "graph", "hybrid"]
    assert all(k == 3 for _, _, k in retriever.calls)


def test_graphrag_r1_observation_has_facts_and_passages():
    env = make_env(dialect="graphrag_r1")
    env.reset(options={"question": NOLAN})
    obs, *_ , info = env.step("<think> I need the director <|begin_of_query|> Inception director <|end_of_query|>")
    assert obs.startswith("\n<|begin_of_documents|>\n(Inception directed by Christopher Nolan)\n")
    assert "Doc 1 (Title: Inception)" in obs and obs.endswith("<|end_of_documents|>\n")
    assert env.record.turns[0].facts[0][:3] == ("Inception", "directed by", "Christopher Nolan")
    obs, reward, terminated, *_ = env.step(" It is London. </think><answer> London </answer>")
    assert terminated and reward == 1.0 and env.record.format_check().ok


def test_top_k_is_honoured():
    env = make_env(top_k=1)
    _, _, _, _, info = run(env, NOLAN, [SEARCH_PASSAGE])[0]
    assert len(info["retrieved_ids"]) == 1


# ----------------------------------------------------------------------------- format errors and budget


def test_format_error_observation_counts_toward_the_budget():
    env = make_env()
    obs, reward, terminated, truncated, info = run(env, NOLAN, ["<think>x</think><search> [web] q </search>"])[0]
    assert obs.startswith("\n\n<information>Invalid action: unknown retrieval mode [web]")
    assert obs.endswith("</information>\n\n")
    assert info["format_error"] and not info["format_valid"]
    assert "unknown retrieval mode" in info["parse_error"]
    assert info["action_kind"] == "invalid" and info["budget_left"] == 3 and info["num_retrievals"] == 0
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert env.record.num_format_errors == 1 and env.retriever.calls == []


def test_think_only_segment_is_a_format_error():
    env = make_env(dialect="lws")
    obs, *_, info = run(env, NOLAN, ["<think>Let me think about it.</think>"])[0]
    assert info["action_kind"] == "think" and info["format_error"]
    assert "no search or answer" in obs


def test_budget_allows_an_answer_after_the_last_search_then_truncates():
    env = make_env(retrieval_budget=2)
    results = run(env, NOLAN, [SEARCH_GRAPH, "garbage", ANSWER_LONDON])
    assert [r[4]["budget_left"] for r in results] == [1, 0, 0]
    assert results[-1][2] is True and results[-1][1] == 1.0

    env = make_env(retrieval_budget=2)
    results = run(env, NOLAN, [SEARCH_GRAPH, SEARCH_PASSAGE, SEARCH_PASSAGE])
    obs, reward, terminated, truncated, info = results[-1]
    assert (obs, reward, terminated, truncated) == ("", 0.0, False, True)
    assert info["truncation_reason"] == "retrieval_budget" and not info["format_error"]
    assert env.record.num_retrievals == 2 and len(env.retriever.calls) == 2  # the third never ran
    assert info["episode"].truncation_reason == "retrieval_budget"


def test_invalid_segment_after_budget_truncates_and_is_flagged():
    env = make_env(retrieval_budget=0)
    obs, reward, terminated, truncated, info = run(env, NOLAN, ["<think>x</think>"])[0]
    assert truncated and info["format_error"] and obs == ""
    env = make_env(retrieval_budget=0)
    assert run(env, NOLAN, [ANSWER_LONDON])[0][1] == 1.0


def test_truncated_episode_still_gets_the_terminal_reward():
    env = make_env(retrieval_budget=0, reward_fn=lambda record: -0.5 if record.truncated else 1.0)
    assert run(env, NOLAN, [SEARCH_GRAPH])[0][1] == -0.5


def test_character_limit_truncates():
    prompt_chars = len(get_dialect("routerag").instruction_prompt(NOLAN.question))
    env = make_env(max_episode_chars=prompt_chars + 120)
    obs, reward, terminated, truncated, info = run(env, NOLAN, [SEARCH_GRAPH])[0]
    assert truncated and not terminated and info["truncation_reason"] == "char_limit"
    assert obs.startswith("\n\n<information>")  # the observation that crossed the limit is still returned


def test_token_limit_truncates_with_a_token_counter():
    def count_words(text: str) -> int:
        return len(text.split())

    env = make_env(max_episode_tokens=200, token_counter=count_words)
    results = run(env, NOLAN, [SEARCH_GRAPH, SEARCH_PASSAGE, SEARCH_PASSAGE])
    reasons = [r[4]["truncation_reason"] for r in results]
    assert "token_limit" in reasons
    with pytest.raises(ValueError, match="go together"):
        make_env(max_episode_tokens=10)


def test_oversized_segment_is_a_format_error_not_a_crash():
    env = make_env(max_segment_chars=1000)
    obs, *_, info = run(env, NOLAN, ["<think>" + "x" * 5000 + "</think><answer>London</answer>"])[0]
    assert info["format_error"] and "longer than 1000" in info["parse_error"]
    assert obs in env.observation_space


def test_observation_is_capped_to_the_space():
    long_passages = [p.__class__(p.id, p.title, p.text * 400) for p in PASSAGES]
    env = make_env(retriever=KeywordRetriever(long_passages), max_observation_chars=2000, max_prompt_chars=2000)
    obs, *_ = run(env, NOLAN, [SEARCH_PASSAGE])[0]
    assert len(obs) == 2000 and obs.endswith("</information>\n\n") and obs in env.observation_space


def test_lone_surrogates_in_model_output_never_reach_the_retriever_or_observation():
    env = make_env()
    obs, *_, info = run(env, NOLAN, ["<think>\ud800</think><search> [graph] Inception\udfff director </search>"])[0]
    assert info["query"] == "Inception director"
    assert env.retriever.calls[0][0] == ("Inception director",)
    assert obs in env.observation_space


def test_empty_retrieval_result_renders_a_notice():
    env = make_env()
    obs, *_, info = run(env, NOLAN, ["<think>x</think><search> [passage] zzz qqq </search>"])[0]
    assert info["retrieved_ids"] == () and "No documents were found" in obs and not info["format_error"]


# ----------------------------------------------------------------------------- API misuse


def test_api_misuse_raises_clear_errors():
    env = make_env()
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(ANSWER_LONDON)
    env.reset(options={"question": NOLAN})
    for bad in (None, b"<answer>London</answer>", 3, ["<answer>"]):
        with pytest.raises(TypeError, match="expects the assistant segment as str"):
            env.step(bad)
    env.step(ANSWER_LONDON)
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(ANSWER_LONDON)
    with pytest.raises(TypeError, match="raggym.data.Question"):
        env.reset(options={"question": "What?"})
    no_source = RagSearchEnv(make_retriever())
    with pytest.raises(ValueError, match="no question"):
        no_source.reset()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dialect": "r1_router"}, "MultiKBRouteEnv"),
        ({"dialect": "nope"}, "unknown dialect"),
        ({"search_mode": "web"}, "unknown search_mode"),
        ({"top_k": 0}, "top_k"),
        ({"retrieval_budget": -1}, "retrieval_budget"),
        ({"questions": []}, "questions is empty"),
        ({"question_order": "sorted"}, "question_order"),
        ({"retriever": object()}, "retrieve"),
        ({"render_mode": "human"}, "render_mode"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_env(**kwargs)


def test_prompt_fn_and_oversized_prompt():
    env = make_env(prompt_fn=lambda q, d: f"{d.name}: {q.question}")
    assert env.reset(options={"question": FRANCE})[0] == "routerag: What is the capital of France?"
    env = make_env(prompt_fn=lambda q, d: "x" * 20_000)
    with pytest.raises(ValueError, match="prompt for question"):
        env.reset(options={"question": FRANCE})


# ----------------------------------------------------------------------------- question sources and seeding


def test_seeded_resets_are_reproducible_and_cycle_order_is_in_order():
    questions = [Question(id=f"q{i}", question=f"Q{i}?", answers=("a",)) for i in range(20)]
    env = make_env(questions=questions)
    first = [env.reset(seed=5)[1]["question_id"]] + [env.reset()[1]["question_id"] for _ in range(5)]
    second = [env.reset(seed=5)[1]["question_id"]] + [env.reset()[1]["question_id"] for _ in range(5)]
    assert first == second and len(set(first)) > 1
    cycling = make_env(questions=questions, question_order="cycle")
    assert [cycling.reset()[1]["question_id"] for _ in range(22)] == [f"q{i % 20}" for i in range(22)]
    callable_source = make_env(questions=lambda rng: questions[int(rng.integers(3))])
    assert callable_source.reset(seed=1)[1]["question_id"] in {"q0", "q1", "q2"}
    bad_source = make_env(questions=lambda rng: "not a question")
    with pytest.raises(TypeError, match="not a Question"):
        bad_source.reset()


def test_render_ansi_shows_the_transcript():
    env = make_env(render_mode="ansi")
    run(env, NOLAN, [SEARCH_GRAPH])
    assert env.render() == env.record.transcript()
    assert make_env().render() is None


# ----------------------------------------------------------------------------- batched stepping


def test_step_batch_groups_retrieval_by_mode_and_deduplicates_queries():
    retriever = make_retriever()
    batch = [make_env(retriever=retriever) for _ in range(5)]
    for env in batch:
        env.reset(seed=0, options={"question": NOLAN})
    actions = [SEARCH_GRAPH, SEARCH_GRAPH, SEARCH_PASSAGE, "junk", ANSWER_LONDON]
    results = step_batch(batch, actions)
    assert sorted(retriever.calls) == sorted([(("director of Inception",), "graph", 3), (("Christopher Nolan born",), "passage", 3)])
    assert [r.info["action_kind"] for r in results] == ["search", "search", "search", "invalid", "answer"]
    assert results[0].observation == results[1].observation
    assert results[4].terminated and results[4].reward == 1.0
    assert results[3].info["format_error"]

    # Same outcome as stepping each episode alone.
    for action, batched in zip(actions, results):
        solo = make_env()
        solo.reset(seed=0, options={"question": NOLAN})
        obs, reward, terminated, truncated, info = solo.step(action)
        assert (obs, reward, terminated, truncated) == tuple(batched[:4])
        assert info["retrieved_ids"] == batched.info["retrieved_ids"]


def test_step_batch_mixes_retrievers_and_checks_misuse_before_stepping():
    a, b = make_retriever(), make_retriever()
    env_a, env_b = make_env(retriever=a), make_env(retriever=b)
    for env in (env_a, env_b):
        env.reset(options={"question": NOLAN})
    step_batch([env_a, env_b], [SEARCH_GRAPH, SEARCH_GRAPH])
    assert len(a.calls) == 1 and len(b.calls) == 1
    with pytest.raises(TypeError):
        step_batch([env_a, env_b], [SEARCH_GRAPH, 7])
    assert len(env_a.record.turns) == 1  # nothing moved
    with pytest.raises(ValueError, match="same environment twice"):
        step_batch([env_a, env_a], [SEARCH_GRAPH, SEARCH_GRAPH])
    with pytest.raises(ValueError, match="2 environments but 1 actions"):
        step_batch([env_a, env_b], [SEARCH_GRAPH])


# Per-call timings differ between two runs of the same episode; everything else must not.
TIMING_KEYS = ("retrieval_seconds", "total_retrieval_seconds")


def without_timings(info: dict) -> dict:
    return {k: v for k, v in info.items() if k not in TIMING_KEYS and k != "episode"}


def test_step_equals_the_two_phases_of_the_protocol():
    segments = [SEARCH_GRAPH, "junk", SEARCH_PASSAGE, ANSWER_LONDON]
    stepped, phased = make_env(), make_env()
    assert stepped.context_mode == "append"
    stepped.reset(seed=0, options={"question": NOLAN})
    phased.reset(seed=0, options={"question": NOLAN})
    for segment in segments:
        expected = stepped.step(segment)
        phased.check_step_call(segment)
        outcome = phased.begin_step(segment)
        if isinstance(outcome, envs.RetrievalRequest):
            assert len(phased.record.turns) == len(stepped.record.turns) - 1  # the request changed nothing
            [result] = phased.retriever.retrieve([outcome.query], outcome.mode, outcome.k)
            outcome = phased.finish_step(outcome, result)
        assert tuple(outcome[:4]) == tuple(expected[:4])
        assert without_timings(outcome.info) == without_timings(expected[4])
    assert phased.record.as_dict()["turns"][0]["query"] == stepped.record.as_dict()["turns"][0]["query"]
    assert phased.record.reward == stepped.record.reward == 1.0


def test_truncate_ends_the_episode_and_computes_the_reward_once():
    calls = []

    def reward(record):
        calls.append(record.truncation_reason)
        return -0.25

    env = make_env(reward_fn=reward)
    with pytest.raises(RuntimeError, match="call reset"):
        env.truncate("response_tokens")
    env.reset(options={"question": NOLAN})
    env.step(SEARCH_GRAPH)
    obs, reward_value, terminated, truncated, info = env.truncate("response_tokens")
    assert (obs, reward_value, terminated, truncated) == ("", -0.25, False, True)
    record = info["episode"]
    assert record is env.record and record.truncated and record.truncation_reason == "response_tokens"
    assert record.reward == -0.25 and calls == ["response_tokens"]
    assert info["truncation_reason"] == "response_tokens" and info["num_retrievals"] == 1 and info["budget_left"] == 3
    with pytest.raises(RuntimeError, match="episode is over"):
        env.truncate("response_tokens")
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(ANSWER_LONDON)
    assert calls == ["response_tokens"] and len(record.turns) == 1
    env.reset(options={"question": NOLAN})
    env.step(ANSWER_LONDON)
    with pytest.raises(RuntimeError, match="episode is over"):
        env.truncate("response_tokens")  # an answered episode keeps its reward and reason
    assert env.record.truncation_reason is None and calls == ["response_tokens", None]
    env.reset(options={"question": NOLAN})
    with pytest.raises(ValueError, match="non-empty reason"):
        env.truncate("")


def test_a_failing_retriever_leaves_episodes_untouched_for_a_retry():
    class Flaky(KeywordRetriever):
        fail = True

        def retrieve(self, queries, mode, k):
            if self.fail:
                self.fail = False
                raise ConnectionError("retrieval service down")
            return super().retrieve(queries, mode, k)

    retriever = Flaky(PASSAGES)
    batch = [make_env(retriever=retriever) for _ in range(2)]
    for env in batch:
        env.reset(options={"question": NOLAN})
    with pytest.raises(ConnectionError):
        step_batch(batch, [SEARCH_GRAPH, SEARCH_PASSAGE])
    assert all(len(env.record.turns) == 0 for env in batch)
    results = step_batch(batch, [SEARCH_GRAPH, SEARCH_PASSAGE])
    assert all(r.info["num_retrievals"] == 1 for r in results)


def test_retriever_returning_the_wrong_number_of_results_is_reported():
    class Broken:
        def retrieve(self, queries, mode, k):
            return [QueryResult(q) for q in queries] * 2

    env = make_env(retriever=Broken())
    env.reset(options={"question": NOLAN})
    with pytest.raises(RuntimeError, match="2 results for 1 query"):
        env.step(SEARCH_GRAPH)


# ----------------------------------------------------------------------------- spaces, registration, conformance


def test_unicode_text_space():
    space = UnicodeText(10)
    assert "héllo 中文" in space and "x" * 11 not in space and b"x" not in space and "\ud800" not in space
    assert "\ud800" in UnicodeText(10, allow_surrogates=True)
    sample = space.sample()
    assert isinstance(sample, str) and len(sample) <= 10
    assert space == UnicodeText(10) and space != UnicodeText(11) and "UnicodeText(0, 10" in repr(space)


def test_every_id_is_registered():
    for env_id in envs.ENV_IDS:
        assert env_id in gymnasium.registry
    assert envs.SEARCH_ENV_IDS["raggym/RouteRAG-v0"] == "routerag"


@pytest.mark.parametrize("env_id", list(envs.SEARCH_ENV_IDS))
def test_make_and_check_env(env_id):
    env = gymnasium.make(env_id, retriever=make_retriever(), questions=QUESTIONS)
    assert env.unwrapped.dialect.name == envs.SEARCH_ENV_IDS[env_id]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any other conformance warning fails the check
        warnings.filterwarnings("ignore", message=".*No render fps was declared")  # a text env has no frame rate
        check_env(env.unwrapped)
    obs, info = env.reset(seed=3)
    assert isinstance(obs, str)
    env.close()


def test_sync_vector_env_steps_and_autoresets():
    vec = SyncVectorEnv(
        [lambda: gymnasium.make("raggym/RouteRAG-v0", retriever=make_retriever(), questions=[NOLAN]) for _ in range(3)]
    )
    obs, info = vec.reset(seed=0)
    assert len(obs) == 3 and all("Inception" in o for o in obs)
    obs, reward, terminated, truncated, info = vec.step((SEARCH_GRAPH, ANSWER_LONDON, "junk"))
    assert list(terminated) == [False, True, False]
    assert np.allclose(reward, [0.0, 1.0, 0.0])
    assert list(info["action_kind"]) == ["search", "answer", "invalid"]
    assert list(info["format_error"]) == [False, False, True]
    obs, reward, terminated, truncated, info = vec.step((ANSWER_LONDON, "ignored: autoreset", ANSWER_LONDON))
    assert list(terminated) == [True, False, True]
    assert "Inception" in obs[1]  # the finished episode was reset
    vec.close()


# ---------------------------------------------------------------- allowed_modes (ablations, serving)


def test_single_allowed_mode_forces_every_search_into_it():
    from envs import RagSearchEnv
    from raggym.data import Question

    retriever = make_retriever()
    env = RagSearchEnv(retriever, [Question(id="q", question="Where is Paris?", answers=("France",))],
                       allowed_modes=("graph",))
    prompt, _ = env.reset(seed=0)
    assert "[graph]" in prompt and "[passage]," not in prompt and "no other mode" in prompt
    _, _, term, trunc, info = env.step("<think>x</think><search> [passage] paris </search>")
    assert (term, trunc) == (False, False) and not info["format_error"]
    assert [c[1] for c in retriever.calls] == ["graph"] and info["mode"] == "graph"


def test_disallowed_mode_among_several_is_a_format_error_naming_the_allowed_ones():
    from envs import RagSearchEnv
    from raggym.data import Question

    retriever = make_retriever()
    env = RagSearchEnv(retriever, [Question(id="q", question="Where is Paris?", answers=("France",))],
                       allowed_modes=("passage", "hybrid"))
    env.reset(seed=0)
    obs, _, _, _, info = env.step("<think>x</think><search> [graph] paris </search>")
    assert info["format_error"] and "passage, hybrid" in obs and retriever.calls == []
    _, _, _, _, info = env.step("<think>x</think><search> [graph][passage] paris </search>")
    assert not info["format_error"] and [c[1] for c in retriever.calls] == ["hybrid"]


def test_allowed_modes_are_validated():
    from envs import RagSearchEnv
    from raggym.data import Question

    qs = [Question(id="q", question="Where is Paris?", answers=("France",))]
    with pytest.raises(ValueError, match="subset"):
        RagSearchEnv(make_retriever(), qs, allowed_modes=("table",))
    with pytest.raises(ValueError, match="no mode syntax"):
        RagSearchEnv(make_retriever(), qs, dialect="search_r1", allowed_modes=("passage", "graph"))
    env = RagSearchEnv(make_retriever(), qs, dialect="search_r1", allowed_modes=("graph",))
    assert env.search_mode == "graph"


# ------------------------------------------------ the typed outcome, built from the record itself

SEGMENTS = {
    "routerag": [SEARCH_GRAPH, SEARCH_PASSAGE, ANSWER_LONDON, "<think>no tags",
                 "<think>both</think><search> [graph][passage] Nolan Inception </search>"],
    "search_r1": ["<think>who</think><search> director of Inception </search>", ANSWER_LONDON, "<answer> Paris",
                  "<search> Christopher Nolan born </search>"],
}


@given(dialect=st.sampled_from(sorted(SEGMENTS)), picks=st.lists(st.integers(0, 4), min_size=1, max_size=6),
       question=st.sampled_from(QUESTIONS), budget=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_the_records_outcome_equals_the_one_its_dict_gives(dialect, picks, question, budget):
    """``record.outcome()`` reads the record's fields directly; the public ``from_dict`` over the
    record's ``as_dict()`` (the spelling external records use) must agree field for field, for
    searches, answers, format errors, an exhausted budget and a dialect without modes."""
    env = make_env(dialect=dialect, retrieval_budget=budget, corpus=Corpus(PASSAGES))
    env.reset(seed=0, options={"question": question})
    segments = SEGMENTS[dialect]
    play_to_the_end(env, [segments[pick % len(segments)] for pick in picks])
    record = env.record
    assert record.outcome() == EpisodeOutcome.from_dict(record.as_dict())
