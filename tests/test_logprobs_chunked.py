"""Chunked per-token log-probabilities, entropies and teacher KL: same values and gradients as the full-logits reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from actors.learner import token_logprobs
from raggym.algorithms.logprobs import (
    chunked_token_logprobs,
    final_hidden_states,
    full_token_logprobs,
    head_token_stats,
    head_topk,
    output_head,
)


def _random_case(seed: int, batch: int, seq: int, hidden: int, vocab: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return h, w, ids


def test_hand_computed_tiny_case():
    # lm_head rows e1, e2, e1 + e2; the hidden state [1, 2] at position 0 gives logits [1, 2, 3],
    # and token 1 is id 2, so its log-probability is 3 − log(e + e² + e³).
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    h = torch.tensor([[[1.0, 2.0], [0.0, 0.0]]], dtype=torch.float64)
    ids = torch.tensor([[0, 2]])
    expected = 3.0 - math.log(math.e + math.e**2 + math.e**3)
    for fn in (full_token_logprobs, lambda *a, **k: chunked_token_logprobs(*a, chunk_size=1, **k)):
        out = fn(h, w, ids)
        assert out.shape == (1, 2) and out.dtype == torch.float32
        assert out[0, 0].item() == 0.0  # nothing predicts the first token
        assert out[0, 1].item() == pytest.approx(expected, abs=1e-6)
    # temperature 2 halves the logits: [0.5, 1, 1.5]
    hot = 1.5 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    assert chunked_token_logprobs(h, w, ids, temperature=2.0, chunk_size=1)[0, 1].item() == pytest.approx(hot, abs=1e-6)


def test_matches_the_learner_convention():
    h, w, ids = _random_case(0, 2, 6, 4, 9)
    with torch.no_grad():
        reference = token_logprobs(h @ w.T, ids)
        assert torch.allclose(full_token_logprobs(h, w, ids), reference.float(), atol=1e-6)
        assert torch.allclose(chunked_token_logprobs(h, w, ids, chunk_size=4), reference.float(), atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    seq=st.integers(1, 9),
    hidden=st.integers(1, 6),
    vocab=st.integers(2, 17),
    chunk_size=st.integers(1, 30),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
)
def test_values_and_gradients_equal_the_full_version(seed, batch, seq, hidden, vocab, chunk_size, temperature):
    h, w, ids = _random_case(seed, batch, seq, hidden, vocab)
    g = torch.Generator().manual_seed(seed + 1)
    upstream = torch.randn(batch, seq, generator=g)  # a generic downstream loss: Σ upstream · logprob

    full = full_token_logprobs(h, w, ids, temperature)
    grad_h_full, grad_w_full = torch.autograd.grad((full * upstream).sum(), (h, w))
    chunked = chunked_token_logprobs(h, w, ids, temperature, chunk_size=chunk_size)
    grad_h, grad_w = torch.autograd.grad((chunked * upstream).sum(), (h, w))

    assert chunked.shape == (batch, seq)
    assert torch.allclose(chunked, full, atol=1e-5, rtol=0)
    if seq < 2:  # nothing is predicted: the result does not depend on the inputs
        assert not grad_h.any() and not grad_w.any() and not chunked.any()
    assert torch.allclose(grad_h, grad_h_full, atol=1e-5, rtol=0)
    assert torch.allclose(grad_w, grad_w_full, atol=1e-5, rtol=0)


def test_float32_inputs_agree_with_float64_reference():
    h, w, ids = _random_case(3, 3, 20, 8, 50, dtype=torch.float32)
    ref = full_token_logprobs(h.detach().double(), w.detach().double(), ids)
    out = chunked_token_logprobs(h, w, ids, chunk_size=7)
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)
    out.sum().backward()
    assert h.grad is not None and w.grad is not None and torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_never_builds_the_full_logits():
    batch, seq, hidden, vocab, chunk = 4, 33, 4, 50, 16  # 128 predicted positions × 50 = 6,400 logits
    positions = batch * (seq - 1)
    h, w, ids = _random_case(5, batch, seq, hidden, vocab, dtype=torch.float32)
    for fn, bound in ((full_token_logprobs, None), (chunked_token_logprobs, chunk * vocab)):
        h.grad = w.grad = None
        with _LargestTensor() as probe:
            out = fn(h, w, ids) if bound is None else fn(h, w, ids, chunk_size=chunk)
            out.sum().backward()
        if bound is None:
            assert probe.largest >= positions * vocab  # the reference does build [B·(T−1), V]
        else:
            # one chunk's logits, or the [V, H] / [B·T, H] gradients, whichever is larger
            assert probe.largest <= max(bound, vocab * hidden, batch * seq * hidden)


def test_no_autograd_path_and_bad_arguments():
    h, w, ids = _random_case(7, 2, 5, 3, 6)
    with torch.no_grad():
        assert torch.allclose(chunked_token_logprobs(h, w, ids, chunk_size=3), full_token_logprobs(h, w, ids), atol=1e-6)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(h, w, ids, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(h, w, ids, temperature=0.0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        full_token_logprobs(h, w[:, :2], ids)
    with pytest.raises(ValueError, match="token_ids"):
        chunked_token_logprobs(h, w, ids[:, :3])


# ----------------------------------------------------------------------------- head_token_stats


def _linear_head(seed: int, hidden: int, vocab: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.float64)


def _all_stats(stats):
    return torch.stack([stats.logprobs, stats.entropy, stats.teacher_kl])


@pytest.mark.parametrize("chunk_size,num_chunks", [(1, None), (3, None), (4, 7), (50, None), (50, 3)])
def test_head_stats_and_their_gradients_equal_the_full_logits(chunk_size, num_chunks):
    positions, width, vocab, k = 10, 5, 23, 4
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(positions, width, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (positions,), generator=g)
    teacher_values = torch.randn(positions, k, generator=g, dtype=torch.float64)
    teacher_indices = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(positions)])
    upstream = torch.randn(3, positions, generator=g, dtype=torch.float64)
    head = _linear_head(0, width, vocab)
    kwargs = dict(entropy=True, entropy_grad=True, teacher_values=teacher_values, teacher_indices=teacher_indices)

    full = _all_stats(head_token_stats(hidden, head, targets, 1.7, 0, **kwargs))
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, head.weight))
    chunked = _all_stats(head_token_stats(hidden, head, targets, 1.7, chunk_size, num_chunks=num_chunks, **kwargs))
    grads = torch.autograd.grad((chunked * upstream).sum(), (hidden, head.weight))

    assert torch.allclose(chunked, full, atol=1e-6, rtol=0)
    for got, want in zip(grads, full_grads):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    # independent checks of one row against the definitions (the softmax runs in float32)
    z = (head(hidden[2]) / 1.7).detach()
    p = torch.softmax(z, -1)
    assert full[0, 2].item() == pytest.approx(float(torch.log_softmax(z, -1)[targets[2]]), abs=1e-5)
    assert full[1, 2].item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-5)


def test_entropy_is_a_detached_statistic_unless_asked():
    head = _linear_head(1, 3, 7)
    hidden = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 1, 2, 3])
    stats = head_token_stats(hidden, head, targets, chunk_size=2, entropy=True)
    assert stats.logprobs.requires_grad and not stats.entropy.requires_grad and stats.teacher_kl is None
    assert head_token_stats(hidden, head, targets, chunk_size=2, entropy=True, entropy_grad=True).entropy.requires_grad


def test_num_chunks_sets_how_often_the_head_runs_forward_and_backward():
    # Under ZeRO-3 every call of the head gathers its weight with all ranks: the count must not
    # depend on how many positions a rank has.
    head = _linear_head(2, 3, 7)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    hidden = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    lp = head_token_stats(hidden, head, torch.tensor([1, 2, 3]), chunk_size=2, num_chunks=5).logprobs
    assert len(calls) == 5 and lp.shape == (3,)
    lp.sum().backward()
    assert len(calls) == 10  # each chunk, the empty ones included, recomputed once in the backward
    values, indices = head_topk(hidden.detach(), head, 2, chunk_size=2, num_chunks=4)
    assert len(calls) == 14 and values.shape == indices.shape == (3, 2)
    expected = torch.topk(head(hidden.detach()), 2)
    assert torch.equal(indices, expected.indices) and torch.allclose(values, expected.values.float())


def test_final_hidden_states_through_the_head_are_the_models_logits():
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 97, (2, 9))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits
        hidden = final_hidden_states(model, ids, attn, positions)
        assert hidden.shape == (2, 9, 16)
        assert torch.allclose(output_head(model)(hidden), logits, atol=1e-5, rtol=0)
    model.config.final_logit_softcapping = 30.0  # a head the chunked path would get wrong
    with pytest.raises(ValueError, match="logit_chunk_size"):
        output_head(model)


def test_head_stats_reject_bad_arguments():
    head = _linear_head(3, 3, 7)
    hidden = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="chunk_size"):
        head_token_stats(hidden, head, torch.zeros(4, dtype=torch.long), chunk_size=-1)
    with pytest.raises(ValueError, match="targets"):
        head_token_stats(hidden, head, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="together"):
        head_token_stats(hidden, head, torch.zeros(4, dtype=torch.long), teacher_values=torch.zeros(4, 2))
