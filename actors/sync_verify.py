"""Proof that a weight sync took effect: after the sync, the engines and the learner score one probe.

A sync can report success and change nothing. The version advances, yet the engine keeps sampling
from the weights it had: a receive that loads no tensor, an adapter that is never merged, a worker
that Ray restarted with its initial weights. Every later sample is then off the learner's policy
while the logs say it is on it. The version numbers cannot see this; only the weights can.

So after a sync ``SyncVerifier`` has the learner and every synced engine score the same fixed probe
sequence x (about 256 tokens): log p(x_t | x_<t) for t ≥ 1, at temperature 1, each with its own
forward pass (vLLM's ``prompt_logprobs``, the HF engine's model, the learner's policy). For each
engine it checks:

1. agreement: drift = mean_t |log p_engine(x_t | x_<t) − log p_learner(x_t | x_<t)| ≤ tolerance;
2. movement: with moved_L and moved_E the mean per-token change of the learner's and the engine's
   probe since that engine's last verified sync, moved_L > tolerance requires moved_E ≥ moved_L / 2.

(1) alone catches a stale engine whenever the learner moved by more than twice the tolerance; (2)
names that failure ("the engine did not move") and catches it from just above the tolerance up.
The tolerance is the design target for fp32 (1e-4 per token, 4e-6 to 1e-5 measured) and a looser
0.1 for an engine in a reduced precision (bf16 vs an fp32 learner drifts ~0.04 per token here).

A failed check raises ``WeightSyncError`` naming the worker, the version and the drift; the recipe
lets it end the run, so no step trains on samples from stale weights and the last checkpoint stays
the last good one. Each check's figures are logged (``sync/probe_*``). ``every`` spaces the checks
out (every sync by default; every N-th on a cluster, where a probe costs one short forward per
engine); a restarted worker's resync is always checked.

On Ray a checked sync carries the probe: the learner scores it in the call that publishes (or
broadcasts) the weights, each worker in the call that loads them, and the scores come back in their
answers (``actors.weight_sync.Published`` / ``Loaded``), so verifying costs no call of its own.
Nothing here imports Ray: the runtime hands in a scoring function for the baseline and for a
restarted worker's check, and the synced scores for the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

FP32_TOLERANCE = 1e-4  # the design target: mean engine-vs-learner drift per token after a sync, fp32
REDUCED_PRECISION_TOLERANCE = 0.1  # an engine in bf16/fp16 against the learner (0.039 measured on CPU)
FOLLOW_SHARE = 0.5  # an engine "followed" the learner when its probe moved at least this share as far

# The probe: ordinary prose of the kinds an agent reads and writes (instructions, a passage, a search,
# an answer), so the probe's tokens exercise the embedding rows and layers a rollout uses. Written for
# this project; any fixed text would do, as long as learner and engine score the same ids.
PROBE_TEXT = (
    "You answer questions about a small world of people, places and companies. Think first, then "
    "search a passage index or a knowledge graph when you need a fact, and finish with a short answer.\n"
    "Question: In which city was the founder of the Larkspur Ferry Company born?\n"
    "<think>The company is named in a passage; its founder is a person, and a person's birthplace "
    "is easier to reach through the graph.</think>\n<search> [graph] founder of Larkspur Ferry Company "
    "birthplace </search>\n<information>(1) Larkspur Ferry Company: a shipping firm started in 1887 by "
    "Oriane Vasquez, who ran boats across the northern bay until the bridge opened. (2) Oriane Vasquez "
    "grew up in Port Alder, a fishing town on the western coast, and moved to the capital at nineteen. "
    "(3) Port Alder lies at the mouth of the river Mere; its harbour freezes in hard winters.</information>\n"
    "<think>The second passage says where the founder grew up, which is the birthplace asked for.</think>\n"
    "<answer> Port Alder </answer>\n"
    "Question: Which university did the author of the survey on tidal mills attend, and when did it open?\n"
    "<think>I need the author first, then the university, then its opening year: three facts, so "
    "two searches at least.</think>\n<search> [passage] survey on tidal mills author </search>\n"
    "<information>(1) A Survey of Tidal Mills (1952) was written by the engineer Tomasz Heller after "
    "ten years of field work along the estuaries. (2) Heller studied at the Northgate Institute of "
    "Technology, which opened its doors in 1901 with forty students and two laboratories.</information>\n"
    "<answer> the Northgate Institute of Technology, opened in 1901 </answer>\n"
)


class WeightSyncError(RuntimeError):
    """A sync reported success but an engine does not score like the learner it was synced from."""

    def __init__(self, message: str, *, worker: int, version: int, drift: float):
        super().__init__(message)
        self.worker, self.version, self.drift = int(worker), int(version), float(drift)


def probe_token_ids(tokenizer, length: int) -> list[int]:
    """The first ``length`` token ids of ``PROBE_TEXT`` under ``tokenizer`` (no special tokens)."""
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    if length < 2:
        raise ValueError(f"a sync probe needs at least 2 tokens (1 scored), got {length}")
    if length > len(ids):
        raise ValueError(f"the sync probe has {len(ids)} tokens under this tokenizer; asked for {length}")
    return ids[:length]


def default_tolerance(engine_dtype: str | None) -> float:
    """``FP32_TOLERANCE`` for an fp32 engine (or one that names no dtype), else the reduced-precision one."""
    name = str(engine_dtype or "float32").removeprefix("torch.")
    return FP32_TOLERANCE if name in ("float32", "float", "fp32", "auto") else REDUCED_PRECISION_TOLERANCE


@dataclass(frozen=True)
class ProbeReading:
    """One engine's probe against the learner's, at one version, and how far each moved since the
    engine's reference (its last verified sync, or the start)."""

    worker: int
    version: int
    tokens: int
    drift_mean: float  # mean_t |engine − learner|
    drift_max: float
    learner_moved: float  # mean_t |learner − learner at the reference|
    engine_moved: float  # mean_t |engine − engine at the reference|

    def problem(self, tolerance: float) -> str | None:
        """Why this reading fails (``None`` when it passes); see the module docstring."""
        if self.drift_mean > tolerance:
            how = (f"its probe moved {self.engine_moved:.3g} per token since it was last verified, the learner's "
                   f"{self.learner_moved:.3g}")
            return (f"its log-probs of the probe differ from the learner's by {self.drift_mean:.3g} per token "
                    f"(mean over {self.tokens} tokens, max {self.drift_max:.3g}; tolerance {tolerance:.3g}); {how}")
        if self.learner_moved > tolerance and self.engine_moved < FOLLOW_SHARE * self.learner_moved:
            return (f"it did not follow the learner: the learner's probe moved {self.learner_moved:.3g} per token "
                    f"since this engine was last verified, the engine's only {self.engine_moved:.3g}")
        return None


