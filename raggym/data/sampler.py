"""The training prompt samplers: shuffled passes over the questions, resumable from a checkpoint.

``PromptSampler`` draws batches from one shuffled pass over all questions after another.
``BalancedPromptSampler`` (``data.balance_by``, a trainer option off by default) gives each value
of a question attribute (``kind``: RouteRAG's routing task has ``direct`` and ``graph_only``) an
equal share of every batch: with V values and batches of P prompts, each value gets ⌊P / V⌋
prompts, and the P mod V leftover slots go to the values in turn, so no value gets more than one
prompt more than another in a batch or in any run of batches. Each value's questions are drawn in
shuffled passes of their own. Random batches instead carry whatever mix they draw (3 to 13
``graph_only`` prompts of 16 in issue #42's run), and the mix moves what the batch teaches.

Both are deterministic given the seed; ``state_dict`` / ``load_state_dict`` round-trip through
JSON, so a resumed run draws the batches an uninterrupted one draws.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

# The question attributes (``raggym.data.Question`` fields) a batch can be balanced by: one value
# per question, from a few values.
BALANCE_ATTRIBUTES = ("kind", "hops")


class PromptSampler:
    """Shuffled passes over the training questions; its cursor and RNG state are checkpointed."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise ValueError("no training questions")
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n)
        self.cursor = 0
        self.epoch = 0

    def next_batch(self, size: int) -> list[int]:
        out = []
        while len(out) < size:
            if self.cursor == self.n:
                self.order, self.cursor, self.epoch = self.rng.permutation(self.n), 0, self.epoch + 1
            out.append(int(self.order[self.cursor]))
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"n": self.n, "order": self.order.tolist(), "cursor": self.cursor, "epoch": self.epoch,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if state.get("balance_by") is not None:
            raise ValueError(f"the checkpoint's sampler balanced its batches by {state['balance_by']!r}; "
                             f"this run has data.balance_by off (set data.balance_by={state['balance_by']} to resume it)")
        if state["n"] != self.n:
            raise ValueError(f"checkpoint sampler covers {state['n']} questions, this run has {self.n}")
        self.order = np.asarray(state["order"], dtype=np.int64)
        self.cursor, self.epoch = int(state["cursor"]), int(state["epoch"])
        self.rng.bit_generator.state = state["rng"]


class BalancedPromptSampler:
    """Batches with an equal count of each value of one question attribute (module docstring).

    ``values[i]`` is question i's value of ``attribute``; every question needs one. Values are
    ordered by their text, so the draw does not depend on the order they first appear in.
    """

    def __init__(self, values: Sequence[Hashable], seed: int, attribute: str = "kind"):
        if not len(values):
            raise ValueError("no training questions")
        lacking = [i for i, v in enumerate(values) if v is None]
        if lacking:
            raise ValueError(f"{len(lacking)} of {len(values)} training questions have no {attribute!r} "
                             f"(the first: question {lacking[0]}); data.balance_by={attribute} needs it on every question")
        self.attribute, self.n = attribute, len(values)
        self.values = sorted(set(values), key=str)
        self.members = [np.asarray([i for i, v in enumerate(values) if v == value], dtype=np.int64) for value in self.values]
        self.rng = np.random.default_rng(seed)
        self.orders = [self.rng.permutation(len(m)) for m in self.members]  # each value's current pass
        self.cursors = [0] * len(self.values)
        self.epochs = [0] * len(self.values)
        self.turn = 0  # the value that gets the next batch's first leftover slot

    def counts(self, size: int) -> list[int]:
        """How many prompts of each value (in ``self.values`` order) the next batch of ``size`` holds."""
        groups = len(self.values)
        base, leftover = divmod(size, groups)
        return [base + int((g - self.turn) % groups < leftover) for g in range(groups)]

    def next_batch(self, size: int) -> list[int]:
        counts = self.counts(size)
        self.turn = (self.turn + size % len(self.values)) % len(self.values)
        drawn = [[self._next_of(g) for _ in range(count)] for g, count in enumerate(counts)]
        # interleaved (one of each value in turn), so that no stretch of the batch holds one value only
        return [group[j] for j in range(max(counts)) for group in drawn if j < len(group)]

    def _next_of(self, g: int) -> int:
        """The next question of value ``g``'s current pass (a new shuffled pass once it is done)."""
        if self.cursors[g] == len(self.members[g]):
            self.orders[g], self.cursors[g] = self.rng.permutation(len(self.members[g])), 0
            self.epochs[g] += 1
        self.cursors[g] += 1
        return int(self.members[g][self.orders[g][self.cursors[g] - 1]])

    def state_dict(self) -> dict:
        return {"balance_by": self.attribute, "n": self.n, "values": [str(v) for v in self.values],
                "group_sizes": [len(m) for m in self.members], "orders": [o.tolist() for o in self.orders],
                "cursors": list(self.cursors), "epochs": list(self.epochs), "turn": self.turn,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        """Resume the draw. A ``PromptSampler``'s state (a run that turns balancing on when it
        resumes, e.g. for RouteRAG's stage 2 from a stage-1 checkpoint) leaves this sampler where its
        seed put it: its balanced passes start afresh, the same way in every such run."""
        if state["n"] != self.n:
            raise ValueError(f"checkpoint sampler covers {state['n']} questions, this run has {self.n}")
        if state.get("balance_by") is None:
            return
        mine = {"balance_by": self.attribute, "values": [str(v) for v in self.values],
                "group_sizes": [len(m) for m in self.members]}
        theirs = {key: state.get(key) for key in mine}
        if theirs != mine:
            raise ValueError(f"the checkpoint's sampler balanced {theirs}, this run balances {mine}")
        self.orders = [np.asarray(o, dtype=np.int64) for o in state["orders"]]
        self.cursors, self.epochs = [int(c) for c in state["cursors"]], [int(e) for e in state["epochs"]]
        self.turn = int(state["turn"])
        self.rng.bit_generator.state = state["rng"]


def make_prompt_sampler(questions: Sequence, seed: int, balance_by: str | None = None):
    """The run's sampler over ``questions`` (``raggym.data.Question``): balanced by the attribute
    ``balance_by`` names (one of ``BALANCE_ATTRIBUTES``), or plain shuffled passes when it is None."""
    if balance_by is None:
        return PromptSampler(len(questions), seed)
    if balance_by not in BALANCE_ATTRIBUTES:
        raise ValueError(f"data.balance_by: unknown question attribute {balance_by!r}; one of {BALANCE_ATTRIBUTES}")
    return BalancedPromptSampler([getattr(q, balance_by) for q in questions], seed, balance_by)


__all__ = ["BALANCE_ATTRIBUTES", "BalancedPromptSampler", "PromptSampler", "make_prompt_sampler"]
