"""The recipe's small components on hand-built inputs: batch assembly, log-prob drift, episode
requests, outcome round trips, evaluation records, step metrics."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from raggym.algorithms.batch import assemble_batch, make_train_batch
from raggym.algorithms.policy_loss import register_policy_loss_term
from raggym.rewards import EpisodeOutcome
from raggym.trajectory import Rollout


def _rollout(ids, mask, logprobs, prompt_id="0:q1", sample=0, answer="Paris", step=0, **outcome):
    return Rollout(token_ids=list(ids), loss_mask=list(mask), sampled_logprobs=list(logprobs),
                   span_labels=[0] * len(ids), prompt_length=mask.index(1) if 1 in mask else len(ids),
                   prompt_id=prompt_id, step_index=step, sample_index=sample,
                   outcome=EpisodeOutcome(answer=answer, gold_answers=("Paris",), **outcome),
                   turns=[{"weight_version": 3}])


def test_logprob_drift_is_the_masked_mean_and_max_gap():
    from actors.learner import _logprob_drift, _mean_metrics

    sampled = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    recomputed = torch.tensor([[0.0, -1.5, -1.0], [-9.0, -0.25, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    drift = _logprob_drift(sampled, recomputed, mask)
    # |gaps| on trained tokens: 0.5, 1.0, 0.25 (the −9 at an untrained position does not count)
    gaps = {k: v for k, v in drift.items() if k.startswith("logprob_drift")}
    assert gaps == pytest.approx({"logprob_drift_mean": 1.75 / 3, "logprob_drift_max": 1.0, "logprob_drift_tokens": 3})
    # and the mismatch diagnostics beside them (raggym.algorithms.rollout_correction): log ρ = −0.5, 1.0, 0.25
    assert drift["rollout_is/kl_k1"] == pytest.approx(-0.75 / 3)  # E[−log ρ]
    assert set(drift) - set(gaps) == {"rollout_is/kl_k1", "rollout_is/kl_k3", "rollout_is/ppl_ratio",
                                      "rollout_is/chi2_token", "rollout_is/chi2_seq"}
    assert _logprob_drift(None, recomputed, mask) == {}
    # across learners: the worst token overall, the mean weighted by each rank's tokens
    ranks = [{"logprob_drift_mean": 0.5, "logprob_drift_max": 1.0, "logprob_drift_tokens": 3.0, "update_seconds": 1.0},
             {"logprob_drift_mean": 0.1, "logprob_drift_max": 2.0, "logprob_drift_tokens": 1.0, "update_seconds": 2.0}]
    merged = _mean_metrics(ranks)
    assert merged["logprob_drift_max"] == 2.0 and merged["logprob_drift_mean"] == pytest.approx(1.6 / 4)


def test_assemble_batch_pads_with_inert_rows_and_carries_sampled_logprobs():
    rollouts = [_rollout([5, 6, 7], [0, 1, 1], [0.0, -0.1, -0.2]),
                _rollout([5, 6], [0, 1], [0.0, -0.3], sample=1),
                _rollout([5, 8, 9, 4], [0, 1, 0, 1], [0.0, -0.4, 0.0, -0.5], sample=2)]
    batch, fillers = assemble_batch(rollouts, [1.0, -1.0, 0.5], pad_token_id=0, multiple=2)
    assert fillers == 1 and batch.token_ids.shape == (4, 4)
    assert batch.sampled_logprobs[2].tolist() == pytest.approx([0.0, -0.4, 0.0, -0.5])
    assert batch.sampled_logprobs[1].tolist() == pytest.approx([0.0, -0.3, 0.0, 0.0])
    assert batch.loss_mask[3].sum() == 0 and batch.advantages[3] == 0  # the filler trains nothing
    assert batch.advantages[:3].tolist() == [1.0, -1.0, 0.5]


def test_a_train_batch_checks_its_fields_slices_them_and_pads_with_inert_rows():
    batch = make_train_batch([[1, 2, 3], [4, 5], [6]], [[0, 1, 1], [0, 1], [0]], [1.0, -1.0, 0.5])
    # a field of another row count or length is named at construction, and so is an unset required one
    with pytest.raises(ValueError, match=r"TrainBatch.old_logprobs has 2 rows, token_ids 3"):
        replace(batch, old_logprobs=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"TrainBatch.mode_choice_mask has shape \(3, 4\)"):
        replace(batch, mode_choice_mask=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="TrainBatch.evidence_overlap has 2 rows"):
        replace(batch, evidence_overlap=torch.zeros(2))
    with pytest.raises(TypeError, match="TrainBatch.loss_mask must be a tensor"):
        replace(batch, loss_mask=None)
    # extra fields by name: an unknown one raises, here and for a loss term that would read it
    with pytest.raises(TypeError, match="mode_choice_masks"):
        assemble_batch([_rollout([5, 6], [0, 1], [0.0, -0.3])], [1.0], pad_token_id=0, multiple=1,
                       extra={"mode_choice_masks": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match="reads batch fields \\['mode_mask'\\]"):
        register_policy_loss_term("reads_a_typo", batch_keys=("mode_mask",))
    # rows(): every set field sliced alike, the unset ones stay unset
    full = replace(batch, sampled_logprobs=torch.arange(9.0).reshape(3, 3), evidence_overlap=torch.tensor([0.1, 0.2, 0.3]))
    picked = full.rows(torch.tensor([2, 0]))
    assert picked.num_rows == 2 and set(picked.tensors()) == set(full.tensors())
    for name, value in full.tensors().items():
        assert torch.equal(getattr(picked, name), value[[2, 0]]), name
    assert picked.old_logprobs is None and picked.mode_choice_mask is None and picked.teacher_positions is None
    # filler rows: copies of row 0 with every mask and advantage a loss or a count reads zeroed
    marked = replace(full, mode_choice_mask=torch.ones(3, 3), teacher_kl_mask=torch.ones(3, 3))
    padded = marked.with_filler_rows(2)
    assert padded.num_rows == 5 and marked.with_filler_rows(0) is marked
    for name in ("token_ids", "attention_mask", "sampled_logprobs", "evidence_overlap"):
        assert torch.equal(getattr(padded, name)[3:], getattr(marked, name)[:1].expand_as(getattr(padded, name)[3:])), name
    for name in ("loss_mask", "advantages", "mode_choice_mask", "teacher_kl_mask"):
        assert not getattr(padded, name)[3:].any(), name
        assert torch.equal(getattr(padded, name)[:3], getattr(marked, name)), name
    assert marked.mode_choice_mask.sum() == 9  # the batch padded is left as it was


def test_episode_requests_share_the_prompt_id_within_a_group():
    from experiments.recipe.training import episode_requests
    from raggym.data import Question

    qs = [Question(id="a", question="A?", answers=["x"]), Question(id="b", question="B?", answers=["y"])]
    plain = episode_requests(qs, "4", 3)
    assert [(r.prompt_id, r.sample_index, r.step_index) for r in plain] == \
        [("4:a", 0, 0), ("4:a", 1, 0), ("4:a", 2, 0), ("4:b", 0, 0), ("4:b", 1, 0), ("4:b", 2, 0)]
    steps = episode_requests(qs[:1], "4", 2, lambda q: [{"phase": "route", "step_index": 0}, {"phase": "final", "step_index": 1}])
    assert [(r.step_index, r.options) for r in steps] == [(0, {"phase": "route"})] * 2 + [(1, {"phase": "final"})] * 2


def test_outcome_round_trips_steps_and_env_reward_and_caches_its_metrics():
    step = {"phase": "answer", "answer": "Paris", "gold_answer": "Paris"}
    o = EpisodeOutcome(answer="paris", gold_answers=("Paris", "City of Light"), steps=(step,), env_reward=1.0,
                       retrieved_texts=(("Paris is the capital",),), gold_passages=("Paris is the capital",))
    assert (o.em, o.f1, o.evidence_overlap) == (1.0, 1.0, 1.0)
    back = EpisodeOutcome.from_dict(o.as_dict())
    assert back == o and back.steps == (step,) and back.env_reward == 1.0
    assert EpisodeOutcome.from_dict({"answer": None, "gold_answers": ["x"], "reward": 0.0}).env_reward == 0.0


def test_episode_records_join_the_calls_of_one_episode():
    from experiments.eval.harness import episode_records

    calls = [_rollout([1, 2], [0, 1], [0, -1], prompt_id="e:q", step=0),
             _rollout([3, 4, 5], [0, 1, 1], [0, -1, -1], prompt_id="e:q", step=1),
             _rollout([6, 7], [0, 1], [0, -1], prompt_id="e:r", step=0)]
    records = episode_records(calls)
    assert len(records) == 2 and records[0]["loss_mask"] == [0, 1, 0, 1, 1] and records[0]["step_index"] == 1


def test_step_metrics_by_hand():
    from experiments.recipe.training import step_metrics

    rollouts = [_rollout([1, 2, 3], [0, 1, 1], [0, -1, -1], answer="Paris", env_reward=1.0, queries=("a", "b")),
                _rollout([1, 2], [0, 1], [0, -1], answer=None, env_reward=0.0)]
    m = step_metrics(rollouts, [1.0, 0.0], [0.7, -0.7])
    assert m["em"] == 0.5 and m["answered"] == 0.5 and m["retrievals_mean"] == 1.0
    assert m["reward_mean"] == 0.5 and m["env_reward_mean"] == 0.5 and m["advantage_abs_mean"] == pytest.approx(0.7)
    assert m["response_tokens_mean"] == 1.5 and m["sequence_tokens_mean"] == 2.5


def test_a_resumed_run_rewinds_its_step_logs_to_the_checkpoint(tmp_path):
    from raggym.learning_log import MetricsLogger

    logger = MetricsLogger(tmp_path)
    for step in (1, 2, 3):
        logger.log({"step": step, "reward_mean": step / 10})
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/em": 0.5}) + "\n" for s in (2, 3)))
    assert logger.rewind(2) == 2  # step 3's metrics line and its eval line
    logger.log({"step": 3, "reward_mean": 0.9})
    logger.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["reward_mean"] == 0.9
    assert [json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [2]
