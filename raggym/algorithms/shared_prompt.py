"""Shared-prompt packing: run a group's common prompt through the model once per pass.

GRPO samples G continuations of one prompt. A learner pass that feeds the G sequences as G padded
rows computes the prompt G times, and on the demo's shape (about 290 prompt tokens of about 360)
that is most of the work. Causal attention makes the prompt's hidden states independent of what
follows, so they can be computed once and attended to by every continuation. ``pack_sequences``
lays a micro-batch out that way (AReaL calls it tree training):

    packed row = [shared prefix P tokens] [continuation 1] [continuation 2] … [continuation k] [pad]

with position ids ``0 … P−1`` for the prefix and ``P, P+1, …`` again for each continuation, and an
attention mask in which a prefix token sees the prefix causally and a continuation token sees the
whole prefix plus its own continuation causally (never a sibling). Every real token therefore
sees exactly the tokens, at exactly the positions, it sees in its own unpacked row, so its hidden
state, its log-probability and the gradients through it are the same (up to float rounding); the
gradient of a prefix token sums over the continuations that read it, as it would over G rows.

The same layout does two more things that save work without changing any number:

* only the positions whose next-token distribution is needed (``needed``: the trained tokens, or
  every real token for a full log-probability pass) go through the output embedding and the
  softmax (``keep``, applied to the final hidden states), instead of every prompt position;
* rows are trimmed to their own length instead of the batch's, and rows with nothing needed (the
  masked filler rows that round a batch up to the mini-batch size) are not computed at all.

Rows join a shared prefix when their longest common prefix with the group's first row is at least
``min_shared_tokens``; the group's prefix is the shortest of those common prefixes. Rows with no
partner are packed alone (plain causal rows). The packing is pure tensor bookkeeping: no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_MIN_SHARED_TOKENS = 16  # below this the saving does not pay for the custom mask


@dataclass
class PackedBatch:
    """One micro-batch laid out for a single forward pass (see the module docstring).

    ``keep`` marks the packed positions whose logits are needed; ``hidden[keep]`` takes them
    flattened in row-major order (``[K, ...]``). Entry ``e`` (of ``M``) is the original token
    ``target_index[e] = b·T + t``: its log-probability comes from kept logit ``logit_index[e]``
    (``None``: the identity, ``M == K``).
    """

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor  # [R, L] 1 on real tokens, or [R, 1, L, L] bool (True = may attend)
    keep: torch.Tensor  # [R, L] bool
    logit_index: torch.Tensor | None  # [M] long
    target_index: torch.Tensor  # [M] long, into the flattened [B, T]
    targets: torch.Tensor  # [M] long: token ids of the entries
    shape: tuple[int, int]  # (B, T) of the unpacked micro-batch
    real_tokens: int  # tokens of the rows that were packed, counted as in their own rows
    computed_tokens: int  # real positions that ran through the model (shared prefixes once)
    padded_tokens: int  # R·L − computed_tokens

    @property
    def shared(self) -> bool:
        return self.attention_mask.ndim == 4

    def model_attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask to hand to an HF model: the 2D padding mask, or the 4D mask as an additive
        float mask (0 where attending, the dtype's minimum elsewhere), which both the eager and
        the SDPA attention accept as given."""
        if not self.shared:
            return self.attention_mask
        blocked = torch.zeros(self.attention_mask.shape, dtype=dtype)
        return blocked.masked_fill_(~self.attention_mask, torch.finfo(dtype).min)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[M]`` per-entry values → ``[B, T]`` with zeros elsewhere (differentiable)."""
        b, t = self.shape
        flat = values.new_zeros(b * t).index_put((self.target_index.to(values.device),), values)
        return flat.view(b, t)

    def gather(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[B, T, …]`` → ``[M, …]``: the entries' rows of a per-token tensor."""
        b, t = self.shape
        return per_token.reshape(b * t, *per_token.shape[2:])[self.target_index.to(per_token.device)]


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def prefix_groups(rows: list[torch.Tensor], min_shared_tokens: int) -> list[tuple[list[int], int]]:
    """Greedy groups of row indices sharing a prefix, each with its prefix length.

    A row joins the group of the first earlier ungrouped row whose common prefix with it is at
    least ``min_shared_tokens``; a group's prefix is the shortest such common prefix. A row alone
    is its own group with prefix = the whole row.
    """
    groups: list[tuple[list[int], int]] = []
    taken = [False] * len(rows)
    for i, head in enumerate(rows):
        if taken[i]:
            continue
        taken[i] = True
        members, prefix = [i], head.numel()
        for j in range(i + 1, len(rows)):
            if taken[j]:
                continue
            shared = common_prefix_length(head, rows[j])
            if shared >= max(1, min_shared_tokens):
                members.append(j)
                taken[j] = True
                prefix = min(prefix, shared)
        groups.append((members, prefix))
    return groups


