"""DeepSpeed policy learner and the data-parallel group that drives K of them (RLlib's split).

``Learner`` (one process, one data-parallel rank) owns the trainable policy inside a DeepSpeed
engine, an optional frozen reference model (KL anchor, and the PathRouter teacher that sees the
gold evidence), and turns a batch of token sequences into policy updates with the loss functions
of ``raggym.algorithms.losses`` — it implements no loss itself. ``LearnerGroup`` (the driver side)
starts K ``Learner`` Ray actors, wires their torch.distributed process group (gloo on CPU, NCCL on
GPU), shards each batch across them, averages their metrics and hands the new weights to the
rollout workers. As in RLlib, the Learner computes losses and applies updates; the LearnerGroup
does the distribution; neither knows about environments.

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
                                   or from the first mini-batch's own forward (``Learner.update``;
                                   the on-policy ratio is exactly 1 on the first mini-batch)
    ref_logprobs     [N, T]        optional: computed with the reference model when KL is on
    # PathRouter teacher KL (only when loss.teacher_kl is on):
    teacher_token_ids       [N, T']  the teacher's input: gold evidence + the same trajectory
    teacher_attention_mask  [N, T']
    teacher_positions       [N, T]   long: index in the teacher sequence of student token t, or −1
    teacher_kl_mask         [N, T]   1 on think and query tokens (``spans.teacher_kl_mask_from_labels``)
    evidence_overlap        [N]      EO of each trajectory
    # the mode entropy bonus (only when loss.mode_entropy_coef > 0):
    mode_choice_mask        [N, T]   1 on the tokens that chose a search's retrieval mode
                                     (``raggym.algorithms.batch.mode_choice_mask``)

Every per-token tensor is aligned to ``token_ids``: entry ``t`` is about token ``t``, predicted
from the logits at ``t − 1``; position 0 is never trained. ``make_train_batch`` builds one from
Python lists.

Update schedule (one ``update`` call = one policy version)::

    for epoch in range(ppo_epochs):                              # PPO epochs
        for mini-batch of mini_batch_size sequences (global):     # one optimizer step each
            for micro-batch of micro_batch_size (per rank):       # gradient accumulation
                loss = weight · [clipped PG + β·KL(π‖π_ref) − c_H·H − c_M·H_mode] (+ teacher KL)
                engine.backward(loss); engine.step()              # steps at the GA boundary

``weight`` makes the accumulated, data-parallel-averaged gradient equal the gradient of the
*mini-batch* loss under the chosen aggregation: with ``token-mean`` every trainable token of the
global mini-batch counts once (DAPO's token-level loss), not once per micro-batch mean. Each
micro-batch loss is ``Σ L / n_micro``; multiplying it by ``n_micro · K · GA / n_global`` (the
global trainable-token count, one all-reduce per mini-batch) and letting DeepSpeed divide by GA
and average over K ranks leaves ``Σ_global L / n_global``. The seq-mean aggregations use the
number of non-empty sequences instead of tokens. The teacher KL term is PathRouter's mean over the
evidence-poor trajectories of the whole mini-batch (1/|I_low| Σ_i KL_i): each micro-batch adds
``λ · Σ_i KL_i · K · GA / |I_low|`` with ``|I_low|`` all-reduced together with the token count, so
its weight does not depend on how many such trajectories a micro-batch happens to hold.

Every pass runs micro-batches through ``raggym.algorithms.shared_prompt.pack_sequences``: rows
trimmed to their length, a prompt shared by several rows computed once (``share_prompts``), and
logits only where a log-probability is needed; the numbers are those of the plain padded pass.

Memory: the model runs only up to its final hidden states; the output head, the log-softmax, the
entropy and the teacher KL then run ``logit_chunk_size`` positions at a time
(``raggym.algorithms.logprobs.head_token_stats``, recomputed chunk by chunk in the backward), so
no ``[tokens, vocabulary]`` tensor exists beyond one chunk. ``max_tokens_per_micro_batch`` splits a
micro-batch further into passes of at most that many padded tokens; the optimizer still steps once
per mini-batch and each pass's loss keeps its share, so the update is the same. Under ZeRO-3 the
ranks agree on the number of passes and of head chunks (every one gathers weights with all ranks),
and the policy and reference load partitioned in the training dtype (``policy_load_plan``).

Logits are divided by ``temperature`` before every log-probability, so ``compute_logprobs`` with
the rollout temperature reproduces the engine's ``processed`` logprobs (top-k/top-p off).

CPU notes: fp32, gloo, plain ``torch.optim.AdamW`` (DeepSpeed's CPU Adam needs a compiled op).
DeepSpeed's CPU shared-memory all-reduce op (an inference-only speed-up) costs a ~2 minute C++
build on first use, so it is switched off unless ``cpu_shm_comm=True``.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch

from raggym.algorithms.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    clipped_policy_loss,
    kl_loss,
    selective_teacher_kl_loss,
    teacher_kl_weight,
)
from raggym.config_util import dataclass_from_mapping
from raggym.models import LoraSettings, apply_lora

from raggym.algorithms.batch import TrainBatch, make_train_batch  # noqa: F401  (re-exported)
from raggym.algorithms.batch import teacher_kl_eligible, teacher_kl_span
from raggym.algorithms.logprobs import DEFAULT_CHUNK_SIZE, final_hidden_states, head_token_stats, head_topk, output_head
from raggym.algorithms.shared_prompt import PackedBatch, pack_sequences, shared_prompt_order

# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class OptimizerConfig:
    """``torch.optim.AdamW`` settings."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass
