"""The policy loss as named terms: a registry of pure tensor functions that the learner adds up.

verl keeps each policy loss behind a registry (``register_policy_loss``); here each *term* of the
loss is one registered function, and ``learner.loss.terms`` names the terms a run adds up. Left
out, the terms follow the coefficient keys, so a config written before the registry trains as it
did (``default_terms``)::

    term           adds (a mean over its normaliser's units)                       switched on by
    clipped_pg     PPO / DAPO clipped surrogate (losses.clipped_policy_loss)       always
    dual_clip      the same with verl's dual clip: Â < 0 → min(L, −Â·c)            dual_clip: true
    kl             + β·KL(π_θ ‖ π_ref) (losses.kl_loss)                            kl_coef > 0
    entropy        − c_H·H, the entropy of the trained tokens                      entropy_coef > 0
    mode_entropy   − c_M·H_mode, the entropy where a search's mode was chosen      mode_entropy_coef > 0
    mode_pg        + k·L_mode, the clipped surrogate over the mode choices alone   mode_pg_coef > 0
                   (a mean over the trained mode-choice tokens, ``mode_choice_tokens``)
    teacher_kl     PathRouter's selective top-K teacher KL                         teacher_kl: true

A term is ``fn(inputs: PolicyLossInputs, config: PolicyLossConfig, **options) -> LossTerm``: a
scalar already signed and scaled (β·KL, −c_H·H), averaged over the *units* its normaliser counts
in the micro-batch: trained tokens or trained sequences for most (``trained_units``, as
``aggregation`` says), the evidence-poor trajectories for PathRouter's teacher KL. Terms that
share a normaliser form a group ``g``, and ``PolicyLoss`` composes one micro-batch's loss as::

    loss = Σ_g w_g · Σ_{term ∈ g} term(inputs, config),    w_g = n_g(micro) · K · GA / n_g(mini-batch, all ranks)

so that the gradient DeepSpeed accumulates (÷ GA) and averages over the K ranks is that of the
mini-batch mean of every group, however the mini-batch was split into micro-batches. ``options``
are the term's own settings, ``learner.loss.term_options.<name>`` in a config.

A new term is one decorated function (and its name in ``learner.loss.terms``)::

    @register_policy_loss_term("nll")
    def nll(inputs, config, coef: float = 0.1) -> LossTerm:     # an SFT term beside the PG
        value = aggregate_loss(-inputs.log_probs, inputs.mask, config.aggregation)  # −log π_θ(y_t)
        return LossTerm(coef * value, {"nll": value.item()})         # + c·NLL

``needs`` tells the learner what to compute beyond the policy's log-probs and entropies
(``LEARNER_INPUTS``); ``batch_keys`` are the ``TrainBatch`` fields the term reads. Registration is per
process: for Ray learners name the term by its import string, ``"package.module:function"``
(the import registers it in every process), or register it in a module every process imports.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

from raggym.algorithms.batch import BATCH_FIELDS, TrainBatch, teacher_kl_eligible, teacher_kl_span
from raggym.algorithms.losses import (
    DUAL_CLIP_RATIO_C,
    aggregate_loss,
    clipped_policy_loss,
    kl_loss,
    mode_choice_policy_loss,
    selective_teacher_kl_loss,
    teacher_kl_weight,
)
from raggym.algorithms.rollout_correction import RolloutCorrectionConfig

# ---------------------------------------------------------------------------------------------
# configuration and the data a term sees
# ---------------------------------------------------------------------------------------------


@dataclass
class PolicyLossConfig:
    """The loss terms (``terms``) and the settings of the built-in ones (``learner.loss`` in a config)."""

    clip_low: float = 0.2  # ε (PPO) or ε_low (DAPO)
    clip_high: float | None = None  # ε_high (DAPO: 0.28); None = symmetric
    dual_clip: bool = False  # verl's dual clip: a token with Â < 0 loses at most −Â·clip_ratio_c
    clip_ratio_c: float = DUAL_CLIP_RATIO_C  # verl's default
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    token_sum_norm: float | None = None  # Dr.GRPO's constant for seq-mean-token-sum
    kl_coef: float = 0.0  # β of the KL-to-reference loss term (GRPO: 0.001–0.04)
    kl_kind: str = "low_var_kl"  # k1 | abs | k2 | k3 (= low_var_kl)
    entropy_coef: float = 0.0  # c_H; the entropy is always logged
    # c_M: an entropy bonus at the tokens where the agent chose a search's retrieval mode only
    # (the batch's ``mode_choice_mask``), aggregated like the PG term (a mode token weighs what
    # any trained token does), so exploration of the route is kept without flattening the rest
    mode_entropy_coef: float = 0.0
    # k: an extra clipped PG term over the mode-choice tokens alone (losses.mode_choice_policy_loss),
    # a mean over those tokens: the route gets weight k of its own instead of 1 token's share of ~70
    mode_pg_coef: float = 0.0
    # the mode-PG term's credit: "none", the episodes' advantages; "route", those advantages centred
    # per route over the batch (raggym.algorithms.batch.route_centred_mode_advantages; the recipe builds them)
    mode_pg_centring: Literal["none", "route"] = "none"
    teacher_kl: bool = False  # PathRouter selective teacher KL
    teacher_top_k: int = 128
    evidence_threshold: float = 0.1  # θ_P
    teacher_max_weight: float = 0.1  # λ̄
    teacher_warmup_steps: int = 20  # W
    # The terms added up, each a registered name or "package.module:function";
    # None: the built-in terms the keys above switch on (``default_terms``).
    terms: list[str] | None = None
    term_options: Any = None  # {term name: {setting: value}}: keyword settings of registered terms
    # Importance weights for the rollout engine–learner gap (raggym.algorithms.rollout_correction):
    # {level: token | sequence | geometric, kind: truncate | mask, threshold, lower}; None: off
    rollout_correction: Any = None

    def __post_init__(self) -> None:
        correction = self.rollout_correction
        if not isinstance(correction, RolloutCorrectionConfig):
            if correction is not None and not isinstance(correction, Mapping):
                raise ValueError(f"learner.loss.rollout_correction must be a mapping or null, got {correction!r}")
            unknown = sorted(set(correction or {}) - {"level", "kind", "threshold", "lower"})
            if unknown:
                raise ValueError(f"learner.loss.rollout_correction has unknown keys {unknown}; "
                                 "known: level, kind, threshold, lower")
            self.rollout_correction = RolloutCorrectionConfig(**dict(correction or {}))
        if self.mode_pg_centring not in ("none", "route"):
            raise ValueError(f"learner.loss.mode_pg_centring must be 'none' or 'route', got {self.mode_pg_centring!r}")
        if self.mode_pg_centring == "route" and not self.mode_pg_coef > 0:
            raise ValueError("learner.loss.mode_pg_centring: route centres the mode-PG term's credit; "
                             "it needs learner.loss.mode_pg_coef > 0")
        if self.terms is not None:
            self.terms = [str(t) for t in self.terms]
        named = self.term_names()
        if not named:
            raise ValueError("learner.loss.terms is empty: name at least one policy-loss term (null: the default terms)")
        if len(set(named)) != len(named):
            raise ValueError(f"learner.loss.terms names a term twice: {named}")
        options = self.term_options or {}
        if not isinstance(options, Mapping) or not all(isinstance(v, Mapping) for v in options.values()):
            raise ValueError(f"learner.loss.term_options must map term names to settings, got {options!r}")
        names = {get_policy_loss_term(t).name for t in named}  # unknown names fail here, with the known ones
        stray = sorted(set(options) - names)
        if stray:
            raise ValueError(f"learner.loss.term_options has settings for {stray}, which are not among the terms {sorted(names)}")

    def term_names(self) -> list[str]:
        """The terms as named: ``terms``, or the ones the coefficient keys switch on."""
        return list(self.terms) if self.terms is not None else list(default_terms(self))


@dataclass
class PolicyLossInputs:
    """One micro-batch as a term sees it. Per-token tensors are ``[B, T]`` float32, aligned to
    ``token_ids`` (entry t is about token t, predicted from position t − 1; entry 0 never trains)."""

    log_probs: torch.Tensor  # log π_θ(y_t) at the sampled tokens, with gradient
    old_log_probs: torch.Tensor  # log π_old(y_t)
    advantages: torch.Tensor  # [B] or [B, T]
    mask: torch.Tensor  # 1 on the trained tokens
    entropy: torch.Tensor  # H(π_θ(· | y_<t)) at the trained tokens; with gradient only if a term needs "entropy_grad"
    ref_log_probs: torch.Tensor | None = None  # log π_ref(y_t), when a term needs "ref_log_probs"
    teacher_kl: torch.Tensor | None = None  # KL(teacher ‖ π_θ) on the teacher's top-K, when a term needs "teacher_kl"
    rollout_is_weights: torch.Tensor | None = None  # w_t of the rollout correction, when it is on (no gradient)
    batch: TrainBatch | None = None  # the micro-batch's own fields (CPU)
    step: int = 0  # the trainer step, for schedules (the teacher-KL ramp)


@dataclass
class LossTerm:
    """What a term returns for one micro-batch."""

    loss: torch.Tensor  # scalar, signed and scaled: it is added to the loss as it is (β·KL, −c_H·H)
    stats: dict[str, float] = field(default_factory=dict)  # logged as mini-batch means (weighted like the loss)
    totals: dict[str, float] = field(default_factory=dict)  # summed over the update; the term's ``summarize`` reports them


# What the learner computes for a term that asks for it (``needs``).
LEARNER_INPUTS = {
    "ref_log_probs": "the reference model's log-probs of the sampled tokens (loads a reference model)",
    "entropy_grad": "gradients through the per-token entropy (an entropy bonus)",
    "teacher_kl": "KL(teacher ‖ π_θ) per token on the teacher's top-K: the reference model run on the batch's "
                  "teacher_token_ids (loads a reference model)",
}
TEACHER_INPUT_KEYS = ("teacher_token_ids", "teacher_attention_mask", "teacher_positions")  # the learner's teacher pass reads these

# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

Normalizer = Callable[[TrainBatch, PolicyLossConfig], torch.Tensor]


def trained_units(batch: TrainBatch, config: PolicyLossConfig) -> torch.Tensor:
    """What ``config.aggregation`` averages over in ``batch``: its trained tokens (token-mean), or
    its sequences with any trained token (the seq-mean aggregations)."""
    mask = batch.loss_mask.float().clone()
    mask[:, 0] = 0  # nothing predicts the first token
    if config.aggregation == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).float().sum()


def mode_choice_tokens(batch: TrainBatch, config: PolicyLossConfig) -> torch.Tensor:
    """Σ c·m: the trained tokens where a search's retrieval mode was chosen (the ``mode_pg`` term's units)."""
    trained = batch.loss_mask.float().clone()
    trained[:, 0] = 0  # nothing predicts the first token
    return (batch.mode_choice_mask.float() * trained.gt(0).float()).sum()


def evidence_poor_trajectories(batch: TrainBatch, config: PolicyLossConfig) -> torch.Tensor:
    """|I_low|: the trajectories PathRouter's teacher KL averages over (EO < θ_P, a covered token)."""
    return teacher_kl_eligible(batch, config.evidence_threshold).sum()


