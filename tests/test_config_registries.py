"""experiments.recipe.config: the open registries (reward methods, advantage estimators, gymnasium env
ids, engines) accept what users register and reject unknown names with the known ones listed;
configs built in Python and edited configs are checked like loaded ones."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gymnasium
import pytest

from experiments.recipe.config import ConfigError, config_from_dict, load_config, to_plain, validate_config
from experiments.recipe.training import mode_choice_slot

TINY = "experiments/configs/search_r1_tiny.yaml"


def _custom_reward(options: dict):
    from raggym.rewards import exact_match
    from raggym.rewards.schedules import RewardSchedule, StageSchedule

    unknown = set(options) - {"cost"}
    if unknown:
        raise ValueError(f"em_cost reward config: unknown key(s) {sorted(unknown)}")
    cost = float(options.get("cost", 0.1))
    return RewardSchedule("em_cost", StageSchedule(("main",), (0,)), {
        "main": lambda outcomes: [exact_match(o.answer, o.gold_answers) - cost * o.retrieval_count for o in outcomes]})


@pytest.fixture
def em_cost_reward():
    from raggym.rewards.schedules import CUSTOM_SCHEDULES, register_reward_schedule

    register_reward_schedule("em_cost", _custom_reward)
    yield "em_cost"
    CUSTOM_SCHEDULES.pop("em_cost", None)


def test_a_registered_reward_method_is_accepted_and_its_keys_reach_its_builder(em_cost_reward):
    from raggym.rewards import EpisodeOutcome
    from raggym.rewards.schedules import reward_schedule_from_config

    cfg = load_config(TINY, ["method=em_cost", "reward.method=em_cost", "reward.cost=0.25"])
    assert cfg.method == cfg.reward.method == "em_cost" and cfg.reward.cost == 0.25
    schedule = reward_schedule_from_config(to_plain(cfg.reward))
    right = EpisodeOutcome(answer="Paris", gold_answers=("Paris",), queries=("a", "b"))
    assert schedule(0)([right]) == [pytest.approx(0.5)]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["method=em_kost", "reward.method=em_kost"])
    message = str(err.value)
    assert "override: method: unknown method 'em_kost'" in message
    assert "override: reward.method: unknown reward method 'em_kost'" in message
    assert "'em_cost'" in message and "'routerag'" in message and "'r1_router'" in message


@dataclass(frozen=True)
class EMCostKeys:
    cost: float = 0.1


def _custom_reward_of_section(options: EMCostKeys):
    return _custom_reward({"cost": options.cost})


@pytest.fixture
def typed_em_cost_reward():
    from raggym.rewards.schedules import CUSTOM_SCHEDULES, REWARD_SECTIONS, register_reward_schedule

    register_reward_schedule("em_cost_typed", _custom_reward_of_section, section=EMCostKeys)
    yield "em_cost_typed"
    CUSTOM_SCHEDULES.pop("em_cost_typed", None)
    REWARD_SECTIONS.pop("em_cost_typed", None)


def test_a_reward_registered_with_a_section_has_its_keys_checked_at_load(typed_em_cost_reward):
    from raggym.rewards import EpisodeOutcome
    from raggym.rewards.schedules import register_reward_schedule, reward_schedule_from_config

    typed = [f"method={typed_em_cost_reward}", f"reward.method={typed_em_cost_reward}"]
    cfg = load_config(TINY, [*typed, "reward.cost=0.25"])
    schedule = reward_schedule_from_config(to_plain(cfg.reward))  # the builder gets an EMCostKeys
    right = EpisodeOutcome(answer="Paris", gold_answers=("Paris",), queries=("a", "b"))
    assert schedule(0)([right]) == [pytest.approx(0.5)]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [*typed, "reward.cost=cheap", "reward.cots=1"])
    assert str(err.value).splitlines()[1:] == [
        "  override: reward.cost: must be float, got 'cheap' (str)",
        "  override: unknown config key 'reward.cots': no 'cots' under 'reward'; known: ['cost']"]
    with pytest.raises(TypeError, match="must be a dataclass"):
        register_reward_schedule("em_cost_untyped", _custom_reward, section=dict)


@pytest.fixture
def estimator():
    from raggym.algorithms.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    @register_advantage_estimator("centred_only")
    def centred_only(rewards, group_keys, outcomes=(), **options):
        return ADVANTAGE_ESTIMATORS["grpo"](rewards, group_keys, outcomes, normalize_by_std=False)

    yield "centred_only"
    ADVANTAGE_ESTIMATORS.pop("centred_only", None)


def test_a_registered_advantage_estimator_is_accepted(estimator):
    from raggym.algorithms.advantages import register_advantage_estimator

    assert load_config(TINY, [f"advantage.estimator={estimator}"]).advantage.estimator == estimator
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator(estimator)(lambda *a, **k: None)
    with pytest.raises(ConfigError, match=r"override: advantage.estimator: unknown estimator 'grpoo'; known: \[.*'centred_only'.*'grpo'"):
        load_config(TINY, ["advantage.estimator=grpoo"])


@pytest.fixture
def custom_env_ids():
    from envs import RagSearchEnv

    class ThriftyEnv(RagSearchEnv):
        def __init__(self, retriever, questions=None, dialect="search_r1", *, penalty: float = 0.1, **kwargs):
            super().__init__(retriever, questions, dialect, **kwargs)
            self.penalty = penalty

    ids = {"by_string": "raggym-test/Search-v0", "by_class": "raggym-test/Thrifty-v0"}
    gymnasium.register(ids["by_string"], entry_point="envs.rag_search_env:RagSearchEnv", kwargs={"dialect": "search_r1"})
    gymnasium.register(ids["by_class"], entry_point=ThriftyEnv)
    yield ids
    for env_id in ids.values():
        gymnasium.registry.pop(env_id, None)


def test_env_ids_come_from_gymnasiums_registry_and_kwargs_from_the_entry_point(custom_env_ids):
    cfg = load_config(TINY, [f"env.id={custom_env_ids['by_string']}", "env.kwargs.top_k=2", "eval.env_kwargs.retrieval_budget=6"])
    assert cfg.env.id == custom_env_ids["by_string"] and cfg.env.kwargs.top_k == 2
    with pytest.raises(ConfigError, match=r"override: unknown config key 'env.kwargs.topk': no 'topk' under 'env.kwargs'"):
        load_config(TINY, [f"env.id={custom_env_ids['by_string']}", "env.kwargs.topk=2"])
    with pytest.raises(ConfigError, match=r"override: env.kwargs.top_k: must be int, got 'two'"):
        load_config(TINY, [f"env.id={custom_env_ids['by_string']}", "env.kwargs.top_k=two"])
    # a subclass's own keyword and, through its **kwargs, RagSearchEnv's; the trainer's own arguments stay out
    by_class = f"env.id={custom_env_ids['by_class']}"
    assert load_config(TINY, [by_class, "env.kwargs.penalty=0.5", "env.kwargs.top_k=1"]).env.kwargs.penalty == 0.5
    with pytest.raises(ConfigError, match=r"env.kwargs.penalty: must be float"):
        load_config(TINY, [by_class, "env.kwargs.penalty=high"])
    with pytest.raises(ConfigError, match=r"unknown config key 'env.kwargs.reward_fn'"):
        load_config(TINY, [by_class, "env.kwargs.reward_fn=em"])
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["env.id=raggym/SerchR1-v0"])
    message = str(err.value)
    assert "override: env.id: unknown environment 'raggym/SerchR1-v0'" in message
    assert "'raggym/SearchR1-v0'" in message and message.count("unknown environment") == 1


def test_engines_by_import_string_or_registered_name():
    from actors.engines.rollout_worker import ENGINE_FACTORIES, register_engine

    cfg = load_config(TINY, ["rollout.engine=actors.engines.hf:HFEngine", "rollout.engine_kwargs.device=cpu"])
    assert cfg.rollout.engine == "actors.engines.hf:HFEngine"
    with pytest.raises(ConfigError, match=r"override: unknown config key 'rollout.engine_kwargs.devise'"):
        load_config(TINY, ["rollout.engine=actors.engines.hf:HFEngine", "rollout.engine_kwargs.devise=cpu"])
    with pytest.raises(ConfigError, match=r"rollout.engine: cannot import engine 'actors.engines.hf:HfEngine'"):
        load_config(TINY, ["rollout.engine=actors.engines.hf:HfEngine"])
    with pytest.raises(ConfigError, match=r"rollout.engine: unknown engine 'hff'; known: \['hf', 'vllm'"):
        load_config(TINY, ["rollout.engine=hff"])

    def tiny_hf(**kwargs):  # a factory function: its keywords go wherever it sends them
        from actors.engines.hf import HFEngine

        return HFEngine(**kwargs)

    register_engine("tiny-hf", tiny_hf)
    try:
        assert load_config(TINY, ["rollout.engine=tiny-hf", "rollout.engine_kwargs.anything=1"]).rollout.engine == "tiny-hf"
    finally:
        ENGINE_FACTORIES.pop("tiny-hf", None)


def test_configs_built_in_python_or_edited_are_checked_like_loaded_ones():
    cfg = config_from_dict({"run": {"steps": 5}, "learner": {"zero_stage": 0}}, source="demo")
    assert cfg.run.steps == 5 and cfg.learner.zero_stage == 0 and cfg.run.keep_checkpoints == 2
    with pytest.raises(ConfigError) as err:  # every bad key is reported, not only the first
        config_from_dict({"run": {"steps": "five", "stepz": 1}, "learner": {"zero_stag": 0}}, source="demo")
    lines = str(err.value).splitlines()[1:]
    assert lines == ["  demo: run.steps: must be int, got 'five' (str)",
                     "  demo: unknown config key 'run.stepz': no 'stepz' under 'run'; known: ['checkpoint_every', "
                     "'dump_trajectories', 'keep_checkpoints', 'keep_policy_every', 'name', 'out_dir', 'resume', 'seed', 'steps']",
                     lines[2]]
    assert lines[2].startswith("  demo: unknown config key 'learner.zero_stag'")
    cfg.method = "no_such_method"  # a fixed section's str field accepts it; validation does not
    with pytest.raises(ConfigError, match=r"method: unknown method 'no_such_method'"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match=r"config: unknown config key 'policy.name'"):
        validate_config({"policy": {"name": "x"}})


@pytest.mark.parametrize("key", ["mode_entropy_coef", "mode_pg_coef"])
def test_the_mode_choice_terms_need_searches_that_name_a_mode(key):
    configs = Path(__file__).resolve().parents[1] / "experiments" / "configs"
    on = [f"learner.loss.{key}=1.0"]
    cfg = load_config(str(configs / "routerag_tiny.yaml"), on)
    assert cfg.learner.loss[key] == 1.0
    # the trainer then hands the learner the mode-choice tokens (the batch's mode_choice_mask)
    assert mode_choice_slot(cfg) and mode_choice_slot(load_config(str(configs / "routerag_tiny.yaml"))) is None
    with pytest.raises(ConfigError, match=rf"learner.loss.{key}: raggym/SearchR1-v0's searches name no retrieval mode"):
        load_config(str(configs / "search_r1_tiny.yaml"), on)
    with pytest.raises(ConfigError, match=rf"learner.loss.{key}: must be non-negative"):
        load_config(str(configs / "routerag_tiny.yaml"), [f"learner.loss.{key}=-0.1"])
