"""Policy losses as pure tensor functions: clipped policy gradient (PPO / GRPO / DAPO clip-higher),
loss aggregation, KL to a reference (loss term or reward penalty), entropy bonus, and
PathRouter's selective top-K teacher KL.

Shapes: token-level tensors are ``[batch, seq]`` (log-probabilities of the sampled tokens,
advantages, masks); logits are ``[batch, seq, vocab]``; sequence-level tensors are ``[batch]``.
``mask`` is the response/loss mask: 1 on tokens the model generated and should be trained on,
0 on prompt, observation (retrieved text) and padding tokens (see ``raggym.algorithms.spans``).

Clipped surrogate (PPO, Schulman et al., 2017, eq. 7; DAPO, Yu et al., 2025, arXiv:2503.14476,
§3.1 "clip-higher" decouples the two bounds)::

    ρ_t   = exp(log π_θ(y_t) − log π_old(y_t))
    L_t   = max(−Â_t · ρ_t,  −Â_t · clip(ρ_t, 1 − ε_low, 1 + ε_high))

Dual clip (Ye et al., 2020, "Mastering Complex Control in MOBA Games with Deep RL",
arXiv:1912.09729; verl's ``clip_ratio_c``; off unless ``dual_clip=True``): when Â_t < 0
and ρ_t is large, the pessimistic bound above grows without limit (−Â_t · ρ_t); the dual clip caps
it at −Â_t · c (c > 1, verl's default 3)::

    L_t   = min(L_t, −Â_t · c)   if Â_t < 0,   else L_t

Aggregation over tokens (``aggregation``):

* ``"token-mean"`` — Σ_{i,t} L·m / Σ_{i,t} m. DAPO §3.3 (token-level loss): every token counts the
  same, so long responses are not under-weighted.
* ``"seq-mean-token-mean"`` — mean_i (Σ_t L·m / Σ_t m). The GRPO paper's objective (DeepSeekMath
  eq. 3). Sequences with an empty mask are left out of the mean.
* ``"seq-mean-token-sum"`` — mean_i Σ_t L·m, optionally divided by a constant ``token_sum_norm``
  (Dr.GRPO, Liu et al., 2025, arXiv:2503.20783, divides by the generation budget instead of
  the response length).

Clipped surrogate at the mode choices (``mode_choice_policy_loss``; a trainer option of this
project, not a paper's, off unless ``learner.loss.mode_pg_coef`` > 0): the same per-token L_t,
with the same advantages and ratios, averaged over the tokens where the agent chose a search's
retrieval mode (c_t = 1, ``raggym.algorithms.batch.mode_choice_mask``) and nothing else::

    L_mode = Σ_{i,t} c_{i,t} · m_{i,t} · L_{i,t} / Σ_{i,t} c_{i,t} · m_{i,t}

Added to the loss as k · L_mode, it gives the mode choice the weight k on its own, however many
other tokens the episode trained (in the token-mean PG term a choice is one token of ~70).

KL to the frozen reference: ``kl_loss`` adds β·KL to the loss (GRPO); ``kl_penalized_rewards``
subtracts β·Σ_t KL_t from each sequence reward instead (PPO-style reward penalty). Estimators are
in ``raggym.algorithms.kl``.

PathRouter teacher KL (Wang et al., 2026, arXiv:2606.16409, selective teacher distillation)::

    S_t      = top-K indices of the teacher's logits at position t (K = 128)
    p̃_T, p̃_S = softmax of teacher / student logits restricted to S_t   (renormalised over S_t)
    KL_t     = Σ_{v ∈ S_t} p̃_T(v) · (log p̃_T(v) − log p̃_S(v))     forward KL(teacher‖student)
    KL_i     = mean of KL_t over think and query positions of trajectory i
    L_teach  = λ(step) · mean of KL_i over trajectories with EO_i < θ_P
    λ(step)  = λ̄ · min(1, step / W),   λ̄ = 0.1, W = 20

The teacher is a frozen copy of the reference model that also sees the gold evidence; it is not
part of this module (pass its logits).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from raggym.algorithms.kl import kl_estimate

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
DUAL_CLIP_RATIO_C = 3.0  # verl's default c of the dual clip


def _check_token_shapes(*tensors: torch.Tensor) -> None:
    shape = tensors[0].shape
    if len(shape) != 2:
        raise ValueError(f"token-level tensors must be [batch, seq], got {tuple(shape)}")
    for t in tensors[1:]:
        if t.shape != shape:
            raise ValueError(f"shape mismatch: {tuple(t.shape)} vs {tuple(shape)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ values·mask / Σ mask over all elements; 0 (with a gradient path) when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: LossAggregation = "token-mean",
    token_sum_norm: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[batch, seq]`` per-token loss to a scalar (see the module docstring)."""
    _check_token_shapes(per_token, mask)
    m = mask.to(per_token.dtype)
    if aggregation == "token-mean":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)  # Σ L·m / Σ m
    seq_tokens = m.sum(dim=-1)
    has_tokens = (seq_tokens > 0).to(per_token.dtype)
    n_seqs = has_tokens.sum().clamp(min=1.0)
    if aggregation == "seq-mean-token-mean":
        per_seq = (per_token * m).sum(dim=-1) / seq_tokens.clamp(min=1.0)  # Σ_t L·m / Σ_t m
        return (per_seq * has_tokens).sum() / n_seqs
    if aggregation == "seq-mean-token-sum":
        per_seq = (per_token * m).sum(dim=-1)  # Σ_t L·m
        if token_sum_norm is not None:
            per_seq = per_seq / token_sum_norm
        return (per_seq * has_tokens).sum() / n_seqs
    raise ValueError(
        f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}"
    )


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1).expand_as(like)
    return advantages


