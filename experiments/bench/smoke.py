"""The GPU smoke check's two pieces, shared by `gpu_smoke.sh` (vLLM + Ray) and `bench/gpu.py` (HF, in process).

A batch of four sampled answers with fixed advantages, the engine's logprobs as the old logprobs;
and the largest gap between those and the learner's recomputation on trained tokens, which must
stay small once the engine has the learner's weights.
"""

from __future__ import annotations

from raggym.algorithms.batch import make_train_batch

SMOKE_ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


def smoke_batch(prompts, results, pad_token_id: int):
    """A ``TrainBatch`` of prompt + sampled ids, trained on the sampled ids only."""
    return make_train_batch([p + r.token_ids for p, r in zip(prompts, results)],
                            [[0] * len(p) + [1] * len(r.token_ids) for p, r in zip(prompts, results)],
                            SMOKE_ADVANTAGES,
                            [[0.0] * len(p) + r.logprobs for p, r in zip(prompts, results)], pad_token_id=pad_token_id)


def max_logprob_gap(recomputed, batch) -> float:
    """max |log π_learner − log π_engine| over the trained tokens of ``batch``."""
    mask = batch.loss_mask.bool()
    return float((recomputed - batch.old_logprobs)[mask].abs().max())
