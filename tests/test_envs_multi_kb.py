"""MultiKBRouteEnv: R1-Router's route -> intermediate answer -> ... -> final answer episodes."""

from __future__ import annotations

import dataclasses
import json
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import SyncVectorEnv
from hypothesis import given, settings, strategies as st

from envs import MultiKBRouteEnv, step_batch
from raggym.data.types import Passage
from raggym.rewards.outcome import EpisodeOutcome
from test_envs_support import QUESTIONS, KeywordRetriever, make_retriever, play_to_the_end

NOLAN, FRANCE = QUESTIONS
TABLE_PASSAGES = [
    Passage.from_content("Films", "Table: Films. Columns: film | year | director. Rows: Inception | 2010 | Christopher Nolan; Jaws | 1975 | Steven Spielberg."),
]


def route(sub_question: str, kb: str) -> str:
    return f"<think>Next I need one fact.</think>\n<sub-question>{sub_question}</sub-question>\n<ret>{kb}</ret>"


def answer(text: str) -> str:
    return f"<think>The documents say so.</think>\n<answer>{text}</answer>"


STOP = "<think>That is enough.</think><sub-question>None</sub-question><ret>None</ret>"


def make_env(**kwargs) -> MultiKBRouteEnv:
    kwargs.setdefault("knowledge_bases", {"Text Retriever": make_retriever(), "Table Retriever": KeywordRetriever(TABLE_PASSAGES)})
    kwargs.setdefault("questions", QUESTIONS)
    kwargs.setdefault("gold_knowledge_base_names", {"text": "Text Retriever", "table": "Table Retriever"})
    return MultiKBRouteEnv(**kwargs)


def test_full_episode_route_answer_stop_final():
    env = make_env()
    prompt, info = env.reset(seed=0, options={"question": NOLAN})
    assert prompt.endswith("Original question: Where was the director of Inception born?\n")
    assert "Text Retriever, Table Retriever" in prompt and info["phase"] == "route" and env.phase == "route"
    assert env.stop_strings == ("</ret>", "</answer>")

    obs, reward, terminated, truncated, info = env.step(route("Who directed Inception?", "Table Retriever"))
    assert (info["phase"], info["next_phase"], info["knowledge_base"]) == ("route", "answer", "Table Retriever")
    assert info["sub_question"] == "Who directed Inception?" and info["retrieved_ids"] == (TABLE_PASSAGES[0].id,)
    assert info["num_retrievals"] == 1 and info["retrieval_cost"] == 1.0 and not info["format_error"]
    # The answer step sees only this step's documents and the sub-question.
    assert "Documents:\nDoc 1 (Title: Films) Table: Films." in obs and obs.endswith("Question: Who directed Inception?\n")
    assert "Where was the director" not in obs

    obs, *_, info = env.step(answer("Christopher Nolan"))
    assert info["phase"] == "answer" and info["intermediate_answer"] == "Christopher Nolan" and info["next_phase"] == "route"
    assert obs.endswith("Sub-question 1: Who directed Inception?\nAnswer 1: Christopher Nolan\n")

    obs, *_, info = env.step(route("Where was Christopher Nolan born?", "text retriever"))
    assert info["knowledge_base"] == "Text Retriever" and info["retrieved_ids"][0] == make_retriever().passages[1].id
    env.step(answer("London"))
    obs, *_, info = env.step(STOP)
    assert info["next_phase"] == "final" and info["num_retrievals"] == 2
    assert "Answer 2: London" in obs and "final answer" in obs

    obs, reward, terminated, truncated, info = env.step(answer("London"))
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    record = info["episode"]
    assert record.answer == "London" and record.reward == 1.0 and record.num_retrievals == 2
    assert [s.phase for s in record.steps] == ["route", "answer", "route", "answer", "route", "final"]
    assert [s.route_step for s in record.steps] == [0, 0, 1, 1, 2, 2]
    # Every step keeps the exact context the model saw and what it wrote (Step-GRPO input).
    assert record.steps[0].context == prompt and record.steps[0].output == route("Who directed Inception?", "Table Retriever")
    assert record.steps[1].context.endswith("Question: Who directed Inception?\n")
    # Gold values from the golden trajectory, KB labels mapped to this env's names.
    assert record.steps[0].gold_knowledge_base == "Text Retriever"
    assert record.steps[0].gold_sub_question == "director of Inception"
    assert record.steps[1].gold_answer == "Christopher Nolan"
    assert record.steps[2].gold_answer == "London" and record.steps[4].gold_sub_question is None
    assert record.steps[5].gold_answer == "London"
    data = record.as_dict()
    json.dumps(data)
    assert data["queries"] == ["Who directed Inception?", "Where was Christopher Nolan born?"]
    assert data["modes"] == ["Table Retriever", "Text Retriever"] and data["format_ok"]
    assert record.outcome().retrieval_count == 2


