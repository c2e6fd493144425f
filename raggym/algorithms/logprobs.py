"""Per-token log-probabilities from final hidden states, with or without the full logits tensor.

A policy-gradient step needs ``log π(token_t | tokens_<t)`` for every position. The direct way
multiplies all hidden states by the output embedding (``lm_head``) at once: ``[B, T, V]`` logits,
then a float32 copy for a stable ``log_softmax``. With a Qwen-sized vocabulary (V = 151,936) and
8 sequences of 2,048 tokens that is 10 GB per float32 copy, and autograd keeps some of those
copies alive until the backward pass: on one 80 GB GPU next to a 3B model's optimizer state it
is what runs out of memory first.

``chunked_token_logprobs`` computes the same numbers a slice of positions at a time: each chunk's
logits exist only while that chunk is processed. Under autograd every chunk runs inside
``torch.utils.checkpoint``, so the forward pass keeps only the chunk's inputs and its ``[chunk]``
result, and the backward pass recomputes one chunk's logits at a time. Peak extra memory is about
``chunk_size · V · (2 + 4 + 4)`` bytes (bf16 logits, their float32 copy, its gradient) instead of
that times ``B·T / chunk_size``; the price is a second logits matmul per chunk in the backward.

Conventions match ``actors.learner.token_logprobs``: entry ``t`` of the ``[B, T]`` result is the
log-probability of ``token_ids[:, t]`` under the logits at position ``t − 1`` divided by
``temperature`` (the rollout temperature, so the values equal the engine's sampling logprobs);
entry 0 is 0 because nothing predicts the first token. ``full_token_logprobs`` is the direct
computation, kept as the reference.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 1024  # positions per chunk: 1024 × 151,936 × 4 B ≈ 0.6 GB of float32 logits


def _check_inputs(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> None:
    if hidden_states.ndim != 3:
        raise ValueError(f"hidden_states must be [batch, seq, hidden], got shape {tuple(hidden_states.shape)}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden_states.shape[2]:
        raise ValueError(
            f"lm_head_weight must be [vocab, hidden={hidden_states.shape[2]}], got shape {tuple(lm_head_weight.shape)}"
        )
    if tuple(token_ids.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"token_ids must be [batch, seq] = {tuple(hidden_states.shape[:2])}, got {tuple(token_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[N]`` log-softmax of ``hidden @ weight.T / temperature`` at ``targets``; ``hidden`` is ``[N, H]``."""
    logits = (hidden @ weight.T).float() / temperature  # matmul in the model's dtype, softmax in float32
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def full_token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[B, T]`` float32 log-probabilities through the full ``[B, T − 1, V]`` logits (the reference)."""
    _check_inputs(hidden_states, lm_head_weight, token_ids, temperature)
    batch, seq, width = hidden_states.shape
    hidden = hidden_states[:, :-1].reshape(-1, width)
    targets = token_ids[:, 1:].reshape(-1).long()
    lp = _target_logprobs(hidden, lm_head_weight, targets, temperature).reshape(batch, seq - 1)
    return torch.nn.functional.pad(lp, (1, 0))


def chunked_token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``[B, T]`` float32 log-probabilities, the same as ``full_token_logprobs``, ``chunk_size`` positions at a time.

    Positions of all sequences are taken together (flattened), so a chunk may span sequences and
    the last chunk is shorter. Gradients flow to ``hidden_states`` and ``lm_head_weight``.
    """
    _check_inputs(hidden_states, lm_head_weight, token_ids, temperature)
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk_size = int(chunk_size)
    batch, seq, width = hidden_states.shape
    hidden = hidden_states[:, :-1].reshape(-1, width)
    targets = token_ids[:, 1:].reshape(-1).long()
    # Checkpointing only pays when a backward pass will follow; without autograd it would only
    # add bookkeeping.
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    parts = []
    # split (not slicing in a loop): its backward concatenates the chunks' gradients once instead
    # of adding one zero-padded [B·T, H] gradient per chunk. With T = 1 it yields one empty chunk.
    for rows, tgt in zip(hidden.split(chunk_size), targets.split(chunk_size)):
        if recompute:
            parts.append(checkpoint(_target_logprobs, rows, lm_head_weight, tgt, temperature, use_reentrant=False))
        else:
            parts.append(_target_logprobs(rows, lm_head_weight, tgt, temperature))
    lp = torch.cat(parts).reshape(batch, seq - 1)
    return torch.nn.functional.pad(lp, (1, 0))


__all__ = ["DEFAULT_CHUNK_SIZE", "chunked_token_logprobs", "full_token_logprobs"]