def shared_prompt_order(token_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A permutation of the rows that puts rows with a common prefix next to each other.

    Sorting the real tokens lexicographically does it (a shared prefix sorts together); within
    one mini-batch the order of rows does not change the update (each micro-batch's loss is
    weighted by its share of the mini-batch's normaliser), so the learner may apply it freely.
    """
    lengths = attention_mask.sum(-1).tolist()
    keys = [tuple(token_ids[i, : int(n)].tolist()) for i, n in enumerate(lengths)]
    return torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)


def _right_padded_lengths(attention_mask: torch.Tensor) -> list[int]:
    lengths = attention_mask.sum(-1).long()
    positions = torch.arange(attention_mask.shape[1])
    if not torch.equal(attention_mask.bool(), positions[None, :] < lengths[:, None]):
        raise ValueError("pack_sequences needs right-padded rows (attention mask 1…1 0…0)")
    return lengths.tolist()


def pack_sequences(
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    needed: torch.Tensor,
    share_prefix: bool = True,
    min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Lay out a right-padded ``[B, T]`` micro-batch for one forward pass (module docstring).

    ``needed[b, t]`` (bool, ``t ≥ 1``) asks for the log-probability of token ``t`` of row ``b``;
    rows with no needed token are left out (all of them left out keeps row 0, so that a backward
    pass still has a graph). With ``share_prefix=False`` every row is packed alone: the same
    numbers, trimmed rows and kept logits only.
    """
    token_ids, attention_mask = token_ids.cpu(), attention_mask.cpu()
    b, t = token_ids.shape
    lengths = _right_padded_lengths(attention_mask)
    needed = needed.cpu().bool() & attention_mask.bool()
    needed[:, 0] = False
    active = [i for i in range(b) if bool(needed[i].any())] or [0]
    rows = [token_ids[i, : lengths[i]] for i in active]
    if share_prefix:
        groups = [([active[m] for m in members], prefix) for members, prefix in prefix_groups(rows, min_shared_tokens)]
    else:
        groups = [([i], lengths[i]) for i in active]
    shared = any(len(members) > 1 for members, _ in groups)

    packed_ids, packed_pos, segments = [], [], []
    entry_row, entry_pos, entry_target = [], [], []
    for r, (members, prefix) in enumerate(groups):
        head = members[0]
        ids = [token_ids[head, :prefix]]
        pos = [torch.arange(prefix)]
        seg = [torch.zeros(prefix, dtype=torch.long)]
        offset = prefix
        for k, m in enumerate(members):
            tail = lengths[m] - prefix
            ids.append(token_ids[m, prefix : lengths[m]])
            pos.append(torch.arange(prefix, lengths[m]))
            seg.append(torch.full((tail,), k + 1, dtype=torch.long))
            # token t is predicted at original position t − 1: in the prefix, or in m's tail
            ts = needed[m].nonzero().squeeze(-1)
            src = ts - 1
            entry_pos.append(torch.where(src < prefix, src, offset + src - prefix))
            entry_row.append(torch.full_like(ts, r))
            entry_target.append(m * t + ts)
            offset += tail
        packed_ids.append(torch.cat(ids))
        packed_pos.append(torch.cat(pos))
        segments.append(torch.cat(seg))

    width = max(x.numel() for x in packed_ids)
    n_rows = len(groups)
    input_ids = torch.full((n_rows, width), int(pad_token_id), dtype=torch.long)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    segment = torch.full((n_rows, width), -1, dtype=torch.long)  # −1: padding
    for r, (ids, pos, seg) in enumerate(zip(packed_ids, packed_pos, segments)):
        input_ids[r, : ids.numel()], position_ids[r, : pos.numel()], segment[r, : seg.numel()] = ids, pos, seg
    real = segment >= 0
    if shared:
        idx = torch.arange(width)
        causal = idx[None, :] <= idx[:, None]  # [q, k]
        same = (segment[:, None, :] == segment[:, :, None]) | (segment[:, None, :] == 0)  # own segment or the prefix
        mask = causal[None] & same & real[:, None, :] & real[:, :, None]
        mask |= torch.eye(width, dtype=torch.bool)[None] & ~real[:, :, None]  # padding sees itself: no empty row
        attention = mask[:, None]
    else:
        attention = real.long()

    rows_e, pos_e, target_e = torch.cat(entry_row), torch.cat(entry_pos), torch.cat(entry_target)
    order = torch.argsort(rows_e * width + pos_e, stable=True)  # HF returns kept logits row-major
    rows_e, pos_e, target_e = rows_e[order], pos_e[order], target_e[order]
    keep = torch.zeros((n_rows, width), dtype=torch.bool)
    keep[rows_e, pos_e] = True
    rank = keep.flatten().long().cumsum(0) - 1
    logit_index = rank[rows_e * width + pos_e]
    if logit_index.numel() == int(keep.sum()):
        logit_index = None  # one entry per kept position, in order
    computed = int(real.sum())
    return PackedBatch(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention, keep=keep,
        logit_index=logit_index, target_index=target_e, targets=token_ids.flatten()[target_e], shape=(b, t),
        real_tokens=sum(lengths[i] for i in active), computed_tokens=computed,
        padded_tokens=n_rows * width - computed,
    )


def entry_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[M]`` log-softmax of ``logits / temperature`` (``[M, V]``) at ``targets``, in float32."""
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets.to(scaled.device).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


__all__ = [
    "DEFAULT_MIN_SHARED_TOKENS",
    "PackedBatch",
    "common_prefix_length",
    "entry_logprobs",
    "pack_sequences",
    "prefix_groups",
    "shared_prompt_order",
]
