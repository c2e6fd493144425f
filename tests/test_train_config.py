import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.config import load_config
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
