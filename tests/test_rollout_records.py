"""What the rollout loop records on each ``Rollout`` for the learner, while the episode runs.

The scripted engine (``actors/engines/scripted.py``) plays known segments through the real SmolLM2
tokenizer; the environment is the real ``RagSearchEnv`` over ``KeywordRetriever`` (no model). The
rollouts must carry the tokens where the model named a retrieval mode and, when the config asks
for it, PathRouter's teacher prompt, so that the learner's inputs are built without decoding the
model's output again.
"""

from __future__ import annotations

import pytest

from actors.engines import make_engine
from envs import RagSearchEnv
from envs.rollout import EpisodeRequest, LocalBackend, MultiTurnRollout, RolloutConfig
from raggym.algorithms.batch import teacher_fields
from raggym.data import Corpus
from raggym.trajectory import chat_prompt_ids
from test_envs_support import PASSAGES, QUESTIONS, make_retriever

BOTH_MODES = ["<think>look</think>\n<search> [passage] {question} </search>",
              "<think>again</think>\n<search> [graph] {question} </search>",
              "<think>done</think>\n<answer> London </answer>"]
CONFIG = dict(max_response_tokens=200, max_turn_tokens=64, max_observation_tokens=128)
NOLAN = QUESTIONS[0]  # two gold passages: Inception's and Christopher Nolan's


@pytest.fixture(scope="module")
def tokenizer():
    return make_engine("scripted", model="smollm2-135m").tokenizer


def run(tokenizer, samples: int = 2, **config):
    engine = make_engine("scripted", tokenizer=tokenizer, script=BOTH_MODES)
    corpus = Corpus(PASSAGES)
    envs = [RagSearchEnv(make_retriever(), [NOLAN], dialect="routerag", corpus=corpus) for _ in range(samples)]
    loop = MultiTurnRollout(LocalBackend(engine), tokenizer, None, RolloutConfig(**{**CONFIG, **config}))
    return envs, loop.run(envs, [EpisodeRequest(NOLAN, f"0:{NOLAN.id}", g) for g in range(samples)])


def test_each_search_records_the_token_that_starts_its_mode_name(tokenizer):
    _, rollouts = run(tokenizer)
    for rollout in rollouts:
        assert [tokenizer.decode([rollout.token_ids[p]]) for p in rollout.mode_choice_positions] == ["pass", "graph"]
        # each lies in the turn that named it: the first before the first observation, the second after it
        first_turn_end = rollout.turns[0]["end"]
        passage, graph = rollout.mode_choice_positions
        assert rollout.prompt_length < passage < first_turn_end < graph


def test_the_teacher_prompt_is_recorded_from_the_gold_passages_and_the_reset_prompt(tokenizer):
    envs, rollouts = run(tokenizer, teacher_evidence_tokens=10)
    gold = "\n".join(p.text for p in PASSAGES[:2])  # NOLAN's gold passages, in the question's order
    # 10 tokens: 'In' 'ception' ' is' ' a' ' ' '2' '0' '1' '0' ' film' (SmolLM2 spells numbers digit by digit)
    evidence = "Inception is a 2010 film"
    ids = tokenizer(gold, add_special_tokens=False)["input_ids"]
    assert ids[:10] == tokenizer(evidence, add_special_tokens=False)["input_ids"]
    for env, rollout in zip(envs, rollouts):
        # the paper appends the gold passages to the teacher's prompt: the episode's prompt, then the evidence
        assert rollout.teacher_prompt_ids == chat_prompt_ids(tokenizer, f"{env.record.prompt}\n\nEvidence:\n{evidence}")
        assert rollout.as_dict()["teacher_prompt_ids"] == rollout.teacher_prompt_ids
    fields = teacher_fields(rollouts, int(tokenizer.pad_token_id))
    for row, rollout in enumerate(rollouts):  # the teacher reads the student's own response tokens after its prompt
        for t in range(rollout.prompt_length, len(rollout)):
            assert fields["teacher_token_ids"][row, fields["teacher_positions"][row, t]] == rollout.token_ids[t]


def test_no_teacher_prompt_is_recorded_unless_asked(tokenizer):
    _, rollouts = run(tokenizer, samples=1)
    assert rollouts[0].teacher_prompt_ids is None and rollouts[0].as_dict()["teacher_prompt_ids"] is None
    with pytest.raises(ValueError, match="recorded no teacher prompt"):
        teacher_fields(rollouts, int(tokenizer.pad_token_id))
    with pytest.raises(ValueError, match="teacher_evidence_tokens must be at least 1"):
        RolloutConfig(teacher_evidence_tokens=0)


def test_an_episodes_em_is_computed_once_for_the_env_reward_the_training_reward_and_the_log(tokenizer, monkeypatch):
    """The env's default reward (EM) reads the outcome the record closed with; the rollout carries
    that outcome, so the reward schedule and the step log reuse its EM: one exact match per episode."""
    from raggym import text_metrics
    from raggym.rewards import metrics
    from raggym.rewards.routerag import routerag_batch_rewards

    calls = []
    real = text_metrics.exact_match
    for module in (text_metrics, metrics):  # metrics re-exports it under its own name
        monkeypatch.setattr(module, "exact_match", lambda *a, **k: calls.append(a) or real(*a, **k))
    envs, rollouts = run(tokenizer, samples=3)
    assert [r.outcome.env_reward for r in rollouts] == [1.0, 1.0, 1.0]
    assert [env.unwrapped._record.outcome() is r.outcome for env, r in zip(envs, rollouts)] == [True] * 3
    assert routerag_batch_rewards([r.outcome for r in rollouts], stage=2) != []
    assert [metrics.outcome_metrics(r.outcome)["em"] for r in rollouts] == [1.0, 1.0, 1.0]
    assert len(calls) == 3
