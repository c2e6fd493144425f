"""Per-token log-probabilities, entropies and teacher KL from final hidden states, a chunk at a time.

A policy-gradient step needs ``log π(token_t | tokens_<t)`` for every trained position. The direct
way multiplies all hidden states by the output embedding (``lm_head``) at once: ``[B, T, V]``
logits, then float32 copies for the temperature, the ``logsumexp`` and the entropy, and autograd
keeps several of them alive until the backward pass, which adds gradients of the same size. With
Qwen2.5's vocabulary (V = 151,936) one float32 copy for 32 sequences of 2,800 tokens is 54 GB: on
an 80 GB GPU it is what runs out of memory first.

``head_token_stats`` computes the same numbers ``chunk_size`` positions at a time from the final
hidden states (``final_hidden_states`` runs a Hugging Face causal LM up to them without its
output head). Each chunk's logits exist only while that chunk is processed. Under autograd every
chunk runs inside ``torch.utils.checkpoint`` (non-reentrant), so the forward pass keeps only the
chunk's ``[chunk, H]`` inputs and its ``[chunk]`` results, and the backward pass recomputes one
chunk's logits at a time. Peak extra memory is a few ``chunk_size · V`` float32 tensors (the
logits, their scaled copy, softmax temporaries and, in the backward, their gradient) instead of
that times ``positions / chunk_size``; the price is a second ``lm_head`` matmul per chunk in the
backward. The output head is called as a module (not through its weight), so DeepSpeed ZeRO-3's
module hooks gather a partitioned head as they do in the model's own forward.

Conventions match ``actors.learner.token_logprobs``: entry ``t`` of a ``[B, T]`` result is the
log-probability of ``token_ids[:, t]`` under the logits at position ``t − 1`` divided by
``temperature`` (the rollout temperature, so the values equal the engine's sampling logprobs);
entry 0 is 0 because nothing predicts the first token. ``full_token_logprobs`` is the direct
computation, kept as the reference; ``chunked_token_logprobs`` is the chunked one on a plain
weight matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from raggym.algorithms.losses import teacher_topk, topk_forward_kl

# Positions per chunk: 256 × 151,936 × 4 B ≈ 0.16 GB per float32 copy of a chunk's logits, and
# 256 × 2,048 × 151,936 × 2 ≈ 160 GFLOP per chunk's matmul, still a full-speed GPU matmul
# (docs/benchmarks.md, "Learner logits memory", measures the whole pass).
DEFAULT_CHUNK_SIZE = 256


@dataclass
class HeadStats:
    """Per-position results of ``head_token_stats``, all ``[M]`` float32."""

    logprobs: torch.Tensor  # log-softmax(logits / T) at the target
    entropy: torch.Tensor | None = None  # entropy of softmax(logits / T)
    teacher_kl: torch.Tensor | None = None  # topk_forward_kl of the unscaled logits


def _check_chunk_size(chunk_size: int | None) -> int | None:
    if chunk_size is None or int(chunk_size) == 0:
        return None
    if int(chunk_size) < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 or None: no chunking), got {chunk_size}")
    return int(chunk_size)


def _chunk_stats(hidden, targets, head, temperature, entropy, entropy_grad, teacher_values, teacher_indices):
    """Stats of one chunk of positions: ``hidden`` is ``[c, H]``; returns a tuple of ``[c]`` tensors."""
    logits = head(hidden)  # matmul in the model's dtype; the softmax below runs in float32
    # (no division at T = 1: one [c, V] float32 copy fewer when the head already returns float32)
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    out = [scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse]
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # H = −Σ p log p = lse − Σ_v p_v z_v (z = logits / T); the row-wise dot product needs
            # no [c, V] product tensor, unlike (p * z).sum(-1) or a log_softmax
            out.append(lse - torch.einsum("cv,cv->c", torch.softmax(scaled, dim=-1), scaled))
    if teacher_values is not None:
        out.append(topk_forward_kl(logits[None], teacher_values[None], teacher_indices[None])[0])
    return tuple(out)


def head_token_stats(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    teacher_values: torch.Tensor | None = None,
    teacher_indices: torch.Tensor | None = None,
    num_chunks: int | None = None,
) -> HeadStats:
    """Log-probabilities (and optionally entropies and teacher KL) of ``M`` positions.

    ``hidden`` is ``[M, H]`` (the final hidden state of the position *before* each target),
    ``head`` maps ``[c, H]`` to ``[c, V]`` logits (the model's output embedding module),
    ``targets`` is ``[M]`` token ids. ``entropy_grad`` lets gradients flow through the entropy
    (an entropy bonus in the loss); otherwise it is a detached statistic. ``teacher_values`` /
    ``teacher_indices`` (``[M, K]``) add PathRouter's top-K forward KL per position, computed on
    the unscaled logits. ``chunk_size`` 0 or None computes all positions at once (the reference:
    full ``[M, V]`` logits). Gradients flow to ``hidden`` and the head's parameters.

    ``num_chunks`` pads with empty chunks up to that many head calls, all recomputed in the
    backward: under ZeRO-3 each call of a partitioned head gathers its weight with every rank, so
    all ranks must call it equally often whatever their number of positions.
    """
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be [positions, hidden], got shape {tuple(hidden.shape)}")
    if tuple(targets.shape) != (hidden.shape[0],):
        raise ValueError(f"targets must be [{hidden.shape[0]}], got shape {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if (teacher_values is None) != (teacher_indices is None):
        raise ValueError("teacher_values and teacher_indices go together")
    chunk = _check_chunk_size(chunk_size)
    targets = targets.to(hidden.device).long()
    teacher = teacher_values is not None
    extras = (teacher_values.to(hidden.device), teacher_indices.to(hidden.device)) if teacher else (None, None)
    if (chunk is None or hidden.shape[0] <= chunk) and num_chunks is None:
        parts = [_chunk_stats(hidden, targets, head, temperature, entropy, entropy_grad, *extras)]
    else:
        # Recomputation only pays when a backward pass will follow; without autograd it would
        # only add bookkeeping.
        recompute = torch.is_grad_enabled()
        # split (not slicing in a loop): its backward concatenates the chunks' gradients once
        # instead of adding one zero-padded [M, H] gradient per chunk.
        size = chunk or max(1, hidden.shape[0])
        pieces = [list(x.split(size)) for x in (hidden, targets, *(extras if teacher else ()))]
        for column in pieces:
            column += [column[0][:0]] * (int(num_chunks or 0) - len(column))
        pieces += [] if teacher else [[None] * len(pieces[0])] * 2
        parts = []
        for rows, tgt, t_val, t_idx in zip(*pieces):
            args = (rows, tgt, head, temperature, entropy, entropy_grad, t_val, t_idx)
            parts.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if recompute else _chunk_stats(*args))
    columns = [torch.cat(column) if len(parts) > 1 else column[0] for column in zip(*parts)]
    stats = HeadStats(logprobs=columns.pop(0))
    if entropy:
        stats.entropy = columns.pop(0)
    if teacher:
        stats.teacher_kl = columns.pop(0)
    return stats


@torch.no_grad()
def head_topk(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], k: int,
              chunk_size: int | None = DEFAULT_CHUNK_SIZE, num_chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` logits (float32) and their vocabulary indices at each of ``M`` positions: ``[M, k]`` each.

    ``num_chunks``: at least that many head calls (see ``head_token_stats``).
    """
    chunk = _check_chunk_size(chunk_size) or max(1, hidden.shape[0])
    values, indices = [], []
    chunks = list(hidden.split(chunk))
    chunks += [hidden[:0]] * (int(num_chunks or 0) - len(chunks))
    for rows in chunks:
        v, i = teacher_topk(head(rows), k)
        values.append(v.float())
        indices.append(i)
    return torch.cat(values), torch.cat(indices)


# ---------------------------------------------------------------------------------------------
# the model side: final hidden states without the output head
# ---------------------------------------------------------------------------------------------


def _causal_lm(model) -> torch.nn.Module:
    """The Hugging Face causal LM inside a DeepSpeed engine (``.module``), or the model itself."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def output_head(model) -> torch.nn.Module:
    """The model's output embedding (``lm_head``) as a module; an error for heads it cannot chunk."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(lm).__name__} post-processes its logits ({attr}); chunked log-probs would differ: "
                             f"set the learner's logit_chunk_size to 0")
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embedding: it is not a causal LM head")
    return head