def test_routing_stops_after_max_route_steps():
    env = make_env(max_route_steps=2)
    env.reset(options={"question": NOLAN})
    for _ in range(2):
        env.step(route("Who directed Inception?", "Text Retriever"))
        obs, *_, info = env.step(answer("Christopher Nolan"))
    assert info["next_phase"] == "final" and env.phase == "final"
    *_, terminated, truncated, info = env.step(answer("London"))
    assert terminated and info["episode"].num_retrievals == 2


def test_malformed_route_costs_a_step_and_repeats_the_prompt_with_a_note():
    env = make_env()
    prompt, _ = env.reset(options={"question": NOLAN})
    obs, reward, terminated, truncated, info = env.step(route("Who directed Inception?", "Web Search"))
    assert info["format_error"] and "unknown knowledge base" in info["parse_error"]
    assert obs.startswith(prompt) and "Your previous output was invalid: unknown knowledge base" in obs
    assert info["next_phase"] == "route" and (reward, terminated, truncated) == (0.0, False, False)
    obs, *_, info = env.step(answer("London"))  # an answer where a route is due
    assert info["format_error"] and "this is a routing step" in info["parse_error"]
    obs, *_, info = env.step("total garbage \ud800")
    assert info["format_error"] and info["next_phase"] == "final"  # three routing steps used
    assert env.record.num_format_errors == 3 and env.record.num_retrievals == 0


def test_malformed_intermediate_answer_is_recorded_as_missing():
    env = make_env()
    env.reset(options={"question": NOLAN})
    env.step(route("Who directed Inception?", "Text Retriever"))
    obs, *_, info = env.step("<think>no answer tag</think>")
    assert info["format_error"] and info["intermediate_answer"] is None
    assert obs.endswith("Sub-question 1: Who directed Inception?\nAnswer 1: unknown\n")


def test_malformed_final_answer_truncates():
    env = make_env(reward_fn=lambda record: -1.0 if record.truncated else 1.0)
    env.reset(options={"question": NOLAN})
    env.step(STOP)
    obs, reward, terminated, truncated, info = env.step("<answer>")
    assert (obs, reward, terminated, truncated) == ("", -1.0, False, True)
    assert info["truncation_reason"] == "invalid_final_answer" and info["format_error"]
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(answer("London"))


def test_misuse_and_configuration_errors():
    env = make_env()
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(STOP)
    env.reset(options={"question": FRANCE})
    with pytest.raises(TypeError, match="as str"):
        env.step(None)
    with pytest.raises(ValueError, match="at least one knowledge base"):
        MultiKBRouteEnv({})
    with pytest.raises(TypeError, match="retrieve"):
        MultiKBRouteEnv({"Text Retriever": object()})
    with pytest.raises(ValueError, match="unknown knowledge base"):
        make_env(knowledge_base_modes={"Image": "passage"})
    with pytest.raises(ValueError, match="unknown mode"):
        make_env(knowledge_base_modes={"Text Retriever": "web"})


def test_knowledge_base_modes_reach_the_retriever():
    text = make_retriever()
    env = make_env(knowledge_bases={"Text Retriever": text}, knowledge_base_modes={"Text Retriever": "graph"}, top_k=2)
    env.reset(options={"question": NOLAN})
    env.step(route("Who directed Inception?", "Text Retriever"))
    assert text.calls == [(("Who directed Inception?",), "graph", 2)]


def test_step_batch_groups_routes_by_knowledge_base():
    text, table = make_retriever(), KeywordRetriever(TABLE_PASSAGES)
    batch = [make_env(knowledge_bases={"Text Retriever": text, "Table Retriever": table}) for _ in range(4)]
    for env in batch:
        env.reset(options={"question": NOLAN})
    results = step_batch(batch, [
        route("Who directed Inception?", "Text Retriever"),
        route("Who directed Inception?", "Text Retriever"),
        route("Who directed Inception?", "Table Retriever"),
        STOP,
    ])
    assert text.calls == [(("Who directed Inception?",), "passage", 3)] and len(table.calls) == 1
    assert [r.info["next_phase"] for r in results] == ["answer", "answer", "answer", "final"]


