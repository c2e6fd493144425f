"""Two ZeRO-3 learner ranks (two processes, gloo on CPU) whose shards need different numbers of
forward passes and of logit chunks.

Under ZeRO-3 every forward of a module, the output head's chunks included, gathers the module's
weights with all ranks; a rank that ran one pass or one chunk fewer than the other would leave it
waiting in the gather. The learner makes the ranks agree (the largest count, filler passes of
weight 0); the step must equal one learner's step on the whole batch.
"""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest
import torch

from actors.learner import Learner, make_train_batch, micro_pieces, shard_batch

pytestmark = pytest.mark.integration

LENGTHS = (30, 22, 26, 18)
WATCHED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")
BUDGET = 55  # rank 0's rows (30, 22): 2 × 30 > 55, two passes; rank 1's (26, 18): 2 × 26 ≤ 55, one pass


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in LENGTHS]
    masks = [[0] * 10 + [1] * (n - 10) for n in LENGTHS]
    return make_train_batch(ids, masks, [1.0, -1.0, 0.5, -0.25])


def _config(model: str, **overrides) -> dict:
    return {"model": model, "zero_stage": 3, "micro_batch_size": 2, "mini_batch_size": 4, "shuffle": False,
            "optimizer": {"lr": 1e-3, "eps": 1.0, "weight_decay": 0.0}, "grad_clip": 1e6, "seed": 0,
            "old_logprobs": "recompute", "loss": {"kl_coef": 0.1}, "logit_chunk_size": 3, "num_threads": 1, **overrides}


def _rank(rank: int, port: int, model: str, results) -> None:
    try:
        learner = Learner(_config(model, max_tokens_per_micro_batch=BUDGET), rank=rank, world_size=2,
                          master_addr="127.0.0.1", master_port=port)
        metrics = learner.update(shard_batch(_batch(), 2)[rank], step=0)
        # both ranks gather together; numpy crosses the queue by value (a tensor would go through
        # shared memory that vanishes with this process)
        weights = {n: t.numpy() for n, t in learner.hf_named_parameters() if n in WATCHED}
        results.put((rank, metrics, weights))
    except BaseException as exc:  # reported to the test instead of a silent hang
        results.put((rank, repr(exc), None))
        raise


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from raggym.models import converted_checkpoint, resolve_model_spec

    tok = AutoTokenizer.from_pretrained(str(converted_checkpoint(resolve_model_spec("smollm2-135m"))))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_ranks_with_different_pass_and_chunk_counts_take_one_learners_step(tiny_model):
    from actors.weight_sync import pick_free_port

    shards = shard_batch(_batch(), 2)
    passes = [len(micro_pieces(s.attention_mask.sum(-1).tolist(), 2, BUDGET)) for s in shards]
    assert passes == [2, 1]  # the situation under test: the ranks disagree

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = pick_free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, tiny_model, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, metrics, weights = results.get(timeout=420)
            got[rank] = (metrics, weights)
    except queue.Empty:
        pytest.fail("the two ZeRO-3 ranks did not finish: one is waiting in a collective the other never joined")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, (metrics, _) in got.items():
        assert isinstance(metrics, dict), f"rank {rank} failed: {metrics}"
    assert got[0][1] is not None and got[0][1].keys() == set(WATCHED)

    # one learner, the whole batch, no budget, unchunked logits: the same step
    single = Learner(_config(tiny_model, micro_batch_size=4, logit_chunk_size=0))
    before = {n: t for n, t in single.hf_named_parameters() if n in WATCHED}
    reference_metrics = single.update(_batch(), step=0)
    after = {n: t for n, t in single.hf_named_parameters() if n in WATCHED}
    assert got[0][0]["micro_batches"] == got[1][0]["micro_batches"] == 2.0  # rank 1 ran one filler pass
    pg = (got[0][0]["pg_loss"] + got[1][0]["pg_loss"]) / 2  # LearnerGroup's rank average
    assert pg == pytest.approx(reference_metrics["pg_loss"], abs=1e-6)
    for name in WATCHED:
        step = after[name] - before[name]
        scale = float(step.abs().max())
        assert scale > 0
        torch.testing.assert_close(torch.from_numpy(got[0][1][name]) - before[name], step, atol=1e-3 * scale, rtol=1e-3)