def importance_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """ρ = π_θ / π_old per token; the log-ratio is clamped to ±20 to keep exp finite."""
    return torch.exp((log_probs - old_log_probs).clamp(min=-20.0, max=20.0))


def policy_gradient_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    aggregation: LossAggregation = "token-mean",
    token_sum_norm: float | None = None,
) -> torch.Tensor:
    """Unclipped importance-weighted policy gradient surrogate: aggregate(−Â · ρ).

    At ρ = 1 its gradient is that of REINFORCE, −Â · ∇ log π.
    """
    adv = _token_advantages(advantages, log_probs)
    _check_token_shapes(log_probs, old_log_probs, adv, mask)
    per_token = -adv * importance_ratio(log_probs, old_log_probs)  # −Â ρ
    return aggregate_loss(per_token, mask, aggregation, token_sum_norm)


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    aggregation: LossAggregation = "token-mean",
    token_sum_norm: float | None = None,
    dual_clip: bool = False,
    clip_ratio_c: float = DUAL_CLIP_RATIO_C,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped policy-gradient loss with PPO's ε or DAPO's (ε_low, ε_high).

    ``advantages`` may be ``[batch]`` (broadcast over tokens) or ``[batch, seq]``.
    ``clip_high=None`` means symmetric clipping (``clip_high = clip_low``); DAPO uses 0.2 / 0.28.
    ``dual_clip=True`` caps the loss of negative-advantage tokens at −Â·``clip_ratio_c`` (c > 1;
    3.0 as in verl); off by default.

    Returns ``(loss, stats)``; ``stats`` holds detached scalars ``clip_fraction`` (share of masked
    tokens where the clipped branch was active), ``approx_kl`` (mean of log π_old − log π_θ) and
    ``ratio_mean``; with the dual clip also ``clip_fraction_lower`` (share of masked tokens with
    Â < 0 where the −Â·c cap was active).

    ``token_weights`` (``[batch, seq]``, no gradient) multiply each token's clipped loss: the
    rollout correction's importance weights w_t (``raggym.algorithms.rollout_correction``).
    """
    if clip_high is None:
        clip_high = clip_low
    if dual_clip and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be greater than 1, got {clip_ratio_c}")
    adv = _token_advantages(advantages, log_probs)
    _check_token_shapes(log_probs, old_log_probs, adv, mask)
    ratio = importance_ratio(log_probs, old_log_probs)  # ρ_t
    unclipped = -adv * ratio  # −Â ρ
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # −Â clip(ρ, 1−ε_low, 1+ε_high)
    per_token = torch.maximum(unclipped, clipped)  # pessimistic bound
    if dual_clip:
        cap = -adv * clip_ratio_c  # −Â·c
        capped = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)  # Â < 0: min(L, −Â·c)
    if token_weights is not None:
        _check_token_shapes(per_token, token_weights)
        per_token = per_token * token_weights.detach()  # w_t · L_t
    loss = aggregate_loss(per_token, mask, aggregation, token_sum_norm)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).to(log_probs.dtype), mask),
            "approx_kl": masked_mean(old_log_probs - log_probs, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
        if dual_clip:
            stats["clip_fraction_lower"] = masked_mean(capped.to(log_probs.dtype), mask)
    return loss, stats


def mode_choice_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    mode_choice_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: bool = False,
    clip_ratio_c: float = DUAL_CLIP_RATIO_C,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate of ``clipped_policy_loss`` averaged over the trained mode-choice
    tokens only: L_mode = Σ c·m·L / Σ c·m (module docstring); 0 when no trained token chose a mode.

    ``mode_choice_mask`` is ``[batch, seq]``, 1 where a search's retrieval mode was chosen. The
    normaliser is the number of trained mode choices whatever the main loss's aggregation, so
    multiplying by k weighs the mean mode choice k times. Returns ``(L_mode, stats)`` with the
    clipped surrogate's stats taken over the choices.
    """
    _check_token_shapes(log_probs, mode_choice_mask)
    choices = mode_choice_mask.to(log_probs.dtype) * mask.to(log_probs.dtype)  # c·m
    return clipped_policy_loss(log_probs, old_log_probs, advantages, choices, clip_low=clip_low, clip_high=clip_high,
                               aggregation="token-mean", dual_clip=dual_clip, clip_ratio_c=clip_ratio_c,
                               token_weights=token_weights)  # Σ c·m·L / Σ c·m


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "low_var_kl",
    aggregation: LossAggregation = "token-mean",
) -> torch.Tensor:
    """KL(π_θ ‖ π_ref) as a loss term (multiply by β yourself): aggregate(k(log π, log π_ref))."""
    _check_token_shapes(log_probs, ref_log_probs, mask)
    return aggregate_loss(kl_estimate(log_probs, ref_log_probs, kind), mask, aggregation)


