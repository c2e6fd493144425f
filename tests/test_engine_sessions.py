"""``HFEngine`` sessions on the real SmolLM2-135M: the reference engine as a ``SessionEngine``.

Its sessions go through ``BatchingSessionEngine`` (no KV cache between turns): every check
compares against a from-scratch forward pass of the session's whole context, or against
``generate`` of the same single prompt, which is what makes the engine batch-invariant.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.engines import HFEngine, SamplingParams
from raggym.generation import SessionEngine

ATOL = 2e-4  # what padding and a different matmul order change, as in test_engines.py


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares 2 cores; one thread avoids OpenMP oversubscription
    eng = HFEngine("smollm2-135m")
    yield eng
    eng.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    questions = ["What is the capital of France?", "Count from 1 to 20, separated by commas.", "Name three colours."]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"] for q in questions]


@pytest.fixture(scope="module")
def observation(engine):
    text = "\n<information> Paris is the capital and the largest city of France, on the Seine. </information>\n"
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def full_forward_logprobs(engine, context, generated, temperature=1.0):
    """log_softmax(logits / T) of each generated id from one unpadded forward pass of everything."""
    ids = torch.tensor([list(context) + list(generated)])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    steps = logits[len(context) - 1 : len(context) - 1 + len(generated)] / temperature
    return torch.log_softmax(steps, dim=-1).gather(-1, torch.tensor(generated)[:, None]).squeeze(-1)


def assert_exact(engine, context, result, temperature=1.0):
    expected = full_forward_logprobs(engine, context, result.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=ATOL, rtol=0)


async def play(engine, session_id, prompt, observation, turns, seed, max_new_tokens, temperature=1.0):
    """A session of ``turns`` turns: each context is the previous one + the sampled ids + the observation."""
    context, record = list(prompt), []
    for turn in range(turns):
        sampling = SamplingParams(temperature=temperature, seed=seed * 100 + turn)
        result = await engine.generate_async(session_id, context, sampling, max_new_tokens=max_new_tokens)
        record.append((list(context), result))
        context = context + result.token_ids + observation
    return record


def test_hf_engine_is_a_session_engine(engine):
    assert isinstance(engine, SessionEngine)


def test_every_turn_matches_a_full_forward(engine, prompts, observation):
    lengths = (5, 9, 7)  # different lengths: sessions finish their turns at different times

    async def main():
        return await asyncio.gather(*(play(engine, f"exact-{i}", p, observation, 3, i, n, temperature=0.8)
                                      for i, (p, n) in enumerate(zip(prompts, lengths))))

    for record in asyncio.run(main()):
        for context, result in record:
            assert_exact(engine, context, result, temperature=0.8)
            assert result.weight_version == engine.weight_version
    for i in range(3):
        engine.end_session(f"exact-{i}")


def test_unseeded_requests_share_generate_calls(engine, prompts):
    calls_before = len(engine._sessions.calls)

    async def main():
        return await asyncio.gather(*(engine.generate_async(f"greedy-{i}", p, SamplingParams(temperature=0.0), max_new_tokens=4)
                                      for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    assert engine._sessions.calls[calls_before:] == [3]  # one call of three prompts
    expected = engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=4)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    for i in range(3):
        engine.end_session(f"greedy-{i}")


def test_a_seed_reproduces_a_session_alone_or_batched_and_matches_generate(engine, prompts, observation):
    async def batched():
        return await asyncio.gather(*(play(engine, f"seed-b{i}", p, observation, 2, 7 + i, 8) for i, p in enumerate(prompts)))

    async def alone():
        return await play(engine, "seed-alone", prompts[1], observation, 2, 8, 8)

    together = asyncio.run(batched())
    single = asyncio.run(alone())
    assert [r.token_ids for _, r in single] == [r.token_ids for _, r in together[1]]
    # a first turn samples what generate of the same single prompt samples (stream derive_seed(seed, 0))
    (plain,) = engine.generate([prompts[1]], SamplingParams(seed=8 * 100), max_new_tokens=8)
    assert plain.token_ids == single[0][1].token_ids
    other = asyncio.run(play(engine, "seed-other", prompts[1], observation, 1, 9, 8))
    assert other[0][1].token_ids != single[0][1].token_ids
    for sid in ["seed-alone", "seed-other", *(f"seed-b{i}" for i in range(3))]:
        engine.end_session(sid)


def test_an_update_waits_for_the_call_in_flight(engine, prompts):
    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    version = engine.weight_version

    async def main():
        long = asyncio.ensure_future(engine.generate_async("inflight", prompts[1], SamplingParams(temperature=0.0),
                                                           max_new_tokens=24))
        while engine.load()["running"] == 0:
            await asyncio.sleep(0.005)
        update = asyncio.to_thread(engine.update_weights, original, version + 1)
        result, new_version = await asyncio.gather(long, update)
        after = await engine.generate_async("inflight", prompts[1], SamplingParams(temperature=0.0), max_new_tokens=2)
        return result, new_version, after

    try:
        result, new_version, after = asyncio.run(main())
        assert len(result.token_ids) == 24 and result.weight_version == version  # finished on the old weights
        assert new_version == after.weight_version == version + 1
    finally:
        engine.update_weights(original, version=version)
        engine.end_session("inflight")


def test_load_and_end_session(engine, prompts):
    async def main():
        assert engine.load() == {"sessions": 0, "running": 0}
        a = asyncio.ensure_future(engine.generate_async("load-a", prompts[0], SamplingParams(temperature=0.0), max_new_tokens=12))
        b = asyncio.ensure_future(engine.generate_async("load-b", prompts[1], SamplingParams(temperature=0.0), max_new_tokens=30))
        await asyncio.sleep(0)
        assert engine.load() == {"sessions": 2, "running": 2}
        first, _ = await asyncio.gather(a, b)
        assert engine.load() == {"sessions": 2, "running": 0}
        engine.end_session("load-a")
        engine.end_session("load-b")
        assert engine.load() == {"sessions": 0, "running": 0}
        again = await engine.generate_async("load-a", prompts[0], SamplingParams(temperature=0.0), max_new_tokens=12)
        engine.end_session("load-a")
        return first, again

    first, again = asyncio.run(main())
    assert first.token_ids == again.token_ids
    with pytest.raises(ValueError):
        asyncio.run(engine.generate_async("empty", [], max_new_tokens=4))


def test_stop_strings_and_eos_end_a_session_turn_like_generate(engine, prompts):
    free = engine.generate(prompts[1:2], SamplingParams(temperature=0.0), max_new_tokens=16)[0]
    stop = engine.tokenizer.decode(free.token_ids)[5:9]
    eos_engine = HFEngine(engine.model, engine.tokenizer, eos_token_ids=[free.token_ids[2]])

    async def main():
        stopped = await engine.generate_async("stop", prompts[1], SamplingParams(temperature=0.0), [stop], 16)
        ended = await eos_engine.generate_async("eos", prompts[1], SamplingParams(temperature=0.0), max_new_tokens=16)
        return stopped, ended

    try:
        stopped, ended = asyncio.run(main())
    finally:
        eos_engine.close()
    expected = engine.generate(prompts[1:2], SamplingParams(temperature=0.0), [stop], 16)[0]
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_string) == (expected.token_ids, "stop", stop)
    assert ended.finish_reason == "eos" and ended.token_ids == free.token_ids[:3]
    engine.end_session("stop")
