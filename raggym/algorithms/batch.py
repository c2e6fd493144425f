"""From ``Rollout`` records to the learner's ``TrainBatch``: padding, filler rows, teacher inputs.

Pure functions of token lists and tensors (no model, no Ray, no tokenizer). What the batch needs
beyond the tokens (where the model chose a retrieval mode, PathRouter's teacher prompt) the
rollout recorded when it happened (``raggym.trajectory``); nothing here decodes the model's
output again. ``TrainBatch`` itself describes the batch format, field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np
import torch

from raggym.algorithms.spans import teacher_kl_mask_from_labels

REQUIRED_FIELDS = ("token_ids", "attention_mask", "loss_mask", "advantages")
PER_TOKEN_FIELDS = ("attention_mask", "loss_mask", "sampled_logprobs", "old_logprobs", "ref_logprobs", "mode_choice_mask",
                    "mode_choice_advantages", "rollout_is_weights",
                    "teacher_positions", "teacher_kl_mask", "teacher_topk_values", "teacher_topk_indices")  # [N, T, ...]
# What a loss term or a count reads of a row: zero in a filler row, so that it adds nothing.
FILLER_ZEROED = ("loss_mask", "advantages", "teacher_kl_mask", "mode_choice_mask", "mode_choice_advantages")


@dataclass(eq=False)  # compared field by field, tensors would make == ambiguous
class TrainBatch:
    """The learner's batch: ``N`` trajectories, right-padded to one length ``T``.

    Every per-token field is aligned to ``token_ids``: entry ``t`` is about token ``t``, predicted
    from the logits at ``t − 1``; position 0 is never trained. The optional fields are ``None``
    when absent; the learner fills in ``old_logprobs``, ``ref_logprobs`` and the teacher's top-K
    when a loss term needs them. ``make_train_batch`` builds one from Python lists; construction
    checks that every field has the ``N`` rows (and per-token fields the ``T`` columns) of
    ``token_ids`` and names the one that does not.
    """

    token_ids: torch.Tensor  # [N, T] long: prompt + response (+ observations) of each trajectory
    attention_mask: torch.Tensor  # [N, T] 1 on real tokens
    loss_mask: torch.Tensor  # [N, T] 1 on tokens the policy generated and is trained on
    advantages: torch.Tensor  # [N] per sequence or [N, T] per token
    # [N, T] the rollout engine's logprobs of the sampled tokens: compared with the learner's own
    # (logged drift) and, with old_logprobs="rollout", π_old after the first optimizer step
    sampled_logprobs: torch.Tensor | None = None
    # [N, T] log π_old(token_t | tokens_<t); default: the current weights' values before the first
    # update, from a separate pass or the first mini-batch's own forward (``actors.learner.old_logprobs``;
    # the on-policy ratio is exactly 1 on the first mini-batch)
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # [N, T] the reference model's, computed when a term needs it (KL)
    # [N, T] the rollout correction's importance weights of the PG loss (no gradient; 1 where none),
    # set by the learner when learner.loss.rollout_correction is on (raggym.algorithms.rollout_correction)
    rollout_is_weights: torch.Tensor | None = None
    # the mode entropy bonus (only with the mode_entropy term):
    mode_choice_mask: torch.Tensor | None = None  # [N, T] 1 on the tokens that chose a search's retrieval mode
    # [N, T] the mode-PG term's advantages at those tokens when they differ from ``advantages``
    # (learner.loss.mode_pg_centring: route, ``route_centred_mode_advantages``); None: ``advantages``
    mode_choice_advantages: torch.Tensor | None = None
    # PathRouter's teacher KL (only with the teacher_kl term):
    teacher_token_ids: torch.Tensor | None = None  # [N, T'] long: the prompt with gold evidence + the same trajectory
    teacher_attention_mask: torch.Tensor | None = None  # [N, T']
    teacher_positions: torch.Tensor | None = None  # [N, T] long: index in the teacher sequence of token t, or −1
    teacher_kl_mask: torch.Tensor | None = None  # [N, T] 1 on think and query tokens (spans.teacher_kl_mask_from_labels)
    evidence_overlap: torch.Tensor | None = None  # [N] EO of each trajectory
    teacher_topk_values: torch.Tensor | None = None  # [N, T, K] the teacher's top-K logits (the learner's teacher pass)
    teacher_topk_indices: torch.Tensor | None = None  # [N, T, K] long: their vocabulary indices

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in REQUIRED_FIELDS:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"TrainBatch.{f.name} must be a tensor, got {type(value).__name__}")
        if self.token_ids.dim() != 2:
            raise ValueError(f"TrainBatch.token_ids must be [N, T], got shape {tuple(self.token_ids.shape)}")
        n, t = self.token_ids.shape
        for name, value in self.tensors().items():
            if value.shape[0] != n:
                raise ValueError(f"TrainBatch.{name} has {value.shape[0]} rows, token_ids {n}")
            per_token = name in PER_TOKEN_FIELDS or (name == "advantages" and value.dim() > 1)
            if per_token and (value.dim() < 2 or value.shape[1] != t):
                raise ValueError(f"TrainBatch.{name} has shape {tuple(value.shape)}; token_ids is [{n}, {t}]")

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{field name: tensor}`` of the fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def rows(self, index: torch.Tensor | slice) -> TrainBatch:
        """The same fields, of the rows ``index`` selects (unset fields stay unset)."""
        return TrainBatch(**{name: value[index] for name, value in self.tensors().items()})

    def with_filler_rows(self, count: int) -> TrainBatch:
        """The batch and ``count`` copies of row 0 that train nothing (``FILLER_ZEROED`` zeroed)."""
        if not count:
            return self
        grown = {name: torch.cat([v, v[:1].expand(count, *v.shape[1:]).clone()]) for name, v in self.tensors().items()}
        for name in FILLER_ZEROED:
            if name in grown:
                grown[name][self.num_rows :] = 0
        return TrainBatch(**grown)


BATCH_FIELDS = frozenset(f.name for f in fields(TrainBatch))
BatchFields = dict[str, torch.Tensor]  # TrainBatch field name -> tensor, set with ``dataclasses.replace``


def _pad_rows(rows: Sequence[Sequence[float]], n: int, width: int, dtype) -> torch.Tensor:
    out = torch.zeros((n, width), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(list(row), dtype=dtype)
    return out


def make_train_batch(
    token_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    advantages: torch.Tensor | Sequence[float] | Sequence[Sequence[float]],
    old_logprobs: Sequence[Sequence[float]] | None = None,
    pad_token_id: int = 0,
    sampled_logprobs: Sequence[Sequence[float]] | None = None,
) -> TrainBatch:
    """Right-pad Python lists into a ``TrainBatch`` (token-level advantages are padded with 0)."""
    n = len(token_ids)
    optional = {"old_logprobs": old_logprobs, "sampled_logprobs": sampled_logprobs}
    if not (len(loss_masks) == len(advantages) == n) or any(v is not None and len(v) != n for v in optional.values()):
        raise ValueError("token_ids, loss_masks, advantages (and logprobs) need one entry per sequence")
    width = max(len(t) for t in token_ids)
    ids = torch.full((n, width), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, (t, m) in enumerate(zip(token_ids, loss_masks)):
        if len(m) != len(t):
            raise ValueError(f"sequence {i}: {len(t)} tokens but {len(m)} loss-mask entries")
        ids[i, : len(t)] = torch.tensor(list(t), dtype=torch.long)
        attn[i, : len(t)] = 1
    if isinstance(advantages, torch.Tensor) and advantages.dim() == 1:  # one per sequence, as estimated
        adv = advantages.detach().to(torch.float32).clone()
    elif len(advantages) and isinstance(advantages[0], (list, tuple)):
        adv = _pad_rows(advantages, n, width, torch.float32)
    else:
        adv = torch.tensor([float(a) for a in advantages], dtype=torch.float32)
    padded = {key: _pad_rows(rows, n, width, torch.float32) for key, rows in optional.items() if rows is not None}
    return TrainBatch(ids, attn, _pad_rows(loss_masks, n, width, torch.float32), adv, **padded)


def assemble_batch(rollouts: Sequence, advantages: torch.Tensor | Sequence[float], pad_token_id: int, multiple: int,
                   extra: BatchFields | None = None) -> tuple[TrainBatch, int]:
    """A ``TrainBatch`` of ``rollouts`` padded with masked-out filler rows to a multiple of the
    mini-batch size; returns ``(batch, number of filler rows)``.

    ``extra`` sets further fields (``mode_choice_fields``, ``teacher_fields``). The rollouts'
    sampled logprobs travel along, so the learner can log their drift from its own. A filler row
    (a copy of row 0 with loss mask, advantage, teacher and mode-choice masks zeroed) adds nothing
    to any loss term or to the token/sequence counts the aggregation divides by, so the update
    equals one on the real rows; it only lets any number of sequences split into mini-batches
    (Step-GRPO's per-step sequences, DAPO's filtered groups).
    """
    batch = make_train_batch([r.token_ids for r in rollouts], [r.loss_mask for r in rollouts], advantages,
                             pad_token_id=pad_token_id, sampled_logprobs=[r.sampled_logprobs for r in rollouts])
    batch = replace(batch, **(extra or {}))  # an unknown field name raises here
    pad = (-len(rollouts)) % max(1, multiple)
    return batch.with_filler_rows(pad), pad


def mode_choice_mask(rollout) -> list[float]:
    """1.0 on each token where the model chose a search's retrieval mode, 0.0 elsewhere.

    The positions are the rollout's ``mode_choice_positions``, recorded turn by turn from the
    dialect's ``mode_slot`` (RouteRAG's marks the ``graph`` of ``<search> [graph]``) in the text
    the model wrote; the prompt and the observations are never marked.
    """
    mask = [0.0] * len(rollout.token_ids)
    for position in rollout.mode_choice_positions:
        mask[position] = 1.0
    return mask


def mode_choice_fields(rollouts: Sequence, route_centred: torch.Tensor | None = None) -> BatchFields:
    """``{"mode_choice_mask": [N, T]}`` for the learner's mode-choice terms (``mode_choice_mask``
    per rollout, right-padded like the other per-token fields). With ``route_centred`` (the
    rollouts' advantages ``[N]``), also ``mode_choice_advantages``: those advantages centred per
    route over the batch (``route_centred_mode_advantages``)."""
    rows = [mode_choice_mask(r) for r in rollouts]
    mask = _pad_rows(rows, len(rows), max(len(r.token_ids) for r in rollouts), torch.float32)
    if route_centred is None:
        return {"mode_choice_mask": mask}
    ids = _pad_rows([list(r.token_ids) for r in rollouts], len(rows), mask.shape[1], torch.long)
    return {"mode_choice_mask": mask, "mode_choice_advantages": route_centred_mode_advantages(route_centred, ids, mask)}


def route_centred_mode_advantages(advantages: torch.Tensor, token_ids: torch.Tensor,
                                  mode_choice_mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]``: at each mode choice, its sequence's advantage minus the mean advantage of every
    choice in the batch that chose the same route (the same token), 0 elsewhere::

        Ã_{i,t} = Â_i − mean{Â_j : choice (j, s) picked token y_{i,t}}

    For each route the centred credits sum to 0 over the batch, so a shift of the mode logits
    shared by every question gets no first-order credit from the slot term when the slot's state
    is the same for all questions (issue #64, sitting 7: cosine 0.9992 between the two types'
    states); what remains is how a route's credit differs between questions. A route chosen once
    gets 0."""
    chosen = mode_choice_mask.bool()
    per_token = advantages.float()[:, None].expand(chosen.shape) if advantages.dim() == 1 else advantages.float()
    centred = torch.zeros(chosen.shape, dtype=torch.float32)
    for route in token_ids[chosen].unique():
        picked = chosen & (token_ids == route)
        centred[picked] = per_token[picked] - per_token[picked].mean()
    return centred


def teacher_fields(rollouts: Sequence, pad_token_id: int) -> BatchFields:
    """PathRouter's teacher inputs: the same trajectory behind a prompt that shows the gold evidence.

    The teacher prompt is each rollout's recorded ``teacher_prompt_ids`` (the episode's prompt
    with the gold passages appended, ``raggym.trajectory.teacher_prompt_ids``); the response tokens
    are the student's, so student token ``t ≥ prompt_length`` is teacher token
    ``len(teacher prompt) + t − prompt_length``. ``evidence_overlap`` is read from each rollout's
    outcome (computed once there).
    """
    missing = [f"{r.prompt_id}/{r.sample_index}" for r in rollouts if r.teacher_prompt_ids is None]
    if missing:
        raise ValueError(f"{len(missing)} rollouts (the first: {missing[0]}) recorded no teacher prompt; roll out "
                         "with RolloutConfig.teacher_evidence_tokens set (the trainer sets it when "
                         "learner.loss.teacher_kl is on)")
    rows, positions, masks = [], [], []
    for r in rollouts:
        prompt = list(r.teacher_prompt_ids)
        p = int(r.prompt_length)
        response = list(r.token_ids[p:])
        rows.append(prompt + response)
        positions.append([-1] * p + [len(prompt) + i for i in range(len(response))])
        masks.append(np.asarray(teacher_kl_mask_from_labels(r.span_labels), dtype=np.float32))
    n, width, student = len(rows), max(len(r) for r in rows), max(len(r.token_ids) for r in rollouts)
    ids = torch.full((n, width), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    pos = torch.full((n, student), -1, dtype=torch.long)
    for i, (row, p) in enumerate(zip(rows, positions)):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        pos[i, : len(p)] = torch.tensor(p)
    return {"teacher_token_ids": ids, "teacher_attention_mask": attn, "teacher_positions": pos,
            "teacher_kl_mask": _pad_rows(masks, n, student, torch.float32),
            "evidence_overlap": torch.tensor([r.outcome.evidence_overlap for r in rollouts], dtype=torch.float32)}


def teacher_kl_span(batch: TrainBatch) -> torch.Tensor:
    """``[N, T]`` float: positions PathRouter's teacher KL covers (think/query tokens that are
    trained and have a teacher counterpart)."""
    trained = batch.loss_mask.float().clone()
    trained[:, 0] = 0  # nothing predicts the first token
    return batch.teacher_kl_mask.float() * (batch.teacher_positions > 0).float() * trained.gt(0).float()


def teacher_kl_eligible(batch: TrainBatch, evidence_threshold: float) -> torch.Tensor:
    """``[N]`` float: 1 for the trajectories in PathRouter's teacher-KL mean (EO < θ_P and at least
    one covered position), the set ``I_low`` the mean is normalised by."""
    low = batch.evidence_overlap.float() < evidence_threshold  # EO < θ_P
    return (low & (teacher_kl_span(batch).sum(-1) > 0)).float()
