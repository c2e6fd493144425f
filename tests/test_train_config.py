import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.recipe.config import ConfigError, config_from_dict, load_config
from raggym.data.sampler import PromptSampler


def test_yaml_and_overrides_merge_over_defaults(tmp_path):
    cfg = load_config("experiments/configs/cpu_tiny.yaml", ["run.steps=7", "rollout.group_size=3"])
    assert cfg.run.steps == 7 and cfg.rollout.group_size == 3
    assert cfg.run.keep_checkpoints == 2  # a default the YAML does not set
    assert cfg.learner.zero_stage == 2 and cfg.num_learners == 2


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("runn: {steps: 2}\n")
    with pytest.raises(ValueError, match="unknown config sections.*runn"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["run.steps"])


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config("experiments/configs/cpu_tiny.yaml", overrides)
    return str(err.value).splitlines()[1:]


def test_the_learner_section_is_typed_and_refuses_what_the_trainer_sets():
    assert _problems(["learner.micro_batch_size=two"]) == ["  override: learner.micro_batch_size: must be int, got 'two' (str)"]
    [unknown] = _problems(["learner.micro_batch_sise=2"])
    assert unknown.startswith("  override: unknown config key 'learner.micro_batch_sise': no 'micro_batch_sise' under "
                              "'learner'; known: ['cpu_shm_comm', ")
    assert "'micro_batch_size'" in unknown and "'model'" not in unknown  # the trainer's keys are not offered
    assert _problems(["learner.model=Qwen/Qwen2.5-3B"]) == [
        "  override: learner.model: cannot be set here: the learner trains policy.model (or the SFT policy)"]
    assert _problems(["learner.temperature=0.5", "learner.loss.evidence_threshold=0.2"]) == [
        "  override: learner.temperature: cannot be set here: set rollout.temperature (the learner divides logits by it)",
        "  override: learner.loss.evidence_threshold: cannot be set here: set reward.evidence_threshold (θ_P, used by "
        "the routes and the teacher KL alike)"]
    cfg = load_config("experiments/configs/cpu_tiny.yaml", ["learner.optimizer.betas=[0.8,0.9]"])
    assert tuple(cfg.learner.optimizer.betas) == (0.8, 0.9) and cfg.learner.max_logprob_drift == 0.02  # a default


def test_the_typed_sections_own_value_checks_run_at_load_time():
    assert _problems(["learner.loss.terms=[]"]) == [
        "  override: learner.loss.terms: is empty: name at least one policy-loss term (null: the default terms)"]
    assert _problems(["learner.lora={r: 0}"]) == ["  override: learner: LoRA r must be at least 1, got 0"]
    assert _problems(["data.synthetic.n_entities=10"]) == ["  override: data.synthetic: n_entities must be at least 60, got 10"]
    assert _problems(["data.synthetic.max_hops=many"]) == ["  override: data.synthetic.max_hops: must be int, got 'many' (str)"]
    world = load_config(None).data.synthetic  # the default world: small, the rest WorldConfig's defaults
    assert (world.seed, world.n_entities, world.n_questions, world.max_hops) == (0, 300, 60, 4)


def test_the_reward_section_is_typed_by_its_method():
    assert _problems(["reward.stage2_start=abc"]) == ["  override: reward.stage2_start: must be int, got 'abc' (str)"]
    configs = "experiments/configs/"
    with pytest.raises(ConfigError, match=r"override: reward.sft_steps: cannot be set here: the SFT cold start is "
                                          r"the sft: section \(sft.enabled, sft.epochs\)"):
        load_config(configs + "graphrag_r1_tiny.yaml", ["reward.sft_steps=2"])
    with pytest.raises(ConfigError, match=r"override: reward.route_weights: cannot be set here: set advantage.route_weights"):
        load_config(configs + "pathrouter_tiny.yaml", ["reward.route_weights=[1.0,1.0,1.0,1.0]"])
    with pytest.raises(ConfigError, match=r"override: unknown config key 'reward.judge.modle': no 'modle' under "
                                          r"'reward.judge'; known: \['device', 'engine', 'max_new_tokens', 'model'\]"):
        load_config(configs + "lws_tiny.yaml", ["reward.judge.modle=policy"])
    with pytest.raises(ConfigError, match=r"demo: reward.stage2_start: is required for lws"):
        config_from_dict({"method": "lws", "reward": {"method": "lws"}, "env": {"id": "raggym/LWS-v0"}}, source="demo")