def read_probe(worker: int, version: int, learner_now: torch.Tensor, engine_now: torch.Tensor,
               learner_ref: torch.Tensor, engine_ref: torch.Tensor) -> ProbeReading:
    """The figures of ``ProbeReading`` from four equal-length vectors of per-token log-probs."""
    vectors = [torch.as_tensor(v, dtype=torch.float64).flatten() for v in (learner_now, engine_now, learner_ref, engine_ref)]
    if len({v.numel() for v in vectors}) != 1 or vectors[0].numel() == 0:
        raise ValueError(f"probe log-prob vectors must be non-empty and of one length, got {[v.numel() for v in vectors]}")
    learner_now, engine_now, learner_ref, engine_ref = vectors
    gap = (engine_now - learner_now).abs()
    return ProbeReading(int(worker), int(version), int(gap.numel()), float(gap.mean()), float(gap.max()),
                        float((learner_now - learner_ref).abs().mean()), float((engine_now - engine_ref).abs().mean()))


class SyncVerifier:
    """Checks syncs against a fixed probe (module docstring).

    ``score(ids, workers) -> (learner, engines)``: the learner's current per-token log-probs of
    ``ids`` (length ``len(ids) - 1``) and one such vector per listed worker index, computed side by
    side where the runtime can. ``baseline(n)`` scores the start (learner and engines on the same
    initial weights, which it checks too). Each sync: ``next_probe()`` counts it and hands out the
    probe when it is due, and ``check_sync(version, learner, engines)`` checks the scores the sync
    brought back (``after_sync(version)`` does both, scoring with ``score``, for a sync that cannot
    carry the probe); ``verify(version, workers)`` verifies at once (a restarted worker's resync).
    """

    def __init__(self, probe_ids: Sequence[int], score: Callable, *, tolerance: float, every: int = 1):
        if every < 1:
            raise ValueError(f"verify every N-th sync needs N >= 1, got {every} (build no verifier to turn it off)")
        if not tolerance > 0:
            raise ValueError(f"the sync tolerance must be positive, got {tolerance}")
        self.probe_ids = [int(t) for t in probe_ids]
        self.score, self.tolerance, self.every = score, float(tolerance), int(every)
        self.syncs = 0
        self._start: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None
        self._refs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # worker -> (learner, engine) at its last check

    def _scores(self, workers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        learner, engines = self.score(self.probe_ids, list(workers))
        return self._vectors(learner, workers, engines)

    @staticmethod
    def _vectors(learner, workers: Sequence[int], engines: Sequence) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if len(engines) != len(workers):
            raise RuntimeError(f"asked {len(workers)} engines to score the sync probe, got {len(engines)} answers")
        as_vector = lambda v: torch.as_tensor(v, dtype=torch.float64).flatten()  # noqa: E731
        return as_vector(learner), {int(i): as_vector(e) for i, e in zip(workers, engines)}

    def baseline(self, num_workers: int, version: int = 0) -> dict[str, float]:
        """Score the start, the reference of later checks; raises if the engines already disagree."""
        t0 = time.perf_counter()
        learner, engines = self._scores(range(num_workers))
        self._start = (learner, engines)
        self._refs = {i: (learner, e) for i, e in engines.items()}
        return {**self._check(version, learner, engines), "verify_seconds": time.perf_counter() - t0}

    def restarted(self, workers: Sequence[int]) -> None:
        """Workers Ray rebuilt hold their initial weights again: measure their movement from the start."""
        if self._start is None:
            return
        learner, engines = self._start
        for i in workers:
            self._refs[int(i)] = (learner, engines[int(i)])

    def next_probe(self) -> list[int] | None:
        """Count one sync of every worker; the probe ids when this sync is to be checked (every
        ``every``-th), else ``None``. A runtime sends them with the sync, whose answers bring back
        the scores for ``check_sync``, so a checked sync costs no call of its own."""
        self.syncs += 1
        return None if self.syncs % self.every else list(self.probe_ids)

    def check_sync(self, version: int, learner, engines: Sequence) -> dict[str, float]:
        """Check the scores a sync to ``version`` brought back: the learner's vector and one per
        worker, in worker order. Returns the ``probe_*`` metrics; raises ``WeightSyncError``."""
        if self._start is None:
            raise RuntimeError("SyncVerifier.check_sync before baseline(): there is nothing to measure movement from")
        if len(engines) != len(self._refs):
            raise RuntimeError(f"a sync of {len(self._refs)} engines brought back {len(engines)} probe scores")
        learner, by_worker = self._vectors(learner, range(len(engines)), engines)
        return self._check(version, learner, by_worker)

    def after_sync(self, version: int) -> dict[str, float]:
        """``next_probe`` and, when due, ``verify`` at once: for a sync that did not carry the probe.
        Returns the ``probe_*`` metrics, or ``{}`` when this sync is not checked."""
        return {} if self.next_probe() is None else self.verify(version)

    def verify(self, version: int, workers: Sequence[int] | None = None) -> dict[str, float]:
        """Check ``workers`` (default: all) at ``version`` now."""
        if self._start is None:
            raise RuntimeError("SyncVerifier.verify before baseline(): there is nothing to measure movement from")
        t0 = time.perf_counter()
        chosen = sorted(self._refs) if workers is None else [int(i) for i in workers]
        learner, engines = self._scores(chosen)
        return {**self._check(version, learner, engines), "verify_seconds": time.perf_counter() - t0}

    def _check(self, version: int, learner: torch.Tensor, engines: dict[int, torch.Tensor]) -> dict[str, float]:
        readings = []
        for i, engine in engines.items():
            learner_ref, engine_ref = self._refs[i]
            reading = read_probe(i, version, learner, engine, learner_ref, engine_ref)
            problem = reading.problem(self.tolerance)
            if problem is not None:
                raise WeightSyncError(
                    f"weight sync to rollout worker {i} at version {version} did not take: {problem}. The run stops "
                    "here, before any step trains on samples from those weights; its last checkpoint is the last "
                    "good state (docs/runtime.md, 'Weight sync verification').",
                    worker=i, version=version, drift=reading.drift_mean)
            readings.append(reading)
            self._refs[i] = (learner, engine)
        return {"probe_drift_mean": max(r.drift_mean for r in readings),
                "probe_drift_max": max(r.drift_max for r in readings),
                "probe_learner_moved": max(r.learner_moved for r in readings),
                "probe_engine_moved": min(r.engine_moved for r in readings),
                "probe_engines": float(len(readings))}


__all__ = ["FP32_TOLERANCE", "PROBE_TEXT", "ProbeReading", "REDUCED_PRECISION_TOLERANCE",
           "SyncVerifier", "WeightSyncError", "default_tolerance", "probe_token_ids", "read_probe"]
