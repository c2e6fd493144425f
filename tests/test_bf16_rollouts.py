"""bf16 rollouts (issue #68): a bf16 vLLM engine on this CPU synced from a bf16 learner and from an
fp32 one, as a GPU cluster runs it (every peer in bf16).

For each learner dtype: the engine and the learner agree on the sync probe at the start within the
reduced-precision tolerance (``actors.sync_verify.REDUCED_PRECISION_TOLERANCE``, 0.1 nat per token);
one learner step moves the probe by more than that tolerance, so an engine that has not loaded the
step fails the check; after the sync the check passes and the engine's sampled tokens carry the
learner's log-probs within the same tolerance. The drifts are printed (``-rP``) for
docs/benchmarks.md. The step is large (lr 1e-3), so that the move is far above bf16's own noise.
"""

from __future__ import annotations

import pytest

from actors.engines import SamplingParams
from actors.engines.vllm_engine import VLLMEngine
from actors.learner import Learner, LearnerConfig
from actors.sync_verify import REDUCED_PRECISION_TOLERANCE, SyncVerifier, WeightSyncError, default_tolerance, probe_token_ids
from test_engine_contract import QUESTIONS, drift, sample_and_train

# vLLM in bf16 and a learner per case: `make test-integration`
pytestmark = pytest.mark.integration

BF16_ENGINE = {"dtype": "bfloat16", "enforce_eager": True, "kv_cache_gib": 1}
LEARNER = {"model": "smollm2-135m", "zero_stage": 0, "micro_batch_size": 4, "mini_batch_size": 4, "num_threads": 1,
           "seed": 0, "optimizer": {"lr": 1e-3, "weight_decay": 0.0}}


@pytest.fixture(scope="module")
def engine():
    eng = VLLMEngine("smollm2-135m", **BF16_ENGINE)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("learner_dtype", ["bfloat16", "float32"])
def test_a_bf16_engine_follows_each_learner_step_within_the_bf16_tolerance(engine, learner_dtype):
    trained = Learner(LearnerConfig.from_dict({**LEARNER, "dtype": learner_dtype}))
    tolerance = default_tolerance(engine.info()["dtype"])
    assert tolerance == REDUCED_PRECISION_TOLERANCE  # the runtime's choice for a bf16 engine
    tok = trained.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"])
               for q in QUESTIONS]
    original = trained.get_weights().state_dict()
    verifier = SyncVerifier(probe_token_ids(tok, 128), lambda ids, workers: (trained.score_probe(ids), [engine.score_prompt(ids)]),
                            tolerance=tolerance)
    try:
        start = verifier.baseline(1)
        at_start = engine.generate(prompts * 2, SamplingParams(temperature=1.0, seed=3), max_new_tokens=16)
        start_drift = drift(trained, prompts * 2, at_start)
        print(f"{learner_dtype} learner, bf16 engine, same weights: probe {start}, sampled tokens (mean, max) {start_drift}")
        assert start["probe_drift_mean"] <= tolerance and start_drift[0] <= tolerance
        sample_and_train(trained, engine, prompts, seed=5)
        with pytest.raises(WeightSyncError, match="worker 0 at version 1 did not take"):
            verifier.verify(1)  # the engine still holds version 0, and the step moved the probe past the tolerance
        assert engine.update_weights(trained.get_weights()) == trained.version == 1
        checked = verifier.after_sync(1)
        assert checked["probe_learner_moved"] > tolerance  # so the check above could fail, and did
        fresh = engine.generate(prompts * 2, SamplingParams(temperature=1.0, seed=6), max_new_tokens=16)
        after = drift(trained, prompts * 2, fresh)
        print(f"{learner_dtype} learner, bf16 engine, after one step and a sync: probe {checked}, sampled tokens {after}")
        assert {r.weight_version for r in fresh} == {1} and after[0] <= tolerance
    finally:
        assert engine.update_weights(original, version=0) == 0
