"""Training metrics: one JSON line per step plus TensorBoard scalars, and sample trajectories."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboardX import SummaryWriter

from raggym.atomic import atomic_write_text

# The per-step JSONL files a run appends to; a resumed run rewinds them to its checkpoint.
STEP_LOGS = ("metrics.jsonl", "samples.jsonl", "eval.jsonl")


class MetricsLogger:
    """``metrics.jsonl`` (every step), ``samples.jsonl`` (a few decoded episodes per step) and
    TensorBoard event files under ``tb/``."""

    def __init__(self, out_dir: str | Path, samples_per_step: int = 2):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.metrics = (self.out / "metrics.jsonl").open("a", encoding="utf-8")
        self.samples = (self.out / "samples.jsonl").open("a", encoding="utf-8")
        self.samples_per_step = samples_per_step
        self.tb = SummaryWriter(str(self.out / "tb"))

    def rewind(self, step: int) -> int:
        """Drop the lines logged after ``step`` (a run killed after logging a step but before its
        checkpoint logs that step again when it resumes); returns how many lines were dropped."""
        self.metrics.close()
        self.samples.close()
        dropped = 0
        for name in STEP_LOGS:
            path = self.out / name
            if not path.exists():
                continue
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for line in lines if not line.strip() or int(json.loads(line).get("step", 0)) <= step]
            if len(kept) != len(lines):
                dropped += len(lines) - len(kept)
                atomic_write_text(path, "".join(kept))
        self.metrics = (self.out / "metrics.jsonl").open("a", encoding="utf-8")
        self.samples = (self.out / "samples.jsonl").open("a", encoding="utf-8")
        return dropped

    def log(self, record: dict, trajectories=(), rewards=(), advantages=()) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        step = int(record.get("step", 0))
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self.tb.add_scalar(key, value, step)
        self.tb.flush()
        for t, r, a in list(zip(trajectories, rewards, advantages))[: self.samples_per_step]:
            ep = t.get("episode", {})
            self.samples.write(json.dumps({"step": step, "question": ep.get("question"), "answer": ep.get("answer"),
                                           "turns": [x.get("text") for x in t.get("turns", [])],
                                           "reward": r, "advantage": a}) + "\n")
        self.samples.flush()

    def close(self) -> None:
        self.metrics.close()
        self.samples.close()
        self.tb.close()