def test_make_check_env_and_vector_env():
    kbs = {"Text Retriever": make_retriever(), "Table Retriever": KeywordRetriever(TABLE_PASSAGES)}
    env = gymnasium.make("raggym/MultiKBRoute-v0", knowledge_bases=kbs, questions=QUESTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any other conformance warning fails the check
        warnings.filterwarnings("ignore", message=".*No render fps was declared")  # a text env has no frame rate
        check_env(env.unwrapped)
    vec = SyncVectorEnv([lambda: gymnasium.make("raggym/MultiKBRoute-v0", knowledge_bases=kbs, questions=[NOLAN]) for _ in range(2)])
    obs, _ = vec.reset(seed=0)
    obs, reward, terminated, truncated, info = vec.step((STOP, route("Who directed Inception?", "Text Retriever")))
    assert list(info["next_phase"]) == ["final", "answer"]
    obs, reward, terminated, truncated, info = vec.step((answer("London"), answer("Christopher Nolan")))
    assert list(terminated) == [True, False] and reward[0] == 1.0
    vec.close()


def test_render_ansi():
    env = make_env(render_mode="ansi")
    env.reset(options={"question": NOLAN})
    env.step(STOP)
    assert env.render().startswith("[route] ")


# ----------------------------------------------------------------------------- batched-step protocol


def test_context_mode_and_truncate():
    calls = []
    env = make_env(reward_fn=lambda record: calls.append(record.truncation_reason) or 0.5)
    assert env.context_mode == "replace"
    env.reset(options={"question": NOLAN})
    env.step(route("Who directed Inception?", "Text Retriever"))
    obs, reward, terminated, truncated, info = env.truncate("response_tokens")
    assert (obs, reward, terminated, truncated) == ("", 0.5, False, True)
    assert info["episode"] is env.record and env.record.truncation_reason == "response_tokens"
    assert info["next_phase"] is None and info["num_retrievals"] == 1 and calls == ["response_tokens"]
    with pytest.raises(RuntimeError, match="episode is over"):
        env.truncate("response_tokens")
    assert calls == ["response_tokens"]


# ----------------------------------------------------------------------------- teacher forcing (Step-GRPO)

GOLD_0, GOLD_1 = NOLAN.golden_trajectory
GOLD_PHASES = [("route", 0), ("answer", 0), ("route", 1), ("answer", 1), ("final", 2)]  # Eq. 11: 2n + 1 groups
STOP_ROUTE_PHASE = ("route", 2)  # the optional stop-route group (advantage.stop_route_group)


def forced(option: dict, **kwargs):
    """A fresh environment reset into one teacher-forced step, with its context."""
    env = make_env(**kwargs)
    context, info = env.reset(options=option)
    return env, context, info


def test_golden_step_options_list_every_step_of_the_golden_trajectory_in_order():
    options = MultiKBRouteEnv.golden_step_options(NOLAN)
    assert [(o["phase"], o["golden_prefix"]) for o in options] == GOLD_PHASES
    assert [o["step_index"] for o in options] == list(range(5))
    assert all(o["question"] is NOLAN for o in options)


def test_the_stop_route_group_is_added_only_on_request():
    # n = 2 golden steps: 2n + 1 = 5 groups by default (Eq. 11), 2n + 2 = 6 with the stop route.
    options = MultiKBRouteEnv.golden_step_options(NOLAN, stop_route_group=True)
    assert [(o["phase"], o["golden_prefix"]) for o in options] == [*GOLD_PHASES[:4], STOP_ROUTE_PHASE, GOLD_PHASES[4]]
    assert [o["step_index"] for o in options] == list(range(6))


def test_teacher_forced_contexts_hold_the_golden_prefix_and_nothing_sampled():
    # A free-running episode first, with sampled sub-questions the golden ones do not contain.
    env = make_env()
    env.reset(options={"question": NOLAN})
    env.step(route("Who made Jaws?", "Table Retriever"))
    env.step(answer("Steven Spielberg"))
    options = MultiKBRouteEnv.golden_step_options(NOLAN)
    route_1 = options[2]
    context, info = env.reset(options=route_1)
    assert info == {"question_id": "q-nolan", "phase": "route", "golden_prefix": 1, "step_index": 2}
    assert context == env.dialect.routing_prompt(NOLAN.question, [(GOLD_0["query"], GOLD_0["answer"])])
    assert "Sub-question 1: director of Inception\nAnswer 1: Christopher Nolan\n" in context
    assert "Jaws" not in context and "Spielberg" not in context and "Sub-question 2" not in context
    final = forced(options[-1])[1]
    assert final == env.dialect.final_answer_prompt(
        NOLAN.question, [(GOLD_0["query"], GOLD_0["answer"]), (GOLD_1["query"], GOLD_1["answer"])]
    )
    # Every step's input is byte-identical across environments (all G samples of a group share it).
    for option in options:
        contexts = {forced(option)[1] for _ in range(3)}
        assert len(contexts) == 1
    assert len({forced(o)[1] for o in options}) == len(options) == 5


def test_teacher_forced_answer_step_sees_the_documents_of_the_golden_sub_question():
    text, table = make_retriever(), KeywordRetriever(TABLE_PASSAGES)
    env, context, _ = forced(MultiKBRouteEnv.golden_step_options(NOLAN)[1],
                             knowledge_bases={"Text Retriever": text, "Table Retriever": table})
    # Golden step 0 routes "director of Inception" to the text knowledge base.
    assert text.calls == [(("director of Inception",), "passage", 3)] and table.calls == []
    assert "Doc 1 (Title: Inception) Inception is a 2010 film directed by Christopher Nolan." in context
    assert context.endswith("Question: director of Inception\n") and "Where was the director" not in context
    assert env.record.num_retrievals == 1 and env.phase == "answer"
    *_, terminated, truncated, info = env.step(answer("Christopher Nolan"))
    assert terminated and not truncated and info["intermediate_answer"] == "Christopher Nolan"
    step = info["episode"].steps[0]
    assert step.retrieved and step.retrieved_ids[0] == make_retriever().passages[0].id
    assert (step.sub_question, step.knowledge_base, step.context) == ("director of Inception", "Text Retriever", context)
    data = info["episode"].as_dict()
    assert data["queries"] == ["director of Inception"] and data["teacher_forced_phase"] == "answer"
    assert (data["golden_prefix"], data["golden_step_index"]) == (0, 1)


def test_teacher_forced_gold_values_come_from_the_golden_trajectory():
    outputs = {
        "route": route("Who directed Inception?", "Text Retriever"),
        "answer": answer("Christopher Nolan"),
        "final": answer("London"),
    }
    expected_gold = [
        (GOLD_0["query"], "Text Retriever", GOLD_0["answer"]),
        (GOLD_0["query"], "Text Retriever", GOLD_0["answer"]),
        (GOLD_1["query"], "Text Retriever", GOLD_1["answer"]),
        (GOLD_1["query"], "Text Retriever", GOLD_1["answer"]),
        ("None", "None", None),  # route n: the gold is to stop
        (None, None, "London"),
    ]
    options = MultiKBRouteEnv.golden_step_options(NOLAN, stop_route_group=True)
    assert len(options) == len(expected_gold)
    for option, gold in zip(options, expected_gold):
        env, *_ = forced(option)
        *_, terminated, truncated, info = env.step(outputs[option["phase"]])
        assert terminated and not truncated and info["next_phase"] is None
        (step,) = info["episode"].steps
        assert (step.phase, step.route_step) == (option["phase"], option["golden_prefix"])
        assert (step.gold_sub_question, step.gold_knowledge_base, step.gold_answer) == gold
        with pytest.raises(RuntimeError, match="episode is over"):
            env.step(outputs[option["phase"]])  # one model call per teacher-forced episode


def test_teacher_forced_episode_ends_after_one_call_with_the_reward():
    seen = []
    reward_fn = lambda record: seen.append((record.teacher_forced_phase, record.truncation_reason)) or 1.0  # noqa: E731
    text = make_retriever()
    options = MultiKBRouteEnv.golden_step_options(NOLAN)
    env, *_ = forced(options[0], reward_fn=reward_fn, knowledge_bases={"Text Retriever": text})
    _, reward, terminated, _, info = env.step(STOP)  # stopping too early is well formed, just wrong
    assert terminated and reward == 1.0 and info["episode"].steps[0].sub_question is None
    assert text.calls == []  # a sampled route is not retrieved for: the next input is golden anyway
    env.reset(options=options[2])
    _, _, terminated, truncated, info = env.step(answer("London"))
    assert truncated and not terminated and info["truncation_reason"] == "invalid_route" and info["format_error"]
    assert "this is a routing step" in info["parse_error"]
    env.reset(options=options[3])
    *_, truncated, info = env.step("<think>no answer</think>")
    assert truncated and info["truncation_reason"] == "invalid_intermediate_answer"
    env.reset(options=options[-1])
    *_, truncated, info = env.step("<answer>")
    assert truncated and info["truncation_reason"] == "invalid_final_answer"
    assert seen == [("route", None), ("route", "invalid_route"), ("answer", "invalid_intermediate_answer"),
                    ("final", "invalid_final_answer")]


def test_step_batch_over_one_teacher_forced_group():
    text = make_retriever()
    option = MultiKBRouteEnv.golden_step_options(NOLAN)[2]
    group = [make_env(knowledge_bases={"Text Retriever": text}) for _ in range(3)]
    contexts = {env.reset(options=option)[0] for env in group}
    assert len(contexts) == 1
    results = step_batch(group, [route("Where was Christopher Nolan born?", "Text Retriever"), STOP, "garbage"])
    assert [(r.terminated, r.truncated) for r in results] == [(True, False), (True, False), (False, True)]
    assert text.calls == [] and [r.info["episode"].steps[0].gold_sub_question for r in results] == [GOLD_1["query"]] * 3


def test_questions_without_usable_golden_steps_are_refused_by_name():
    with pytest.raises(ValueError, match=r"question 'q-france' has no golden steps"):
        MultiKBRouteEnv.golden_step_options(FRANCE)
    env = make_env()
    with pytest.raises(ValueError, match="'q-france' has no golden steps"):
        env.reset(options={"question": FRANCE, "phase": "route", "golden_prefix": 0})
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(STOP)  # the refused reset left nothing to step
    no_kb = dataclasses.replace(NOLAN, id="q-no-kb", kind="musique", golden_trajectory=(
        GOLD_0, {"query": "Christopher Nolan born", "answer": "London"}))
    with pytest.raises(ValueError, match=r"question 'q-no-kb' \(kind 'musique'\): golden step 1 has no knowledge base"):
        MultiKBRouteEnv.golden_step_options(no_kb)
    none_gold = dataclasses.replace(NOLAN, golden_trajectory=({**GOLD_0, "answer": None}, GOLD_1))
    with pytest.raises(ValueError, match="golden step 0 has no answer; a None gold must never be rewarded silently"):
        env.reset(options={"question": none_gold, "phase": "final", "golden_prefix": 2})
    # A free-running episode of the same question still runs (evaluation needs no golden steps).
    assert env.reset(options={"question": FRANCE})[1]["phase"] == "route"


def test_teacher_forcing_option_errors():
    env = make_env()
    with pytest.raises(ValueError, match="out of range for the answer phase"):
        env.reset(options={"question": NOLAN, "phase": "answer", "golden_prefix": 2})
    with pytest.raises(ValueError, match="out of range for the final phase"):
        env.reset(options={"question": NOLAN, "phase": "final", "golden_prefix": 1})
    with pytest.raises(ValueError, match=r'options\["phase"\]'):
        env.reset(options={"question": NOLAN, "golden_prefix": 0})
    with pytest.raises(ValueError, match=r'options\["golden_prefix"\] must be an int'):
        env.reset(options={"question": NOLAN, "phase": "route"})
    text_only = make_env(knowledge_bases={"Table Retriever": KeywordRetriever(TABLE_PASSAGES)})
    with pytest.raises(ValueError, match="routes to knowledge base 'Text Retriever', which this environment does not have"):
        text_only.reset(options={"question": NOLAN, "phase": "route", "golden_prefix": 0})


def test_musique_questions_get_teacher_forced_steps(musique_dir):
    from raggym.data import load_corpus, load_questions

    corpus = load_corpus(musique_dir / "corpus.json")
    questions = load_questions(musique_dir / "questions.json", corpus)
    env = make_env(knowledge_bases={"Text Retriever": KeywordRetriever(list(corpus)[:50])})
    for q in questions:
        options = MultiKBRouteEnv.golden_step_options(q)
        assert len(options) == 2 * q.hops + 1
    first = questions[0]
    context, _ = env.reset(options=MultiKBRouteEnv.golden_step_options(first)[2])
    assert "Sub-question 1: What company published Journal of Psychotherapy Integration?\n" in context
    assert "Answer 1: American Psychological Association\n" in context
    *_, info = env.step(route("Who was the first president of the American Psychological Association?", "Text Retriever"))
    step = info["episode"].steps[0]
    assert step.gold_sub_question == "Who was the first president of American Psychological Association?"
    assert (step.gold_knowledge_base, step.gold_answer) == ("Text Retriever", "G. Stanley Hall")


def test_a_none_sub_question_stops_whatever_ret_holds():
    env = make_env()
    env.reset(seed=0, options={"question": NOLAN})
    text = "<think>I know enough.</think><sub-question>None</sub-question><ret>Text Retriever</ret>"
    obs, reward, terminated, truncated, info = env.step(text)
    # the paper's stop condition: straight to the final answer, no retrieval, no format error
    assert info["next_phase"] == "final" and info["num_retrievals"] == 0 and not info["format_error"]
    assert "final answer" in obs and not (terminated or truncated)


def test_route_without_think_is_retrieved_but_scores_no_format_reward():
    """A routing step that skips <think> still routes, but R_route's r_format is 0 (hand-computed)."""
    import numpy as np

    from raggym.rewards.r1_router import r1_router_step_rewards, step_format_ok

    options = MultiKBRouteEnv.golden_step_options(NOLAN)
    with_think = route(GOLD_0["query"], "Text Retriever")
    without_think = f"<sub-question>{GOLD_0['query']}</sub-question><ret>Text Retriever</ret>"
    outcomes = []
    for text in (with_think, without_think):
        env, *_ = forced(options[0])
        *_, terminated, truncated, info = env.step(text)
        assert terminated and not truncated  # both are routes
        outcomes.append(info["episode"].outcome())
    steps = [o.steps[0] for o in outcomes]
    assert [step_format_ok(s) for s in steps] == [True, False]
    embed = lambda texts: np.ones((len(texts), 2))  # noqa: E731  (every sub-question at cosine 1)
    # gold route and cos 1: 1·(½·1 + ½·1) = 1 with the think block, 0·(…) = 0 without
    assert r1_router_step_rewards(outcomes, embed) == pytest.approx([1.0, 0.0])


def test_answers_without_think_are_accepted_but_score_no_answer_reward():
    """Eq. 10 gates answer steps by r_format too: a right answer that skips <think> earns 0 (hand-computed)."""
    import numpy as np

    from raggym.rewards.r1_router import r1_router_step_rewards, step_format_ok

    options = MultiKBRouteEnv.golden_step_options(NOLAN)
    intermediate, final = options[1], options[-1]
    outcomes = []
    for option, text in ((intermediate, GOLD_0["answer"]), (final, "London")):
        for output in (answer(text), f"<answer>{text}</answer>"):
            env, *_ = forced(option)
            *_, terminated, truncated, info = env.step(output)
            assert terminated and not truncated  # both are answers the environment takes
            outcomes.append(info["episode"].outcome())
    assert [step_format_ok(o.steps[0]) for o in outcomes] == [True, False, True, False]
    no_routes = lambda texts: np.zeros((0, 2))  # noqa: E731  (answer steps embed nothing)
    # R_mid = r_format · recall: 1 · 1 with <think>, 0 · 1 without; R_final = r_format · accuracy likewise
    assert r1_router_step_rewards(outcomes, no_routes) == pytest.approx([1.0, 0.0, 1.0, 0.0])


ROUTE_SEGMENTS = [route("Who directed Inception?", "Table Retriever"), answer("Christopher Nolan"),
                  route("Where was Christopher Nolan born?", "Text Retriever"), STOP, answer("London"),
                  "<ret>no sub-question", answer("")]


@given(picks=st.lists(st.integers(0, len(ROUTE_SEGMENTS) - 1), min_size=1, max_size=8),
       question=st.sampled_from(QUESTIONS), teacher_forced=st.integers(-1, 4))
@settings(max_examples=60, deadline=None)
def test_the_route_records_outcome_equals_the_one_its_dict_gives(picks, question, teacher_forced):
    """As for ``RagSearchEnv``: the record's own ``outcome()`` and ``from_dict(as_dict())`` agree, for
    free-running episodes (routes, answers, malformed steps, the stop route) and teacher-forced steps."""
    if teacher_forced >= 0:
        env, *_ = forced(MultiKBRouteEnv.golden_step_options(NOLAN)[teacher_forced])
    else:
        env = make_env()
        env.reset(seed=0, options={"question": question})
    play_to_the_end(env, [ROUTE_SEGMENTS[pick] for pick in picks])
    record = env.record
    assert record.outcome() == EpisodeOutcome.from_dict(record.as_dict())
