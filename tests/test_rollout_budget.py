"""What the rollout loop's response budget counts (``RolloutConfig.response_budget_counts``).

``"model"`` counts the model's sampled tokens only; ``"model_and_observations"`` also counts the
observation tokens appended after them, as verl-tool's ``max_response_length`` does (LWS's Table 5
budget). The episodes are scripted (``actors/engines/scripted.py``) through the real SmolLM2
tokenizer over ``RagSearchEnv`` and ``KeywordRetriever``, so every count below is known by hand:

- the prompt is followed by turn 1, a passage search of 27 tokens;
- its observation is 60 tokens (two hits, well under the 128-token observation cap);
- turn 2 is a graph search of 26 tokens, followed by another observation of 60 tokens;
- turn 3 answers in 15 tokens.

Uncapped, an episode is 27 + 26 + 15 = 68 model tokens and 120 observation tokens: 188 in all.
"""

from __future__ import annotations

import pytest

from actors.engines import make_engine
from actors.runtime import _rollout_config
from envs import RagSearchEnv
from envs.rollout import RESPONSE_BUDGET_COUNTS, EpisodeRequest, LocalBackend, MultiTurnRollout, RolloutConfig
from raggym.algorithms.spans import SpanLabel
from experiments.recipe.config import load_config
from raggym.data import Corpus
from test_envs_support import PASSAGES, QUESTIONS, make_retriever

SCRIPT = ["<think>look</think>\n<search> [passage] {question} </search>",
          "<think>again</think>\n<search> [graph] {question} </search>",
          "<think>done</think>\n<answer> London </answer>"]
NOLAN = QUESTIONS[0]  # "Where was the director of Inception born?"
TURN_CAP, OBSERVATION_CAP = 64, 128


@pytest.fixture(scope="module")
def tokenizer():
    return make_engine("scripted", model="smollm2-135m").tokenizer


def run(tokenizer, budget: int, counts: str):
    engine = make_engine("scripted", tokenizer=tokenizer, script=SCRIPT)
    env = RagSearchEnv(make_retriever(), [NOLAN], dialect="routerag", corpus=Corpus(PASSAGES))
    config = RolloutConfig(max_response_tokens=budget, max_turn_tokens=TURN_CAP,
                           max_observation_tokens=OBSERVATION_CAP, response_budget_counts=counts)
    rollout, = MultiTurnRollout(LocalBackend(engine), tokenizer, None, config).run([env], [EpisodeRequest(NOLAN, "p")])
    turns = [len(ids) for ids in rollout.turn_token_ids()]
    observed = rollout.span_labels.count(SpanLabel.OBSERVATION)
    return rollout, env.record, turns, observed


def test_the_script_has_the_token_counts_the_module_docstring_states(tokenizer):
    for segment, n in zip(SCRIPT, (27, 26, 15)):
        assert len(tokenizer(segment.format(question=NOLAN.question), add_special_tokens=False)["input_ids"]) == n
    for counts in RESPONSE_BUDGET_COUNTS:  # a budget of 200 holds the whole episode under either rule
        rollout, record, turns, observed = run(tokenizer, 200, counts)
        assert (turns, observed, len(rollout) - rollout.prompt_length) == ([27, 26, 15], 120, 188)
        assert not record.truncated and record.answer == "London"


def test_counting_observations_leaves_the_second_turn_what_the_first_observation_did_not_use(tokenizer):
    # budget 100: turn 1 takes 27 (73 left), its observation 60 (13 left), so turn 2 is cut to 13
    # tokens and the budget is spent: the episode ends for its response length, 100 tokens after the prompt
    rollout, record, turns, observed = run(tokenizer, 100, "model_and_observations")
    assert (turns, observed) == ([27, 13], 60)
    assert len(rollout) - rollout.prompt_length == 27 + 60 + 13 == 100
    assert rollout.truncated_by_length and record.truncation_reason == "response_tokens"
    # counting the model's tokens only, the same 100 hold all three turns (68 model tokens)
    rollout, record, turns, observed = run(tokenizer, 100, "model")
    assert (turns, observed, rollout.response_length) == ([27, 26, 15], 120, 68)
    assert not rollout.truncated_by_length and record.answer == "London"


def test_counting_observations_cuts_an_observation_to_the_budget_left_and_ends_the_episode(tokenizer):
    # budget 40: turn 1 takes 27 (13 left); its 60-token observation keeps 13, and no second call is made
    rollout, record, turns, observed = run(tokenizer, 40, "model_and_observations")
    assert (turns, observed) == ([27], 13)
    assert len(rollout) - rollout.prompt_length == 40
    assert rollout.truncated_by_length and record.truncation_reason == "response_tokens"
    # counting the model's tokens only: the whole observation, then a second turn of the 13 left
    rollout, record, turns, observed = run(tokenizer, 40, "model")
    assert (turns, observed, rollout.response_length) == ([27, 13], 60, 40)
    assert record.truncation_reason == "response_tokens"


def test_the_counting_rule_is_one_of_the_known_names():
    assert RolloutConfig().response_budget_counts == "model"  # the default keeps the model-tokens-only rule
    with pytest.raises(ValueError, match=r"response_budget_counts must be one of \['model', 'model_and_observations'\]"):
        RolloutConfig(response_budget_counts="observations")


def test_the_runtime_builds_its_rollout_config_with_the_configured_counting_rule():
    cfg = load_config("experiments/configs/lws_tiny.yaml", ["rollout.response_budget_counts=model_and_observations"])
    assert _rollout_config(cfg).response_budget_counts == "model_and_observations"
