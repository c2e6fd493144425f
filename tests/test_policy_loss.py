"""The policy-loss registry (``raggym.algorithms.policy_loss``): each built-in term on hand-computed
tensors, composition by name from the config keys, clear errors for unknown names, and a term a
user registers that the Learner then trains with (and docs/extending.md's loss-term example)."""

from __future__ import annotations

import gc
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.learner import Learner, LearnerConfig, make_train_batch
from experiments.recipe.config import ConfigError, load_config
from raggym.algorithms.batch import TrainBatch, route_centred_mode_advantages
from raggym.algorithms.losses import aggregate_loss
from raggym.algorithms.policy_loss import (
    POLICY_LOSS_TERMS,
    LossTerm,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossInputs,
    default_terms,
    evidence_poor_trajectories,
    get_policy_loss_term,
    mode_choice_tokens,
    register_policy_loss_term,
    trained_units,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _inputs(**fields) -> PolicyLossInputs:
    """A micro-batch of float64 tensors; unset per-token fields are zeros shaped like ``mask``."""
    mask = fields.pop("mask")
    zeros = torch.zeros_like(mask)
    base = dict(log_probs=zeros, old_log_probs=zeros, advantages=zeros, mask=mask, entropy=zeros)
    return PolicyLossInputs(**{**base, **fields})


def _batch(loss_mask: torch.Tensor, **fields) -> TrainBatch:
    """A ``TrainBatch`` of hand-made fields; the token ids, attention mask and advantages no term here reads."""
    return TrainBatch(token_ids=torch.zeros(loss_mask.shape, dtype=torch.long), attention_mask=torch.ones_like(loss_mask),
                      loss_mask=loss_mask, advantages=torch.zeros(loss_mask.shape[0]), **fields)


def _term(name: str, inputs: PolicyLossInputs, **config) -> LossTerm:
    return get_policy_loss_term(name).fn(inputs, PolicyLossConfig(**config))


def _log(values) -> torch.Tensor:
    return torch.log(torch.tensor(values, dtype=torch.float64))


# ----------------------------------------------------------------------------- each term by hand


def test_clipped_pg_by_hand():
    inputs = _inputs(log_probs=_log([[1.5, 0.5, 1.1]]), old_log_probs=torch.zeros(1, 3, dtype=torch.float64),
                     advantages=torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64), mask=torch.ones(1, 3))
    out = _term("clipped_pg", inputs, clip_low=0.2)
    # ratios 1.5, 0.5, 1.1: max(−1.5, −1.2) = −1.2; max(−0.5, −0.8) = −0.5; max(1.1, 1.1) = 1.1;
    # token-mean (−1.2 − 0.5 + 1.1) / 3 = −0.2; one token of three on the clipped branch
    assert out.loss.item() == pytest.approx(-0.2)
    assert out.stats["pg_loss"] == pytest.approx(-0.2) and out.stats["clip_fraction"] == pytest.approx(1 / 3)
    assert out.totals == {}


def _dual_clip_inputs() -> PolicyLossInputs:
    # both tokens at ratio 5; advantages −1 and +1
    return _inputs(log_probs=_log([[5.0, 5.0]]), old_log_probs=torch.zeros(1, 2, dtype=torch.float64),
                   advantages=torch.tensor([[-1.0, 1.0]], dtype=torch.float64), mask=torch.ones(1, 2))


def test_dual_clip_by_hand():
    out = _term("dual_clip", _dual_clip_inputs(), clip_low=0.2, clip_ratio_c=3.0)
    # Â = −1: max(5, 1.2) = 5, capped at −Â·c = 3; Â = +1: max(−5, −1.2) = −1.2 (no cap for Â > 0)
    # token-mean (3 − 1.2) / 2 = 0.9; the cap bit one token of two
    assert out.loss.item() == pytest.approx(0.9)
    assert out.stats["clip_fraction_lower"] == pytest.approx(0.5)
    # without the cap the first token would cost 5: (5 − 1.2) / 2 = 1.9
    assert _term("clipped_pg", _dual_clip_inputs(), clip_low=0.2).loss.item() == pytest.approx(1.9)
    # clipped_pg honours the dual_clip key as well: never silently ignored
    assert _term("clipped_pg", _dual_clip_inputs(), clip_low=0.2, dual_clip=True).loss.item() == pytest.approx(0.9)


