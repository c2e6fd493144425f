"""Where the agent chose a retrieval mode: the tokens the learner's mode entropy bonus acts on.

``RolloutBuilder`` records, as each model turn is appended, the token holding the first
character of each search's mode name in that turn's text (found through the dialect's
``mode_slot``), here with the real SmolLM2 tokenizer; ``mode_choice_mask`` marks the recorded
positions. Text the environment wrote (the prompt's instructions, an observation) must never be
marked: the agent chose nothing there.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raggym.algorithms.batch import assemble_batch, mode_choice_fields, mode_choice_mask  # noqa: E402
from raggym.trajectory import RolloutBuilder  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from raggym.models import load_policy_tokenizer

    return load_policy_tokenizer("smollm2-135m")


def episode(tokenizer, turns: list[str], observation: str = "<information> a note </information>",
            prompt: str = "Search with <search> [graph] a query </search>."):
    builder = RolloutBuilder(tokenizer, "routerag", max_response_tokens=4096, max_observation_tokens=4096)
    builder.add_prompt(tokenizer.encode(prompt, add_special_tokens=False))
    for i, turn in enumerate(turns):
        ids = tokenizer.encode(turn, add_special_tokens=False)
        builder.add_model_turn(ids, [0.0] * len(ids))
        if i + 1 < len(turns):
            builder.add_observation(observation)
    return builder.finish()


def marked(tokenizer, rollout) -> list[str]:
    mask = mode_choice_mask(rollout)
    return [tokenizer.decode([rollout.token_ids[i]]) for i, m in enumerate(mask) if m]


def test_only_the_models_own_mode_names_are_marked(tokenizer):
    rollout = episode(tokenizer, ["<think>who?</think>\n<search> [graph] the employer of Ana Oru</search>",
                                  "<search>[passage] Ana Oru employer</search>",
                                  "<answer> Fenqua Works </answer>"],
                      observation="<information> it said <search> [graph] inside a document </information>")
    # the prompt's example and the observation's copy are the environment's text, not choices
    assert marked(tokenizer, rollout) == ["graph", "pass"]
    assert sum(mode_choice_mask(rollout)) == 2


def test_a_turn_without_a_finished_slot_marks_nothing(tokenizer):
    assert marked(tokenizer, episode(tokenizer, ["<answer> Paris </answer>"])) == []
    assert marked(tokenizer, episode(tokenizer, ["<think>x</think>\n<search> ["])) == []


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["passage", "graph"]), st.sampled_from(["", " "]),
                          st.text(alphabet="abcdefgh XYZ", min_size=1, max_size=12)), min_size=1, max_size=3))
def test_every_search_marks_one_token_that_starts_its_mode(tokenizer, searches):
    turns = [f"<think>t</think>\n<search>{space}[{mode}] {query}</search>" for mode, space, query in searches]
    tokens = marked(tokenizer, episode(tokenizer, turns + ["<answer> x </answer>"]))
    assert len(tokens) == len(searches)
    for token, (mode, _, _) in zip(tokens, searches):
        assert token and mode.startswith(token.strip())


def test_filler_rows_carry_no_mode_choice(tokenizer):
    rollouts = [episode(tokenizer, ["<search> [graph] q</search>", "<answer> a </answer>"]),
                episode(tokenizer, ["<search> [passage] q</search>", "<answer> a </answer>"]),
                episode(tokenizer, ["<answer> a </answer>"])]
    fields = mode_choice_fields(rollouts)
    assert fields["mode_choice_mask"].sum(-1).tolist() == [1.0, 1.0, 0.0]
    batch, fillers = assemble_batch(rollouts, [1.0, -1.0, 0.0], pad_token_id=0, multiple=4, extra=fields)
    assert fillers == 1 and batch.mode_choice_mask[3].sum() == 0 and batch.loss_mask[3].sum() == 0
    # a marked token is always one the loss trains on
    assert bool(((batch.mode_choice_mask > 0) <= (batch.loss_mask > 0)).all())


def test_route_centred_credit_reaches_the_batch_and_not_its_filler_rows(tokenizer):
    rollouts = [episode(tokenizer, ["<search> [graph] q</search>", "<answer> a </answer>"]),
                episode(tokenizer, ["<search> [graph] r</search>", "<answer> a </answer>"]),
                episode(tokenizer, ["<search> [passage] q</search>", "<answer> a </answer>"])]
    fields = mode_choice_fields(rollouts, torch.tensor([1.0, -0.5, 2.0]))
    at_choice = (fields["mode_choice_advantages"] * fields["mode_choice_mask"]).sum(-1)
    # graph twice: 1 − 0.25, −0.5 − 0.25; passage once: 0
    assert at_choice.tolist() == pytest.approx([0.75, -0.75, 0.0])
    batch, fillers = assemble_batch(rollouts, [1.0, -0.5, 2.0], pad_token_id=0, multiple=4, extra=fields)
    assert fillers == 1 and batch.mode_choice_advantages[3].abs().sum() == 0
    assert torch.equal(batch.mode_choice_advantages[:3], fields["mode_choice_advantages"])
    assert "mode_choice_advantages" not in mode_choice_fields(rollouts)  # off unless asked


def test_the_recorded_positions_count_the_prompt_turns_and_observations_before_them(tokenizer):
    turns = ["<search> [graph] who</search>", "<search>[passage] q</search>", "<answer> a </answer>"]
    rollout = episode(tokenizer, turns, observation="<information> x </information>", prompt="Pick a mode.")
    # SmolLM2 splits: the prompt into 4 tokens (positions 0-3); turn 1 into '<' 'search' '>' ' ['
    # 'graph' ']' ' who' '</' 'search' '>' (4-13, 'graph' at 4 + 4 = 8); the observation into '<'
    # 'information' '>' ' x' ' </' 'information' '>' (14-20); turn 2 into '<' 'search' '>' '['
    # 'pass' 'age' ']' ' q' '</' 'search' '>' (21-31, 'pass' at 21 + 4 = 25); then the second
    # observation (32-38) and the answer (39-45), which names no mode.
    assert len(rollout) == 46
    assert rollout.mode_choice_positions == [8, 25]
    assert [tokenizer.decode([rollout.token_ids[p]]) for p in (8, 25)] == ["graph", "pass"]
    assert rollout.as_dict()["mode_choice_positions"] == [8, 25]


def test_a_mode_choice_off_the_models_tokens_is_refused(tokenizer):
    rollout = episode(tokenizer, ["<search> [graph] who</search>", "<answer> a </answer>"], prompt="Pick a mode.")
    rollout.check()
    rollout.mode_choice_positions.append(2)  # a prompt token
    with pytest.raises(ValueError, match="not a model token"):
        rollout.check()


def test_a_dialect_without_a_mode_slot_records_no_choice(tokenizer):
    builder = RolloutBuilder(tokenizer, "search_r1", max_response_tokens=64)
    builder.add_prompt(tokenizer.encode("Q?", add_special_tokens=False))
    ids = tokenizer.encode("<search> [graph] q</search>", add_special_tokens=False)
    builder.add_model_turn(ids, [0.0] * len(ids))
    assert builder.finish().mode_choice_positions == []