def final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``[R, L, H]`` final (normalised) hidden states of a causal LM, without computing any logits.

    The model is called as usual (through a DeepSpeed engine's ``forward`` when given one) with an
    all-False ``logits_to_keep`` mask over the sequence positions, so its head runs on none of them
    (1-D: transformers < 5.20, which vLLM pins, indexes ``hidden[:, mask, :]`` and rejects a 2-D mask); the decoder's output is
    taken with a forward hook. ``attention_mask`` may be 2D padding or an additive 4D mask.
    """
    decoder = _causal_lm(model).get_decoder()
    captured: list[torch.Tensor] = []

    def keep_output(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = decoder.register_forward_hook(keep_output)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
              logits_to_keep=torch.zeros(input_ids.shape[-1], dtype=torch.bool, device=input_ids.device), use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected the decoder to run once in the model's forward, it ran {len(captured)} times")
    return captured[0]


# ---------------------------------------------------------------------------------------------
# [B, T] conventions on a plain weight matrix
# ---------------------------------------------------------------------------------------------


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


def _shifted_logprobs(hidden_states, lm_head_weight, token_ids, temperature, chunk_size) -> torch.Tensor:
    _check_inputs(hidden_states, lm_head_weight, token_ids, temperature)
    batch, seq, width = hidden_states.shape
    hidden = hidden_states[:, :-1].reshape(-1, width)
    targets = token_ids[:, 1:].reshape(-1)
    stats = head_token_stats(hidden, lambda rows: rows @ lm_head_weight.T, targets, temperature, chunk_size)
    return torch.nn.functional.pad(stats.logprobs.reshape(batch, seq - 1), (1, 0))


def full_token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[B, T]`` float32 log-probabilities through the full ``[B, T − 1, V]`` logits (the reference)."""
    return _shifted_logprobs(hidden_states, lm_head_weight, token_ids, temperature, None)


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
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _shifted_logprobs(hidden_states, lm_head_weight, token_ids, temperature, chunk_size)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HeadStats",
    "chunked_token_logprobs",
    "final_hidden_states",
    "full_token_logprobs",
    "head_token_stats",
    "head_topk",
    "output_head",
]