def test_kl_term_by_hand():
    inputs = _inputs(log_probs=torch.tensor([[-1.0, -2.0]], dtype=torch.float64),
                     ref_log_probs=torch.tensor([[-1.5, -1.0]], dtype=torch.float64), mask=torch.ones(1, 2))
    out = _term("kl", inputs, kl_coef=0.1)  # low_var_kl (k3) = e^x − 1 − x, x = log π_ref − log π
    # x = −0.5: e^−0.5 − 1 + 0.5 = 0.1065307;  x = 1: e − 2 = 0.7182818;  mean 0.4124062; β = 0.1
    assert out.stats["kl_loss"] == pytest.approx((math.exp(-0.5) - 0.5 + math.e - 2) / 2)
    assert out.loss.item() == pytest.approx(0.1 * 0.41240624, rel=1e-7)
    k1 = _term("kl", inputs, kl_coef=0.1, kl_kind="k1")  # log π − log π_ref = 0.5, −1.0: mean −0.25
    assert k1.loss.item() == pytest.approx(-0.025)


def test_entropy_term_by_hand():
    inputs = _inputs(entropy=torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64), mask=torch.tensor([[0.0, 1.0, 1.0]]))
    # token-mean over the trained tokens: (2 + 4) / 2 = 3; the bonus lowers the loss: −c_H · 3
    assert _term("entropy", inputs, entropy_coef=0.1).loss.item() == pytest.approx(-0.3)
    # seq-mean-token-sum: the sequence's sum 2 + 4 = 6 (Dr.GRPO's constant divides the PG term only,
    # as it always has: the entropy, like the KL, is aggregated without it)
    assert _term("entropy", inputs, entropy_coef=0.1, aggregation="seq-mean-token-sum",
                 token_sum_norm=4.0).loss.item() == pytest.approx(-0.6)


def test_mode_entropy_term_by_hand():
    inputs = _inputs(entropy=torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 6.0]], dtype=torch.float64),
                     mask=torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
                     batch=_batch(torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
                                  mode_choice_mask=torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 1.0]])))
    out = _term("mode_entropy", inputs, mode_entropy_coef=0.5)
    # choices that are trained: (0, 2) with H = 4 and (1, 1) with H = 5 ((1, 2) is not trained);
    # H_mode = (4 + 5) / 3 trained tokens = 3, every other trained token counting 0; loss −0.5 · 3
    assert out.stats["mode_entropy_term"] == pytest.approx(3.0)
    assert out.loss.item() == pytest.approx(-1.5)
    assert out.totals == {"mode_entropy_sum": 9.0, "mode_choices": 2.0}
    # over an update of two epochs: the choices' own mean entropy 9 / 2, and 2 / 2 choices per epoch
    summary = get_policy_loss_term("mode_entropy").summarize(out.totals, 2)
    assert summary == {"mode_entropy": 4.5, "mode_choices": 1.0}


def _mode_pg_inputs() -> PolicyLossInputs:
    # trained choices: (0, 1), (0, 3) and (1, 2); (1, 3) is marked but not trained (loss mask 0)
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    return _inputs(log_probs=_log([[1.0, 1.5, 1.0, 0.5], [1.0, 1.0, 1.1, 2.0]]),
                   old_log_probs=torch.zeros(2, 4, dtype=torch.float64),
                   advantages=torch.tensor([1.0, -1.0], dtype=torch.float64), mask=mask,
                   batch=_batch(mask.clone(), mode_choice_mask=torch.tensor([[0.0, 1, 0, 1], [0, 0, 1, 1]])))


