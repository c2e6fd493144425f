"""Multi-turn, token-in-token-out rollouts with the real HF engine and the real retriever."""

import pytest

from actors.engines.base import SamplingParams
from envs.rollout import EpisodeRequest, LocalBackend, MultiTurnRollout, RolloutConfig
from envs import RagSearchEnv
from raggym.algorithms.spans import SpanLabel
from raggym.trajectory import RolloutBuilder, chat_prompt_ids, token_char_offsets


class ScriptedEngine:
    """Replays fixed segments through the real tokenizer: lets a test pin down exact ids.

    It is a test driver for the loop (the model's choices are fixed), not a stand-in for the
    HF engine, which the other tests here exercise with real sampling.
    """

    weight_version = 3

    def __init__(self, tokenizer, segments):
        self.tokenizer, self.segments, self.calls = tokenizer, list(segments), []

    def generate(self, prompts, sampling=None, stop_strings=(), max_new_tokens=256):
        from actors.engines.base import GenerationResult

        self.calls.append([list(p) for p in prompts])
        seg = self.segments.pop(0)
        ids = self.tokenizer(seg, add_special_tokens=False)["input_ids"][:max_new_tokens]
        return [GenerationResult(ids, [-0.5] * len(ids), "stop", weight_version=self.weight_version) for _ in prompts]


def test_token_offsets_cover_text(hf_engine):
    tok = hf_engine.tokenizer
    ids = tok("<think>plan ü日本</think><search> [graph] who? </search>", add_special_tokens=False)["input_ids"]
    text, offsets = token_char_offsets(tok, ids)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(a <= b for a, b in offsets) and all(offsets[i][1] == offsets[i + 1][0] for i in range(len(offsets) - 1))


def test_scripted_episode_masks_spans_and_exact_ids(hf_engine, small_world, small_world_retriever):
    tok = hf_engine.tokenizer
    q = next(q for q in small_world.questions if q.hops == 1)
    segments = [f"<think>look it up</think><search> [graph] {q.golden_trajectory[0]['query']} </search>",
                f"<think>found it</think><answer>{q.answer}</answer>"]
    engine = ScriptedEngine(tok, segments)
    env = RagSearchEnv(small_world_retriever, [q], dialect="routerag")
    traj, = MultiTurnRollout(LocalBackend(engine), tok, config=RolloutConfig()).run([env], [EpisodeRequest(q, "g0")])
    # the exact generated ids come back, turn by turn, via the mask
    expected = [tok(s, add_special_tokens=False)["input_ids"] for s in segments]
    assert traj.model_token_spans() == expected and traj.turn_token_ids() == expected
    assert traj.weight_versions == [3, 3]
    # the prompt is the chat template of the env's rendered prompt
    assert traj.token_ids[: traj.prompt_length] == chat_prompt_ids(tok, env.record.prompt)
    # the second engine call saw prompt + turn 1 + observation, with the observation tokenized once
    obs = env.record.turns[0].observation
    obs_ids = tok(obs, add_special_tokens=False)["input_ids"]
    assert engine.calls[1][0] == traj.token_ids[: traj.prompt_length] + expected[0] + obs_ids
    labels = traj.span_labels
    for i, (m, lab) in enumerate(zip(traj.loss_mask, labels)):
        if i < traj.prompt_length:
            assert m == 0 and lab == SpanLabel.PROMPT
        elif lab == SpanLabel.OBSERVATION:
            assert m == 0
        else:
            assert m == 1 and lab in (SpanLabel.THINK, SpanLabel.QUERY, SpanLabel.ANSWER, SpanLabel.OTHER)
    assert sum(1 for lab in labels if lab == SpanLabel.OBSERVATION) == len(obs_ids)
    assert {SpanLabel.THINK, SpanLabel.QUERY, SpanLabel.ANSWER} <= set(labels)
    ep = traj.episode
    assert ep["answer"] == q.answer and ep["num_retrievals"] == 1
    assert traj.group_key == ("g0", 0) and traj.outcome.answer == q.answer and traj.outcome.em == 1.0
    assert ep["turns"][0]["retrieved_ids"] == small_world_retriever.retrieve([q.golden_trajectory[0]["query"]], "graph", 3)[0].ids


