"""Where the agent chose a retrieval mode: the tokens the learner's mode entropy bonus acts on.

``mode_choice_mask`` reads a rollout's model-written text with the real SmolLM2 tokenizer and
marks the token holding the first character of each search's mode name, found through the
dialect's ``mode_slot``. Text the environment wrote (the prompt's instructions, an observation)
must never be marked: the agent chose nothing there.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raggym.algorithms.batch import assemble_batch, mode_choice_fields, mode_choice_mask  # noqa: E402
from raggym.protocol import get_dialect  # noqa: E402
from raggym.trajectory import RolloutBuilder  # noqa: E402

SLOT = get_dialect("routerag").mode_slot


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
    return builder.finish({})


def marked(tokenizer, rollout) -> list[str]:
    mask = mode_choice_mask(rollout, tokenizer, SLOT)
    return [tokenizer.decode([rollout.token_ids[i]]) for i, m in enumerate(mask) if m]


def test_only_the_models_own_mode_names_are_marked(tokenizer):
    rollout = episode(tokenizer, ["<think>who?</think>\n<search> [graph] the employer of Ana Oru</search>",
                                  "<search>[passage] Ana Oru employer</search>",
                                  "<answer> Fenqua Works </answer>"],
                      observation="<information> it said <search> [graph] inside a document </information>")
    # the prompt's example and the observation's copy are the environment's text, not choices
    assert marked(tokenizer, rollout) == ["graph", "pass"]
    assert sum(mode_choice_mask(rollout, tokenizer, SLOT)) == 2


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
    fields = mode_choice_fields(rollouts, tokenizer, SLOT)
    assert fields["mode_choice_mask"].sum(-1).tolist() == [1.0, 1.0, 0.0]
    batch, fillers = assemble_batch(rollouts, [1.0, -1.0, 0.0], pad_token_id=0, multiple=4, extra=fields)
    assert fillers == 1 and batch["mode_choice_mask"][3].sum() == 0 and batch["loss_mask"][3].sum() == 0
    # a marked token is always one the loss trains on
    assert bool(((batch["mode_choice_mask"] > 0) <= (batch["loss_mask"] > 0)).all())
