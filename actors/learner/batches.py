"""Cutting a ``TrainBatch`` up: shards for the ranks, forward passes within a budget, log-probs of logits.

Pure tensor helpers (no model, no process group); the batch format is
``raggym.algorithms.batch.TrainBatch``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from raggym.algorithms.batch import TrainBatch

def shard_batch(batch: TrainBatch, num_shards: int) -> list[TrainBatch]:
    """Split along the sequence axis into ``num_shards`` equal contiguous shards."""
    n = batch.num_rows
    if n % num_shards:
        raise ValueError(f"a batch of {n} sequences does not split evenly over {num_shards} learners")
    per = n // num_shards
    return [batch.rows(slice(r * per, (r + 1) * per)) for r in range(num_shards)]


def micro_pieces(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[slice]:
    """Split rows ``0 … len(lengths) − 1`` into consecutive ranges for one forward pass each.

    A range holds at most ``max_rows`` rows and, with a ``max_tokens`` budget, at most that many
    padded tokens (rows × the longest row's length); a row longer than the budget goes alone.
    Ranges never reorder rows, so rows that share a prompt stay together where the budget allows.
    """
    if int(max_rows) < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if max_tokens is not None and int(max_tokens) < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1 (or null: no budget), got {max_tokens}")
    pieces, start, longest = [], 0, 0
    for i, length in enumerate(int(n) for n in lengths):
        rows, widest = i - start + 1, max(longest, length)
        if i > start and (rows > max_rows or (max_tokens is not None and rows * widest > max_tokens)):
            pieces.append(slice(start, i))
            start, widest = i, length
        longest = widest
    if len(lengths):
        pieces.append(slice(start, len(lengths)))
    return pieces


def trained_positions(batch: TrainBatch) -> torch.Tensor:
    """``[N, T]`` bool: the tokens the loss trains (position 0 never: nothing predicts it)."""
    trained = batch.loss_mask > 0
    trained[:, 0] = False
    return trained


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probabilities of ``token_ids`` under ``logits`` of the same positions' predecessors.

    ``logits`` is ``[B, T, V]`` straight from the model (position ``t`` predicts token ``t+1``);
    entry 0 of the result is 0 (no prediction for the first token).
    """
    shifted = logits[:, :-1].float()
    targets = token_ids[:, 1:].unsqueeze(-1)
    lp = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)  # log softmax at the target
    return torch.nn.functional.pad(lp, (1, 0))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # works for left or right padding


__all__ = ["micro_pieces", "position_ids", "shard_batch", "token_logprobs", "trained_positions"]