def test_mode_pg_term_by_hand():
    out = _term("mode_pg", _mode_pg_inputs(), clip_low=0.2, mode_pg_coef=2.0)
    # (0, 1): ρ 1.5, Â +1: max(−1.5, −1.2) = −1.2;  (0, 3): ρ 0.5, Â +1: max(−0.5, −0.8) = −0.5;
    # (1, 2): ρ 1.1, Â −1: max(1.1, 1.1) = 1.1;  L_mode = (−1.2 − 0.5 + 1.1) / 3 choices = −0.2
    # (the untrained choice (1, 3), ρ 2, would add 2; the unchosen (0, 2) is not a choice); k = 2
    assert out.stats["mode_pg_term"] == pytest.approx(-0.2)
    assert out.loss.item() == pytest.approx(-0.4)
    assert out.stats["mode_pg_clip_fraction"] == pytest.approx(1 / 3)
    assert float(mode_choice_tokens(_mode_pg_inputs().batch, PolicyLossConfig())) == 3.0  # its normaliser
    loss_fn = PolicyLoss(PolicyLossConfig(mode_pg_coef=2.0))
    assert [t.name for t in loss_fn.terms] == ["clipped_pg", "mode_pg"]
    assert loss_fn.normalizers == [trained_units, mode_choice_tokens] and loss_fn.batch_keys == ("mode_choice_mask",)
    # the main term's dual clip applies here too: a choice at ρ 5 with Â −1 costs 5, capped at c = 3
    capped = _inputs(log_probs=_log([[1.0, 5.0]]), old_log_probs=torch.zeros(1, 2, dtype=torch.float64),
                     advantages=torch.tensor([-1.0], dtype=torch.float64), mask=torch.tensor([[0.0, 1.0]]),
                     batch=_batch(torch.tensor([[0.0, 1.0]]), mode_choice_mask=torch.tensor([[0.0, 1.0]])))
    assert _term("mode_pg", capped, mode_pg_coef=1.0).loss.item() == pytest.approx(5.0)
    assert _term("mode_pg", capped, mode_pg_coef=1.0, dual_clip=True).loss.item() == pytest.approx(3.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_mode_pg_reads_only_the_trained_mode_choices(seed, aggregation):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 6)
    mask = (torch.rand(shape, generator=g) < 0.7).double()
    mask[0, 1] = 1.0  # at least one trained choice
    choice = (torch.rand(shape, generator=g) < 0.4).double()
    choice[0, 1] = 1.0
    fields = dict(log_probs=torch.randn(shape, generator=g, dtype=torch.float64) * 0.3,
                  old_log_probs=torch.randn(shape, generator=g, dtype=torch.float64) * 0.3,
                  advantages=torch.randn(shape, generator=g, dtype=torch.float64), mask=mask)
    config = dict(clip_low=0.2, clip_high=0.28, mode_pg_coef=1.0, aggregation=aggregation)
    value = _term("mode_pg", _inputs(**fields, batch=_batch(mask, mode_choice_mask=choice)), **config).loss.item()
    # the same as the token-mean clipped PG over a mask of the trained choices only, whatever the aggregation
    alone = _inputs(**{**fields, "mask": mask * choice})
    assert value == pytest.approx(_term("clipped_pg", alone, clip_low=0.2, clip_high=0.28).loss.item(), rel=1e-9)
    # what the other tokens hold does not matter
    other = 1 - mask * choice
    noisy = {**fields, "log_probs": fields["log_probs"] + other * torch.randn(shape, generator=g, dtype=torch.float64),
             "advantages": fields["advantages"] + other * 5.0}
    again = _term("mode_pg", _inputs(**noisy, batch=_batch(mask, mode_choice_mask=choice)), **config).loss.item()
    assert again == pytest.approx(value, rel=1e-9)


