"""A rollout's turns point into its flat arrays: each model turn's ids and sampling log-probs are
stored once (``token_ids``, ``sampled_logprobs``) and read back through the turn's span.

Built with the real SmolLM2 tokenizer through ``RolloutBuilder``, the way the rollout loop builds
them; an empty observation puts two model turns side by side, where the loss mask alone could
not tell them apart.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from raggym.trajectory import RolloutBuilder  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from raggym.models import load_policy_tokenizer

    return load_policy_tokenizer("smollm2-135m")


turn_texts = st.lists(st.sampled_from(["<think>look</think>", "<search> [graph] who </search>", " x", "<answer> a </answer>"]),
                      min_size=1, max_size=3).map("".join)
observations = st.sampled_from(["", "<information> a note </information>"])


def build(tokenizer, turns, observation_after):
    builder = RolloutBuilder(tokenizer, "routerag", max_response_tokens=4096, max_observation_tokens=4096)
    builder.add_prompt(tokenizer.encode("Answer the question.", add_special_tokens=False))
    given_ids, given_logprobs = [], []
    for i, text in enumerate(turns):
        ids = tokenizer.encode(text, add_special_tokens=False)
        logprobs = [-(i + 1) - j / 100 for j in range(len(ids))]  # distinct, so a shifted slice shows
        builder.add_model_turn(ids, logprobs, weight_version=i)
        given_ids.append(ids)
        given_logprobs.append(logprobs)
        if i + 1 < len(turns):
            builder.add_observation(observation_after[i])
    return builder.finish(), given_ids, given_logprobs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(turn_texts, min_size=1, max_size=4), observation_after=st.lists(observations, min_size=3, max_size=3))
def test_each_turn_reads_back_exactly_the_ids_and_logprobs_it_was_given(tokenizer, turns, observation_after):
    rollout, given_ids, given_logprobs = build(tokenizer, turns, observation_after)
    assert rollout.turn_token_ids() == given_ids
    assert rollout.turn_logprobs() == given_logprobs
    assert rollout.weight_versions == list(range(len(turns)))
    assert [t["text"] for t in rollout.turns] == [tokenizer.decode(ids) for ids in given_ids]
    assert rollout.turns[0]["start"] == rollout.prompt_length and rollout.turns[-1]["end"] == len(rollout)
    # nothing is kept beside the flat arrays: a turn holds its span, text, finish reason and version
    assert all(set(t) == {"start", "end", "text", "finish_reason", "weight_version"} for t in rollout.turns)
    dumped = rollout.as_dict()  # a trajectory file's row: the spans still cut its arrays into the turns
    assert [dumped["token_ids"][t["start"]:t["end"]] for t in dumped["turns"]] == given_ids


def test_two_turns_with_an_empty_observation_between_them_stay_two(tokenizer):
    rollout, given_ids, _ = build(tokenizer, ["<search> [graph] who </search>", "<answer> a </answer>"], [""])
    assert rollout.turn_token_ids() == given_ids
    assert rollout.model_token_spans() == [given_ids[0] + given_ids[1]]  # the mask alone merges them


@pytest.mark.parametrize("corrupt", ["over_the_prompt", "over_an_observation", "past_the_end", "backwards"])
def test_check_refuses_a_turn_span_that_is_not_a_run_of_model_tokens(tokenizer, corrupt):
    rollout, _, _ = build(tokenizer, ["<search> [graph] who </search>", "<answer> a </answer>"],
                          ["<information> a note </information>"])
    rollout.check()
    first, second = rollout.turns
    if corrupt == "over_the_prompt":
        first["start"] -= 1
    elif corrupt == "over_an_observation":
        first["end"] += 1
    elif corrupt == "past_the_end":
        second["end"] = len(rollout) + 1
    else:
        second["start"], second["end"] = second["end"], second["start"]
    with pytest.raises(ValueError, match="span"):
        rollout.check()