def test_real_sampling_rollout_keeps_engine_output(hf_engine, small_world, small_world_retriever):
    tok = hf_engine.tokenizer
    questions = small_world.questions[:4]
    envs = [RagSearchEnv(small_world_retriever, questions, dialect="routerag") for _ in questions]
    cfg = RolloutConfig(max_response_tokens=40, max_turn_tokens=16, max_observation_tokens=64)
    trajs = MultiTurnRollout(LocalBackend(hf_engine), tok, SamplingParams(temperature=1.0, seed=11), cfg).run(envs, questions)
    for traj in trajs:
        traj.check()
        assert traj.response_length <= 40
        turn_ids = traj.turn_token_ids()
        assert traj.model_token_spans() == turn_ids  # each turn's span is one run of the mask
        assert [tok.decode(ids) for ids in turn_ids] == [t["text"] for t in traj.turns]
        assert all(len(ids) <= 16 for ids in turn_ids)
        # the rollout logprobs of model tokens are the engine's, and 0 elsewhere
        flat = [lp for lps in traj.turn_logprobs() for lp in lps]
        assert [lp for lp, m in zip(traj.sampled_logprobs, traj.loss_mask) if m] == flat
        assert all(lp <= 0 for lp in flat) and not any(lp for lp, m in zip(traj.sampled_logprobs, traj.loss_mask) if not m)
        assert traj.episode["terminated"] or traj.episode["truncated"]
        obs_tokens = sum(1 for lab in traj.span_labels if lab == SpanLabel.OBSERVATION)
        assert obs_tokens <= 64 * max(0, len(traj.turns) - 1)


def test_builder_rejects_overlong_turns(hf_engine):
    b = RolloutBuilder(hf_engine.tokenizer, "routerag", max_response_tokens=3)
    b.add_prompt([1, 2])
    with pytest.raises(ValueError, match="response budget"):
        b.add_model_turn([5, 6, 7, 8], [0.0] * 4)
    with pytest.raises(RuntimeError):
        b.add_prompt([1])


def test_turn_cap_cuts_a_turn_and_sequence_cap_ends_the_episode(hf_engine, small_world, small_world_retriever):
    """Per-turn cap 10 and a 4,096-style context cap, hand-counted on one scripted episode.

    Turn 1 (a search of more than 10 tokens) is cut to 10 by the per-turn cap; the env answers the
    unfinished segment with an observation, kept at 20 tokens. Turn 2 may then sample only what
    the context has left (S - prompt - 10 - 20 = 6 < 10), after which the episode is truncated
    for its sequence length, never for its response budget (1,000 tokens, far from reached).
    """
    tok = hf_engine.tokenizer
    q = next(q for q in small_world.questions if q.hops == 1)
    long_search = f"<think>I should look this up first</think><search> [passage] {q.question} </search>"
    long_answer = f"<think>now I know the answer to this question</think><answer>{q.answer}</answer>"
    assert len(tok(long_search, add_special_tokens=False)["input_ids"]) > 10
    assert len(tok(long_answer, add_special_tokens=False)["input_ids"]) > 10
    env = RagSearchEnv(small_world_retriever, [q], dialect="routerag")
    prompt_len = len(chat_prompt_ids(tok, env.reset(options={"question": q})[0]))
    sequence_cap = prompt_len + 10 + 20 + 6
    engine = ScriptedEngine(tok, [long_search, long_answer])
    cfg = RolloutConfig(max_response_tokens=1000, max_turn_tokens=10, max_observation_tokens=20,
                        max_sequence_tokens=sequence_cap)
    traj, = MultiTurnRollout(LocalBackend(engine), tok, config=cfg).run([env], [EpisodeRequest(q, "g0")])
    assert [len(ids) for ids in traj.turn_token_ids()] == [10, 6]
    assert len(engine.calls) == 2 and len(engine.calls[1][0]) == prompt_len + 10 + 20
    assert traj.prompt_length == prompt_len and len(traj.token_ids) == sequence_cap
    assert sum(traj.loss_mask) == 16
    assert traj.truncated_by_length and env.record.truncated
    assert env.record.truncation_reason == "sequence_tokens"


def test_sequence_cap_cuts_an_observation_to_the_room_left(hf_engine, small_world, small_world_retriever):
    """An observation longer than the context's room keeps only the room's tokens, then the episode ends."""
    tok = hf_engine.tokenizer
    q = next(q for q in small_world.questions if q.hops == 1)
    search = f"<search> [passage] {q.question} </search>"
    search_len = len(tok(search, add_special_tokens=False)["input_ids"])
    env = RagSearchEnv(small_world_retriever, [q], dialect="routerag")
    prompt_len = len(chat_prompt_ids(tok, env.reset(options={"question": q})[0]))
    cfg = RolloutConfig(max_response_tokens=1000, max_turn_tokens=100, max_observation_tokens=200,
                        max_sequence_tokens=prompt_len + search_len + 5)
    engine = ScriptedEngine(tok, [search])
    traj, = MultiTurnRollout(LocalBackend(engine), tok, config=cfg).run([env], [EpisodeRequest(q, "g0")])
    assert len(engine.calls) == 1
    assert traj.span_labels.count(SpanLabel.OBSERVATION) == 5
    assert len(traj.token_ids) == prompt_len + search_len + 5
    assert env.record.truncation_reason == "sequence_tokens"


def test_rollout_config_rejects_a_nonpositive_sequence_cap():
    with pytest.raises(ValueError, match="max_sequence_tokens"):
        RolloutConfig(max_sequence_tokens=0)
    with pytest.raises(ValueError, match="max_turn_tokens"):
        RolloutConfig(max_turn_tokens=0)