def test_route_centred_slot_credit_by_hand():
    """learner.loss.mode_pg_centring: route. Four choices: rows 0 and 1 chose token 7 (Â +2, −1),
    rows 2 and 3 token 9 (Â +1, +3); each route's mean comes off: 7 → +1.5, −1.5; 9 → −1, +1."""
    ids = torch.tensor([[1, 7, 5], [1, 7, 5], [1, 9, 5], [1, 9, 5]])
    choice = torch.tensor([[0.0, 1, 0], [0, 1, 0], [0, 1, 0], [0, 1, 0]])
    centred = route_centred_mode_advantages(torch.tensor([2.0, -1.0, 1.0, 3.0]), ids, choice)
    assert centred.tolist() == [[0.0, 1.5, 0.0], [0.0, -1.5, 0.0], [0.0, -1.0, 0.0], [0.0, 1.0, 0.0]]
    # a route chosen once gets 0; per-token advantages are read at the choice
    single = route_centred_mode_advantages(torch.tensor([[0.0, 4.0, 0.0], [0.0, 2.0, 9.0]]), ids[1:3], choice[:2])
    assert single.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # the mode-PG term trains on the centred credit, the main term keeps the episodes' advantages
    mask = torch.tensor([[0.0, 1, 1]] * 4)
    fields = dict(log_probs=torch.zeros(4, 3, dtype=torch.float64), old_log_probs=torch.zeros(4, 3, dtype=torch.float64),
                  advantages=torch.tensor([2.0, -1.0, 1.0, 3.0], dtype=torch.float64), mask=mask)
    batch = _batch(mask, mode_choice_mask=choice, mode_choice_advantages=centred)
    plain = _term("mode_pg", _inputs(**fields, batch=batch), mode_pg_coef=1.0)
    route = _term("mode_pg", _inputs(**fields, batch=batch), mode_pg_coef=1.0, mode_pg_centring="route")
    # ρ = 1 everywhere: L_mode = −mean(Â at the choices): plain −(2 − 1 + 1 + 3) / 4; centred −0 (they sum to 0)
    assert plain.loss.item() == pytest.approx(-1.25) and route.loss.item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="needs the batch's mode_choice_advantages"):
        _term("mode_pg", _inputs(**fields, batch=_batch(mask, mode_choice_mask=choice)), mode_pg_coef=1.0,
              mode_pg_centring="route")
    with pytest.raises(ValueError, match=r"needs learner.loss.mode_pg_coef > 0"):
        PolicyLossConfig(mode_pg_centring="route")
    with pytest.raises(ValueError, match="must be 'none' or 'route'"):
        PolicyLossConfig(mode_pg_coef=1.0, mode_pg_centring="type")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([7, 9, 11]), st.floats(-3, 3)), min_size=1, max_size=12))
def test_route_centred_credit_sums_to_zero_for_every_route(choices):
    ids = torch.tensor([[0, token] for token, _ in choices])
    mask = torch.tensor([[0.0, 1.0]] * len(choices))
    centred = route_centred_mode_advantages(torch.tensor([a for _, a in choices]), ids, mask)
    for token in {t for t, _ in choices}:
        assert abs(float(centred[:, 1][ids[:, 1] == token].sum())) < 1e-4
    assert torch.all(centred[:, 0] == 0)


def _teacher_batch() -> TrainBatch:
    return _batch(
        loss_mask=torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]),
        teacher_kl_mask=torch.tensor([[0.0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]]),  # think/query tokens
        teacher_positions=torch.tensor([[-1, 3, 4, 5], [-1, 0, 2, 3], [-1, 3, 4, 5]]),  # row 1, t = 1: no counterpart
        evidence_overlap=torch.tensor([0.05, 0.02, 0.5]),  # rows 0 and 1 below θ_P = 0.1
    )


def test_teacher_kl_term_by_hand():
    batch = _teacher_batch()
    per_position = torch.tensor([[9.0, 1.0, 3.0, 7.0], [0.0, 5.0, 2.0, 4.0], [8.0, 8.0, 8.0, 8.0]], dtype=torch.float64)
    inputs = _inputs(teacher_kl=per_position, mask=batch.loss_mask.clone(), batch=batch, step=10)
    out = _term("teacher_kl", inputs, teacher_max_weight=0.1, teacher_warmup_steps=20)
    # KL_0 = (1 + 3) / 2 = 2 (t = 1, 2); KL_1 = (2 + 4) / 2 = 3 (t = 2, 3); row 2 has EO ≥ θ_P
    # mean over I_low = 2.5; λ = 0.1 · min(1, 10 / 20) = 0.05; loss 0.125
    assert out.loss.item() == pytest.approx(0.125)
    assert out.stats == {"teacher_loss": pytest.approx(0.125)}
    assert out.totals == {"teacher_kl_sum": pytest.approx(5.0), "teacher_kl_trajectories": 2.0}
    assert float(evidence_poor_trajectories(batch, PolicyLossConfig())) == 2.0  # its normaliser: |I_low|
    summary = get_policy_loss_term("teacher_kl").summarize(out.totals, 2)
    assert summary == {"teacher_kl": pytest.approx(2.5), "teacher_kl_trajectories": 1.0}


