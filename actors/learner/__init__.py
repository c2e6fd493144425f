"""DeepSpeed policy learner and the data-parallel group that drives K of them (RLlib's split).

``Learner`` (one process, one data-parallel rank) owns the trainable policy inside a DeepSpeed
engine and an optional frozen reference model (KL anchor, and the PathRouter teacher that sees the
gold evidence), and turns a batch of token sequences into policy updates with the loss terms of
``raggym.algorithms.policy_loss``, composed by name from ``learner.loss`` — it implements no loss
itself. ``LearnerGroup`` (the driver side) starts K ``Learner`` Ray actors, wires their
torch.distributed process group (gloo on CPU, NCCL on GPU), shards each batch across them,
averages their metrics and hands the new weights to the rollout workers. As in RLlib, the Learner
computes losses and applies updates; the LearnerGroup does the distribution; neither knows about
environments.

The package, by job (read ``learner.py`` for the update step):

=================== =========================================================================
``config.py``       ``LearnerConfig``, ``OptimizerConfig`` (``PolicyLossConfig`` is the loss's)
``batches.py``      slicing, sharding and splitting a ``TrainBatch`` into forward passes
``distributed.py``  the process group, collectives, threads, ZeRO-3 partitioned loading
``old_logprobs.py`` where π_old comes from, and the engine-vs-learner log-prob drift
``update_log.py``   one update's timers and metrics
``learner.py``      ``Learner``: setup, forward passes, ``update``, weights, checkpoints
``learner_group.py`` ``LearnerGroup``: K learners as Ray actors
=================== =========================================================================

Batch format (``TrainBatch``, a dict of tensors, sequences right-padded to one length ``T``)::

    token_ids        [N, T] long   prompt + response (+ observations) of each trajectory
    attention_mask   [N, T]        1 on real tokens
    loss_mask        [N, T]        1 on tokens the policy generated and is trained on
    advantages       [N] or [N, T]
    sampled_logprobs [N, T]        optional: the rollout engine's logprobs of the sampled tokens;
                                   compared with the learner's own (logged drift) and, with
                                   ``old_logprobs="rollout"``, π_old after the first optimizer step
    old_logprobs     [N, T]        optional: log π_old(token_t | tokens_<t); default: the current
                                   weights' values before the first update, from a separate pass
                                   or from the first mini-batch's own forward (``old_logprobs.py``;
                                   the on-policy ratio is exactly 1 on the first mini-batch)
    ref_logprobs     [N, T]        optional: computed with the reference model when a term needs it (KL)
    # PathRouter teacher KL (only with the teacher_kl term):
    teacher_token_ids       [N, T']  the teacher's input: gold evidence + the same trajectory
    teacher_attention_mask  [N, T']
    teacher_positions       [N, T]   long: index in the teacher sequence of student token t, or −1
    teacher_kl_mask         [N, T]   1 on think and query tokens (``spans.teacher_kl_mask_from_labels``)
    evidence_overlap        [N]      EO of each trajectory
    # the mode entropy bonus (only with the mode_entropy term):
    mode_choice_mask        [N, T]   1 on the tokens that chose a search's retrieval mode
                                     (``raggym.algorithms.batch.mode_choice_mask``)

Every per-token tensor is aligned to ``token_ids``: entry ``t`` is about token ``t``, predicted
from the logits at ``t − 1``; position 0 is never trained. ``make_train_batch`` builds one from
Python lists.
"""

from actors.learner.batches import batch_size_of, micro_pieces, shard_batch, slice_batch, token_logprobs
from actors.learner.config import LearnerConfig, LoraSettings, OptimizerConfig, PolicyLossConfig
from actors.learner.distributed import init_torch_distributed, policy_load_plan, zero3_partitioned_loading
from actors.learner.learner import Learner
from actors.learner.learner_group import LearnerGroup, _mean_metrics  # noqa: F401  (_mean_metrics: tests)
from actors.learner.old_logprobs import logprob_drift as _logprob_drift  # noqa: F401  (tests)
from raggym.algorithms.batch import TrainBatch, make_train_batch

__all__ = [
    "Learner",
    "LearnerConfig",
    "LearnerGroup",
    "LoraSettings",
    "OptimizerConfig",
    "PolicyLossConfig",
    "TrainBatch",
    "batch_size_of",
    "init_torch_distributed",
    "make_train_batch",
    "micro_pieces",
    "policy_load_plan",
    "shard_batch",
    "slice_batch",
    "token_logprobs",
    "zero3_partitioned_loading",
]