@dataclass(frozen=True)
class PolicyLossTerm:
    """A registered term and what it asks of the learner."""

    name: str
    fn: Callable[..., LossTerm]
    needs: frozenset[str] = frozenset()  # keys of LEARNER_INPUTS
    batch_keys: tuple[str, ...] = ()  # TrainBatch fields the term reads
    normalizer: Normalizer = trained_units  # the units the term's value is a mean over
    summarize: Callable[[Mapping[str, float], int], dict[str, float]] | None = None  # metrics from the totals and the epoch count
    summed_over_ranks: tuple[str, ...] = ()  # metrics that add up over data-parallel ranks (others are averaged)


POLICY_LOSS_TERMS: dict[str, PolicyLossTerm] = {}


def register_policy_loss_term(
    name: str,
    *,
    needs: Sequence[str] = (),
    batch_keys: Sequence[str] = (),
    normalizer: Normalizer = trained_units,
    summarize: Callable[[Mapping[str, float], int], dict[str, float]] | None = None,
    summed_over_ranks: Sequence[str] = (),
    replace: bool = False,
):
    """Decorator: make ``fn(inputs, config, **options) -> LossTerm`` usable as ``name`` in ``learner.loss.terms``."""
    unknown = sorted(set(needs) - set(LEARNER_INPUTS))
    if unknown:
        raise ValueError(f"policy-loss term {name!r} needs {unknown}; the learner provides {sorted(LEARNER_INPUTS)}")
    unknown = sorted(set(batch_keys) - BATCH_FIELDS)
    if unknown:
        raise ValueError(f"policy-loss term {name!r} reads batch fields {unknown}; a TrainBatch has {sorted(BATCH_FIELDS)}")

    def decorate(fn: Callable[..., LossTerm]) -> Callable[..., LossTerm]:
        if name in POLICY_LOSS_TERMS and not replace:
            raise ValueError(f"policy-loss term {name!r} is already registered")
        POLICY_LOSS_TERMS[name] = PolicyLossTerm(name, fn, frozenset(needs), tuple(batch_keys), normalizer,
                                                 summarize, tuple(summed_over_ranks))
        return fn

    return decorate


