"""``Learner``: one data-parallel rank of policy training on DeepSpeed.

It owns the trainable policy inside a DeepSpeed engine and an optional frozen reference model
(the KL anchor, and the teacher that sees privileged inputs), and turns a ``TrainBatch`` into
policy updates. The loss is ``raggym.algorithms.policy_loss.PolicyLoss``: the terms the config
names, composed by name; the learner computes what they ask for (log-probs, entropies, reference
log-probs, a teacher's top-K KL) and knows none of them.

Update schedule (one ``update`` call = one policy version)::

    π_old: recompute it now, or take it from the first mini-batch's own forward   (old_logprobs.py)
    for epoch in range(ppo_epochs):                              # PPO epochs
        for mini-batch of mini_batch_size sequences (global):     # one optimizer step each
            for micro-batch of micro_batch_size (per rank):       # gradient accumulation
                loss = Σ_g w_g · Σ_{term ∈ g} term                  # e.g. clipped PG + β·KL − c_H·H
                engine.backward(loss); engine.step()              # steps at the GA boundary

``w_g`` makes the accumulated, data-parallel-averaged gradient equal the gradient of the
*mini-batch* loss: each term is a mean over its normaliser's units in the micro-batch (trained
tokens with ``token-mean``, so every trainable token of the global mini-batch counts once, DAPO's
token-level loss; non-empty sequences with the seq-mean aggregations; PathRouter's evidence-poor
trajectories for its teacher KL). Multiplying it by ``n_micro · K · GA / n_global`` (the
normaliser's global count, all normalisers in one all-reduce per mini-batch) and letting
DeepSpeed divide by GA and average over K ranks leaves ``Σ_global L / n_global``.

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
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from actors.checkpoint import load_learner_state, reset_adam_state, save_learner_state, save_policy_hf
from actors.learner.batches import micro_pieces, position_ids, trained_positions
from actors.learner.config import LearnerConfig
from actors.learner.distributed import (
    all_reduce,
    disable_cpu_shm_comm,
    init_torch_distributed,
    policy_load_plan,
    ray_cpu_allotment,
    zero3_partitioned_loading,
)
from actors.learner.old_logprobs import OldLogprobs
from actors.learner.update_log import UpdateLog
from actors.weight_sync import FlatWeights, Published, WeightSyncGroup, node_address, pick_free_port
from raggym.algorithms.batch import TrainBatch
from raggym.algorithms.logprobs import final_hidden_states, head_token_stats, head_topk, output_head
from raggym.algorithms.losses import LOSS_AGGREGATIONS
from raggym.algorithms.policy_loss import PolicyLoss, PolicyLossInputs
from raggym.algorithms.rollout_correction import rollout_correction
from raggym.algorithms.shared_prompt import PackedBatch, pack_sequences, shared_prompt_order
from raggym.models import apply_lora, load_policy
from raggym.process_memory import release_freed_memory


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
        self.policy_loss = PolicyLoss(self.config.loss)  # the loss terms, by name (unknown names fail here)
        self.rank, self.world_size = int(rank), int(world_size)
        self.version = 0  # bumped after every update(); rollouts record it
        self.optimizer_reset_at: int | None = None  # the optimizer.reset_at_step done (checkpointed)
        self.engine = None
        self.reference = None
        self._sync_group = None
        self._tokens_computed = self._tokens_padded = 0  # positions run through the model, real / padding
        if setup:
            self.setup(master_addr, master_port)

    # ------------------------------------------------------------------ setup

    def master_endpoint(self) -> tuple[str, int]:
        """Address and a free port on this node, for rank 0 to host the process group."""
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
        threads = cfg.num_threads or ray_cpu_allotment()
        if threads:
            torch.set_num_threads(int(threads))
        if device == "cpu" and not cfg.cpu_shm_comm:
            disable_cpu_shm_comm()
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
        optimizer = cfg.optimizer.build(trainable)
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
        return final_hidden_states(model, ids, attn, position_ids(attn))

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
        return int(self._all_reduce(torch.tensor([float(count)]), op=dist.ReduceOp.MAX))

    def _head_chunks(self, positions: int) -> int | None:
        """``num_chunks`` for ``head_token_stats`` / ``head_topk``: the ranks' largest chunk count under ZeRO-3."""
        chunk = self.config.logit_chunk_size
        if not self._zero3_ranks_must_agree() or not chunk:
            return None  # without chunking the head runs once per forward on every rank
        return self._agreed(max(1, math.ceil(positions / chunk)))

    @torch.no_grad()
    def _logprobs_with(self, model, token_ids, attention_mask, micro_batch_size, needed=None,
                       temperature: float | None = None) -> torch.Tensor:
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        attention_mask = torch.ones_like(token_ids) if attention_mask is None else torch.as_tensor(attention_mask)
        needed = attention_mask.bool() if needed is None else torch.as_tensor(needed).bool() & attention_mask.bool()
        needed[:, 0] = False  # nothing predicts the first token
        out = torch.zeros(token_ids.shape, dtype=torch.float32)
        head, chunk = output_head(model), self.config.logit_chunk_size
        temperature = self.config.temperature if temperature is None else float(temperature)
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

    def score_probe(self, token_ids) -> torch.Tensor:
        """log π(x_t | x_<t) at temperature 1 for t = 1 .. len - 1 of one sequence, a float CPU tensor:
        the learner's side of a weight sync's probe (``actors.sync_verify``), which compares it as a
        tensor. Every rank takes part under ZeRO-3; rank 0's values are the group's."""
        ids = torch.as_tensor([list(token_ids)], dtype=torch.long)
        was_training = self.engine.training
        self.engine.eval()
        try:
            return self._logprobs_with(self.engine, ids, None, None, temperature=1.0)[0, 1:].detach().cpu()
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
        n, t = batch.token_ids.shape
        values = torch.zeros((n, t, k), dtype=torch.float32)
        indices = torch.zeros((n, t, k), dtype=torch.long)
        head = output_head(self.reference)
        teacher_ids, teacher_attn = batch.teacher_token_ids, batch.teacher_attention_mask
        pieces = self._pieces(teacher_attn, self.config.micro_batch_size)
        for p in range(self._agreed(len(pieces))):
            sl = pieces[min(p, len(pieces) - 1)]
            if p >= len(pieces):  # a forward only to keep ZeRO-3 ranks in step
                hidden = self._hidden(self.reference, teacher_ids[sl][:1], teacher_attn[sl][:1])
                head_topk(hidden[0, :0], head, k, self.config.logit_chunk_size, self._head_chunks(0))
                continue
            hidden = self._hidden(self.reference, teacher_ids[sl], teacher_attn[sl])
            pos = batch.teacher_positions[sl].long()
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

    def update(self, batch: TrainBatch, step: int | None = None) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; returns averaged metrics.

        ``step`` is the trainer step (the loss terms' schedules read it, e.g. the teacher-KL
        ramp); defaults to the learner's version. All ranks of a group must call this together
        with equally sized shards. π_old: ``actors.learner.old_logprobs``.

        Metrics: the loss terms' stats, the time breakdown ``seconds_*`` (old-logprob pass,
        reference pass, teacher pass, forward, backward, optimizer, waiting on other ranks) and
        ``padding_share`` / ``prompt_share_saved`` of the training forwards.
        """
        cfg = self.config
        step = self.version if step is None else int(step)
        n, per_rank = self._check_batch(batch)
        log = UpdateLog(self.world_size, self.grad_accum)
        batch = replace(batch)  # the passes below set fields of this copy, not of the caller's batch
        pi_old = OldLogprobs(batch, cfg.old_logprobs, single_update=cfg.ppo_epochs == 1 and n == per_rank)
        if pi_old.needs_pass:
            self._recompute_old_logprobs(batch, pi_old, log)
        pi_old.measure(batch)
        self._correct_for_the_rollout(batch, pi_old)
        self._frozen_model_passes(batch, log)  # what the loss terms need of the reference model
        reset = self._reset_optimizer_if_due(step)
        self._tokens_computed = self._tokens_padded = 0  # count the training forwards only

        self.engine.train()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.version * 1009 + self.rank)
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if cfg.shuffle else torch.arange(n)
            for m0 in range(0, n, per_rank):
                mini = self._mini_batch(batch, order[m0 : m0 + per_rank])
                pi_old.start_mini_batch(mini)
                units = self._global_units(mini, log)  # what each loss group averages over, all ranks
                passes = self._micro_batches(mini)
                log.micro_batches += len(passes)
                for p, (micro, filler) in enumerate(passes):
                    weights = self._group_weights(micro, units, filler)
                    # The optimizer steps after the mini-batch's last piece, however many there are.
                    self.engine.set_gradient_accumulation_boundary(p == len(passes) - 1)
                    with log.timer("forward"):
                        loss, stats, totals, current = self._micro_loss(micro, weights, step)
                    with log.timer("backward"):
                        self.engine.backward(loss)
                    pi_old.observe(micro, current, filler)
                    boundary = self.engine.is_gradient_accumulation_boundary()
                    if pi_old.decides_now(boundary):  # before the first optimizer step
                        self._keep_or_recompute_old_logprobs(batch, pi_old, log)
                    self._optimizer_step(boundary, log)
                    if not filler:
                        log.micro_batch(micro, weights, stats, totals)
                pi_old.end_mini_batch()
                log.end_mini_batch()
        self.version += 1
        metrics = log.metrics(
            self._tokens_computed, self._tokens_padded, **pi_old.drift,
            **self.policy_loss.summarize(log.totals, cfg.ppo_epochs),
            optimizer_steps=float(cfg.ppo_epochs * (n // per_rank)), old_logprobs_recomputed=float(pi_old.recomputed),
            lr=float(self.optimizer.param_groups[0]["lr"]), weight_version=float(self.version),
            optimizer_reset=float(reset),
        )
        # The step's activations and gradients are freed, but glibc keeps their pages: on CPU a
        # SmolLM2-135M learner grew from 2.6 GB to 9.7 GB over two steps of 16 x 500 tokens
        # without this, and stayed at 2.6 GB with it (raggym.process_memory).
        release_freed_memory()
        return metrics

    def _check_batch(self, batch: TrainBatch) -> tuple[int, int]:
        """``(sequences, per-rank mini-batch size)``; the batch must hold what the loss terms read."""
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"Learner.update takes a TrainBatch, got {type(batch).__name__}")
        lacking = self.policy_loss.missing_batch_keys(batch)
        if lacking:
            raise KeyError(f"the loss terms read batch fields the batch lacks: {lacking}")
        n, per_rank = batch.num_rows, self.config.mini_batch_size // self.world_size
        if n == 0 or n % per_rank:
            raise ValueError(
                f"this learner got {n} sequences; it needs a positive multiple of the per-learner "
                f"mini-batch {per_rank} (mini_batch_size {self.config.mini_batch_size} / {self.world_size} learners)"
            )
        return n, per_rank

    def _recompute_old_logprobs(self, batch: TrainBatch, pi_old: OldLogprobs, log: UpdateLog) -> None:
        with log.timer("old_logprobs"):
            batch.old_logprobs = self.compute_logprobs(batch.token_ids, batch.attention_mask,
                                                       needed=trained_positions(batch))
        pi_old.recomputed = True

    def _keep_or_recompute_old_logprobs(self, batch: TrainBatch, pi_old: OldLogprobs, log: UpdateLog) -> None:
        """π_old for the rest of the update: the rollout's log-probs, unless they drift too far on any rank."""
        drift = pi_old.checked_drift()
        too_far = torch.tensor([float(drift.get("logprob_drift_mean", 0.0) > self.config.max_logprob_drift)])
        if float(self._all_reduce(too_far, log, dist.ReduceOp.MAX)) > 0:
            self._recompute_old_logprobs(batch, pi_old, log)
        else:
            batch.old_logprobs = batch.sampled_logprobs

    def _correct_for_the_rollout(self, batch: TrainBatch, pi_old: OldLogprobs) -> None:
        """``learner.loss.rollout_correction``: weigh each token's PG loss by π_old / π_rollout
        (truncated, or masked: a rejected token leaves ``loss_mask``, so it counts in no loss
        term and in no denominator). π_old is this update's recomputed pass (config check)."""
        correction = self.config.loss.rollout_correction
        if not correction.enabled:
            return
        if pi_old.sampled is None:
            raise ValueError("learner.loss.rollout_correction needs the rollout engine's log-probs of the sampled "
                             "tokens (TrainBatch.sampled_logprobs); this batch has none")
        corrected = rollout_correction(batch.old_logprobs, pi_old.sampled, batch.loss_mask, correction)
        batch.loss_mask = corrected.keep.to(batch.loss_mask.dtype)
        batch.rollout_is_weights = corrected.weights
        pi_old.drift.update(corrected.metrics)

    def _frozen_model_passes(self, batch: TrainBatch, log: UpdateLog) -> None:
        """What the loss terms need of the frozen model: reference log-probs, the teacher's top-K."""
        needs = self.policy_loss.needs
        if "ref_log_probs" in needs and batch.ref_logprobs is None:
            with log.timer("reference"):
                batch.ref_logprobs = self.compute_ref_logprobs(batch.token_ids, batch.attention_mask,
                                                               needed=trained_positions(batch))
        if "teacher_kl" in needs:
            with log.timer("teacher"):
                batch.teacher_topk_values, batch.teacher_topk_indices = self.compute_teacher_topk(batch)
        batch.teacher_token_ids = batch.teacher_attention_mask = None  # the teacher's full input is spent

    @staticmethod
    def _mini_batch(batch: TrainBatch, rows: torch.Tensor) -> TrainBatch:
        """The rows, those that share a prompt next to each other, so that they share a micro-batch
        (the update does not depend on how a mini-batch is split: each micro loss has its weight)."""
        mini = batch.rows(rows)
        return mini.rows(shared_prompt_order(mini.token_ids, mini.attention_mask))

    def _global_units(self, mini: TrainBatch, log: UpdateLog) -> list[float]:
        """Each loss group's normaliser count in the mini-batch, summed over the ranks (one all-reduce)."""
        return self._all_reduce(self.policy_loss.units(mini), log).tolist()

    def _micro_batches(self, mini: TrainBatch) -> list[tuple[TrainBatch, bool]]:
        """This rank's forward/backward passes over the mini-batch: ``(micro-batch, filler)`` pairs.

        Micro-batches of ``micro_batch_size`` rows, each split further under the token budget. Past
        its own count (ZeRO-3, other ranks split finer) a rank repeats its last piece's first row
        as a filler, weight 0: a forward and backward that change nothing.
        """
        size = self.config.micro_batch_size
        pieces = [slice(u0 + p.start, u0 + p.stop) for u0 in range(0, mini.num_rows, size)
                  for p in self._pieces(mini.attention_mask[u0 : u0 + size], size)]
        filler = slice(pieces[-1].start, pieces[-1].start + 1)
        return [(mini.rows(pieces[p]), False) if p < len(pieces) else (mini.rows(filler), True)
                for p in range(self._agreed(len(pieces)))]

    def _group_weights(self, micro: TrainBatch, units: list[float], filler: bool) -> list[float]:
        """w_g = n_micro · K · GA / n_global per loss group (module docstring); GA is DeepSpeed's
        divisor whatever the number of pieces, so the pieces' weights add up alike."""
        if filler:
            return [0.0] * len(units)
        local = self.policy_loss.units(micro).tolist()
        return [n * self.world_size * self.grad_accum / total if total > 0 else 0.0 for n, total in zip(local, units)]

    def _micro_loss(self, micro: TrainBatch, weights: list[float], step: int):
        """The micro-batch's share of the mini-batch loss, its stats per loss group, the terms'
        totals, and its detached log-probs."""
        inputs = self._loss_inputs(micro, step)
        loss, stats, totals = self.policy_loss(inputs, weights)
        return loss, stats, totals, inputs.log_probs.detach()

    def _loss_inputs(self, mb: TrainBatch, step: int) -> PolicyLossInputs:
        """One training forward over the micro-batch, and what the loss terms read of it."""
        needs, device = self.policy_loss.needs, self.device
        mask = mb.loss_mask.to(torch.float32).clone()
        mask[:, 0] = 0  # nothing predicts the first token
        hidden, packed = self._packed_hidden(self.engine, mb.token_ids, mb.attention_mask, mask > 0)
        teacher = {}
        if "teacher_kl" in needs:  # student logits (not divided by T) at the entries against the teacher's top-K there
            teacher = {"teacher_values": packed.gather(mb.teacher_topk_values),
                       "teacher_indices": packed.gather(mb.teacher_topk_indices)}
        # Entropy only at the trained positions (the full-vocabulary softmax is not free): the
        # entries' logits are the distributions their tokens were drawn from.
        head_stats = head_token_stats(
            hidden, output_head(self.engine), packed.targets, self.config.temperature, self.config.logit_chunk_size,
            entropy=True, entropy_grad="entropy_grad" in needs, num_chunks=self._head_chunks(hidden.shape[0]), **teacher,
        )
        log_probs = packed.scatter(head_stats.logprobs)  # log softmax(z / T) at the sampled tokens
        # Without old log-probs the weights have not moved since the rollout (first mini-batch of
        # a "rollout" update), so π_old is this very forward's value: ratio 1, as a recomputation gives.
        old = mb.old_logprobs.to(device, torch.float32) if mb.old_logprobs is not None else log_probs.detach()
        return PolicyLossInputs(
            log_probs=log_probs, old_log_probs=old, advantages=mb.advantages.to(device, torch.float32),
            mask=mask.to(device), entropy=packed.scatter(head_stats.entropy),
            ref_log_probs=mb.ref_logprobs.to(device, torch.float32) if "ref_log_probs" in needs else None,
            teacher_kl=packed.scatter(head_stats.teacher_kl) if teacher else None, batch=mb, step=step,
            rollout_is_weights=(mb.rollout_is_weights.to(device, torch.float32)
                                if mb.rollout_is_weights is not None else None),
        )

    def _reset_optimizer_if_due(self, step: int) -> bool:
        """``optimizer.reset_at_step``: AdamW starts afresh before the first update at or after
        that step, once (the reset is checkpointed, so a run resumed past it does not reset again;
        an update skipped at that step moves the reset to the next one)."""
        at = self.config.optimizer.reset_at_step
        if at is None or step < at or self.optimizer_reset_at == at:
            return False
        reset_adam_state(self)
        self.optimizer_reset_at = at
        return True

    def _optimizer_step(self, boundary: bool, log: UpdateLog) -> None:
        """``engine.step()`` (the update itself at the GA boundary) and the gradient norm there."""
        # ZeRO-0 reports no global norm: read it off the gradients before the step clears them
        norm = self._grad_norm() if boundary and self.config.zero_stage == 0 else None
        with log.timer("optimizer"):
            self.engine.step()
        if boundary:
            log.grad_norm(norm if norm is not None else self._grad_norm())

    def _grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            return float(norm)
        grads = [p.grad.detach().float() for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def _all_reduce(self, values: torch.Tensor, log: UpdateLog | None = None, op=None) -> torch.Tensor:
        """All-reduce over the data-parallel ranks; the wait counts as ``seconds_wait`` of ``log``."""
        values, waited = all_reduce(values, self.world_size, op)
        if log is not None:
            log.seconds["wait"] += waited
        return values

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

    def _rank0_weights(self, dtype: torch.dtype | str | None) -> list[tuple[str, torch.Tensor]]:
        """``hf_named_parameters`` as a list on rank 0 (empty elsewhere; every rank must call it),
        floating tensors converted to ``dtype`` (e.g. ``"bfloat16"`` for a bf16 vLLM engine)."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        named = []
        for name, tensor in self.hf_named_parameters():
            if self.rank == 0:
                named.append((name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor))
        return named

    def get_weights(self, dtype: torch.dtype | str | None = None):
        """``FlatWeights`` of the current policy on rank 0 (``None`` on other ranks), in ``dtype``."""
        named = self._rank0_weights(dtype)
        return FlatWeights.from_named_tensors(named, self.version) if self.rank == 0 else None

    def publish_weights(self, dtype: torch.dtype | str | None = None, probe: Sequence[int] | None = None) -> Published:
        """``ray.put`` the weights once (rank 0's ``Published.weights``; ``None`` elsewhere) and,
        with ``probe``, score it under them (``_probe_logprobs``). A ref inside the answer stays a
        ref: Ray hands the caller the reference, not the weights."""
        import ray

        flat = self.get_weights(dtype)
        ref = ray.put(flat) if flat is not None else None
        del flat  # the object store holds the copy now
        release_freed_memory()
        return Published(weights=ref, probe_logprobs=self._probe_logprobs(probe))

    def _probe_logprobs(self, probe: Sequence[int] | None) -> torch.Tensor | None:
        """The sync probe's scores when a sync carries one: rank 0's, and every rank's under ZeRO-3
        (its forward gathers the parameters from all ranks)."""
        if probe is None or (self.rank != 0 and self.config.zero_stage != 3):
            return None
        return self.score_probe(probe)

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str = "gloo") -> None:
        """Rank 0 becomes the sender (rank 0) of a ``WeightSyncGroup``; other ranks do nothing."""
        if self.rank != 0:
            return
        device = self.device if backend != "gloo" else "cpu"
        self._sync_group = WeightSyncGroup(host, port, 0, world_size, backend=backend, device=device)

    def broadcast_weights(self, dtype: torch.dtype | str | None = None, probe: Sequence[int] | None = None) -> Published:
        """Send the current weights over the sync group (every rank calls it under ZeRO-3); with
        ``probe``, score it once the weights are sent."""
        named = self._rank0_weights(dtype)
        sent = 0
        if self.rank == 0:
            if self._sync_group is None:
                raise RuntimeError("call init_weight_sync before broadcast_weights")
            sent = self._sync_group.send(named, self.version)
        del named
        release_freed_memory()  # the gathered, cast copies of the weights
        return Published(bytes_sent=sent, probe_logprobs=self._probe_logprobs(probe))

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, out_dir: str, policy: bool = True) -> str | None:
        """``out_dir/learner`` (optimizer + version) and, with ``policy``, ``out_dir/policy`` (HF).

        Safetensors and JSON only (see ``actors.checkpoint``). All ranks call; rank 0 writes, so
        with learners on several nodes ``out_dir`` must be shared storage.
        """
        save_learner_state(self, Path(out_dir) / "learner")
        if policy:
            save_policy_hf(self, Path(out_dir) / "policy")
        return str(out_dir) if self.rank == 0 else None

    def load_checkpoint(self, in_dir: str) -> dict:
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


