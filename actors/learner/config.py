"""The learner's settings: ``LearnerConfig`` (the ``learner:`` section of a config) and its optimizer.

The loss section, ``PolicyLossConfig``, belongs to ``raggym.algorithms.policy_loss`` with the
terms that read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping

import torch

from raggym.algorithms.logprobs import DEFAULT_CHUNK_SIZE
from raggym.algorithms.policy_loss import PolicyLoss, PolicyLossConfig
from raggym.config_util import dataclass_from_mapping
from raggym.models import LoraSettings


@dataclass
class OptimizerConfig:
    """The learner's torch optimizer: AdamW (the recipes') or plain SGD."""

    # "sgd": torch.optim.SGD without momentum, θ ← θ − lr·(g + weight_decay·θ): a step proportional
    # to the gradient, where AdamW's is rescaled per weight (its first step is lr·sign(g)). betas
    # and eps are AdamW's and unused by SGD (reset_at_step is refused with it); a checkpoint's
    # AdamW moments are not loaded into SGD (the weights are).
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    # Start AdamW afresh before the update of this trainer step (counted from 0): its moments and
    # step count are zeroed once, so the next step is a fresh optimizer's first. A second stage
    # that resumes the first's checkpoint (the routing study's stage 2) would otherwise inherit the
    # first stage's momentum along with its weights. None: never.
    reset_at_step: int | None = None

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"learner.optimizer.name must be 'adamw' or 'sgd', got {self.name!r}")
        if self.name == "sgd" and self.reset_at_step is not None:
            raise ValueError("learner.optimizer.reset_at_step resets AdamW's moments; SGD without momentum has none")

    def build(self, params) -> torch.optim.Optimizer:
        """The torch optimizer over ``params`` (DeepSpeed wraps it)."""
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.0, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                 weight_decay=self.weight_decay)


@dataclass
class LearnerConfig:
    model: str = "smollm2-135m"  # any raggym model spec
    zero_stage: int = 2  # 0 (plain DDP-style) … 3
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gradient_checkpointing: bool = False
    lora: LoraSettings | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    grad_clip: float = 1.0
    micro_batch_size: int = 2  # sequences per rank per forward/backward
    mini_batch_size: int = 8  # sequences per optimizer step, over all ranks
    ppo_epochs: int = 1
    temperature: float = 1.0  # rollout temperature: logits are divided by it
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    reference_model: bool | None = None  # None: load one iff a loss term needs it (KL, teacher KL)
    shuffle: bool = True  # shuffle sequences into mini-batches each epoch
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads (None: the Ray actor's CPU allotment, else as is)
    cpu_shm_comm: bool = False
    # Speed (``docs/benchmarks.md``, "Learner step"); none of these changes the update's numbers.
    share_prompts: bool = True  # compute a shared prompt once per pass for all rows that share it
    min_shared_prefix: int = 16  # tokens two rows must share before they are packed together
    old_logprobs: Literal["recompute", "rollout"] = "rollout"  # how π_old is obtained (``actors.learner.old_logprobs``)
    max_logprob_drift: float = 0.02  # "rollout": mean |log π_rollout − log π_learner| that forces recomputation
    # Memory (``docs/benchmarks.md``, "Learner logits memory"); neither changes the update's numbers.
    logit_chunk_size: int = DEFAULT_CHUNK_SIZE  # positions whose [chunk, V] logits exist at once; 0: all at once
    max_tokens_per_micro_batch: int | None = None  # split a micro-batch so rows × longest row stays under this

    def __post_init__(self) -> None:
        correction = getattr(self.loss, "rollout_correction", None)
        if correction is not None and correction.enabled and self.old_logprobs != "recompute":
            raise ValueError("learner.loss.rollout_correction weighs each token by π_old / π_rollout, so π_old must come "
                             "from the learner's own pass before the update: set learner.old_logprobs: recompute")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "LearnerConfig" | None) -> "LearnerConfig":
        """Build from a plain (e.g. OmegaConf/YAML) mapping; unknown keys are an error."""
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        return dataclass_from_mapping(cls, data)

    def to_dict(self) -> dict:
        return asdict(self)

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def needs_reference(self) -> bool:
        if self.reference_model is not None:
            return bool(self.reference_model)
        return bool(PolicyLoss(self.loss).needs & {"ref_log_probs", "teacher_kl"})


__all__ = ["LearnerConfig", "LoraSettings", "OptimizerConfig", "PolicyLossConfig"]
