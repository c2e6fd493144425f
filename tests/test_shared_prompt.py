"""Shared-prompt packing (``raggym.algorithms.shared_prompt``): layout by hand, and equality of
log-probabilities, losses and gradients with the plain padded computation on a small random Llama
(the real transformers architecture, eager and SDPA attention)."""

from __future__ import annotations

import pytest
import torch

from actors.learner import token_logprobs
from raggym.algorithms.kl import kl_estimate
from raggym.algorithms.losses import aggregate_loss, clipped_policy_loss, entropy_from_logits
from raggym.algorithms.shared_prompt import (
    common_prefix_length,
    entry_logprobs,
    pack_sequences,
    prefix_groups,
    shared_prompt_order,
)


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    return ids, attn


def test_layout_of_two_rows_sharing_a_prompt_by_hand():
    # rows 0 and 2 share [5, 6, 7]; row 1 shares nothing; row 3 has nothing to train (left out)
    ids, attn = right_padded([[5, 6, 7, 8, 9], [1, 2, 3], [5, 6, 7, 4], [5, 6, 7, 1]])
    needed = torch.zeros_like(ids, dtype=torch.bool)
    needed[0, 3:5] = needed[2, 3] = needed[1, 1:3] = True
    packed = pack_sequences(ids, attn, needed, min_shared_tokens=2)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4], [1, 2, 3, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 0, 0, 0]]
    allowed = packed.attention_mask[0, 0].long().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # 8 sees the prompt and itself
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],  # 4 (row 2) sees the prompt, not its sibling's 8, 9
    ]
    assert packed.attention_mask[1, 0, 4].long().tolist() == [0, 0, 0, 0, 1, 0]  # padding sees itself only
    # entries: row 0 tokens 3, 4 (predicted at packed 2, 3); row 2 token 3 (packed 2, shared); row 1 tokens 1, 2
    assert packed.keep.long().tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert sorted(packed.target_index.tolist()) == sorted([0 * 5 + 3, 0 * 5 + 4, 2 * 5 + 3, 1 * 5 + 1, 1 * 5 + 2])
    assert packed.logit_index is not None and packed.logit_index.numel() == 5  # packed position 2 feeds two entries
    assert (packed.real_tokens, packed.computed_tokens, packed.padded_tokens) == (12, 9, 3)
    unshared = pack_sequences(ids, attn, needed, share_prefix=False)
    assert not unshared.shared and unshared.input_ids.shape == (3, 5)


def test_prefix_helpers():
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 9])
    assert common_prefix_length(a, b) == 2 and common_prefix_length(a, a[:3]) == 3
    assert prefix_groups([a, torch.tensor([7, 7]), b], min_shared_tokens=2) == [([0, 2], 2), ([1], 2)]
    assert prefix_groups([a, b], min_shared_tokens=3) == [([0], 4), ([1], 3)]
    ids, attn = right_padded([[3, 1], [1, 2, 3], [3, 0, 5], [1, 2]])
    assert shared_prompt_order(ids, attn).tolist() == [3, 1, 2, 0]
    with pytest.raises(ValueError, match="right-padded"):
        pack_sequences(ids, torch.tensor([[0, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]]), attn.bool())


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def tiny_llama(request):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = request.param
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def grpo_like_batch(seed: int = 0):
    """Two groups of three samples sharing a 24-token prompt, plus one loner; a masked-out
    observation inside each continuation, as in a multi-turn rollout."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for _ in range(2):
        prompt = torch.randint(3, 300, (24,), generator=g).tolist()
        for tail in (9, 14, 5):
            rows.append(prompt + torch.randint(3, 300, (tail,), generator=g).tolist())
            mask = [0] * 24 + [1] * tail
            mask[26:28] = [0, 0]  # an observation the policy did not write
            masks.append(mask[: len(rows[-1])])
    rows.append(torch.randint(3, 300, (20,), generator=g).tolist())
    masks.append([0] * 8 + [1] * 12)
    ids, attn = right_padded(rows)
    loss_mask = torch.zeros(ids.shape)
    for i, m in enumerate(masks):
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    loss_mask[:, 0] = 0
    advantages = torch.randn(len(rows), generator=g)
    return ids, attn, loss_mask, advantages


def grpo_loss(log_probs, logits_entropy, loss_mask, advantages, old, ref):
    """Clipped PG + β·k3 KL − c_H·H, token-mean: the terms the learner adds up."""
    pg, _ = clipped_policy_loss(log_probs, old, advantages, loss_mask)
    kl = aggregate_loss(kl_estimate(log_probs, ref, "k3"), loss_mask)
    entropy = aggregate_loss(logits_entropy, loss_mask)
    return pg + 0.1 * kl - 0.01 * entropy


def test_shared_prompt_losses_and_gradients_equal_the_padded_computation(tiny_llama):
    model = tiny_llama
    ids, attn, loss_mask, advantages = grpo_like_batch()
    g = torch.Generator().manual_seed(1)
    old = torch.randn(ids.shape, generator=g) * 0.1 - 5.0  # ratios away from 1, so clipping takes part
    ref = torch.randn(ids.shape, generator=g) * 0.1 - 5.0

    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    lp_plain = token_logprobs(logits, ids)
    ent_plain = torch.nn.functional.pad(entropy_from_logits(logits[:, :-1]), (1, 0))
    loss_plain = grpo_loss(lp_plain, ent_plain, loss_mask, advantages, old, ref)
    loss_plain.backward()
    grads_plain = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    packed = pack_sequences(ids, attn, loss_mask > 0, min_shared_tokens=16)
    assert packed.shared and packed.input_ids.shape[0] == 3  # two groups and the loner
    assert packed.computed_tokens < 0.6 * packed.real_tokens
    mask4d = packed.model_attention_mask(torch.float32)
    # every position's logits, then the kept ones row-major (the learner does the same on hidden
    # states; a 2-D logits_to_keep mask needs transformers >= 5.20, vLLM's CPU build pins < 5.20)
    out = model(input_ids=packed.input_ids, attention_mask=mask4d, position_ids=packed.position_ids).logits[packed.keep]
    out = out if packed.logit_index is None else out[packed.logit_index]
    lp_packed = packed.scatter(entry_logprobs(out, packed.targets))
    ent_packed = packed.scatter(entropy_from_logits(out.float()))
    loss_packed = grpo_loss(lp_packed, ent_packed, loss_mask, advantages, old, ref)
    loss_packed.backward()

    trained = loss_mask > 0
    torch.testing.assert_close(lp_packed[trained], lp_plain[trained], atol=1e-5, rtol=0)
    assert torch.all(lp_packed[~trained] == 0)
    torch.testing.assert_close(loss_packed, loss_plain, atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_plain[name], atol=1e-5, rtol=1e-4, msg=name)
    assert grads_plain["model.embed_tokens.weight"].abs().sum() > 0