def test_open_sections_keep_the_keys_written_with_the_types_checked():
    cfg = config_from_dict({"env": {"kwargs": {"top_k": "3"}}, "reward": {"stage2_start": "5"}})
    assert cfg.env.kwargs == {"top_k": 3} and cfg.reward == {"method": "routerag", "stage2_start": 5}


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 30), size=st.integers(1, 12), cut=st.integers(0, 6), seed=st.integers(0, 2**31))
def test_sampler_resumes_exactly(n, size, cut, seed):
    straight = PromptSampler(n, seed)
    expected = [straight.next_batch(size) for _ in range(cut + 3)]
    first = PromptSampler(n, seed)
    got = [first.next_batch(size) for _ in range(cut)]
    state = first.state_dict()
    import json

    resumed = PromptSampler(n, seed + 1)  # a different seed: the state must override it
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the checkpoint is JSON
    got += [resumed.next_batch(size) for _ in range(3)]
    assert got == expected
    # every pass over the data visits each question once
    flat = [i for b in expected for i in b]
    for p in range(len(flat) // n):
        assert sorted(flat[p * n : (p + 1) * n]) == list(range(n))


def test_a_shared_runtime_serves_only_runs_with_its_episode_limits_and_policy():
    from raggym.config_nodes import EPISODE_LIMITS, check_runtime_serves

    built = load_config("experiments/configs/cpu_tiny.yaml")
    check_runtime_serves(built, load_config("experiments/configs/cpu_tiny.yaml", ["run.steps=9"]), EPISODE_LIMITS, "train")
    for override, key in (("rollout.max_turn_tokens=7", "rollout.max_turn_tokens"), ("env.id=raggym/SearchR1-v0", "env.id"),
                          ("rollout.response_budget_counts=model_and_observations", "rollout.response_budget_counts")):
        run = load_config("experiments/configs/cpu_tiny.yaml", [override])
        with pytest.raises(ValueError, match=rf"evaluate: the given runtime was built with {key}=.*this run asks for {key}="):
            check_runtime_serves(built, run, EPISODE_LIMITS, "evaluate")
    other_policy = load_config("experiments/configs/cpu_tiny.yaml", ["policy.model=/elsewhere"])
    check_runtime_serves(built, other_policy, EPISODE_LIMITS, "evaluate")  # an evaluation names its policy itself
    with pytest.raises(ValueError, match="policy.model"):
        check_runtime_serves(built, other_policy, ("policy.model", *EPISODE_LIMITS), "train")


def test_a_reward_value_its_config_refuses_fails_at_load_not_at_train_start():
    assert _problems(["reward.time_source=minutes"]) == [
        "  override: reward: time_source must be one of seconds, cost, got 'minutes'"]
    assert load_config("experiments/configs/cpu_tiny.yaml", ["reward.time_source=cost"]).reward.time_source == "cost"


def test_the_sync_check_settings_are_validated():
    problems = _problems(["rollout.verify_sync.every=-1", "rollout.verify_sync.tolerance=0",
                          "rollout.verify_sync.probe_tokens=1"])
    assert any("rollout.verify_sync.every" in p and "non-negative" in p for p in problems), problems
    assert any("rollout.verify_sync.tolerance" in p and "positive" in p for p in problems), problems
    assert any("rollout.verify_sync.probe_tokens" in p and "at least 2" in p for p in problems), problems


def test_the_rollout_dtype_reaches_the_engine_and_may_not_contradict_its_kwargs():
    from actors.runtime import engine_kwargs

    bf16 = load_config(None, ["rollout.dtype=bfloat16"])
    assert engine_kwargs(bf16, in_process=True)["dtype"] == "bfloat16"
    assert "dtype" not in engine_kwargs(load_config(None, []), in_process=True)  # the engine's own default
    problems = _problems(["rollout.dtype=bfloat16", "rollout.engine_kwargs.dtype=float32"])
    assert any("rollout.dtype" in p and "set one of them" in p for p in problems), problems
    problems = _problems(["rollout.dtype=fp16"])
    assert any("rollout.dtype" in p for p in problems), problems


def test_a_rollout_correction_needs_pi_old_from_the_learners_pass():
    problems = _problems(["learner.loss.rollout_correction={level: token}"])
    assert any("old_logprobs: recompute" in p for p in problems), problems
    cfg = load_config(None, ["learner.loss.rollout_correction={level: sequence, kind: mask}", "learner.old_logprobs=recompute"])
    assert cfg.learner.loss.rollout_correction.kind == "mask"