def kl_penalized_rewards(
    rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> torch.Tensor:
    """KL as a reward penalty on sequence rewards ``[batch]``: ``r_i − β · Σ_t KL_{i,t} · m_{i,t}``.

    Computed without gradient: a reward is a constant for the policy update.
    """
    _check_token_shapes(log_probs, ref_log_probs, mask)
    with torch.no_grad():
        per_token = kl_estimate(log_probs, ref_log_probs, kind) * mask.to(log_probs.dtype)
        return rewards - coef * per_token.sum(dim=-1).to(rewards.dtype)  # r − β Σ_t KL_t


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax at each position: ``[batch, seq, vocab] → [batch, seq]``."""
    log_p = F.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)  # H = −Σ_v p log p


def entropy_bonus(
    logits: torch.Tensor, mask: torch.Tensor, aggregation: LossAggregation = "token-mean"
) -> torch.Tensor:
    """Aggregated policy entropy. Subtract ``coef · entropy_bonus(...)`` from the loss."""
    return aggregate_loss(entropy_from_logits(logits), mask, aggregation)


# ---------------------------------------------------------------------------------------------
# PathRouter selective teacher KL
# ---------------------------------------------------------------------------------------------


def teacher_topk(teacher_logits: torch.Tensor, k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-``k`` logits and their vocabulary indices, ``[batch, seq, k]`` each.

    Computing these once on the teacher's side avoids moving full-vocabulary teacher logits.
    """
    k = min(int(k), teacher_logits.shape[-1])
    values, indices = torch.topk(teacher_logits.detach(), k, dim=-1)
    return values, indices


def topk_forward_kl(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
) -> torch.Tensor:
    """Forward KL(teacher ‖ student) on the teacher's renormalised top-K support: ``[batch, seq]``.

    Gradients flow into the student only.
    """
    student_sel = torch.gather(student_logits, -1, teacher_topk_indices).float()
    log_p_teacher = F.log_softmax(teacher_topk_logits.detach().float(), dim=-1)  # log p̃_T on S_t
    log_p_student = F.log_softmax(student_sel, dim=-1)  # log p̃_S on S_t
    kl = log_p_teacher.exp() * (log_p_teacher - log_p_student)  # p̃_T log(p̃_T / p̃_S)
    return kl.sum(dim=-1)  # Σ over S_t


def topk_teacher_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 128
) -> torch.Tensor:
    """``topk_forward_kl`` from full logits: two ``[batch, seq, vocab]`` → ``[batch, seq]``."""
    values, indices = teacher_topk(teacher_logits, k)
    return topk_forward_kl(student_logits, values, indices)