class PolicyLossConfig:
    """Which terms of ``raggym.algorithms.losses`` make up the loss, and their coefficients."""

    clip_low: float = 0.2  # ε (PPO) or ε_low (DAPO)
    clip_high: float | None = None  # ε_high (DAPO: 0.28); None = symmetric
    dual_clip: bool = False  # verl's dual clip: a token with Â < 0 loses at most −Â·clip_ratio_c
    clip_ratio_c: float = 3.0  # verl's default
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    token_sum_norm: float | None = None  # Dr.GRPO's constant for seq-mean-token-sum
    kl_coef: float = 0.0  # β of the KL-to-reference loss term (GRPO: 0.001–0.04)
    kl_kind: str = "low_var_kl"  # k1 | abs | k2 | k3 (= low_var_kl)
    entropy_coef: float = 0.0  # c_H; the entropy is always logged
    # c_M: an entropy bonus at the tokens where the agent chose a search's retrieval mode only
    # (the batch's ``mode_choice_mask``), aggregated like the PG term (a mode token weighs what
    # any trained token does), so exploration of the route is kept without flattening the rest
    mode_entropy_coef: float = 0.0
    teacher_kl: bool = False  # PathRouter selective teacher KL
    teacher_top_k: int = 128
    evidence_threshold: float = 0.1  # θ_P
    teacher_max_weight: float = 0.1  # λ̄
    teacher_warmup_steps: int = 20  # W


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
    reference_model: bool | None = None  # None: load one iff KL or teacher KL needs it
    shuffle: bool = True  # shuffle sequences into mini-batches each epoch
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads (None: the Ray actor's CPU allotment, else as is)
    cpu_shm_comm: bool = False
    # Speed (``docs/benchmarks.md``, "Learner step"); none of these changes the update's numbers.
    share_prompts: bool = True  # compute a shared prompt once per pass for all rows that share it
    min_shared_prefix: int = 16  # tokens two rows must share before they are packed together
    old_logprobs: Literal["recompute", "rollout"] = "rollout"  # how π_old is obtained (see update)
    max_logprob_drift: float = 0.02  # "rollout": mean |log π_rollout − log π_learner| that forces recomputation
    # Memory (``docs/benchmarks.md``, "Learner logits memory"); neither changes the update's numbers.
    logit_chunk_size: int = DEFAULT_CHUNK_SIZE  # positions whose [chunk, V] logits exist at once; 0: all at once
    max_tokens_per_micro_batch: int | None = None  # split a micro-batch so rows × longest row stays under this

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
        return self.loss.kl_coef > 0 or self.loss.teacher_kl


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------

_REQUIRED = ("token_ids", "attention_mask", "loss_mask", "advantages")
_TEACHER = ("teacher_token_ids", "teacher_attention_mask", "teacher_positions", "teacher_kl_mask", "evidence_overlap")


def batch_size_of(batch: TrainBatch) -> int:
    return int(batch["token_ids"].shape[0])


def slice_batch(batch: TrainBatch, index: torch.Tensor | slice) -> TrainBatch:
    return {k: v[index] for k, v in batch.items()}


def shard_batch(batch: TrainBatch, num_shards: int) -> list[TrainBatch]:
    """Split along the sequence axis into ``num_shards`` equal contiguous shards."""
    n = batch_size_of(batch)
    if n % num_shards:
        raise ValueError(f"a batch of {n} sequences does not split evenly over {num_shards} learners")
    per = n // num_shards
    return [slice_batch(batch, slice(r * per, (r + 1) * per)) for r in range(num_shards)]


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


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probabilities of ``token_ids`` under ``logits`` of the same positions' predecessors.

    ``logits`` is ``[B, T, V]`` straight from the model (position ``t`` predicts token ``t+1``);
    entry 0 of the result is 0 (no prediction for the first token).
    """
    shifted = logits[:, :-1].float()
    targets = token_ids[:, 1:].unsqueeze(-1)
    lp = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)  # log softmax at the target
    return torch.nn.functional.pad(lp, (1, 0))


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # works for left or right padding


def _max_op():
    import torch.distributed as dist

    return dist.ReduceOp.MAX


def _ray_cpu_allotment() -> int | None:
    """CPUs Ray assigned to this actor, or None outside a Ray actor.

    Torch's default is one thread per core of the machine; co-located actors (rollout workers,
    retrievers, learners) that each do that oversubscribe the cores and slow each other down.
    """
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # the driver, not an actor: no allotment
        return None
    return max(1, int(cpus)) if cpus else None


# ---------------------------------------------------------------------------------------------
# distributed setup helpers
# ---------------------------------------------------------------------------------------------


def _disable_cpu_shm_comm() -> None:
    # DeepSpeed builds a C++ shared-memory all-reduce op when its comm backend starts on CPU; it
    # only speeds up inference all-reduce, and the first build takes minutes. deepspeed.ops keeps
    # the probed op table in a module-level dict meant to be edited; marking the op incompatible
    # makes DeepSpeed fall back to plain torch.distributed collectives.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_torch_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    """Join (or create) the default process group through DeepSpeed's comm layer."""
    import deepspeed
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
    )
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"not {rank}/{world_size}"
            )
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, distributed_port=int(master_port), verbose=False,
        init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
    )


def policy_load_plan(config: LearnerConfig) -> tuple[torch.dtype, bool]:
    """``(dtype, partitioned)``: how a learner loads its policy and reference weights.

    ZeRO-3 loads them partitioned (each rank materialises only its 1/K shard of every weight, in
    the training dtype: bf16 on GPU) through ``zero3_partitioned_loading``; loading full fp32
    copies on every rank first would cost about 12 GB of host RAM per 3B model per rank. The
    other stages keep every weight on every rank anyway: they load fp32 on the host and DeepSpeed
    casts to the training dtype (bf16 on GPU, with fp32 master weights in the optimizer).
    """
    if config.zero_stage == 3:
        return config.resolved_dtype(), True
    return torch.float32, False


@contextmanager
def zero3_partitioned_loading(ds_config: Mapping[str, Any]):
    """Inside, ``from_pretrained`` builds models under ``deepspeed.zero.Init`` (partitioned as created).

    transformers looks the DeepSpeed config up through a weak reference to an ``HfDeepSpeedConfig``
    object, so the object is held for the duration of the block and unregistered afterwards: a
    model loaded later in the same process (another learner, a rollout engine) loads whole.
    """
    if int(ds_config.get("zero_optimization", {}).get("stage", 0)) != 3:
        raise ValueError("partitioned loading is for ZeRO stage 3 configs")
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    registered = HfDeepSpeedConfig(dict(ds_config))  # noqa: F841  (kept alive: transformers holds a weak reference)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


# ---------------------------------------------------------------------------------------------
# Learner
# ---------------------------------------------------------------------------------------------


