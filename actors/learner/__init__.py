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
``batches.py``      sharding a ``TrainBatch`` and splitting it into forward passes
``distributed.py``  the process group, collectives, threads, ZeRO-3 partitioned loading
``old_logprobs.py`` where π_old comes from, and the engine-vs-learner log-prob drift
``update_log.py``   one update's timers and metrics
``learner.py``      ``Learner``: setup, forward passes, ``update``, weights, checkpoints
``learner_group.py`` ``LearnerGroup``: K learners as Ray actors
=================== =========================================================================

The batch is a ``raggym.algorithms.batch.TrainBatch``: one tensor field per input (token ids,
masks, advantages, optional log-probs, the teacher's inputs, the mode-choice mask), each with its
shape, sequences right-padded to one length ``T``; ``make_train_batch`` builds one from Python
lists.
"""

from actors.learner.batches import micro_pieces, shard_batch, token_logprobs
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
    "init_torch_distributed",
    "make_train_batch",
    "micro_pieces",
    "policy_load_plan",
    "shard_batch",
    "token_logprobs",
    "zero3_partitioned_loading",
]