def teacher_kl_weight(step: int, max_weight: float = 0.1, warmup_steps: int = 20) -> float:
    """λ(step) = λ̄ · min(1, step / W): the teacher KL ramps in linearly over W steps."""
    if warmup_steps <= 0:
        return float(max_weight)
    return float(max_weight) * min(1.0, max(0, step) / warmup_steps)  # λ̄ · min(1, step/W)


def selective_teacher_kl_loss(
    per_position_kl: torch.Tensor,
    span_mask: torch.Tensor,
    low_evidence: torch.Tensor,
    weight: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted mean teacher KL over think/query positions of low-evidence trajectories.

    ``per_position_kl`` and ``span_mask`` are ``[batch, seq]`` (the mask is 1 on think and query
    tokens, from ``spans.teacher_kl_mask_from_labels``); ``low_evidence`` is ``[batch]`` bool
    (EO < θ_P). Trajectories without any think/query token are skipped. With no eligible
    trajectory the loss is 0.

    Returns ``(weight · KL, stats)`` with detached ``teacher_kl`` (unweighted) and
    ``teacher_kl_trajectories`` (how many trajectories contributed).
    """
    _check_token_shapes(per_position_kl, span_mask)
    m = span_mask.to(per_position_kl.dtype)
    positions = m.sum(dim=-1)
    per_traj = (per_position_kl * m).sum(dim=-1) / positions.clamp(min=1.0)  # mean over spans
    eligible = (low_evidence.to(torch.bool) & (positions > 0)).to(per_position_kl.dtype)
    n = eligible.sum()
    kl = (per_traj * eligible).sum() / n.clamp(min=1.0)  # mean over EO < θ_P trajectories
    stats = {"teacher_kl": kl.detach(), "teacher_kl_trajectories": n.detach()}
    return weight * kl, stats


def pathrouter_teacher_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    span_mask: torch.Tensor,
    evidence_overlap: torch.Tensor,
    step: int,
    top_k: int = 128,
    evidence_threshold: float = 0.1,
    max_weight: float = 0.1,
    warmup_steps: int = 20,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole PathRouter teacher term from full logits and per-trajectory EO ``[batch]``."""
    per_position = topk_teacher_kl(student_logits, teacher_logits, top_k)
    low_evidence = evidence_overlap < evidence_threshold  # EO < θ_P
    weight = teacher_kl_weight(step, max_weight, warmup_steps)
    return selective_teacher_kl_loss(per_position, span_mask, low_evidence, weight)