def get_policy_loss_term(name: str) -> PolicyLossTerm:
    """The term registered as ``name``, or the registered function an import string ``"module:function"`` names."""
    if name in POLICY_LOSS_TERMS:
        return POLICY_LOSS_TERMS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot import policy-loss term {name!r}: {exc}") from exc
        found = [term for term in POLICY_LOSS_TERMS.values() if term.fn is fn]
        if not found:
            raise ValueError(f"{name!r} is not a registered policy-loss term (decorate it with @register_policy_loss_term)")
        return found[0]
    raise ValueError(f"unknown policy-loss term {name!r}; registered: {sorted(POLICY_LOSS_TERMS)} "
                     "(add one with @register_policy_loss_term, or name it 'package.module:function')")


def default_terms(config: PolicyLossConfig) -> tuple[str, ...]:
    """The terms the coefficient keys switch on: what ``terms: null`` means."""
    named = ["dual_clip" if config.dual_clip else "clipped_pg"]
    named += ["kl"] if config.kl_coef > 0 else []
    named += ["entropy"] if config.entropy_coef > 0 else []
    named += ["mode_entropy"] if config.mode_entropy_coef > 0 else []
    named += ["mode_pg"] if config.mode_pg_coef > 0 else []
    named += ["teacher_kl"] if config.teacher_kl else []
    return tuple(named)


