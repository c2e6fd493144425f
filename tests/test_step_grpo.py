"""R1-Router's Step-GRPO through the one rollout loop: teacher-forced step groups with the real
engine, environment and retrievers; golds from the golden trajectory; the step reward's refusals."""

from __future__ import annotations

import functools

import pytest
import torch

from actors.engines.base import SamplingParams
from envs import MultiKBRouteEnv
from envs.rollout import RolloutConfig
from actors.runtime import GOLD_KB_NAMES, InProcessRollouts
from experiments.recipe.training import episode_requests
from raggym.algorithms import get_advantage_estimator
from raggym.rewards import EpisodeOutcome
from raggym.rewards.r1_router import TABLE_KB, TEXT_KB, r1_router_step_rewards

G = 3


@pytest.fixture(scope="module")
def routing_world():
    from raggym.data.synthetic import generate_world
    from raggym.retrieval import Retriever

    world = generate_world(seed=0, n_entities=120, n_questions=16, max_hops=2, attribute_kb="table")
    kbs = {TEXT_KB: Retriever.build(world.corpus, show_progress=False),
           TABLE_KB: Retriever.build(world.table_corpus, show_progress=False)}
    return world, kbs


@pytest.fixture(scope="module")
def step_rollouts(routing_world, hf_engine):
    """G sampled rollouts for every teacher-forced step of one two-step question, the optional
    stop-route group included (advantage.stop_route_group) so that its None gold is exercised too."""
    world, kbs = routing_world
    question = next(q for q in world.questions if len(q.golden_trajectory) == 2)
    requests = episode_requests([question], "7", G, functools.partial(MultiKBRouteEnv.golden_step_options,
                                                                       stop_route_group=True))
    runtime = InProcessRollouts(hf_engine, hf_engine.tokenizer, lambda qs, _: MultiKBRouteEnv(
        kbs, qs, gold_knowledge_base_names=GOLD_KB_NAMES, corpus=world.corpus),
        RolloutConfig(max_response_tokens=12, max_turn_tokens=12, max_observation_tokens=64))
    return question, requests, runtime.rollout(requests, SamplingParams(temperature=1.0, seed=3))


def test_every_sample_of_a_step_group_sees_identical_input_ids(step_rollouts):
    question, requests, rollouts = step_rollouts
    assert len(rollouts) == len(requests) == G * (2 * 2 + 2)  # route 0, answer 0, route 1, answer 1, route 2, final
    groups: dict[tuple, list] = {}
    for r in rollouts:
        groups.setdefault(r.group_key, []).append(r)
    assert sorted(groups) == [(f"7:{question.id}", i) for i in range(6)]
    for key, members in groups.items():
        assert len(members) == G
        prompts = {tuple(r.token_ids[: r.prompt_length]) for r in members}
        assert len(prompts) == 1, f"step group {key} saw {len(prompts)} different inputs"
        assert all(r.response_length > 0 for r in members)  # each sample is one model call
    # different steps do see different inputs
    assert len({tuple(m[0].token_ids[: m[0].prompt_length]) for m in groups.values()}) == 6


def test_gold_values_come_from_the_golden_trajectory(step_rollouts, hf_engine):
    question, _, rollouts = step_rollouts
    golden = question.golden_trajectory
    by_step = {r.step_index: r for r in rollouts}
    for index, (phase, i) in enumerate([("route", 0), ("answer", 0), ("route", 1), ("answer", 1), ("route", 2), ("final", 2)]):
        rollout = by_step[index]
        [step] = rollout.outcome.steps
        assert step["phase"] == phase
        prompt_text = hf_engine.tokenizer.decode(rollout.token_ids[: rollout.prompt_length])
        if phase == "route" and i < 2:
            assert step["gold_sub_question"] == golden[i]["query"]
            assert step["gold_knowledge_base"] == GOLD_KB_NAMES[golden[i]["kb"]]
        elif phase == "route":  # past the golden trajectory the gold is the stop action
            assert step["gold_sub_question"] == "None" and step["gold_knowledge_base"] == "None"
        elif phase == "answer":
            assert step["gold_answer"] == golden[i]["answer"]
            assert golden[i]["query"] in prompt_text  # conditioned on the golden sub-question
        else:
            assert rollout.outcome.gold_answers[0] == question.answer
        for earlier in golden[: i if phase != "answer" else 0]:  # the golden prefix, not a sampled one
            assert earlier["answer"] in prompt_text


def test_step_rewards_and_step_grpo_advantages_group_by_step(step_rollouts):
    _, _, rollouts = step_rollouts

    def embed(texts):  # a deterministic bag-of-characters embedding: the reward's maths, not MiniLM's
        out = torch.zeros(len(texts), 64)
        for i, t in enumerate(texts):
            for ch in t.lower():
                out[i, ord(ch) % 64] += 1
        return out.numpy()

    rewards = r1_router_step_rewards([r.outcome for r in rollouts], embed)
    assert len(rewards) == len(rollouts) and all(0.0 <= x <= 1.0 for x in rewards)
    estimator = get_advantage_estimator("step_grpo")
    advantages = estimator(torch.tensor(rewards), [r.group_key for r in rollouts]).advantages
    for key in {r.group_key for r in rollouts}:
        members = [a for r, a in zip(rollouts, advantages.tolist()) if r.group_key == key]
        assert abs(sum(members)) < 1e-5  # centred within each (question, step) group


def test_step_grpo_hand_computed_two_groups():
    keys = [("q", 0), ("q", 0), ("q", 1), ("q", 1)]
    out = get_advantage_estimator("step_grpo")(torch.tensor([1.0, 0.0, 0.5, 0.5]), keys).advantages
    # group (q,0): mean 0.5, sample std 0.7071 -> ±0.7071; group (q,1) uniform -> 0
    assert out.tolist() == pytest.approx([0.70710, -0.70710, 0.0, 0.0], abs=1e-4)
    with pytest.raises(ValueError, match="step index"):
        get_advantage_estimator("step_grpo")(torch.tensor([1.0]), ["q"])


def test_step_reward_refuses_missing_golds_and_free_running_episodes():
    step = {"phase": "route", "route_step": 0, "format_error": False, "sub_question": "who?", "knowledge_base": TEXT_KB,
            "gold_sub_question": None, "gold_knowledge_base": TEXT_KB}
    with pytest.raises(ValueError, match="no gold_sub_question"):
        r1_router_step_rewards([EpisodeOutcome(answer=None, gold_answers=("x",), prompt_id="q1", steps=(step,))],
                               lambda texts: torch.ones(len(texts), 2).numpy())
    with pytest.raises(ValueError, match="one teacher-forced step per rollout"):
        r1_router_step_rewards([EpisodeOutcome(answer=None, gold_answers=("x",), steps=(step, step))], lambda t: None)


def test_questions_without_golden_steps_are_refused_by_name(routing_world):
    from dataclasses import replace

    world, _ = routing_world
    bare = replace(world.questions[0], golden_trajectory=())
    with pytest.raises(ValueError, match=bare.id):
        episode_requests([bare], "0", 2, MultiKBRouteEnv.golden_step_options)
