"""The per-GPU memory plan of the GPU recipes (experiments/recipe/memory_plan.py)."""

from __future__ import annotations

import pytest

from experiments.recipe.memory_plan import (
    FIT_FRACTION,
    GIB,
    GPU_BYTES,
    QWEN25_3B,
    RECIPES,
    ModelShape,
    engine_gpu_bytes,
    learner_gpu_bytes,
    load_recipe,
    markdown,
    micro_batch_tokens,
    recipe_plan,
)


def test_qwen25_3b_shape_matches_the_published_sizes():
    assert QWEN25_3B.parameters() == pytest.approx(3.09e9, rel=0.01)  # "3.09B" on the model card
    assert QWEN25_3B.kv_dim == 256
    assert QWEN25_3B.kv_cache_bytes_per_token() == 2 * 36 * 256 * 2  # K and V, 36 layers, bf16


def test_micro_batch_tokens_follow_the_budget():
    assert micro_batch_tokens(32, 4096, None) == 131_072
    assert micro_batch_tokens(32, 4096, 32_768) == 32_768  # 8 whole rows
    assert micro_batch_tokens(2, 4096, 32_768) == 8_192  # the row count binds first
    assert micro_batch_tokens(8, 40_000, 32_768) == 40_000  # a row longer than the budget runs alone


def test_learner_components_by_hand():
    tiny = ModelShape(vocab=100, hidden=8, layers=2, intermediate=16, heads=2, kv_heads=1, tied_embeddings=True, qkv_bias=False)
    p = tiny.parameters()
    # embeddings 800 + 2 layers × (q, o 64 each + k, v 32 each + MLP 3·8·16 + norms 16) + final norm 8
    assert p == 800 + 2 * (128 + 64 + 384 + 16) + 8
    zero3 = learner_gpu_bytes(tiny, zero_stage=3, num_learners=4, tokens=10, reference=True, logit_chunk_size=4)
    assert zero3["weights"] == 2 * p // 4 + 2 * p  # the shard + at most everything gathered (p < max live parameters)
    assert zero3["optimizer"] == 12 * p // 4 and zero3["reference"] == 2 * p // 4
    assert zero3["gradients"] == 2 * p // 4 + 2 * p  # partition + one reduce bucket (p < bucket size)
    assert zero3["activations"] == 2 * 10 * 8 * 2 + 2 * 10 * tiny.activation_bytes_per_token_layer()
    assert zero3["logits"] == 4 * 100 * 18 + 4 * 100 * 8 + 4 * 10 * 8
    assert zero3["total"] == sum(v for k, v in zero3.items() if k != "total")
    zero0 = learner_gpu_bytes(tiny, zero_stage=0, num_learners=4, tokens=10, reference=False, gradient_checkpointing=False)
    assert zero0["weights"] == 2 * p and zero0["optimizer"] == 12 * p and zero0["gradients"] == 2 * p
    assert zero0["reference"] == 0 and zero0["activations"] == 2 * 10 * tiny.activation_bytes_per_token_layer()


def test_engine_kv_cache_is_what_the_utilisation_leaves():
    engine = engine_gpu_bytes(QWEN25_3B, gpu_memory_utilization=0.5, seq_len=4096)
    assert engine["weights"] + engine["kv_cache"] + engine["overhead"] == int(0.5 * GPU_BYTES)
    assert engine["kv_tokens"] == engine["kv_cache"] // QWEN25_3B.kv_cache_bytes_per_token()
    assert engine["full_length_sequences"] == engine["kv_tokens"] // 4096


@pytest.mark.parametrize("name", RECIPES)
def test_every_gpu_recipe_fits_an_80gb_gpu(name):
    plan = recipe_plan(load_recipe(name), name)
    assert plan.fits(), markdown([plan])
    assert plan.learner["total"] <= FIT_FRACTION * GPU_BYTES
    assert plan.engine["full_length_sequences"] >= 1


def test_the_former_routerag_micro_batch_did_not_fit():
    # micro-batch 32 at T = 4,096 with no token budget: 131,072 tokens a pass, whose checkpointed
    # activations alone exceed what one GPU can give
    recipe = load_recipe("routerag")
    recipe["learner"] = {**recipe["learner"], "micro_batch_size": 32}
    recipe["learner"].pop("max_tokens_per_micro_batch", None)
    plan = recipe_plan(recipe, "routerag-old")
    assert plan.micro_tokens == 131_072 and not plan.fits()
    assert plan.learner["activations"] > 50 * GIB
