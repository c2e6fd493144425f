"""The weight-sync verifier (``actors/sync_verify.py``): its arithmetic by hand, its rule under
hypothesis, and its bookkeeping (baseline, every N-th sync, restarted workers) over given scores.

The real engines and learners go through it in tests/test_engine_contract.py (vLLM, full step and
LoRA), tests/test_weight_sync.py (object store and gloo, on Ray) and the end-to-end vLLM runs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.sync_verify import (FP32_TOLERANCE, PROBE_TEXT, REDUCED_PRECISION_TOLERANCE, SyncVerifier, WeightSyncError,
                                default_tolerance, probe_token_ids, read_probe)
from actors.runtime import sync_verifier
from experiments.recipe.config import load_config
from raggym.models import load_policy_tokenizer

TOL = 1e-4


def test_a_reading_by_hand():
    learner_now = torch.tensor([-1.0, -2.0, -3.0])
    engine_now = torch.tensor([-1.1, -2.0, -3.2])
    learner_ref = torch.tensor([-1.0, -2.0, -2.0])
    engine_ref = torch.tensor([-1.0, -2.3, -3.2])
    r = read_probe(4, 7, learner_now, engine_now, learner_ref, engine_ref)
    assert (r.worker, r.version, r.tokens) == (4, 7, 3)
    assert r.drift_mean == pytest.approx((0.1 + 0.0 + 0.2) / 3)
    assert r.drift_max == pytest.approx(0.2)
    assert r.learner_moved == pytest.approx((0 + 0 + 1.0) / 3)
    assert r.engine_moved == pytest.approx((0.1 + 0.3 + 0.0) / 3)
    assert "differ from the learner's by 0.1 per token" in r.problem(0.05)
    # within 0.11 of the learner, but it moved 0.133, less than half the learner's 0.333
    assert "did not follow the learner: the learner's probe moved 0.333" in r.problem(0.11)
    assert r.problem(0.34) is None  # the learner moved less than the tolerance: agreement alone decides


def test_an_engine_that_moved_too_little_did_not_follow():
    learner_ref = torch.zeros(4)
    learner_now = torch.full((4,), -3e-4)  # the learner moved 3e-4 per token
    engine_ref = torch.zeros(4)
    engine_now = torch.full((4,), -1e-4)  # the engine a third of that: within 2e-4 of the learner, yet behind
    r = read_probe(0, 1, learner_now, engine_now, learner_ref, engine_ref)
    assert r.drift_mean == pytest.approx(2e-4)
    assert "did not follow the learner" in r.problem(2.5e-4)
    assert read_probe(0, 1, learner_now, learner_now, learner_ref, engine_ref).problem(2.5e-4) is None


def test_vectors_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="one length"):
        read_probe(0, 1, torch.zeros(3), torch.zeros(4), torch.zeros(3), torch.zeros(3))


def test_the_tolerance_follows_the_engines_precision():
    assert default_tolerance("float32") == default_tolerance("torch.float32") == default_tolerance(None) == FP32_TOLERANCE
    assert default_tolerance("bfloat16") == default_tolerance("torch.float16") == REDUCED_PRECISION_TOLERANCE


vectors = st.lists(st.floats(-20.0, 0.0, allow_nan=False), min_size=2, max_size=40)


@settings(max_examples=200, deadline=None)
@given(start=vectors, step=st.floats(1.1, 50.0), noise=st.floats(0.0, 0.1), data=st.data())
def test_an_engine_left_on_its_old_weights_always_fails_once_the_learner_moved_past_the_tolerance(start, step, noise, data):
    n = len(start)
    learner_ref = torch.tensor(start, dtype=torch.float64)
    signs = torch.tensor(data.draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n)), dtype=torch.float64)
    learner_now = learner_ref + signs * step * TOL  # every token moved by step·TOL > TOL
    engine_ref = learner_ref + noise * TOL * signs.flip(0)  # the engine's start, within noise of the learner's
    stale = read_probe(0, 1, learner_now, engine_ref, learner_ref, engine_ref)  # it loaded nothing
    assert stale.problem(TOL) is not None
    followed = read_probe(0, 1, learner_now, learner_now + (engine_ref - learner_ref), learner_ref, engine_ref)
    assert followed.problem(TOL) is None  # the same offset before and after: drift ≤ 0.1·TOL, moved as far


class ScoresByHand:
    """A score function over fixed vectors: what the learner and each engine 'hold' right now."""

    def __init__(self, n_workers: int, tokens: int = 5):
        self.learner = torch.linspace(-4.0, -0.5, tokens - 1, dtype=torch.float64)
        self.engines = [self.learner.clone() for _ in range(n_workers)]
        self.calls: list[list[int]] = []

    def __call__(self, ids, workers):
        assert len(ids) == 5
        self.calls.append(list(workers))
        return self.learner.clone(), [self.engines[i].clone() for i in workers]


def make_verifier(scores, every=1) -> SyncVerifier:
    verifier = SyncVerifier([1, 2, 3, 4, 5], scores, tolerance=TOL, every=every)
    verifier.baseline(len(scores.engines))
    return verifier


def test_a_sync_that_loaded_nothing_raises_naming_worker_version_and_drift():
    scores = ScoresByHand(2)
    verifier = make_verifier(scores)
    scores.learner -= 0.01  # a learner step
    scores.engines[0] -= 0.01  # worker 0 took it; worker 1 did not
    with pytest.raises(WeightSyncError, match=r"rollout worker 1 at version 1 did not take: .* by 0\.01 per token") as info:
        verifier.after_sync(1)
    assert (info.value.worker, info.value.version) == (1, 1)
    assert info.value.drift == pytest.approx(0.01)


def test_a_good_sync_reports_its_figures_and_becomes_the_next_reference():
    scores = ScoresByHand(2)
    verifier = make_verifier(scores)
    for version in (1, 2):
        scores.learner -= 0.01
        scores.engines = [e - 0.01 for e in scores.engines]
        metrics = verifier.after_sync(version)
        assert metrics["probe_drift_mean"] == pytest.approx(0.0, abs=1e-12)
        # moved 0.01 since the last check, not 0.02 since the start: the reference advanced
        assert metrics["probe_learner_moved"] == pytest.approx(0.01)
        assert metrics["probe_engine_moved"] == pytest.approx(0.01)
        assert metrics["probe_engines"] == 2.0


def test_every_n_checks_every_nth_sync_against_the_last_checked_one():
    scores = ScoresByHand(1)
    verifier = make_verifier(scores, every=2)
    calls = len(scores.calls)
    scores.learner -= 0.01
    scores.engines[0] -= 0.01
    assert verifier.after_sync(1) == {} and len(scores.calls) == calls  # not due: nothing scored
    scores.learner -= 0.01  # the engine misses this one
    with pytest.raises(WeightSyncError, match="version 2"):
        verifier.after_sync(2)


def test_a_sync_carries_the_probe_when_due_and_its_scores_are_checked_without_a_call_of_its_own():
    scores = ScoresByHand(2)
    verifier = make_verifier(scores, every=2)
    calls = len(scores.calls)
    assert verifier.next_probe() is None  # sync 1: not due, nothing to carry
    assert verifier.next_probe() == [1, 2, 3, 4, 5]  # sync 2 carries the probe
    scores.learner -= 0.01
    scores.engines[0] -= 0.01
    learner, engines = scores([1, 2, 3, 4, 5], [0, 1])  # what the sync's answers bring back
    with pytest.raises(RuntimeError, match="2 engines brought back 1"):
        verifier.check_sync(2, learner, engines[:1])
    metrics = verifier.check_sync(2, learner, [engines[0], engines[0]])
    assert metrics["probe_engine_moved"] == pytest.approx(0.01) and "verify_seconds" not in metrics
    assert len(scores.calls) == calls + 1  # only this test's own call: the verifier scored nothing itself
    scores.learner -= 0.01  # the next step: worker 0 takes it, worker 1 loads nothing
    scores.engines = [engines[0] - 0.01, engines[0]]
    assert verifier.next_probe() is None and verifier.next_probe() is not None
    with pytest.raises(WeightSyncError, match="rollout worker 1 at version 4"):
        verifier.check_sync(4, *scores([1, 2, 3, 4, 5], [0, 1]))


def test_a_restarted_worker_is_measured_from_the_start():
    scores = ScoresByHand(2)
    verifier = make_verifier(scores)
    scores.learner -= 0.01
    scores.engines = [e - 0.01 for e in scores.engines]
    verifier.after_sync(1)
    scores.engines[1] = ScoresByHand(2).engines[1]  # Ray rebuilt it: its initial weights again
    verifier.restarted([1])
    with pytest.raises(WeightSyncError, match="worker 1 at version 1"):  # its resync loaded nothing
        verifier.verify(1, [1])
    scores.engines[1] = scores.learner.clone()  # the resync took
    metrics = verifier.verify(1, [1])
    assert scores.calls[-1] == [1] and metrics["probe_engine_moved"] == pytest.approx(0.01)


def test_engines_that_disagree_at_the_start_are_refused():
    scores = ScoresByHand(1)
    scores.engines[0] = scores.engines[0] + 0.5  # another model altogether
    with pytest.raises(WeightSyncError, match="version 0"):
        make_verifier(scores)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="N >= 1"):
        SyncVerifier([1, 2], ScoresByHand(1), tolerance=TOL, every=0)
    with pytest.raises(ValueError, match="positive"):
        SyncVerifier([1, 2], ScoresByHand(1), tolerance=0.0)
    with pytest.raises(RuntimeError, match="baseline"):
        SyncVerifier([1, 2], ScoresByHand(1), tolerance=TOL).verify(1)
    with pytest.raises(RuntimeError, match="baseline"):
        SyncVerifier([1, 2], ScoresByHand(1), tolerance=TOL).check_sync(1, torch.zeros(1), [torch.zeros(1)])


def test_the_probe_is_a_fixed_prefix_of_its_text():
    tokenizer = load_policy_tokenizer("smollm2-135m")
    ids = probe_token_ids(tokenizer, 128)
    assert len(ids) == 128 and ids == probe_token_ids(tokenizer, 256)[:128]
    assert tokenizer.decode(ids) in PROBE_TEXT
    with pytest.raises(ValueError, match="has .* tokens under this tokenizer"):
        probe_token_ids(tokenizer, 10_000)


def test_the_run_config_sets_the_verifier_and_either_sides_precision_its_default_tolerance():
    tokenizer = load_policy_tokenizer("smollm2-135m")
    flat = lambda ids, workers: ([-1.0] * (len(ids) - 1), [[-1.0] * (len(ids) - 1) for _ in workers])  # noqa: E731
    cfg = load_config("experiments/configs/cpu_tiny.yaml", ["rollout.verify_sync.probe_tokens=32"])
    verifier = sync_verifier(cfg, tokenizer, flat, ("float32", "torch.float32"), 2)
    assert (verifier.tolerance, verifier.every, len(verifier.probe_ids)) == (FP32_TOLERANCE, 1, 32)
    assert sync_verifier(cfg, tokenizer, flat, ("float32", "torch.bfloat16"), 2).tolerance == REDUCED_PRECISION_TOLERANCE
    assert sync_verifier(cfg, tokenizer, flat, ("bfloat16", "torch.float32"), 2).tolerance == REDUCED_PRECISION_TOLERANCE
    tuned = load_config("experiments/configs/cpu_tiny.yaml", ["rollout.verify_sync.tolerance=0.002",
                                                              "rollout.verify_sync.every=4"])
    assert (sync_verifier(tuned, tokenizer, flat, ("bfloat16", None), 1).tolerance,
            sync_verifier(tuned, tokenizer, flat, ("bfloat16", None), 1).every) == (0.002, 4)
    off = load_config("experiments/configs/cpu_tiny.yaml", ["rollout.verify_sync.every=0"])
    assert sync_verifier(off, tokenizer, flat, ("float32", None), 1) is None