def summed_over_ranks() -> tuple[str, ...]:
    """The metrics of every registered term that add up over data-parallel ranks."""
    return tuple(dict.fromkeys(k for term in POLICY_LOSS_TERMS.values() for k in term.summed_over_ranks))


# ---------------------------------------------------------------------------------------------
# composition
# ---------------------------------------------------------------------------------------------


class PolicyLoss:
    """The terms a ``PolicyLossConfig`` names, composed (module docstring).

    ``normalizers[0]`` is always ``trained_units`` (the logged entropy is averaged over them);
    ``units(batch)`` counts each normaliser's units; ``__call__`` gives one micro-batch's loss
    from its inputs and one weight per normaliser.
    """

    def __init__(self, config: PolicyLossConfig):
        self.config = config
        self.terms = [get_policy_loss_term(name) for name in config.term_names()]
        self.normalizers: list[Normalizer] = list(dict.fromkeys([trained_units, *(t.normalizer for t in self.terms)]))
        self.needs = frozenset().union(*(t.needs for t in self.terms))
        teacher_inputs = TEACHER_INPUT_KEYS if "teacher_kl" in self.needs else ()
        self.batch_keys = tuple(dict.fromkeys([*teacher_inputs, *(k for t in self.terms for k in t.batch_keys)]))
        self.options = {name: dict(settings) for name, settings in (config.term_options or {}).items()}

    def missing_batch_keys(self, batch: TrainBatch) -> dict[str, list[str]]:
        """``{term name: [fields it reads that the batch lacks (None)]}`` for every term short of a field."""
        teacher = {t.name for t in self.terms if "teacher_kl" in t.needs}
        lacking = {t.name: [k for k in (*(TEACHER_INPUT_KEYS if t.name in teacher else ()), *t.batch_keys)
                            if getattr(batch, k) is None]
                   for t in self.terms}
        return {name: keys for name, keys in lacking.items() if keys}

    def units(self, batch: TrainBatch) -> torch.Tensor:
        """``[G]`` float: each normaliser's units in ``batch``."""
        return torch.stack([torch.as_tensor(norm(batch, self.config)) for norm in self.normalizers]).float()

    def __call__(self, inputs: PolicyLossInputs, weights: Sequence[float]) -> tuple[torch.Tensor, list[dict[str, float]], dict[str, float]]:
        """``(Σ_g w_g · Σ_{term ∈ g} term, stats per group, totals)`` of one micro-batch.

        Each group's stats carry its ``loss`` (the unweighted sum); group 0's also the ``entropy``.
        """
        values: list[torch.Tensor | None] = [None] * len(self.normalizers)
        stats: list[dict[str, float]] = [{} for _ in self.normalizers]
        stats[0]["entropy"] = aggregate_loss(inputs.entropy, inputs.mask, self.config.aggregation).item()
        totals: dict[str, float] = {}
        for term in self.terms:
            out = term.fn(inputs, self.config, **self.options.get(term.name, {}))
            g = self.normalizers.index(term.normalizer)
            values[g] = out.loss if values[g] is None else values[g] + out.loss
            stats[g].update(out.stats)
            for key, value in out.totals.items():
                totals[key] = totals.get(key, 0.0) + value
        loss = None
        for g, value in enumerate(values):
            if value is not None:
                stats[g]["loss"] = value.item()
                loss = value * weights[g] if loss is None else loss + value * weights[g]
        return loss, stats, totals

    def summarize(self, totals: Mapping[str, float], epochs: int) -> dict[str, float]:
        """The update's metrics of the terms that report totals."""
        out: dict[str, float] = {}
        for term in self.terms:
            if term.summarize is not None:
                out.update(term.summarize(totals, epochs))
        return out


