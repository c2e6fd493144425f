"""The training prompt sampler: shuffled passes over the questions, resumable from a checkpoint."""

from __future__ import annotations

import numpy as np


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
        if state["n"] != self.n:
            raise ValueError(f"checkpoint sampler covers {state['n']} questions, this run has {self.n}")
        self.order = np.asarray(state["order"], dtype=np.int64)
        self.cursor, self.epoch = int(state["cursor"]), int(state["epoch"])
        self.rng.bit_generator.state = state["rng"]