def test_the_aggregation_normaliser_by_hand():
    batch = _batch(torch.tensor([[1.0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 1]]))
    # position 0 never trains: tokens 2 + 0 + 2 = 4; sequences with any trained token: 2
    assert float(trained_units(batch, PolicyLossConfig())) == 4.0
    assert float(trained_units(batch, PolicyLossConfig(aggregation="seq-mean-token-mean"))) == 2.0


# ----------------------------------------------------------------------------- composition and names


def test_the_config_keys_choose_the_terms_as_before():
    assert default_terms(PolicyLossConfig()) == ("clipped_pg",)
    assert default_terms(PolicyLossConfig(dual_clip=True, kl_coef=0.01, entropy_coef=0.1, mode_entropy_coef=1.0,
                                          mode_pg_coef=0.5, teacher_kl=True)) == (
        "dual_clip", "kl", "entropy", "mode_entropy", "mode_pg", "teacher_kl")
    # every YAML's learner.loss resolves to the terms its coefficients switch on
    configs = Path(__file__).resolve().parents[1] / "experiments" / "configs"
    resolved = {name: LearnerConfig.from_dict({"loss": dict(load_config(str(configs / f"{name}.yaml")).learner.loss)})
                for name in ("routerag", "pathrouter", "lws", "r1_router")}
    assert [t.name for t in PolicyLoss(resolved["routerag"].loss).terms] == ["clipped_pg", "kl"]
    assert [t.name for t in PolicyLoss(resolved["pathrouter"].loss).terms] == ["clipped_pg", "kl", "teacher_kl"]
    assert [t.name for t in PolicyLoss(resolved["lws"].loss).terms] == ["clipped_pg"]
    assert [t.name for t in PolicyLoss(resolved["r1_router"].loss).terms] == ["clipped_pg"]
    assert resolved["pathrouter"].needs_reference() and not resolved["lws"].needs_reference()


def test_terms_named_in_the_config_compose_group_by_group():
    batch = _teacher_batch()
    mask = batch.loss_mask.clone()
    mask[:, 0] = 0
    inputs = _inputs(log_probs=torch.zeros(3, 4, dtype=torch.float64), advantages=torch.tensor([1.0, -1.0, 2.0]),
                     entropy=torch.full((3, 4), 2.0, dtype=torch.float64), mask=mask, batch=batch, step=20,
                     teacher_kl=torch.ones(3, 4, dtype=torch.float64))
    config = PolicyLossConfig(terms=["clipped_pg", "entropy", "teacher_kl"], entropy_coef=0.5, teacher_max_weight=0.1)
    loss_fn = PolicyLoss(config)
    assert [t.name for t in loss_fn.terms] == ["clipped_pg", "entropy", "teacher_kl"]
    assert loss_fn.normalizers == [trained_units, evidence_poor_trajectories]  # two groups
    assert loss_fn.needs == {"entropy_grad", "teacher_kl"}
    assert loss_fn.units(batch).tolist() == [9.0, 2.0]  # trained tokens; evidence-poor trajectories
    loss, stats, totals = loss_fn(inputs, weights=[2.0, 0.5])
    # group 0: PG at ratio 1 = −mean Â over 9 tokens = −(3·1 − 3·1 + 3·2) / 9 = −2/3; entropy bonus
    # −0.5 · 2 = −1; sum −5/3. Group 1: λ = 0.1 · mean KL 1 = 0.1. Loss 2 · (−5/3) + 0.5 · 0.1
    assert loss.item() == pytest.approx(2 * (-5 / 3) + 0.5 * 0.1)
    assert stats[0]["pg_loss"] == pytest.approx(-2 / 3) and stats[0]["entropy"] == pytest.approx(2.0)
    assert stats[0]["loss"] == pytest.approx(-5 / 3)
    assert stats[1] == {"teacher_loss": pytest.approx(0.1), "loss": pytest.approx(0.1)}
    assert totals == {"teacher_kl_sum": pytest.approx(2.0), "teacher_kl_trajectories": 2.0}


