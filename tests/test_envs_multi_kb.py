"""MultiKBRouteEnv: R1-Router's route -> intermediate answer -> ... -> final answer episodes."""

from __future__ import annotations

import json
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import SyncVectorEnv

from envs import MultiKBRouteEnv, step_batch
from raggym.data.types import Passage
from test_envs_support import QUESTIONS, KeywordRetriever, make_retriever

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
        warnings.simplefilter("ignore")
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
