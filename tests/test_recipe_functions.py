"""Each recipe's trainer-side functions on hand-built inputs, with hand-computed expected values.

PathRouter's route-conditioned advantages (through the estimator registry, as ``train()`` calls
them) and its teacher inputs; R1-Router's per-step rewards; DAPO's dynamic-sampling filter and
the per-round seeds of its resampling; batch assembly with teacher fields and filler rows.
Every option that another part of the code may default differently is passed explicitly, so
these tests pin the functions' arithmetic rather than today's defaults. (LoRA is covered on a
tiny random Llama in test_models.py and test_learner.py; the recipes' end-to-end steps are in
test_recipes_tiny.py.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raggym.algorithms import SpanLabel, dynamic_sampling_filter, get_advantage_estimator
from raggym.algorithms.batch import assemble_batch, make_train_batch, teacher_fields
from raggym.rewards import EpisodeOutcome
from raggym.rewards.r1_router import TABLE_KB, TEXT_KB, r1_router_step_rewards
from raggym.trajectory import Rollout, teacher_prompt_ids

SQRT_HALF = math.sqrt(0.5)  # GRPO advantage of a two-sample group with distinct rewards: ±1/√2 (sample std)
GRPO_OPTIONS = {"eps": 1e-6, "normalize_by_std": True, "unbiased_std": True}
ROUTE_OPTIONS = {"route_weights": (1.0, 0.5, 0.3, 1.0), "correct_f1_threshold": 0.5, "evidence_threshold": 0.1,
                 **GRPO_OPTIONS}


# ----------------------------------------------------------------------------- PathRouter advantages


def _outcome(answer, *, retrieved=(), gold_passages=("alpha", "zeta"), gold=("Paris",), **kw):
    return EpisodeOutcome(answer=answer, gold_answers=gold, retrieved_texts=(tuple(retrieved),) if retrieved else (),
                          gold_passages=gold_passages, **kw)


# C and P of each hand-built outcome:
#   correct:   EM 1, or F1("Paris London London", "Paris") = 2·(1/3)·1 / (1/3 + 1) = 0.5 ≥ 0.5
#   supported: EO = mean over the gold passages {alpha, zeta} of F1("alpha beta gamma delta", d)
#              = (2·(1/4)·1/(1/4 + 1) + 0) / 2 = 0.2 ≥ 0.1;  no retrieval: EO = 0
CORRECT_SUPPORTED = _outcome("Paris", retrieved=("alpha beta", "gamma delta"))
CORRECT_BY_F1_UNSUPPORTED = _outcome("Paris London London")
INCORRECT_SUPPORTED = _outcome("Rome", retrieved=("alpha beta", "gamma delta"))
INCORRECT_UNSUPPORTED = _outcome("Rome")


def test_hand_built_outcomes_have_the_stated_metrics():
    assert (CORRECT_SUPPORTED.em, CORRECT_SUPPORTED.evidence_overlap) == (1.0, pytest.approx(0.2))
    assert (CORRECT_BY_F1_UNSUPPORTED.em, CORRECT_BY_F1_UNSUPPORTED.f1) == (0.0, pytest.approx(0.5))
    assert CORRECT_BY_F1_UNSUPPORTED.evidence_overlap == 0.0
    assert (INCORRECT_SUPPORTED.f1, INCORRECT_SUPPORTED.evidence_overlap) == (0.0, pytest.approx(0.2))


def test_route_estimator_scales_each_groups_grpo_advantage_by_its_route_weight():
    route = get_advantage_estimator("route")
    outcomes = [CORRECT_SUPPORTED, INCORRECT_UNSUPPORTED,          # group a: routes 0 and 3
                CORRECT_BY_F1_UNSUPPORTED, INCORRECT_SUPPORTED,    # group b: routes 1 and 2
                CORRECT_SUPPORTED, CORRECT_SUPPORTED]              # group c: equal rewards
    rewards = torch.tensor([1.5, -0.2, 0.9, 0.4, 1.2, 1.2])
    keys = [("a", 0), ("a", 0), ("b", 0), ("b", 0), ("c", 0), ("c", 0)]
    out = route(rewards, keys, outcomes, **ROUTE_OPTIONS)
    # Â = ±1/√2 inside groups a and b (two distinct rewards), 0 in group c; Ã = w_route · Â
    expected = [1.0 * SQRT_HALF, 1.0 * -SQRT_HALF, 0.5 * SQRT_HALF, 0.3 * -SQRT_HALF, 0.0, 0.0]
    assert out.advantages.tolist() == pytest.approx(expected, abs=1e-5)
    assert out.routes.tolist() == [0, 3, 1, 2, 0, 0]


def test_route_estimator_reads_its_thresholds_and_weights_from_the_options():
    route = get_advantage_estimator("route")
    outcomes = [CORRECT_BY_F1_UNSUPPORTED, INCORRECT_SUPPORTED]
    rewards, keys = torch.tensor([1.0, 0.0]), ["q", "q"]
    # F1 0.5 < 0.6: no longer correct (route 3); EO 0.2 < 0.25: no longer supported (route 3)
    strict = route(rewards, keys, outcomes, **{**ROUTE_OPTIONS, "correct_f1_threshold": 0.6, "evidence_threshold": 0.25})
    assert strict.routes.tolist() == [3, 3]
    assert strict.advantages.tolist() == pytest.approx([SQRT_HALF, -SQRT_HALF], abs=1e-5)
    # the weights are indexed by route value: (C↑P↑, C↑P↓, C↓P↑, C↓P↓)
    weighted = route(rewards, keys, outcomes, **{**ROUTE_OPTIONS, "route_weights": (0.0, 2.0, 4.0, 0.0)})
    assert weighted.routes.tolist() == [1, 2]
    assert weighted.advantages.tolist() == pytest.approx([2.0 * SQRT_HALF, 4.0 * -SQRT_HALF], abs=1e-5)
    # Dr.GRPO inside: no std division, Â = r − mean = ±0.5
    centred = route(rewards, keys, outcomes, **{**ROUTE_OPTIONS, "normalize_by_std": False})
    assert centred.advantages.tolist() == pytest.approx([0.5 * 0.5, 0.3 * -0.5], abs=1e-6)


def test_route_estimator_needs_one_outcome_per_reward():
    with pytest.raises(ValueError, match="one outcome per reward"):
        get_advantage_estimator("route")(torch.tensor([1.0, 0.0]), ["q", "q"], [CORRECT_SUPPORTED], **ROUTE_OPTIONS)


# ----------------------------------------------------------------------------- PathRouter teacher inputs


@pytest.fixture(scope="module")
def tokenizer():
    from raggym.models import load_policy_tokenizer

    return load_policy_tokenizer("smollm2-135m")


def _rollout(prompt, response, labels, *, prompt_text="", gold_passages=(), retrieved=(), prompt_id="0:q", sample=0):
    ids = list(prompt) + list(response)
    return Rollout(token_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(response),
                   sampled_logprobs=[0.0] * len(prompt) + [-0.5] * len(response),
                   span_labels=[int(SpanLabel.PROMPT)] * len(prompt) + [int(x) for x in labels],
                   prompt_length=len(prompt), prompt_id=prompt_id, sample_index=sample,
                   outcome=EpisodeOutcome(answer="Paris", gold_answers=("Paris",), gold_passages=gold_passages,
                                          retrieved_texts=(tuple(retrieved),) if retrieved else (), question=prompt_text))


def _with_teacher_prompt(tokenizer, rollout, max_evidence_tokens):
    """``rollout`` with the teacher prompt the rollout loop records under ``RolloutConfig.teacher_evidence_tokens``
    (from the episode's gold passages and its prompt, which is the question alone here)."""
    rollout.teacher_prompt_ids = teacher_prompt_ids(tokenizer, rollout.outcome.gold_passages, rollout.outcome.question,
                                                    max_evidence_tokens)
    return rollout


def test_teacher_fields_append_the_gold_evidence_to_the_prompt_and_align_the_student_tokens(tokenizer):
    from raggym.trajectory import chat_prompt_ids

    T, Q, A, O = SpanLabel.THINK, SpanLabel.QUERY, SpanLabel.ANSWER, SpanLabel.OBSERVATION
    first = _rollout([11, 12, 13, 14], [501, 502, 503, 504, 505], [T, T, Q, O, A], prompt_text="Where is the tower?",
                     gold_passages=("The tower stands in Paris.", "Paris is in France."),
                     retrieved=("The tower stands in Paris.",))
    second = _rollout([21, 22], [601, 602], [A, Q], prompt_text="Who built it?", gold_passages=("Eiffel built it.",),
                      sample=1)
    fields = teacher_fields([_with_teacher_prompt(tokenizer, r, 4) for r in (first, second)], tokenizer.pad_token_id)

    # The evidence is the gold passages joined by newlines, cut to its first 4 tokens.
    evidence_ids = tokenizer("The tower stands in Paris.\nParis is in France.", add_special_tokens=False)["input_ids"]
    evidence = "The tower stands in"  # 'The' ' tower' ' stands' ' in'
    assert len(evidence_ids) > 4 and evidence_ids[:4] == tokenizer(evidence, add_special_tokens=False)["input_ids"]
    # PathRouter appends the gold passages to the teacher's prompt: the question first, then the evidence.
    teacher_prompt = chat_prompt_ids(tokenizer, f"Where is the tower?\n\nEvidence:\n{evidence}")
    n = len(teacher_prompt)
    shown = tokenizer.decode(fields["teacher_token_ids"][0, :n].tolist())
    assert shown.index("Where is the tower?") < shown.index("Evidence:\nThe tower stands in")
    assert fields["teacher_token_ids"][0, : n + 5].tolist() == teacher_prompt + [501, 502, 503, 504, 505]
    assert fields["teacher_attention_mask"][0].tolist() == [1] * (n + 5) + [0] * (fields["teacher_token_ids"].shape[1] - n - 5)
    # Student token t ≥ prompt length sits at teacher position n + t − prompt length; prompt tokens have none.
    assert fields["teacher_positions"][0].tolist() == [-1] * 4 + [n, n + 1, n + 2, n + 3, n + 4]
    second_prompt = chat_prompt_ids(tokenizer, "Who built it?\n\nEvidence:\nEiffel built it")  # 5 tokens cut to 4
    m = len(second_prompt)
    assert fields["teacher_positions"][1].tolist() == [-1, -1, m, m + 1] + [-1] * 5  # padded to the longest student row
    for row, rollout in enumerate((first, second)):
        for t in range(rollout.prompt_length, len(rollout)):
            assert fields["teacher_token_ids"][row, fields["teacher_positions"][row, t]] == rollout.token_ids[t]
    # The teacher KL is taken on THINK and QUERY tokens only.
    assert fields["teacher_kl_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0, 0]]
    assert fields["teacher_kl_mask"].shape == fields["teacher_positions"].shape == (2, 9)
    # EO from each outcome: F1(retrieved, passage) is 1 for the first passage and 0.5 for the second
    # ("paris", "in" shared out of 4 tokens each, "the" dropped), so (1 + 0.5) / 2; no retrieval: 0.
    assert fields["evidence_overlap"].tolist() == pytest.approx([0.75, 0.0])


def test_teacher_fields_refuse_rollouts_that_recorded_no_teacher_prompt(tokenizer):
    recorded = _with_teacher_prompt(tokenizer, _rollout([11], [501], [SpanLabel.THINK], prompt_text="a?"), 8)
    bare = _rollout([11], [502], [SpanLabel.THINK], prompt_text="a?", sample=1)
    with pytest.raises(ValueError, match=r"1 rollouts \(the first: 0:q/1\) recorded no teacher prompt"):
        teacher_fields([recorded, bare], tokenizer.pad_token_id)


def test_assemble_batch_pads_teacher_fields_with_inert_filler_rows(tokenizer):
    T, Q, A = SpanLabel.THINK, SpanLabel.QUERY, SpanLabel.ANSWER
    rollouts = [_rollout([11, 12], [501, 502, 503], [T, Q, A], prompt_text="a?", gold_passages=("x",)),
                _rollout([11, 12], [504, 505], [Q, A], prompt_text="a?", gold_passages=("x",), sample=1),
                _rollout([13], [506], [T], prompt_text="b?", gold_passages=("y",), prompt_id="0:r")]
    extra = teacher_fields([_with_teacher_prompt(tokenizer, r, 8) for r in rollouts], tokenizer.pad_token_id)
    batch, fillers = assemble_batch(rollouts, [0.75, -0.75, 0.0], pad_token_id=0, multiple=4, extra=extra)
    assert fillers == 1
    assert {k: tuple(v.shape) for k, v in batch.tensors().items()} == {
        "token_ids": (4, 5), "attention_mask": (4, 5), "loss_mask": (4, 5), "advantages": (4,),
        "sampled_logprobs": (4, 5), "teacher_token_ids": (4, extra["teacher_token_ids"].shape[1]),
        "teacher_attention_mask": (4, extra["teacher_attention_mask"].shape[1]), "teacher_positions": (4, 5),
        "teacher_kl_mask": (4, 5), "evidence_overlap": (4,)}
    assert batch.token_ids.tolist()[:3] == [[11, 12, 501, 502, 503], [11, 12, 504, 505, 0], [13, 506, 0, 0, 0]]
    assert batch.loss_mask.tolist()[:3] == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert batch.teacher_kl_mask.tolist()[:3] == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert batch.advantages.tolist() == [0.75, -0.75, 0.0, 0.0]
    # The filler is row 0 with everything a loss term or a count reads zeroed.
    assert batch.token_ids[3].tolist() == batch.token_ids[0].tolist()
    assert batch.teacher_positions[3].tolist() == batch.teacher_positions[0].tolist()
    assert batch.loss_mask[3].sum() == 0 and batch.teacher_kl_mask[3].sum() == 0
    # A batch that already fills its mini-batches gets no filler.
    same, none = assemble_batch(rollouts, [0.75, -0.75, 0.0], pad_token_id=0, multiple=3, extra=extra)
    assert none == 0 and same.token_ids.shape[0] == 3


def test_make_train_batch_pads_token_level_advantages_and_checks_lengths():
    batch = make_train_batch([[1, 2, 3], [4, 5]], [[0, 1, 1], [0, 1]], [[0.0, 0.5, -0.5], [0.0, 2.0]], pad_token_id=9,
                             old_logprobs=[[0.0, -1.0, -2.0], [0.0, -3.0]])
    assert batch.token_ids.tolist() == [[1, 2, 3], [4, 5, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.advantages.tolist() == [[0.0, 0.5, -0.5], [0.0, 2.0, 0.0]]
    assert batch.old_logprobs.tolist() == [[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]]
    with pytest.raises(ValueError, match="one entry per sequence"):
        make_train_batch([[1, 2]], [[0, 1]], [1.0, 2.0])
    with pytest.raises(ValueError, match="sequence 0: 2 tokens but 3 loss-mask entries"):
        make_train_batch([[1, 2]], [[0, 1, 1]], [1.0])


# ----------------------------------------------------------------------------- R1-Router step rewards

VECTORS = {  # a hand-built embedding, so every similarity below is exact
    "who founded acme?": [1.0, 0.0, 0.0],
    "acme founder": [1.0, 0.0, 0.0],
    "where was she born?": [1.0, 1.0, 0.0],
    "birthplace of ada": [1.0, 0.0, 0.0],
    "anything": [0.0, 0.0, 1.0],
}


def _route_step(sub_question, kb, gold_sub_question, gold_kb, format_error=False, well_formed=True):
    return {"phase": "route", "route_step": 0, "format_error": format_error, "sub_question": sub_question,
            "knowledge_base": kb, "gold_sub_question": gold_sub_question, "gold_knowledge_base": gold_kb,
            "action": {"kind": "route", "well_formed": well_formed}}


def _answer_step(phase, route_step, answer, gold_answer):
    """A well-formed answer step (think block, then answer), so r_format = 1."""
    return {"phase": phase, "route_step": route_step, "format_error": False, "answer": answer,
            "gold_answer": gold_answer, "action": {"kind": "answer", "well_formed": True}}


def _step_outcome(step, gold=("Ada Lovelace",)):
    return EpisodeOutcome(answer=step.get("answer"), gold_answers=gold, prompt_id="0:q", steps=(step,))


def test_r1_router_step_rewards_hand_computed():
    calls = []

    def embed(texts):
        calls.append(list(texts))
        return np.array([VECTORS[t] for t in texts])

    steps = [
        _route_step("who founded acme?", TEXT_KB, "acme founder", TEXT_KB),          # ½·1 + ½·1
        _route_step("where was she born?", TABLE_KB, "birthplace of ada", TEXT_KB),  # ½·cos 45° + ½·0
        _route_step("who founded acme?", f"{TEXT_KB}, {TABLE_KB}", "acme founder", TEXT_KB),  # two KBs: no route hit
        _route_step("anything", TEXT_KB, "acme founder", TEXT_KB, format_error=True),  # r_format = 0
        _answer_step("answer", 0, "Ada Lovelace and Babbage", "Ada Lovelace"),
        _answer_step("answer", 1, "Ada", "Ada King Lovelace"),
        _answer_step("final", 2, "countess Ada Lovelace", "Ada Lovelace"),
        _answer_step("final", 2, "Lovelace", "Ada Lovelace"),
    ]
    rewards = r1_router_step_rewards([_step_outcome(s) for s in steps], embed, knowledge_bases=(TEXT_KB, TABLE_KB))
    expected = [1.0, 0.5 * SQRT_HALF, 0.5, 0.0,
                1.0,        # R_mid: both reference tokens recalled
                1 / 3,      # R_mid: 1 of the 3 reference tokens
                1.0, 0.0]   # R_final: 1 only when the gold answer occurs in the answer (accuracy)
    assert rewards == pytest.approx(expected, abs=1e-9)
    # One batched embedding call: the four sub-questions, then their four golds.
    assert calls == [["who founded acme?", "where was she born?", "who founded acme?", "anything",
                      "acme founder", "birthplace of ada", "acme founder", "acme founder"]]


def test_r1_router_route_reward_counts_only_the_configured_knowledge_bases():
    embed = lambda texts: np.array([VECTORS[t] for t in texts])  # noqa: E731
    step = _route_step("who founded acme?", "Graph Retriever", "acme founder", "Graph Retriever")
    assert r1_router_step_rewards([_step_outcome(step)], embed, knowledge_bases=(TEXT_KB, TABLE_KB)) == [0.5]
    assert r1_router_step_rewards([_step_outcome(step)], embed, knowledge_bases=("Graph Retriever",)) == [1.0]


# ----------------------------------------------------------------------------- DAPO dynamic sampling


def test_dynamic_sampling_keeps_only_groups_with_differing_step_keyed_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.3, 0.3, 0.4])
    keys = [("0:a", 0), ("0:a", 0), ("0:b", 0), ("0:b", 0), ("0:c", 0), ("0:c", 0), ("0:a", 1), ("0:a", 1), ("0:a", 1)]
    result = dynamic_sampling_filter(rewards, keys)
    # ("0:a", 0) all 1 and ("0:c", 0) all 0 carry no preference; ("0:b", 0) and ("0:a", 1) do.
    assert result.keep.tolist() == [False, False, True, True, False, False, True, True, True]
    assert (result.kept_groups, result.dropped_groups, result.dropped_samples) == (2, 2, 4)
    # Kept groups are exactly those whose GRPO advantages are not all zero.
    advantages = get_advantage_estimator("grpo")(rewards, keys, (), **GRPO_OPTIONS).advantages
    assert [bool(a != 0) for a in advantages.tolist()] == [False, False, True, True, False, False, True, True, True]


def test_each_resampling_round_draws_its_own_seed():
    from experiments.recipe.config import load_config
    from experiments.recipe.training import round_seed_index, sampling_params

    assert round_seed_index(5, 0) == 5  # round 0 is the step's own seed, so DAPO off reproduces plain GRPO
    indices = {round_seed_index(step, r) for step in range(50) for r in range(4)}
    assert len(indices) == 200  # no two (step, round) pairs share a seed
    cfg = load_config(None, ["run.seed=3", "rollout.temperature=1.0"])
    seeds = [sampling_params(cfg, round_seed_index(7, r)).seed for r in range(3)]
    assert len(set(seeds)) == 3
    assert sampling_params(cfg, round_seed_index(7, 1)).seed == seeds[1]  # and the same round repeats exactly