def test_an_unknown_term_is_refused_with_the_known_names():
    with pytest.raises(ValueError) as err:
        PolicyLossConfig(terms=["clipped_pg", "clipped_pgg"])
    message = str(err.value)
    assert "unknown policy-loss term 'clipped_pgg'" in message
    for name in ("clipped_pg", "dual_clip", "kl", "entropy", "mode_entropy", "teacher_kl"):
        assert repr(name) in message
    with pytest.raises(ValueError, match="unknown policy-loss term"):
        LearnerConfig.from_dict({"loss": {"terms": ["nope"]}})
    with pytest.raises(ConfigError, match=r"learner.loss.terms: unknown policy-loss term 'nope'.*'teacher_kl'"):
        load_config("experiments/configs/search_r1_tiny.yaml", ["learner.loss.terms=[clipped_pg,nope]"])
    with pytest.raises(ValueError, match="empty"):
        PolicyLossConfig(terms=[])
    with pytest.raises(ValueError, match="twice"):
        PolicyLossConfig(terms=["kl", "kl"])
    with pytest.raises(ValueError, match="not among the terms"):
        PolicyLossConfig(term_options={"kl": {"coef": 1.0}})
    with pytest.raises(ValueError, match="cannot import policy-loss term"):
        get_policy_loss_term("raggym.no_such_module:term")
    with pytest.raises(ValueError, match="not a registered policy-loss term"):
        get_policy_loss_term("raggym.algorithms.losses:kl_loss")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss_term("kl")(lambda inputs, config: None)
    with pytest.raises(ValueError, match="the learner provides"):
        register_policy_loss_term("needs_a_critic", needs=("values",))


# ----------------------------------------------------------------------------- a user's term in the Learner


SEEN: list[PolicyLossInputs] = []


def likelihood(inputs: PolicyLossInputs, config: PolicyLossConfig, coef: float = 1.0) -> LossTerm:
    """A user's term: the token-mean negative log-likelihood of the trained tokens, c · −log π (SFT-style)."""
    SEEN.append(inputs)
    nll = aggregate_loss(-inputs.log_probs, inputs.mask, config.aggregation)  # −mean log π(y_t)
    return LossTerm(coef * nll, {"nll": nll.item()})


@pytest.fixture
def likelihood_term():
    SEEN.clear()
    register_policy_loss_term("likelihood")(likelihood)
    yield
    POLICY_LOSS_TERMS.pop("likelihood", None)


def test_a_registered_term_is_what_the_learner_trains_with(likelihood_term, tiny_random_policy):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lengths = (14, 9, 12, 7)
    batch = make_train_batch([torch.randint(100, 20000, (n,), generator=g).tolist() for n in lengths],
                             [[0] * 4 + [1] * (n - 4) for n in lengths], [0.0, 0.0, 0.0, 0.0])
    trained = batch.loss_mask.clone()
    trained[:, 0] = 0
    config = {"model": tiny_random_policy, "zero_stage": 0, "micro_batch_size": 1, "mini_batch_size": 4, "shuffle": False,
              "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "grad_clip": 1e6,
              # by import string, as a Ray learner in another process would find it
              "loss": {"terms": [f"{__name__}:likelihood"], "term_options": {"likelihood": {"coef": 2.0}}}}
    learner = Learner(config)
    assert [t.name for t in learner.policy_loss.terms] == ["likelihood"] and learner.reference is None
    before = learner.compute_logprobs(batch.token_ids, batch.attention_mask)
    metrics = learner.update(replace(batch))
    after = learner.compute_logprobs(batch.token_ids, batch.attention_mask)
    del learner
    gc.collect()
    assert len(SEEN) == 4 and all(i.log_probs.requires_grad for i in SEEN)  # one call per micro-batch
    # its stat is the mini-batch's token-mean NLL whatever the split into 4 micro-batches, and
    # the loss is coef times it; no clipped PG term ran
    nll = float(-(before * trained).sum() / trained.sum())
    assert metrics["nll"] == pytest.approx(nll, rel=1e-5)
    assert metrics["loss"] == pytest.approx(2.0 * nll, rel=1e-5) and "pg_loss" not in metrics
    assert float((after * trained).sum()) > float((before * trained).sum())  # the likelihood went up


def test_docs_extending_loss_term_example_runs():
    """docs/extending.md's policy-loss-term block (``python loss-term``, which test_extending.py
    does not run) registers a term and checks its numbers."""
    blocks = re.findall(r"^```python loss-term\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) == 1
    try:
        exec(compile(blocks[0], f"{DOC}#loss-term", "exec"), {"__name__": "extending_loss_term"})
    finally:
        POLICY_LOSS_TERMS.pop("old_policy_kl", None)
