"""BatchedStepWrapper and batched_step_env: wrappers a user applies survive batched stepping."""

from __future__ import annotations

import gymnasium
import pytest

from envs import BatchedStepWrapper, RetrievalRequest, StepResult, batched_step_env, run_retrieval, step_batch
from test_envs_support import QUESTIONS, make_retriever

NOLAN, _ = QUESTIONS
SEARCH = "<think>Who directed Inception?</think><search> [graph] director of Inception </search>"
ANSWER = "<think>He was born in London.</think><answer> London </answer>"
SEGMENTS = ["junk", SEARCH, "<think>only thinking</think>", ANSWER]


class FormatErrorPenalty(BatchedStepWrapper):
    """Reward shaping: -0.1 for every turn with a format error."""

    def transform_result(self, result: StepResult) -> StepResult:
        if result.info.get("format_error"):
            return result._replace(reward=result.reward - 0.1)
        return result


class DoubleReward(BatchedStepWrapper):
    def transform_result(self, result: StepResult) -> StepResult:
        return result._replace(reward=2 * result.reward, info={**result.info, "doubled": True})


class QuestionIdInResetInfo(gymnasium.Wrapper):
    """A reset-side wrapper: it leaves step alone, so batched stepping may go around it."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {**info, "seen_by_wrapper": True}


def make(**kwargs):
    return gymnasium.make("raggym/RouteRAG-v0", retriever=make_retriever(), questions=[NOLAN], **kwargs)


def rewards_through_step(env) -> list[float]:
    env.reset(seed=0)
    return [env.step(segment)[1] for segment in SEGMENTS]


def rewards_through_protocol(env) -> list[float]:
    """What the rollout loop does: reset the outermost object, step the batched one."""
    env.reset(seed=0)
    stepping = batched_step_env(env)
    rewards = []
    for segment in SEGMENTS:
        outcome = stepping.begin_step(segment)
        if isinstance(outcome, RetrievalRequest):
            outcome = stepping.finish_step(outcome, run_retrieval([outcome])[0])
        rewards.append(outcome.reward)
    return rewards


def test_reward_shaping_is_the_same_through_step_step_batch_and_the_protocol():
    plain = rewards_through_step(make())
    assert plain == [0.0, 0.0, 0.0, 1.0]
    shaped = [-0.1, 0.0, -0.1, 1.0]
    assert rewards_through_step(FormatErrorPenalty(make())) == pytest.approx(shaped)
    assert rewards_through_protocol(FormatErrorPenalty(make())) == pytest.approx(shaped)
    batch = [FormatErrorPenalty(make()) for _ in range(2)]
    for env in batch:
        env.reset(seed=0)
    per_step = [step_batch(batch, [segment, segment]) for segment in SEGMENTS]
    assert [[r.reward for r in results] for results in per_step] == [[pytest.approx(x)] * 2 for x in shaped]
    assert batch[0].record.reward == 1.0  # the environment's own reward is untouched; the wrapper shapes results


def test_wrappers_nest_innermost_first_and_forward_the_protocol_attributes():
    inner = make()
    env = DoubleReward(FormatErrorPenalty(inner))
    assert batched_step_env(env) is env and env.stepping_env is env.env
    assert env.stop_strings == inner.unwrapped.stop_strings and env.dialect is inner.unwrapped.dialect
    assert env.context_mode == "append"
    assert rewards_through_step(env) == pytest.approx([-0.2, 0.0, -0.2, 2.0])
    assert env.record is inner.unwrapped.record and env.record.answer == "London"
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.truncate("response_tokens")
    assert truncated and not terminated and reward == 0.0 and info["doubled"] and info["episode"] is env.record
    assert env.record.truncation_reason == "response_tokens"


def test_make_default_wrappers_and_reset_side_wrappers_pass_through():
    env = make()
    chain = []
    layer = env
    while isinstance(layer, gymnasium.Wrapper):
        chain.append(type(layer).__name__)
        layer = layer.env
    assert chain == ["OrderEnforcing", "PassiveEnvChecker"]
    assert batched_step_env(env) is env.unwrapped
    unchecked = make(disable_env_checker=True)
    assert batched_step_env(unchecked) is unchecked.unwrapped
    reset_side = QuestionIdInResetInfo(make())
    assert batched_step_env(reset_side) is reset_side.unwrapped
    assert reset_side.reset(seed=0)[1]["seen_by_wrapper"]
    assert batched_step_env(env.unwrapped) is env.unwrapped


def test_a_wrapper_that_overrides_step_is_refused_by_name():
    transformed = gymnasium.wrappers.TransformReward(make(), lambda r: r - 1.0)
    with pytest.raises(TypeError, match=r"TransformReward overrides step\(\).*subclass envs.BatchedStepWrapper.*transform_result"):
        batched_step_env(transformed)
    transformed.reset(seed=0)
    with pytest.raises(TypeError, match="TransformReward"):
        step_batch([transformed], [ANSWER])
    with pytest.raises(TypeError, match="TransformReward"):
        FormatErrorPenalty(transformed)  # refused when built, not when first stepped
    # TimeLimit, which gymnasium.make adds for max_episode_steps, would be bypassed the same way.
    with pytest.raises(TypeError, match="TimeLimit"):
        batched_step_env(make(max_episode_steps=3))


def test_an_environment_without_the_protocol_is_refused_naming_what_is_missing():
    cartpole = gymnasium.make("CartPole-v1").unwrapped  # without the TimeLimit its spec adds
    with pytest.raises(TypeError, match="CartPoleEnv does not implement the batched-step protocol") as error:
        batched_step_env(cartpole)
    for name in ("begin_step", "finish_step", "truncate", "check_step_call", "stop_strings", "record", "context_mode"):
        assert name in str(error.value)
