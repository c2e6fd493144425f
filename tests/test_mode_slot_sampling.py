"""The mode-slot temperature (issue #64's exploration lever): which contexts end at the slot, how
the option is checked, and that training rollouts (never evaluations) ask for it; and that the
route-centred slot credit (the next lever) reaches the recipe.

The engines' side, that the slot token is drawn from and reported under softmax(z / T_slot) while
every other token keeps the rollout temperature, is in tests/test_engine_contract.py for HF, vLLM's
offline LLM and vLLM's AsyncLLM alike.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engines.hf import process_logits
from experiments.recipe.config import ConfigError, load_config
from experiments.recipe.training import sampling_params
from experiments.train import Hyperparameters
from raggym.generation import MODE_SLOT_WINDOW, ModeSlotDetector, SamplingParams, slot_logits
from raggym.models import load_policy_tokenizer
from raggym.protocol import get_dialect

ROUTERAG_SLOT = get_dialect("routerag").mode_slot
ROUTING_CONFIG = "experiments/configs/routing_grpo.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def detector(tokenizer):
    return ModeSlotDetector(ROUTERAG_SLOT, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


@pytest.mark.parametrize("text, at_slot", [
    ("I should look this up.\n<search> [", True),
    ("<search>[", True),
    ("<search>  \n [", True),
    ("<search> [graph] who directed it</search>\n<search> [", True),  # the last search is open
    ("<search> [graph", False),  # the mode is already written
    ("<search> [graph] who directed it", False),
    ("I should look this up.", False),
    ("[", False),
])
def test_a_context_is_at_the_slot_only_where_the_mode_name_comes_next(detector, tokenizer, text, at_slot):
    assert detector.at_slot(tokenizer.encode(text, add_special_tokens=False)) is at_slot


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=60))
def test_any_text_then_the_open_slot_is_at_the_slot_and_one_more_token_is_not(detector, tokenizer, before):
    ids = tokenizer.encode(before + "\n<search> [", add_special_tokens=False)
    assert detector.at_slot(ids)
    after = ids + tokenizer.encode("graph", add_special_tokens=False)
    assert not detector.at_slot(after)
    assert not detector.at_slot([])


def test_the_window_reads_only_the_contexts_end(detector, tokenizer):
    slot = tokenizer.encode("<search> [", add_special_tokens=False)
    filler = tokenizer.encode(" word" * (3 * MODE_SLOT_WINDOW), add_special_tokens=False)
    assert detector.at_slot(filler + slot)
    assert not detector.at_slot(slot + filler)


def test_slot_sampling_options_are_checked():
    with pytest.raises(ValueError, match="mode_slot_temperature needs mode_slot"):
        SamplingParams(mode_slot_temperature=2.0)
    with pytest.raises(ValueError, match=r"must be > 0"):
        SamplingParams(mode_slot=ROUTERAG_SLOT, mode_slot_temperature=0.0)
    with pytest.raises(ValueError, match=r"mode_slot_min_p must be in \[0, 1\)"):
        SamplingParams(mode_slot=ROUTERAG_SLOT, mode_slot_temperature=2.0, mode_slot_min_p=1.0)
    with pytest.raises(ValueError, match="not a regular expression"):
        SamplingParams(mode_slot="<search> [", mode_slot_temperature=2.0)
    assert SamplingParams(temperature=0.7, mode_slot=ROUTERAG_SLOT, mode_slot_temperature=2.0).slot_sampling
    assert not SamplingParams(temperature=0.0, mode_slot=ROUTERAG_SLOT, mode_slot_temperature=2.0).slot_sampling


def test_slot_logits_drop_the_unlikely_tail_then_take_the_slot_temperature():
    z = torch.tensor([2.0, 0.0, -1.0, -6.0])
    # at T = 0.5 the shares against the top are e^0, e^-4, e^-6, e^-16: min-p 0.01 keeps the first two
    got = slot_logits(z / 0.5, 0.5, 4.0, 0.01)
    assert torch.equal(torch.isfinite(got), torch.tensor([True, True, False, False]))
    assert torch.allclose(got[:2], torch.tensor([0.5, 0.0]))  # z / 4
    assert torch.allclose(slot_logits(z / 0.5, 0.5, 4.0, 0.0), z / 4.0)  # min-p 0: every token, z / 4


def test_process_logits_rescales_only_the_rows_at_the_slot():
    logits = torch.tensor([[2.0, 0.0, -1.0], [2.0, 0.0, -1.0]])
    sampling = SamplingParams(temperature=0.5, mode_slot=ROUTERAG_SLOT, mode_slot_temperature=4.0, mode_slot_min_p=0.0)
    got = process_logits(logits, sampling, torch.tensor([True, False]))
    # by hand: row 0 is softmax(z / 4), row 1 softmax(z / 0.5)
    assert torch.allclose(got[0], torch.log_softmax(logits[0] / 4.0, dim=-1))
    assert torch.allclose(got[1], torch.log_softmax(logits[1] / 0.5, dim=-1))
    # min-p 0.01: at T 0.5 token 2 has e^-6 ≈ 0.0025 of the top's share and goes, token 1 (e^-4 ≈ 0.018) stays
    kept = process_logits(logits, dataclasses.replace(sampling, mode_slot_min_p=0.01), torch.tensor([True, False]))
    assert torch.allclose(kept[0], torch.tensor([0.5, 0.0, float("-inf")]).log_softmax(-1))
    plain = process_logits(logits, SamplingParams(temperature=0.5), torch.tensor([True, False]))
    assert torch.allclose(plain, torch.log_softmax(logits / 0.5, dim=-1))  # no slot temperature asked: no change


def test_training_rollouts_ask_for_the_slot_temperature_and_evaluations_do_not():
    cfg = load_config(ROUTING_CONFIG, ["rollout.mode_slot_temperature=2.0", "learner.old_logprobs=recompute",
                                       "rollout.temperature=0.7"])
    train = sampling_params(cfg, 3)
    assert (train.temperature, train.mode_slot, train.mode_slot_temperature) == (0.7, ROUTERAG_SLOT, 2.0)
    assert train.mode_slot_min_p == 0.001
    assert sampling_params(load_config(ROUTING_CONFIG, ["rollout.mode_slot_temperature=2.0", "rollout.mode_slot_min_p=0.05",
                                                        "learner.old_logprobs=recompute"]), 3).mode_slot_min_p == 0.05
    evaluation = sampling_params(cfg, 3, temperature=0.7)
    assert evaluation.mode_slot_temperature is None and not evaluation.slot_sampling
    assert sampling_params(load_config(ROUTING_CONFIG, []), 3).mode_slot_temperature is None  # off by default


def test_the_slot_temperature_is_refused_where_it_cannot_be_right():
    with pytest.raises(ConfigError, match=r"rollout.mode_slot_temperature: .*set learner.old_logprobs: recompute"):
        load_config(ROUTING_CONFIG, ["rollout.mode_slot_temperature=2.0", "learner.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match=r"rollout.mode_slot_temperature: must be positive"):
        load_config(ROUTING_CONFIG, ["rollout.mode_slot_temperature=-1", "learner.old_logprobs=recompute"])
    with pytest.raises(ConfigError, match=r"rollout.mode_slot_temperature: .*name no retrieval mode"):
        load_config(ROUTING_CONFIG, ["env.id=raggym/SearchR1-v0", "rollout.mode_slot_temperature=2.0",
                                     "learner.old_logprobs=recompute"])


def test_route_centring_of_the_slot_credit_reaches_the_recipe():
    """learner.loss.mode_pg_centring: route makes the recipe hand the learner the centred slot credit
    (experiments/train.py update_and_sync builds mode_choice_fields with the advantages)."""
    on = Hyperparameters.from_config(load_config(ROUTING_CONFIG, ["learner.loss.mode_pg_coef=1.0",
                                                                  "learner.loss.mode_pg_centring=route"]))
    off = Hyperparameters.from_config(load_config(ROUTING_CONFIG, ["learner.loss.mode_pg_coef=1.0"]))
    assert on.mode_slot and on.route_centred_slot and not off.route_centred_slot