# ---------------------------------------------------------------------------------------------
# built-in terms
# ---------------------------------------------------------------------------------------------


def _clipped_pg(inputs: PolicyLossInputs, config: PolicyLossConfig, dual_clip: bool) -> LossTerm:
    pg, pg_stats = clipped_policy_loss(
        inputs.log_probs, inputs.old_log_probs, inputs.advantages, inputs.mask, clip_low=config.clip_low,
        clip_high=config.clip_high, aggregation=config.aggregation, token_sum_norm=config.token_sum_norm,
        dual_clip=dual_clip, clip_ratio_c=config.clip_ratio_c, token_weights=inputs.rollout_is_weights,
    )
    return LossTerm(pg, {"pg_loss": pg.item(), **{k: float(v) for k, v in pg_stats.items()}})


@register_policy_loss_term("clipped_pg")
def clipped_pg(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossTerm:
    """PPO's clipped surrogate, DAPO's (ε_low, ε_high): aggregate(max(−Âρ, −Â·clip(ρ, 1 − ε_low, 1 + ε_high))).

    Honours ``dual_clip`` too, so the key is never silently ignored.
    """
    return _clipped_pg(inputs, config, config.dual_clip)


@register_policy_loss_term("dual_clip")
def dual_clip(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossTerm:
    """The clipped surrogate with verl's dual clip: where Â < 0, L = min(L, −Â·c), c = ``clip_ratio_c``."""
    return _clipped_pg(inputs, config, True)


@register_policy_loss_term("kl", needs=("ref_log_probs",))
def kl_to_reference(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossTerm:
    """β·KL(π_θ ‖ π_ref), the GRPO loss term, with ``kl_kind``'s estimator."""
    kl = kl_loss(inputs.log_probs, inputs.ref_log_probs, inputs.mask, kind=config.kl_kind, aggregation=config.aggregation)
    return LossTerm(config.kl_coef * kl, {"kl_loss": kl.item()})  # + β·KL(π_θ ‖ π_ref)


@register_policy_loss_term("entropy", needs=("entropy_grad",))
def entropy_bonus_term(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossTerm:
    """−c_H·H: the aggregated entropy of the trained tokens as a bonus (it is logged as ``entropy`` anyway)."""
    entropy = aggregate_loss(inputs.entropy, inputs.mask, config.aggregation)
    return LossTerm(-config.entropy_coef * entropy)  # − c_H·H


def _mode_entropy_summary(totals: Mapping[str, float], epochs: int) -> dict[str, float]:
    choices = totals.get("mode_choices", 0.0)
    return {"mode_entropy": totals.get("mode_entropy_sum", 0.0) / choices if choices else float("nan"),  # per choice
            "mode_choices": choices / epochs}


@register_policy_loss_term("mode_entropy", needs=("entropy_grad",), batch_keys=("mode_choice_mask",),
                           summarize=_mode_entropy_summary)
def mode_entropy_bonus(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossTerm:
    """−c_M·H_mode: the entropy at the tokens that chose a search's retrieval mode (the batch's
    ``mode_choice_mask``), every other trained token counting 0, aggregated like the PG term.

    Logged: ``mode_entropy_term`` (H_mode) and, over the update, ``mode_entropy`` (the mean entropy
    of the choices themselves) and ``mode_choices`` (per epoch).
    """
    choice = inputs.batch.mode_choice_mask.to(inputs.mask.device, torch.float32) * inputs.mask
    mode_entropy = aggregate_loss(inputs.entropy * choice, inputs.mask, config.aggregation)  # H_mode
    return LossTerm(-config.mode_entropy_coef * mode_entropy,  # − c_M·H_mode
                    {"mode_entropy_term": mode_entropy.item()},
                    {"mode_entropy_sum": float((inputs.entropy.detach() * choice).sum()), "mode_choices": float(choice.sum())})


@register_policy_loss_term("mode_pg", batch_keys=("mode_choice_mask",), normalizer=mode_choice_tokens)
def mode_choice_pg(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossTerm:
    """k·L_mode: the main loss's clipped surrogate (same advantages, ratios, clip bounds and dual
    clip) over the trained mode-choice tokens only (``losses.mode_choice_policy_loss``)::

        L_mode = Σ_{i,t} c_{i,t}·m_{i,t}·L_{i,t} / Σ_{i,t} c_{i,t}·m_{i,t},   k = ``mode_pg_coef``

    Its normaliser is ``mode_choice_tokens``, so the learner makes it the mean over the whole
    mini-batch's mode choices, whichever micro-batch holds them. With ``mode_pg_centring: route``
    its advantages are the batch's ``mode_choice_advantages`` (centred per route). Logged: ``mode_pg_term`` (L_mode,
    unweighted) and ``mode_pg_clip_fraction``.
    """
    dual = config.dual_clip or "dual_clip" in config.term_names()  # the main term's clipping, whichever names it
    centred = inputs.batch.mode_choice_advantages
    if config.mode_pg_centring == "route" and centred is None:
        raise ValueError("learner.loss.mode_pg_centring: route needs the batch's mode_choice_advantages "
                         "(raggym.algorithms.batch.mode_choice_fields with route_centred)")
    advantages = inputs.advantages if config.mode_pg_centring == "none" else centred.to(inputs.mask.device)
    value, stats = mode_choice_policy_loss(
        inputs.log_probs, inputs.old_log_probs, advantages, inputs.mask,
        inputs.batch.mode_choice_mask.to(inputs.mask.device, inputs.log_probs.dtype), clip_low=config.clip_low,
        clip_high=config.clip_high, dual_clip=dual, clip_ratio_c=config.clip_ratio_c,
        token_weights=inputs.rollout_is_weights,
    )
    return LossTerm(config.mode_pg_coef * value,  # + k·L_mode
                    {"mode_pg_term": value.item(), "mode_pg_clip_fraction": float(stats["clip_fraction"])})


def _teacher_kl_summary(totals: Mapping[str, float], epochs: int) -> dict[str, float]:
    n = totals.get("teacher_kl_trajectories", 0.0)
    return {"teacher_kl": totals.get("teacher_kl_sum", 0.0) / n if n else 0.0,  # mean KL_i over I_low
            "teacher_kl_trajectories": n / epochs}


@register_policy_loss_term("teacher_kl", needs=("teacher_kl",),
                           batch_keys=("teacher_kl_mask", "evidence_overlap"),
                           normalizer=evidence_poor_trajectories, summarize=_teacher_kl_summary,
                           summed_over_ranks=("teacher_kl_trajectories",))
def pathrouter_teacher_kl(inputs: PolicyLossInputs, config: PolicyLossConfig) -> LossTerm:
    """PathRouter's selective teacher KL: λ(step) · mean over I_low of KL_i, KL_i the mean top-K
    KL(teacher ‖ π_θ) over trajectory i's think and query tokens, I_low the trajectories with
    EO < θ_P (``losses.selective_teacher_kl_loss``, ``losses.teacher_kl_weight``).

    Its normaliser is |I_low|, so the learner makes it the mean over the whole mini-batch's
    evidence-poor trajectories, whichever micro-batch holds them. Logged: ``teacher_loss``, and
    over the update ``teacher_kl`` (unweighted) and ``teacher_kl_trajectories`` (per epoch).
    """
    device = inputs.mask.device
    span = teacher_kl_span(inputs.batch).to(device)  # think/query tokens with a teacher counterpart
    low_eo = inputs.batch.evidence_overlap.to(device) < config.evidence_threshold  # EO < θ_P
    lam = teacher_kl_weight(inputs.step, config.teacher_max_weight, config.teacher_warmup_steps)  # λ̄·min(1, step/W)
    loss, stats = selective_teacher_kl_loss(inputs.teacher_kl, span, low_eo, lam)
    kl, n = float(stats["teacher_kl"]), float(stats["teacher_kl_trajectories"])
    return LossTerm(loss, {"teacher_loss": loss.item()}, {"teacher_kl_sum": kl * n, "teacher_kl_trajectories": n})


__all__ = [
    "LEARNER_INPUTS",
    "POLICY_LOSS_TERMS",
    "LossTerm",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "PolicyLossTerm",
    "clipped_pg",
    "default_terms",
    "dual_clip",
    "entropy_bonus_term",
    "evidence_poor_trajectories",
    "get_policy_loss_term",
    "kl_to_reference",
    "mode_choice_pg",
    "mode_choice_tokens",
    "mode_entropy_bonus",
    "pathrouter_teacher_kl",
    "register_policy_loss_term",
    "summed_over_ranks",
    "trained_units",
]
