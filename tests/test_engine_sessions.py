"""``HFEngine`` sessions on the real SmolLM2-135M: continuous batching with a KV cache per session.

Every check compares against a from-scratch forward pass of the session's whole context, so a
cache that holds the wrong keys (stale weights, a misplaced padding column, a wrong position id)
shows up as a logprob mismatch.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from actors.engines import HFEngine, SamplingParams
from actors.engines.base import SessionEngine

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


def record_prefix(contexts) -> list[int]:
    """The ids every context starts with."""
    first = list(contexts[0])
    n = min(next((i for i, (a, b) in enumerate(zip(first, c)) if a != b), min(len(first), len(c))) for c in contexts[1:])
    return first[:n]


def test_hf_engine_is_a_session_engine(engine):
    assert isinstance(engine, SessionEngine)


def test_every_turn_matches_a_full_forward_and_prefills_only_the_new_ids(engine, prompts, observation):
    before = engine.session_stats()
    lengths = (5, 9, 7)  # different lengths: sessions leave and rejoin the batch at different steps

    async def main():
        return await asyncio.gather(*(play(engine, f"exact-{i}", p, observation, 3, i, n, temperature=0.8)
                                      for i, (p, n) in enumerate(zip(prompts, lengths))))

    records = asyncio.run(main())
    after = engine.session_stats()
    reused = prefilled = 0
    for record in records:
        for turn, (context, result) in enumerate(record):
            assert_exact(engine, context, result, temperature=0.8)
            assert result.weight_version == engine.weight_version
            if turn == 0:
                prefilled += len(context)
            else:  # the cache holds everything but the last sampled id, whose keys were never computed
                previous_context, previous = record[turn - 1]
                reused += len(previous_context) + len(previous.token_ids) - 1
                prefilled += 1 + len(observation)
    assert after["reused_tokens"] - before["reused_tokens"] == reused
    # a first turn's ids are computed, or taken from another session that opened with the same ids
    # (these chat prompts share the template's system turn)
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    assert computed + after["shared_tokens"] - before["shared_tokens"] == prefilled
    assert computed >= sum(len(record[0][0]) - len(record_prefix(prompts)) for record in records)
    # the three sessions really were batched: fewer decode steps than tokens decoded one by one
    decoded = sum(len(r.token_ids) - 1 for record in records for _, r in record)
    assert after["decode_steps"] - before["decode_steps"] < decoded
    for i in range(3):
        engine.end_session(f"exact-{i}")


def test_new_and_continuing_sessions_prefill_together_exactly(engine, prompts, observation):
    """Sessions that finish a turn in the same step ask again in the same event-loop tick as a new
    session starts, so one padded prefill holds rows with and without a cached prefix."""
    before = engine.session_stats()
    first_turns_done = asyncio.Event()

    async def late_session():
        await first_turns_done.wait()
        context = prompts[2] + observation  # longer than the others' suffixes, not cached anywhere
        result = await engine.generate_async("mixed-late", context, SamplingParams(seed=5), max_new_tokens=6)
        return context, result

    async def continuing(i):
        record = []
        context = list(prompts[i])
        for turn in range(2):
            result = await engine.generate_async(f"mixed-{i}", context, SamplingParams(seed=10 * i + turn), max_new_tokens=6)
            record.append((context, result))
            first_turns_done.set()
            context = context + result.token_ids + observation
        return record

    async def main():
        return await asyncio.gather(continuing(0), continuing(1), late_session())

    first, second, late = asyncio.run(main())
    for context, result in [*first, *second, late]:
        assert_exact(engine, context, result)
    after = engine.session_stats()
    # 5 requests in fewer prefill passes: at least one pass held several rows
    assert after["prefill_forwards"] - before["prefill_forwards"] < 5
    for sid in ("mixed-0", "mixed-1", "mixed-late"):
        engine.end_session(sid)


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


def test_a_group_opening_with_one_prompt_computes_it_once(engine, prompts, observation):
    """GRPO's G samples of a question open G sessions with the same prompt: requests admitted
    together are prefilled as one row, a session opened later takes the prompt from the shared
    store, and every sample stays exact and seeded per session."""
    prompt = prompts[2]
    before = engine.session_stats()

    async def group():
        return await asyncio.gather(*(play(engine, f"group-{g}", prompt, observation, 2, 40 + g, 6) for g in range(4)))

    records = asyncio.run(group())
    middle = engine.session_stats()
    late = asyncio.run(play(engine, "group-late", prompt, observation, 1, 40, 6))
    after = engine.session_stats()
    for record in [*records, late]:
        for context, result in record:
            assert_exact(engine, context, result)
    # the same seed as group-0's first turn samples the same ids, whoever computed the prompt
    assert late[0][1].token_ids == records[0][0][1].token_ids
    assert len({tuple(record[0][1].token_ids) for record in records}) > 1  # the copies sample on their own
    # four first turns of len(prompt) ids: at most one computes the prompt, the rest share it
    first_turns = 4 * len(prompt)
    shared = middle["shared_tokens"] - before["shared_tokens"]
    assert shared >= 3 * len(prompt) and shared <= first_turns
    computed = middle["prefill_tokens"] - before["prefill_tokens"]
    second_turns = sum(1 + len(observation) for _ in records)
    assert computed + shared == first_turns + second_turns
    # the late session prefills one id (the logits of the prompt's last position) and shares the rest
    assert after["shared_tokens"] - middle["shared_tokens"] == len(prompt) - 1
    assert after["prefill_tokens"] - middle["prefill_tokens"] == 1
    for sid in [*(f"group-{g}" for g in range(4)), "group-late"]:
        engine.end_session(sid)


def test_a_diverging_context_reuses_only_the_common_prefix(engine, prompts):
    prompt = prompts[0]

    async def main():
        first = await engine.generate_async("diverge", prompt, SamplingParams(temperature=0.0), max_new_tokens=6)
        # the same prompt continued with other ids than the ones sampled: only the prompt is reusable
        other = prompt + engine.tokenizer("Lyon is", add_special_tokens=False)["input_ids"]
        before = engine.session_stats()
        second = await engine.generate_async("diverge", other, SamplingParams(temperature=0.7, seed=1), max_new_tokens=5)
        middle = engine.session_stats()
        # a context equal to what the cache holds: every id but the last is reused
        cached = other + second.token_ids[:-1]
        third = await engine.generate_async("diverge", cached, SamplingParams(temperature=0.0), max_new_tokens=4)
        after = engine.session_stats()
        return first, other, second, before, middle, cached, third, after

    first, other, second, before, middle, cached, third, after = asyncio.run(main())
    assert_exact(engine, prompt, first)
    assert middle["reused_tokens"] - before["reused_tokens"] == len(prompt)
    assert_exact(engine, other, second, temperature=0.7)
    assert after["reused_tokens"] - middle["reused_tokens"] == len(cached) - 1
    assert_exact(engine, cached, third)
    engine.end_session("diverge")


def test_a_weight_update_drops_session_caches(engine, prompts, observation):
    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    changed = {n: t * 0.5 if n.endswith("norm.weight") else t for n, t in original.items()}
    version = engine.weight_version
    sampling = SamplingParams(temperature=1.0, seed=42)

    async def turn(session_id, context):
        return await engine.generate_async(session_id, context, sampling, max_new_tokens=6)

    try:
        first = asyncio.run(turn("stale", prompts[0]))
        context = prompts[0] + first.token_ids + observation
        assert engine.session_stats()["cached_tokens"] > 0
        assert engine.session_stats()["shared_contexts"] > 0
        assert engine.update_weights(changed, version=version + 3) == version + 3
        assert engine.session_stats()["cached_tokens"] == engine.session_stats()["shared_contexts"] == 0
        before = engine.session_stats()
        after_update = asyncio.run(turn("stale", context))
        assert engine.session_stats()["reused_tokens"] == before["reused_tokens"]  # nothing reused
        fresh = asyncio.run(turn("fresh", context))
        assert after_update.weight_version == fresh.weight_version == version + 3 != first.weight_version
        assert after_update.token_ids == fresh.token_ids
        torch.testing.assert_close(torch.tensor(after_update.logprobs), torch.tensor(fresh.logprobs), atol=ATOL, rtol=0)
        assert_exact(engine, context, after_update)  # under the new weights
    finally:
        engine.update_weights(original, version=version)
        engine.end_session("stale")
        engine.end_session("fresh")


def test_an_update_waits_for_the_requests_in_flight(engine, prompts):
    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    version = engine.weight_version
    started = threading.Event()

    async def main():
        long = asyncio.ensure_future(engine.generate_async("inflight", prompts[1], SamplingParams(temperature=0.0),
                                                           max_new_tokens=24))
        while engine.session_stats()["decode_steps"] == steps_before:
            await asyncio.sleep(0.005)
        started.set()
        update = asyncio.to_thread(engine.update_weights, original, version + 1)
        result, new_version = await asyncio.gather(long, update)
        after = await engine.generate_async("inflight", prompts[1], SamplingParams(temperature=0.0), max_new_tokens=2)
        return result, new_version, after

    steps_before = engine.session_stats()["decode_steps"]
    try:
        result, new_version, after = asyncio.run(main())
        assert started.is_set()
        assert len(result.token_ids) == 24 and result.weight_version == version  # finished on the old weights
        assert new_version == after.weight_version == version + 1
    finally:
        engine.update_weights(original, version=version)
        engine.end_session("inflight")


def test_load_busy_sessions_cancellation_and_end_session(engine, prompts):
    async def main():
        assert engine.load() == {"sessions": 0, "running": 0}
        a = asyncio.ensure_future(engine.generate_async("load-a", prompts[0], SamplingParams(temperature=0.0), max_new_tokens=12))
        b = asyncio.ensure_future(engine.generate_async("load-b", prompts[1], SamplingParams(temperature=0.0), max_new_tokens=30))
        await asyncio.sleep(0)
        assert engine.load() == {"sessions": 2, "running": 2}
        with pytest.raises(RuntimeError, match="already has a request in flight"):
            await engine.generate_async("load-a", prompts[0], max_new_tokens=2)
        first = await a
        b.cancel()  # the caller left: the scheduler drops the row at its next step
        with pytest.raises(asyncio.CancelledError):
            await b
        while engine.load()["running"]:
            await asyncio.sleep(0.01)
        assert engine.load() == {"sessions": 2, "running": 0}
        engine.end_session("load-a")
        engine.end_session("load-b")
        assert engine.load() == {"sessions": 0, "running": 0}
        before = engine.session_stats()
        again = await engine.generate_async("load-a", prompts[0], SamplingParams(temperature=0.0), max_new_tokens=12)
        assert engine.session_stats()["reused_tokens"] == before["reused_tokens"]  # its cache was dropped
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


def test_growing_cache_layers_write_in_place_and_equal_dynamic_cache(engine, prompts):
    """``new_kv_cache``'s layers give the logits ``DynamicCache`` gives, bit for bit, through a
    left-padded prefill, decode steps and a row selection; a decode step within the spare room
    writes into the same buffer."""
    from transformers import DynamicCache

    from actors.engines.hf import new_kv_cache

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), engine.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1

    def run(cache):
        m, positions, logits, pointers = mask.clone(), (mask.cumsum(1) - 1).clamp(min=0), [], []
        with torch.inference_mode():
            out = engine.model(input_ids=ids, attention_mask=m, position_ids=positions, past_key_values=cache, use_cache=True)
            nxt, pos = out.logits[:, -1].argmax(-1), positions[:, -1]
            logits.append(out.logits[:, -1])
            for step in range(6):
                if step == 3:  # the first row finishes: select the others
                    keep = torch.tensor([1, 2])
                    cache.batch_select_indices(keep)
                    m, nxt, pos = m[keep], nxt[keep], pos[keep]
                m, pos = torch.cat([m, m.new_ones((len(m), 1))], 1), pos + 1
                out = engine.model(input_ids=nxt[:, None], attention_mask=m, position_ids=pos[:, None],
                                   past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1)
                logits.append(out.logits[:, -1])
                pointers.append(cache.layers[0].keys.data_ptr())
        return logits, pointers

    reference, _ = run(DynamicCache(config=engine.model.config))
    grown, pointers = run(new_kv_cache(engine.model.config))
    assert all(torch.equal(a, b) for a, b in zip(reference, grown))
    assert pointers[0] == pointers[1] == pointers[2]  # in place
    assert pointers[3] != pointers[2] and pointers[3] == pointers[4] == pointers[5]  # one copy after the selection


def test_rows_join_and_leave_the_growing_cache_in_place_with_the_logits_of_a_rebuilt_cache(engine, prompts):
    """The running batch's row changes (``GrowingLayer.append_rows``: a longer row joins and the
    batch widens on the left; ``move_rows``: two rows finish, the survivor moves into the first
    hole and the columns that are padding in every kept row are dropped) give, bit for bit, the logits of a ``DynamicCache`` rebuilt
    by concatenation and row selection, and copy no more than the moving rows."""
    from transformers import DynamicCache

    from actors.engines.hf import _pad_left, new_kv_cache

    config = engine.model.config
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # the longest joins last
    first, late = [prompts[i] for i in order[:2]], prompts[order[2]]
    assert len(late) > max(len(p) for p in first)

    def prefill(rows):
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, p in enumerate(rows):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        cache = DynamicCache(config=config)
        out = engine.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                           past_key_values=cache, use_cache=True)
        return cache, mask, out.logits[:, -1].argmax(-1), mask.sum(1)

    def run(batch, join, leave):
        logits, buffers = [], []
        with torch.inference_mode():
            cache, mask, nxt, pos = prefill(first)
            batch, mask = join(batch, None, cache, mask)
            for step in range(7):
                if step == 2:  # a longer row joins
                    added, added_mask, added_next, added_pos = prefill([late])
                    batch, mask = join(batch, mask, added, added_mask)
                    nxt, pos = torch.cat([nxt, added_next]), torch.cat([pos, added_pos])
                if step == 4:  # the first and the longest rows finish: the middle row moves to the front
                    batch, mask = leave(batch, mask)
                    nxt, pos = nxt[[1]], pos[[1]]
                mask = torch.cat([mask, mask.new_ones((len(mask), 1))], 1)
                out = engine.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None],
                                   past_key_values=batch, use_cache=True)
                nxt, pos = out.logits[:, -1].argmax(-1), pos + 1
                logits.append(out.logits[:, -1])
                buffers.append(getattr(batch.layers[0], "_buffer", (batch.layers[0].keys,))[0].data_ptr())
        return logits, buffers

    def join_by_concatenation(batch, mask, cache, added_mask):
        if mask is None:
            return cache, added_mask
        width = max(mask.shape[1], added_mask.shape[1])
        for layer, added in zip(batch.layers, cache.layers):
            layer.keys = torch.cat([_pad_left(layer.keys, width - mask.shape[1], 2), _pad_left(added.keys, width - added_mask.shape[1], 2)])
            layer.values = torch.cat([_pad_left(layer.values, width - mask.shape[1], 2), _pad_left(added.values, width - added_mask.shape[1], 2)])
        return batch, torch.cat([_pad_left(mask, width - mask.shape[1], 1), _pad_left(added_mask, width - added_mask.shape[1], 1)])

    def leave_by_selection(batch, mask):
        mask = mask[[1]]
        lead = int((mask.cumsum(1) == 0).sum(1).min())
        assert lead > 0  # the longest row left its padding columns behind: the batch narrows
        for layer in batch.layers:
            layer.keys, layer.values = layer.keys[[1], :, lead:], layer.values[[1], :, lead:]
        return batch, mask[:, lead:]

    def join_in_place(batch, mask, cache, added_mask):
        if mask is None:
            batch, mask = new_kv_cache(config), added_mask[:0, :0]
        width = max(mask.shape[1], added_mask.shape[1])
        for layer, added in zip(batch.layers, cache.layers):
            layer.append_rows(added.keys, added.values, row_room=4)
        return batch, torch.cat([_pad_left(mask, width - mask.shape[1], 1), _pad_left(added_mask, width - added_mask.shape[1], 1)])

    def leave_in_place(batch, mask):
        mask = mask[[1]]
        lead = int((mask.cumsum(1) == 0).sum(1).min())
        for layer in batch.layers:
            layer.move_rows([(1, 0)], 1, lead)
        return batch, mask[:, lead:]

    reference, _ = run(None, join_by_concatenation, leave_by_selection)
    in_place, buffers = run(None, join_in_place, leave_in_place)
    assert all(torch.equal(a, b) for a, b in zip(reference, in_place))
    assert len(set(buffers)) == 1  # the join, the departure and every decode step wrote into one buffer