class Learner:
    """One data-parallel rank of policy training on DeepSpeed (see the module docstring).

    ``Learner(config)`` alone is a complete single-process learner (world size 1, a private gloo
    or NCCL group on a free local port). ``LearnerGroup`` constructs K of them with
    ``setup=False`` and calls ``setup`` on all at once with rank 0's address.
    """

    def __init__(
        self,
        config: LearnerConfig | Mapping[str, Any] | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str | None = None,
        master_port: int | None = None,
        setup: bool = True,
    ):
        self.config = LearnerConfig.from_dict(config)
        self.rank, self.world_size = int(rank), int(world_size)
        self.version = 0  # bumped after every update(); rollouts record it
        self.engine = None
        self.reference = None
        self._sync_group = None
        self._tokens_computed = self._tokens_padded = 0  # positions run through the model, real / padding
        if setup:
            self.setup(master_addr, master_port)

    # ------------------------------------------------------------------ setup

    def master_endpoint(self) -> tuple[str, int]:
        """Address and a free port on this node, for rank 0 to host the process group."""
        from actors.weight_sync import node_address, pick_free_port

        return node_address(), pick_free_port()

    def setup(self, master_addr: str | None = None, master_port: int | None = None) -> dict:
        """Join the process group, load the policy (and reference), build the DeepSpeed engine."""
        import deepspeed

        cfg = self.config
        device = cfg.resolved_device()
        if master_addr is None or master_port is None:
            if self.world_size != 1:
                raise ValueError("a learner in a group of more than one needs master_addr and master_port")
            master_addr, master_port = self.master_endpoint()
        threads = cfg.num_threads or _ray_cpu_allotment()
        if threads:
            torch.set_num_threads(int(threads))
        if device == "cpu" and not cfg.cpu_shm_comm:
            _disable_cpu_shm_comm()
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_torch_distributed(self.rank, self.world_size, master_addr, int(master_port), "nccl" if device == "cuda" else "gloo")
        torch.manual_seed(cfg.seed)

        if cfg.mini_batch_size % self.world_size:
            raise ValueError(f"mini_batch_size {cfg.mini_batch_size} must be a multiple of the {self.world_size} learners")
        per_rank = cfg.mini_batch_size // self.world_size
        if per_rank % cfg.micro_batch_size:
            raise ValueError(
                f"per-learner mini-batch {per_rank} (mini_batch_size / learners) must be a multiple of "
                f"micro_batch_size {cfg.micro_batch_size}"
            )
        if cfg.loss.aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {cfg.loss.aggregation!r}; expected one of {LOSS_AGGREGATIONS}")
        if cfg.lora is not None and cfg.zero_stage == 3:
            raise ValueError("LoRA with ZeRO-3 is not supported here: use ZeRO stage 0-2 (adapters are small)")
        if cfg.logit_chunk_size < 0:
            raise ValueError(f"logit_chunk_size must be >= 0 (0: all positions at once), got {cfg.logit_chunk_size}")
        micro_pieces([], 1, cfg.max_tokens_per_micro_batch)  # a clear error for a budget below 1 token
        self.grad_accum = per_rank // cfg.micro_batch_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        dtype = cfg.resolved_dtype()

        self.ds_config = self._deepspeed_config(dtype)
        model, self.tokenizer = self._load_policy()
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if cfg.lora is not None:
            model = apply_lora(model, cfg.lora)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = cfg.optimizer
        optimizer = torch.optim.AdamW(trainable, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        if self.world_size == 1 and cfg.zero_stage == 0:
            # Alone, the gradient all-reduce only copies every gradient into flat buckets and back.
            self.engine.enable_backward_allreduce = False

        if cfg.needs_reference():
            ref, _ = self._load_policy()
            ref.requires_grad_(False)
            if cfg.zero_stage == 3:
                # Partition the frozen copy too, so it costs 1/K of a model per rank.
                ref_config = {k: v for k, v in self.ds_config.items() if k not in ("gradient_clipping",)}
                self.reference, *_ = deepspeed.initialize(model=ref, config=ref_config)
            else:
                self.reference = ref.to(device=self.device, dtype=dtype)
            self.reference.eval()
        return self.info()

    def _load_policy(self):
        """The policy (or a reference copy) and its tokenizer, as ``policy_load_plan`` says."""
        from raggym.models import load_policy

        dtype, partitioned = policy_load_plan(self.config)
        if not partitioned:
            return load_policy(self.config.model, dtype=dtype, device="cpu")
        with zero3_partitioned_loading(self.ds_config):
            return load_policy(self.config.model, dtype=dtype, device=str(self.device))

    def _deepspeed_config(self, dtype: torch.dtype) -> dict:
        cfg = self.config
        zero: dict[str, Any] = {"stage": int(cfg.zero_stage)}
        if cfg.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        return {
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "train_batch_size": cfg.micro_batch_size * self.grad_accum * self.world_size,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": zero,
            "bf16": {"enabled": dtype == torch.bfloat16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }

    def info(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "device": str(self.device),
            "zero_stage": self.config.zero_stage,
            "dtype": str(self.config.resolved_dtype()),
            "grad_accum": self.grad_accum,
            "version": self.version,
            "reference_model": self.reference is not None,
            "trainable_parameters": sum(p.numel() for p in self.module.parameters() if p.requires_grad)
            if self.config.zero_stage != 3 else sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters() if p.requires_grad),
        }

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    # ------------------------------------------------------------------ forward passes

    def _hidden(self, model, token_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` final hidden states of padded rows (no logits: the head runs per chunk)."""
        ids = token_ids.to(self.device)
        attn = attention_mask.to(self.device)
        return final_hidden_states(model, ids, attn, _position_ids(attn))

    def _shares_prompts(self) -> bool:
        # The shared layout needs an arbitrary 4D mask, which the eager and SDPA attentions take
        # as given; flash-attention kernels do not (there every row is packed alone).
        # The reference is a copy of the same architecture, so the policy's HF config answers for both.
        impl = getattr(getattr(self.module, "config", None), "_attn_implementation", None)
        return self.config.share_prompts and impl in ("eager", "sdpa")

    def _packed_hidden(self, model, token_ids, attention_mask, needed) -> tuple[torch.Tensor, PackedBatch]:
        """Final hidden states ``[M, H]`` of the positions that predict the needed tokens, in one forward pass.

        Rows are trimmed to their length and a shared prompt runs once
        (``raggym.algorithms.shared_prompt``); entry ``e`` predicts ``packed.targets[e]``. The
        output head is applied later, a chunk of entries at a time (``head_token_stats``).
        """
        packed = pack_sequences(token_ids, attention_mask, needed, share_prefix=self._shares_prompts(),
                                min_shared_tokens=self.config.min_shared_prefix,
                                pad_token_id=int(getattr(self.tokenizer, "pad_token_id", None) or 0))
        dtype = next(self.module.parameters()).dtype
        hidden = final_hidden_states(model, packed.input_ids.to(self.device),
                                     packed.model_attention_mask(dtype).to(self.device), packed.position_ids.to(self.device))
        hidden = hidden[packed.keep.to(self.device)]  # [K, H], row-major like HF's logits_to_keep
        if packed.logit_index is not None:
            hidden = hidden[packed.logit_index.to(self.device)]
        self._tokens_computed += packed.computed_tokens
        self._tokens_padded += packed.padded_tokens
        return hidden, packed

    def _pieces(self, attention_mask: torch.Tensor, rows: int) -> list[slice]:
        """Consecutive row ranges of at most ``rows`` rows within the token budget (``micro_pieces``)."""
        return micro_pieces(attention_mask.sum(-1).tolist(), rows, self.config.max_tokens_per_micro_batch)

    def _zero3_ranks_must_agree(self) -> bool:
        # Under ZeRO-3 every forward of a module gathers its weights with all ranks, so every rank
        # must run as many forwards (and call the output head as often) as the others.
        return self.config.zero_stage == 3 and self.world_size > 1

    def _agreed(self, count: int) -> int:
        """The largest ``count`` over the ranks when they must agree (ZeRO-3), else ``count``."""
        if not self._zero3_ranks_must_agree():
            return count
        agreed, _ = self._all_reduce(torch.tensor([float(count)]), _max_op())
        return int(agreed)

    def _head_chunks(self, positions: int) -> int | None:
        """``num_chunks`` for ``head_token_stats`` / ``head_topk``: the ranks' largest chunk count under ZeRO-3."""
        chunk = self.config.logit_chunk_size
        if not self._zero3_ranks_must_agree() or not chunk:
            return None  # without chunking the head runs once per forward on every rank
        return self._agreed(max(1, math.ceil(positions / chunk)))

    @torch.no_grad()
    def _logprobs_with(self, model, token_ids, attention_mask, micro_batch_size, needed=None) -> torch.Tensor:
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        attention_mask = torch.ones_like(token_ids) if attention_mask is None else torch.as_tensor(attention_mask)
        needed = attention_mask.bool() if needed is None else torch.as_tensor(needed).bool() & attention_mask.bool()
        needed[:, 0] = False  # nothing predicts the first token
        out = torch.zeros(token_ids.shape, dtype=torch.float32)
        head, temperature, chunk = output_head(model), self.config.temperature, self.config.logit_chunk_size
        # the packed layout needs right padding; anything else runs as given, row by padded row
        right_padded = bool((attention_mask.long().cummin(-1).values == attention_mask.long()).all())
        order = shared_prompt_order(token_ids, attention_mask) if right_padded else torch.arange(token_ids.shape[0])
        pieces = self._pieces(attention_mask[order], micro_batch_size or self.config.micro_batch_size)
        for p in range(self._agreed(len(pieces))):
            if p >= len(pieces):  # a forward only to keep ZeRO-3 ranks in step
                rows = order[pieces[-1]][:1]
                hidden = self._hidden(model, token_ids[rows], attention_mask[rows])
                head_token_stats(hidden[0, :0], head, token_ids[rows][0, :0], temperature, chunk, num_chunks=self._head_chunks(0))
                continue
            rows = order[pieces[p]]
            if not bool(needed[rows].any()) and not self._zero3_ranks_must_agree():
                continue
            if right_padded:
                hidden, packed = self._packed_hidden(model, token_ids[rows], attention_mask[rows], needed[rows])
                targets, place = packed.targets, packed.scatter
            else:
                want = needed[rows, 1:]
                hidden = self._hidden(model, token_ids[rows], attention_mask[rows])[:, :-1][want.to(self.device)]
                targets = token_ids[rows, 1:][want]
                place = lambda values, want=want: torch.nn.functional.pad(  # noqa: E731
                    values.new_zeros(want.shape).masked_scatter(want.to(values.device), values), (1, 0))
            lp = head_token_stats(hidden, head, targets, temperature, chunk, num_chunks=self._head_chunks(len(targets))).logprobs
            out[rows] = place(lp).cpu()
        return out

    def compute_logprobs(self, token_ids, attention_mask=None, micro_batch_size: int | None = None,
                         needed: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, T]`` current-policy log π(token_t | tokens_<t) at ``temperature``.

        0 at t = 0, on padding and, when ``needed`` ([N, T] bool) is given, wherever it is False.
        """
        was_training = self.engine.training
        self.engine.eval()
        try:
            return self._logprobs_with(self.engine, token_ids, attention_mask, micro_batch_size, needed)
        finally:
            self.engine.train(was_training)

    def compute_ref_logprobs(self, token_ids, attention_mask=None, micro_batch_size: int | None = None,
                             needed: torch.Tensor | None = None) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("this learner has no reference model (set reference_model=True or a KL coefficient)")
        return self._logprobs_with(self.reference, token_ids, attention_mask, micro_batch_size, needed)

    @torch.no_grad()
    def compute_teacher_topk(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher top-K logits/indices aligned to student token positions: ``[N, T, K]`` each.

        Filled where the student token has a teacher counterpart after the teacher's first token
        (``teacher_positions > 0``, the only places the teacher KL reads), zeros elsewhere.
        """
        if self.reference is None:
            raise RuntimeError("teacher KL needs the reference model")
        k = self.config.loss.teacher_top_k
        n, t = batch["token_ids"].shape
        values = torch.zeros((n, t, k), dtype=torch.float32)
        indices = torch.zeros((n, t, k), dtype=torch.long)
        head = output_head(self.reference)
        teacher_ids, teacher_attn = batch["teacher_token_ids"], batch["teacher_attention_mask"]
        pieces = self._pieces(teacher_attn, self.config.micro_batch_size)
        for p in range(self._agreed(len(pieces))):
            sl = pieces[min(p, len(pieces) - 1)]
            if p >= len(pieces):  # a forward only to keep ZeRO-3 ranks in step
                hidden = self._hidden(self.reference, teacher_ids[sl][:1], teacher_attn[sl][:1])
                head_topk(hidden[0, :0], head, k, self.config.logit_chunk_size, self._head_chunks(0))
                continue
            hidden = self._hidden(self.reference, teacher_ids[sl], teacher_attn[sl])
            pos = batch["teacher_positions"][sl].long()
            covered = pos > 0
            # Student token t is teacher token pos[t]; the teacher predicts it from position pos[t] − 1.
            rows = torch.arange(pos.shape[0])[:, None].expand_as(pos)[covered]
            v, i = head_topk(hidden[rows.to(self.device), (pos[covered] - 1).to(self.device)], head, k,
                             self.config.logit_chunk_size, self._head_chunks(int(covered.sum())))
            piece_values, piece_indices = values[sl], indices[sl]
            piece_values[covered], piece_indices[covered] = v.cpu(), i.cpu()
            values[sl], indices[sl] = piece_values, piece_indices
        return values, indices

    # ------------------------------------------------------------------ update

    def _count(self, batch: TrainBatch) -> torch.Tensor:
        """What the aggregation normalises by: trainable tokens, or sequences with any."""
        mask = batch["loss_mask"].float().clone()
        mask[:, 0] = 0
        if self.config.loss.aggregation == "token-mean":
            return mask.sum()
        return (mask.sum(-1) > 0).float().sum()

    def _micro_loss(self, mb: TrainBatch, weight: float, step: int, teacher_scale: float) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """The micro-batch's share of the mini-batch loss, its stats, and its detached log-probs.

        ``weight`` scales the PG-side terms and ``teacher_scale`` (K·GA / evidence-poor
        trajectories of the mini-batch) the teacher KL's per-trajectory sum, so that both add up
        to the mini-batch loss over micro-batches and ranks (module docstring).
        """
        lc = self.config.loss
        mask = mb["loss_mask"].to(torch.float32).clone()
        mask[:, 0] = 0  # nothing predicts the first token
        hidden, packed = self._packed_hidden(self.engine, mb["token_ids"], mb["attention_mask"], mask > 0)
        mask = mask.to(self.device)
        teacher = {}
        if lc.teacher_kl:  # student logits (not divided by T) at the entries against the teacher's top-K there
            teacher = {"teacher_values": packed.gather(mb["teacher_topk_values"]),
                       "teacher_indices": packed.gather(mb["teacher_topk_indices"])}
        # Entropy only at the trained positions (the full-vocabulary softmax is not free): the
        # entries' logits are the distributions their tokens were drawn from.
        head_stats = head_token_stats(
            hidden, output_head(self.engine), packed.targets, self.config.temperature, self.config.logit_chunk_size,
            entropy=True, entropy_grad=lc.entropy_coef > 0 or lc.mode_entropy_coef > 0, num_chunks=self._head_chunks(hidden.shape[0]), **teacher,
        )
        log_probs = packed.scatter(head_stats.logprobs)  # log softmax(z / T) at the sampled tokens
        # Without old log-probs the weights have not moved since the rollout (first mini-batch of
        # a "rollout" update), so π_old is this very forward's value: ratio 1, as a recomputation gives.
        old = mb["old_logprobs"].to(self.device, torch.float32) if "old_logprobs" in mb else log_probs.detach()
        adv = mb["advantages"].to(self.device, torch.float32)

        pg, pg_stats = clipped_policy_loss(
            log_probs, old, adv, mask, clip_low=lc.clip_low, clip_high=lc.clip_high,
            aggregation=lc.aggregation, token_sum_norm=lc.token_sum_norm,
            dual_clip=lc.dual_clip, clip_ratio_c=lc.clip_ratio_c,
        )
        loss = pg
        stats = {"pg_loss": pg.item(), **{k: float(v) for k, v in pg_stats.items()}}
        if lc.kl_coef > 0:
            ref = mb["ref_logprobs"].to(self.device, torch.float32)
            kl = kl_loss(log_probs, ref, mask, kind=lc.kl_kind, aggregation=lc.aggregation)
            loss = loss + lc.kl_coef * kl  # + β·KL(π_θ ‖ π_ref)
            stats["kl_loss"] = kl.item()
        token_entropy = packed.scatter(head_stats.entropy)
        entropy = aggregate_loss(token_entropy, mask, lc.aggregation)
        if lc.entropy_coef > 0:
            loss = loss - lc.entropy_coef * entropy  # − c_H·H
        stats["entropy"] = entropy.item()
        if lc.mode_entropy_coef > 0:
            choice = mb["mode_choice_mask"].to(self.device, torch.float32) * mask
            # H_mode: the entropy at mode-choice tokens, every other trained token counting 0
            mode_entropy = aggregate_loss(token_entropy * choice, mask, lc.aggregation)
            loss = loss - lc.mode_entropy_coef * mode_entropy  # − c_M·H_mode
            stats["mode_entropy_term"] = mode_entropy.item()
            # summed here, divided in ``update``: the log's mean entropy of the choices themselves
            stats.update(mode_entropy_sum=float((token_entropy.detach() * choice).sum()), mode_choices=float(choice.sum()))
        stats["loss"] = loss.item()
        loss = loss * weight
        if lc.teacher_kl:
            per_pos = packed.scatter(head_stats.teacher_kl)
            span = teacher_kl_span(mb).to(self.device)
            low_eo = mb["evidence_overlap"].to(self.device) < lc.evidence_threshold  # EO < θ_P
            lam = teacher_kl_weight(step, lc.teacher_max_weight, lc.teacher_warmup_steps)  # λ̄·min(1, step/W)
            t_loss, t_stats = selective_teacher_kl_loss(per_pos, span, low_eo, lam)
            # t_loss = λ·Σ_i KL_i / n_micro; the paper's mean runs over the evidence-poor
            # trajectories of the whole batch: λ·Σ_i KL_i / n_low, times K·GA as for the PG terms.
            n_micro = float(t_stats["teacher_kl_trajectories"])
            teacher_term = t_loss * (n_micro * teacher_scale)
            loss = loss + teacher_term
            stats.update(teacher_kl=float(t_stats["teacher_kl"]), teacher_kl_trajectories=n_micro,
                         teacher_loss=teacher_term.item() / (self.world_size * self.grad_accum))
        return loss, stats, log_probs.detach()

    def _grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            return float(norm)
        grads = [p.grad.detach().float() for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def _all_reduce(self, values: torch.Tensor, op=None) -> tuple[torch.Tensor, float]:
        """All-reduce over the data-parallel ranks; returns the result and the seconds spent (waiting)."""
        if self.world_size == 1:
            return values, 0.0
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
        return values, time.perf_counter() - t0

    def update(self, batch: TrainBatch, step: int | None = None) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; returns averaged metrics.

        ``step`` is the trainer step (for the teacher-KL ramp); defaults to the learner's version.
        All ranks of a group must call this together with equally sized shards.

        Old log-probs (when the batch has none): ``old_logprobs="recompute"`` runs a no-grad pass
        over the batch before the first update. ``"rollout"`` skips it: until the first optimizer
        step the weights are the rollout's, so the first mini-batch takes π_old from its own
        training forward (exactly what the pass would compute); later mini-batches and epochs use
        the rollout's sampled logprobs. The drift between those and the learner's own values is
        measured on the first mini-batch; if its mean exceeds ``max_logprob_drift`` (or the batch
        has no sampled logprobs and more than one update follows), the learner recomputes π_old
        for the whole batch before the first optimizer step, as ``"recompute"`` would.

        Metrics include the time breakdown ``seconds_*`` (old-logprob pass, reference pass,
        teacher pass, forward, backward, optimizer, waiting on other ranks) and
        ``padding_share`` / ``prompt_share_saved`` of the training forwards.
        """
        cfg = self.config
        missing = [k for k in _REQUIRED if k not in batch]
        if missing:
            raise KeyError(f"train batch lacks {missing}")
        if cfg.loss.teacher_kl:
            lacking = [k for k in _TEACHER if k not in batch]
            if lacking:
                raise KeyError(f"teacher KL is on but the batch lacks {lacking}")
        if cfg.loss.mode_entropy_coef > 0 and "mode_choice_mask" not in batch:
            raise KeyError("loss.mode_entropy_coef > 0 but the batch lacks 'mode_choice_mask'")
        step = self.version if step is None else int(step)
        n = batch_size_of(batch)
        per_rank = cfg.mini_batch_size // self.world_size
        if n == 0 or n % per_rank:
            raise ValueError(
                f"this learner got {n} sequences; it needs a positive multiple of the per-learner "
                f"mini-batch {per_rank} (mini_batch_size {cfg.mini_batch_size} / {self.world_size} learners)"
            )
        started = time.perf_counter()
        seconds = dict.fromkeys(("old_logprobs", "reference", "teacher", "forward", "backward", "optimizer", "wait"), 0.0)
        self._tokens_computed = self._tokens_padded = 0
        batch = dict(batch)
        sampled = batch.pop("sampled_logprobs", None)
        trained = batch["loss_mask"] > 0
        trained[:, 0] = False
        single_update = cfg.ppo_epochs == 1 and n == per_rank
        recomputed = False

        def recompute_old() -> None:
            t0 = time.perf_counter()
            batch["old_logprobs"] = self.compute_logprobs(batch["token_ids"], batch["attention_mask"], needed=trained)
            seconds["old_logprobs"] += time.perf_counter() - t0

        own_old = "old_logprobs" not in batch and cfg.old_logprobs == "rollout" and (single_update or sampled is not None)
        if "old_logprobs" not in batch and not own_old:
            recompute_old()
            recomputed = True
        drift = {} if own_old else _logprob_drift(sampled, batch["old_logprobs"], batch["loss_mask"])
        if cfg.loss.kl_coef > 0 and "ref_logprobs" not in batch:
            t0 = time.perf_counter()
            batch["ref_logprobs"] = self.compute_ref_logprobs(batch["token_ids"], batch["attention_mask"], needed=trained)
            seconds["reference"] += time.perf_counter() - t0
        if cfg.loss.teacher_kl:
            t0 = time.perf_counter()
            batch["teacher_topk_values"], batch["teacher_topk_indices"] = self.compute_teacher_topk(batch)
            seconds["teacher"] += time.perf_counter() - t0
        # The teacher's full input is no longer needed once its top-K is taken.
        for key in ("teacher_token_ids", "teacher_attention_mask"):
            batch.pop(key, None)
        if own_old and sampled is not None:
            batch["sampled_logprobs"] = sampled  # travels with the first mini-batch's rows for the drift check
        first_pass_tokens = (self._tokens_computed, self._tokens_padded)

        self.engine.train()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.version * 1009 + self.rank)
        per_mini: list[dict[str, float]] = []  # loss-weighted stats of each mini-batch
        teacher_kl_sum = teacher_trajectories = mode_entropy_sum = mode_choices = 0.0
        grad_norms: list[float] = []
        tokens = micro_batches = 0
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if cfg.shuffle else torch.arange(n)
            for m0 in range(0, n, per_rank):
                mini = slice_batch(batch, order[m0 : m0 + per_rank])
                # Rows that share a prompt go into the same micro-batch; the update does not
                # depend on how a mini-batch is split (each micro loss is weighted by its share).
                mini = slice_batch(mini, shared_prompt_order(mini["token_ids"], mini["attention_mask"]))
                checking = own_old and "old_logprobs" not in mini  # first mini-batch of a "rollout" update
                counts = torch.stack([self._count(mini), teacher_kl_eligible(mini, cfg.loss.evidence_threshold).sum()
                                      if cfg.loss.teacher_kl else torch.tensor(0.0)]).float()
                counts, waited = self._all_reduce(counts)  # global normalisers of this mini-batch
                seconds["wait"] += waited
                total, n_low = float(counts[0]), float(counts[1])
                teacher_scale = self.world_size * self.grad_accum / n_low if n_low > 0 else 0.0
                acc: dict[str, float] = {}
                checked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
                # Micro-batches of micro_batch_size rows, each split further under the token budget.
                pieces = [slice(u0 + p.start, u0 + p.stop) for u0 in range(0, per_rank, cfg.micro_batch_size)
                          for p in self._pieces(mini["attention_mask"][u0 : u0 + cfg.micro_batch_size], cfg.micro_batch_size)]
                n_pieces = self._agreed(len(pieces))
                micro_batches += n_pieces
                for p in range(n_pieces):
                    # Past its own count (ZeRO-3, other ranks split finer) a rank repeats its last
                    # piece's first row with weight 0: a forward and backward that change nothing.
                    filler = p >= len(pieces)
                    micro = slice_batch(mini, slice(pieces[-1].start, pieces[-1].start + 1) if filler else pieces[p])
                    # n_micro · K · GA / n_global (see the module docstring); GA is DeepSpeed's
                    # divisor whatever the number of pieces, so the pieces' weights add up alike.
                    weight = float(self._count(micro)) * self.world_size * self.grad_accum / total if total > 0 and not filler else 0.0
                    # The optimizer steps after the mini-batch's last piece, however many there are.
                    self.engine.set_gradient_accumulation_boundary(p == n_pieces - 1)
                    t0 = time.perf_counter()
                    loss, stats, current = self._micro_loss(micro, weight, step, teacher_scale if not filler else 0.0)
                    t1 = time.perf_counter()
                    self.engine.backward(loss)
                    seconds["forward"] += t1 - t0
                    seconds["backward"] += time.perf_counter() - t1
                    if checking and "sampled_logprobs" in micro and not filler:
                        checked.append((micro["sampled_logprobs"], current.cpu(), micro["loss_mask"]))
                    boundary = self.engine.is_gradient_accumulation_boundary()
                    if boundary and checking and not single_update:
                        # Before the first optimizer step: the last moment a recomputation is exact.
                        drift = _logprob_drift(*(torch.cat(x) for x in zip(*checked)))
                        too_far = torch.tensor([float(drift.get("logprob_drift_mean", 0.0) > cfg.max_logprob_drift)])
                        too_far, waited = self._all_reduce(too_far, _max_op())
                        seconds["wait"] += waited
                        if float(too_far) > 0:
                            recompute_old()
                            recomputed = True
                        else:
                            batch["old_logprobs"] = batch["sampled_logprobs"]
                    norm = self._grad_norm() if boundary and cfg.zero_stage == 0 else None
                    t0 = time.perf_counter()
                    self.engine.step()
                    seconds["optimizer"] += time.perf_counter() - t0
                    if boundary:
                        norm = norm if norm is not None else self._grad_norm()
                        if norm is not None and math.isfinite(norm):
                            grad_norms.append(norm)
                    if filler:
                        continue
                    tokens += int(micro["attention_mask"].sum())
                    n_traj = stats.pop("teacher_kl_trajectories", 0.0)
                    teacher_kl_sum += stats.pop("teacher_kl", 0.0) * n_traj
                    teacher_trajectories += n_traj
                    teacher_loss = stats.pop("teacher_loss", None)
                    mode_entropy_sum += stats.pop("mode_entropy_sum", 0.0)
                    mode_choices += stats.pop("mode_choices", 0.0)
                    # Weighted like the loss, so that after averaging over ranks each stat is the
                    # mini-batch value, independent of how it was split into micro-batches.
                    for k, v in stats.items():
                        acc[k] = acc.get(k, 0.0) + v * weight / (self.world_size * self.grad_accum)
                    if teacher_loss is not None:
                        acc["teacher_loss"] = acc.get("teacher_loss", 0.0) + teacher_loss
                if checking and single_update and checked:
                    drift = _logprob_drift(*(torch.cat(x) for x in zip(*checked)))
                if "teacher_loss" in acc:
                    acc["loss"] += acc["teacher_loss"]
                per_mini.append({k: v * self.world_size for k, v in acc.items()})
        elapsed = time.perf_counter() - started
        self.version += 1
        metrics = {k: sum(m[k] for m in per_mini) / len(per_mini) for k in per_mini[0]}
        metrics.update(drift)
        if cfg.loss.mode_entropy_coef > 0:
            metrics.update(mode_entropy=mode_entropy_sum / mode_choices if mode_choices else float("nan"),
                           mode_choices=mode_choices / cfg.ppo_epochs)
        if cfg.loss.teacher_kl:
            metrics["teacher_kl"] = teacher_kl_sum / teacher_trajectories if teacher_trajectories else 0.0
            metrics["teacher_kl_trajectories"] = teacher_trajectories / cfg.ppo_epochs
        computed = self._tokens_computed - first_pass_tokens[0]
        padded = self._tokens_padded - first_pass_tokens[1]
        metrics.update(
            grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            optimizer_steps=float(cfg.ppo_epochs * (n // per_rank)),
            micro_batches=float(micro_batches),  # forward/backward passes (more than n / micro_batch_size under a token budget)
            tokens=float(tokens),
            tokens_computed=float(computed),
            padding_share=padded / (computed + padded) if computed + padded else 0.0,
            prompt_share_saved=1.0 - computed / tokens if tokens else 0.0,
            old_logprobs_recomputed=float(recomputed),
            update_seconds=elapsed,
            tokens_per_s=tokens / elapsed if elapsed > 0 else float("nan"),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            weight_version=float(self.version),
            **{f"seconds_{k}": v for k, v in seconds.items()},
        )
        return metrics

    # ------------------------------------------------------------------ weights

    def hf_named_parameters(self):
        """Yield ``(hf_name, full fp tensor on CPU)`` for every policy weight, in HF naming.

        Under ZeRO-3 every rank must iterate this together (each parameter is gathered across
        ranks); only rank 0's values are meaningful. LoRA adapters are merged into the weights.
        """
        if self.config.lora is not None:
            yield from _merged_lora_parameters(self.module)
            return
        if self.config.zero_stage == 3:
            import deepspeed

            for name, param in self.module.named_parameters():
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    yield name, param.detach().to("cpu", copy=True)
            return
        for name, param in self.module.named_parameters():
            yield name, param.detach().to("cpu", copy=True)

    def get_weights(self, dtype: torch.dtype | str | None = None):
        """``FlatWeights`` of the current policy on rank 0 (``None`` on other ranks).

        ``dtype`` converts floating tensors (e.g. ``"bfloat16"`` for a bf16 vLLM engine).
        """
        from actors.weight_sync import FlatWeights

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        named = []
        for name, tensor in self.hf_named_parameters():
            if self.rank == 0:
                named.append((name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor))
        return FlatWeights.from_named_tensors(named, self.version) if self.rank == 0 else None

    def publish_weights(self, dtype: torch.dtype | str | None = None) -> list:
        """``ray.put`` the weights once; returns ``[ObjectRef]`` on rank 0 and ``[]`` elsewhere.

        The ref is wrapped in a list so that Ray hands the caller the reference, not the value.
        """
        import ray

        flat = self.get_weights(dtype)
        return [ray.put(flat)] if flat is not None else []

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str = "gloo") -> None:
        """Rank 0 becomes the sender (rank 0) of a ``WeightSyncGroup``; other ranks do nothing."""
        if self.rank != 0:
            return
        from actors.weight_sync import WeightSyncGroup

        device = self.device if backend != "gloo" else "cpu"
        self._sync_group = WeightSyncGroup(host, port, 0, world_size, backend=backend, device=device)

    def broadcast_weights(self, dtype: torch.dtype | str | None = None) -> int:
        """Send the current weights over the sync group (every rank calls it under ZeRO-3)."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        named = []
        for name, tensor in self.hf_named_parameters():
            if self.rank == 0:
                named.append((name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor))
        if self.rank != 0:
            return 0
        if self._sync_group is None:
            raise RuntimeError("call init_weight_sync before broadcast_weights")
        return self._sync_group.send(named, self.version)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, out_dir: str, policy: bool = True) -> str | None:
        """``out_dir/learner`` (optimizer + version) and, with ``policy``, ``out_dir/policy`` (HF).

        Safetensors and JSON only (see ``actors.checkpoint``). All ranks call; rank 0 writes, so
        with learners on several nodes ``out_dir`` must be shared storage.
        """
        from pathlib import Path

        from actors.checkpoint import save_learner_state, save_policy_hf

        save_learner_state(self, Path(out_dir) / "learner")
        if policy:
            save_policy_hf(self, Path(out_dir) / "policy")
        return str(out_dir) if self.rank == 0 else None

    def load_checkpoint(self, in_dir: str) -> dict:
        from pathlib import Path

        from actors.checkpoint import load_learner_state

        return load_learner_state(self, Path(in_dir) / "learner")

    # ------------------------------------------------------------------ misc

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = int(version)

    def ping(self) -> bool:
        return True


# ---------------------------------------------------------------------------------------------
# LoRA (optional; needs peft)
# ---------------------------------------------------------------------------------------------


def _merged_lora_parameters(peft_model):
    """HF-named full weights of a peft model: ``W + (alpha/r)·B·A`` for adapted layers."""
    peft_model.merge_adapter()
    try:
        base = peft_model.get_base_model()
        for name, param in base.named_parameters():
            if "lora_" in name:
                continue
            yield name.replace(".base_layer", ""), param.detach().to("cpu", copy=True)
    finally:
        peft_model.unmerge_adapter()


# ---------------------------------------------------------------------------------------------
# LearnerGroup
# ---------------------------------------------------------------------------------------------


def _logprob_drift(sampled: torch.Tensor | None, recomputed: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |log π_rollout − log π_learner| over trained tokens (verl's rollout-probs diff).

    The engine sampled with the same weights the learner recomputes with, so any gap is numerical
    (kernels, dtype, batching) or a bug (stale weights, misaligned tokens); it is logged every step.
    """
    if sampled is None:
        return {}
    mask = loss_mask.to(torch.bool)
    if not bool(mask.any()):
        return {"logprob_drift_mean": 0.0, "logprob_drift_max": 0.0, "logprob_drift_tokens": 0.0}
    gap = (sampled.to(torch.float32) - recomputed.to(torch.float32)).abs()[mask]
    return {"logprob_drift_mean": float(gap.mean()), "logprob_drift_max": float(gap.max()),
            "logprob_drift_tokens": float(mask.sum())}


def _mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    keys = per_rank[0].keys()
    out = {k: sum(m[k] for m in per_rank) / len(per_rank) for k in keys}
    if "logprob_drift_max" in out:  # the worst token over all ranks; the mean weighted by tokens
        out["logprob_drift_max"] = max(m["logprob_drift_max"] for m in per_rank)
        total = sum(m["logprob_drift_tokens"] for m in per_rank)
        out["logprob_drift_mean"] = (sum(m["logprob_drift_mean"] * m["logprob_drift_tokens"] for m in per_rank) / total
                                     if total else 0.0)
        out["logprob_drift_tokens"] = total
    for k in ("tokens", "tokens_computed", "tokens_per_s", "teacher_kl_trajectories"):  # these add up over ranks
        if k in out:
            out[k] = sum(m[k] for m in per_rank)
    out["update_seconds"] = max(m["update_seconds"] for m in per_rank)
    return out


class LearnerGroup:
    """K ``Learner`` Ray actors training one policy data-parallel (RLlib's LearnerGroup role).

    ``resources`` are the Ray options of each learner actor (default ``{"num_cpus": 1}`` on CPU,
    ``{"num_gpus": 1}`` with CUDA). The group's process group uses gloo on CPU, NCCL on GPU.
    Call ``shutdown()`` (or let Ray end) to release the actors.
    """

    def __init__(
        self,
        config: LearnerConfig | Mapping[str, Any] | None = None,
        num_learners: int = 2,
        *,
        resources: Mapping[str, Any] | None = None,
        setup_timeout_s: float = 900.0,
    ):
        import ray

        self.config = LearnerConfig.from_dict(config)
        self.num_learners = int(num_learners)
        if resources is None:
            resources = {"num_gpus": 1} if self.config.resolved_device() == "cuda" else {"num_cpus": 1}
        actor_cls = ray.remote(Learner).options(**resources)
        self.learners = [
            actor_cls.remote(self.config, rank=r, world_size=self.num_learners, setup=False) for r in range(self.num_learners)
        ]
        addr, port = ray.get(self.learners[0].master_endpoint.remote(), timeout=setup_timeout_s)
        self.infos = ray.get([l.setup.remote(addr, port) for l in self.learners], timeout=setup_timeout_s)
        self.version = 0
        self._sync_world = None

    def update(self, batch: TrainBatch, step: int | None = None) -> dict[str, float]:
        """Shard the batch over the learners, update, and return rank-averaged metrics."""
        from actors.cluster import get_all  # a dead or OOM-killed rank raises now, not at NCCL's timeout

        shards = shard_batch(batch, self.num_learners)
        per_rank = get_all([l.update.remote(s, step) for l, s in zip(self.learners, shards)], what="learner update")
        self.version += 1
        metrics = _mean_metrics(per_rank)
        metrics["weight_version"] = float(self.version)
        return metrics

    def compute_logprobs(self, token_ids, attention_mask=None) -> torch.Tensor:
        """Current-policy logprobs, computed on rank 0 (ZeRO-3 needs every rank: use update's own)."""
        import ray

        if self.config.zero_stage == 3:
            n = len(token_ids)
            ids = torch.as_tensor(token_ids)
            attn = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
            if n % self.num_learners:
                raise ValueError("under ZeRO-3 compute_logprobs needs a batch that splits evenly over the learners")
            per = n // self.num_learners
            parts = ray.get([
                l.compute_logprobs.remote(ids[r * per : (r + 1) * per], attn[r * per : (r + 1) * per])
                for r, l in enumerate(self.learners)
            ])
            return torch.cat(parts)
        return ray.get(self.learners[0].compute_logprobs.remote(token_ids, attention_mask))

    def publish_weights(self, dtype: torch.dtype | str | None = None):
        """Put the current weights into the object store once; returns the ``ObjectRef``."""
        import ray

        refs = ray.get([l.publish_weights.remote(dtype) for l in self.learners])
        return refs[0][0]

    def sync_weights(self, workers: Sequence, dtype: torch.dtype | str | None = None) -> dict[str, float]:
        """Object-store sync: publish once, every worker loads it. Returns versions and seconds."""
        from actors.weight_sync import push_weights_via_object_store

        t0 = time.perf_counter()
        ref = self.publish_weights(dtype)
        t1 = time.perf_counter()
        versions = push_weights_via_object_store(ref, workers)
        t2 = time.perf_counter()
        if set(versions) != {self.version}:
            raise RuntimeError(f"rollout workers report weight versions {versions}, expected {self.version}")
        return {"weight_version": float(self.version), "publish_seconds": t1 - t0, "load_seconds": t2 - t1, "sync_seconds": t2 - t0}

    def resync_restarted(self, workers: Sequence, timeout_s: float = 600.0) -> list[int]:
        """Load the current weights into every worker that Ray restarted and that has not been synced
        since (``RolloutWorker(require_sync="after_restart")`` refuses to generate until then);
        returns their indices. The object store carries them whatever the sync mode: a restarted
        worker has lost its place in any collective group, so that group is dropped here and must be
        rebuilt with ``init_weight_sync`` before the next ``broadcast_weights``."""
        import ray

        infos = ray.get([w.info.remote() for w in workers], timeout=timeout_s)
        stale = [i for i, info in enumerate(infos) if not info["synced"]]
        if stale:
            self.sync_weights([workers[i] for i in stale])
            self._sync_world = None
        return stale

    def init_weight_sync(self, workers: Sequence, backend: str = "gloo", timeout_s: float = 600.0) -> int:
        """Build a ``WeightSyncGroup`` of learner rank 0 and every worker's engine rank(s)."""
        import ray

        ranks = ray.get([w.sync_ranks.remote() for w in workers], timeout=timeout_s)
        world = 1 + sum(ranks)
        addr, port = ray.get(self.learners[0].master_endpoint.remote(), timeout=timeout_s)
        calls = [self.learners[0].init_weight_sync.remote(addr, port, world, backend)]
        offset = 1
        for w, r in zip(workers, ranks):
            calls.append(w.init_weight_sync_async.remote(addr, port, offset, world, backend))
            offset += r
        ray.get(calls, timeout=timeout_s)
        self._sync_world = world
        return world

    def broadcast_weights(self, workers: Sequence, dtype: torch.dtype | str | None = None, timeout_s: float = 600.0) -> dict[str, float]:
        """Collective sync over the group built by ``init_weight_sync``."""
        import ray

        if self._sync_world is None:
            raise RuntimeError("call init_weight_sync(workers, backend) first (again after resync_restarted found a restarted worker)")
        t0 = time.perf_counter()
        receives = [w.receive_weights_async.remote() for w in workers]
        sends = [l.broadcast_weights.remote(dtype) for l in self.learners]
        versions = ray.get(receives, timeout=timeout_s)
        sent = ray.get(sends, timeout=timeout_s)[0]
        if set(versions) != {self.version}:
            raise RuntimeError(f"rollout workers report weight versions {versions}, expected {self.version}")
        return {"weight_version": float(self.version), "bytes": float(sent), "sync_seconds": time.perf_counter() - t0}

    def save_checkpoint(self, out_dir: str, policy: bool = True) -> str:
        """Every learner takes part (ZeRO-3 gathers); rank 0 writes ``learner/`` and ``policy/``."""
        return self.call("save_checkpoint", out_dir, policy)[0]

    def load_checkpoint(self, in_dir: str) -> dict:
        """Restore all learners (any ZeRO stage or learner count can read any checkpoint)."""
        meta = self.call("load_checkpoint", in_dir)[0]
        self.version = int(meta["version"])
        return meta

    def call(self, method: str, *args, **kwargs) -> list:
        """Run a ``Learner`` method on every learner and return the results (rank order)."""
        from actors.cluster import get_all

        return get_all([getattr(l, method).remote(*args, **kwargs) for l in self.learners], what=f"learner {method}")

    def shutdown(self) -> None:
        import ray

        for learner in self.learners:
            ray.kill(learner)
        self.learners = []


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
