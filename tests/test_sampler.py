"""``data.balance_by``: prompt batches with equal shares of each value of a question attribute
(``raggym.data.sampler.BalancedPromptSampler``), deterministic and resumable like the plain sampler."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.recipe.config import ConfigError, load_config
from raggym.data import Question
from raggym.data.sampler import BalancedPromptSampler, PromptSampler, make_prompt_sampler

# a question attribute's values: 1 to 3 values, each on at least one question, in any order
values_strategy = st.lists(st.sampled_from(["direct", "graph_only", "bridge"]), min_size=1, max_size=40)


def _draw(sampler, size: int, batches: int) -> list[list[int]]:
    return [sampler.next_batch(size) for _ in range(batches)]


@settings(max_examples=60, deadline=None)
@given(values=values_strategy, size=st.integers(1, 17), batches=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_every_batch_holds_each_value_as_equally_as_its_size_allows(values, size, batches, seed):
    sampler = BalancedPromptSampler(values, seed)
    kinds = sorted(set(values))
    totals = Counter()
    for batch in _draw(sampler, size, batches):
        assert len(batch) == size
        counts = Counter(values[i] for i in batch)
        per_value = [counts[k] for k in kinds]
        assert max(per_value) - min(per_value) <= 1, per_value  # within a batch
        assert sum(per_value) == size
        totals.update(counts)
        # and over the batches so far: the leftover slots go to the values in turn
        assert max(totals[k] for k in kinds) - min(totals[k] for k in kinds) <= 1, totals


@settings(max_examples=60, deadline=None)
@given(values=values_strategy, size=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_each_values_questions_come_in_whole_shuffled_passes(values, size, seed):
    sampler = BalancedPromptSampler(values, seed)
    kinds = sorted(set(values))
    drawn = [i for batch in _draw(sampler, size, 3 * len(values)) for i in batch]  # at least 3 passes of the largest value
    for kind in kinds:
        members = sorted(i for i, v in enumerate(values) if v == kind)
        mine = [i for i in drawn if values[i] == kind]
        for p in range(len(mine) // len(members)):  # every finished pass visits each of the value's questions once
            assert sorted(mine[p * len(members):(p + 1) * len(members)]) == members


@settings(max_examples=60, deadline=None)
@given(values=values_strategy, size=st.integers(1, 12), cut=st.integers(0, 6), seed=st.integers(0, 2**31))
def test_a_resumed_balanced_sampler_draws_what_an_uninterrupted_one_draws(values, size, cut, seed):
    expected = _draw(BalancedPromptSampler(values, seed), size, cut + 3)
    first = BalancedPromptSampler(values, seed)
    got = _draw(first, size, cut)
    resumed = BalancedPromptSampler(values, seed + 1)  # another seed: the state must override it
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # the checkpoint is JSON
    got += _draw(resumed, size, 3)
    assert got == expected
    assert BalancedPromptSampler(list(reversed(values)), seed).values == sorted(set(values))  # order of first sight is irrelevant


def test_the_batch_split_by_hand():
    values = ["direct"] * 5 + ["graph_only"] * 3
    sampler = BalancedPromptSampler(values, seed=0)
    # 3 prompts, 2 values: one leftover slot, given to direct, then graph_only, then direct again
    assert [sampler.counts(3), sampler.next_batch(3) and None] == [[2, 1], None]
    assert sampler.counts(3) == [1, 2]
    sampler.next_batch(3)
    assert sampler.counts(3) == [2, 1] and sampler.counts(4) == [2, 2]


def test_switching_balancing_at_a_resume():
    values = ["direct"] * 6 + ["graph_only"] * 4
    plain = PromptSampler(len(values), seed=3)
    plain.next_batch(4)
    # a run that turns balancing on when it resumes starts its balanced passes from its seed
    turned_on = BalancedPromptSampler(values, seed=3)
    turned_on.load_state_dict(json.loads(json.dumps(plain.state_dict())))
    assert _draw(turned_on, 4, 3) == _draw(BalancedPromptSampler(values, seed=3), 4, 3)
    # a balanced checkpoint into a run with balancing off, or balanced by other values: refused
    balanced = BalancedPromptSampler(values, seed=3).state_dict()
    with pytest.raises(ValueError, match=r"balanced its batches by 'kind'.*data.balance_by off"):
        PromptSampler(len(values), seed=3).load_state_dict(balanced)
    with pytest.raises(ValueError, match="group_sizes"):
        BalancedPromptSampler(["direct"] * 5 + ["graph_only"] * 5, seed=3).load_state_dict(balanced)


def _question(i: int, kind: str | None) -> Question:
    return Question(id=f"q{i}", question=f"question {i}?", answers=("a",), kind=kind, hops=1 + i % 2)


def test_the_sampler_a_config_asks_for():
    questions = [_question(i, "direct" if i % 3 else "graph_only") for i in range(9)]
    assert isinstance(make_prompt_sampler(questions, 0), PromptSampler)  # off by default
    by_kind = make_prompt_sampler(questions, 0, "kind")
    assert by_kind.values == ["direct", "graph_only"] and [len(m) for m in by_kind.members] == [6, 3]
    assert make_prompt_sampler(questions, 0, "hops").values == [1, 2]
    with pytest.raises(ValueError, match=r"1 of 3 training questions have no 'kind' \(the first: question 2\)"):
        make_prompt_sampler([_question(0, "direct"), _question(1, "direct"), _question(2, None)], 0, "kind")
    cfg = load_config("experiments/configs/cpu_tiny.yaml", ["data.balance_by=kind"])
    assert cfg.data.balance_by == "kind" and load_config("experiments/configs/cpu_tiny.yaml").data.balance_by is None
    with pytest.raises(ConfigError, match=r"data.balance_by: unknown question attribute 'type'; .* one of kind, hops"):
        load_config("experiments/configs/cpu_tiny.yaml", ["data.balance_by=type"])
