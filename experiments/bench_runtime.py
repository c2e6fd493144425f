"""Runtime benchmarks (JSON): the rollout loops against plain generate, Ray retrieval vs in-process.

    python -m experiments.bench_runtime --json [--threads 1] [--repeats 3] [--skip-retrieval]

1. One demo-sized RL step's rollout (``experiments/configs/demo_grpo.yaml``: 4 questions x G = 4,
   RouteRAG dialect, top-2, retrieval budget 2, 160 response tokens, 64 per turn, 64 per
   observation), on one in-process HF engine (SmolLM2-135M) and the in-process retriever, run
   side by side with both loops of ``envs.rollout``:

   - ``waves``: two waves, each a blocking ``generate`` over its episodes per turn (every turn
     prefills the whole context again);
   - ``async``: one coroutine per episode over the engine's sessions (``generate_async``: turns
     prefill only their new tokens; requests are batched continuously).

   Each figure is model tokens per wall-clock second of the whole rollout (generation, retrieval
   and environment steps); ``cpu_time`` repeats the ratios per CPU-second of this process, which
   other jobs on a shared machine disturb less. ``async_over_waves`` is the async loop's figure over the wave loop's;
   the two runs alternate when ``--repeats`` > 1, and the sums are compared.
2. ``rollout_over_generate``: the async loop's tokens/s over plain single-turn ``generate`` of the
   same episodes' prompts, with EOS switched off and ``max_new_tokens`` = the rollout's mean model
   tokens per episode, so both produce the same number of tokens. With ``--repeats`` > 1 a plain
   run follows each repeat's loops and the figures are pooled (sums of tokens over sums of
   seconds), so a drift of the machine's speed during the run weighs on both sides;
   ``rollout_over_generate_per_repeat`` lists each repeat's own ratio.
3. Ray retrieval service throughput over the in-process ``Retriever`` (the same index, shards and
   mode) at batch 32 and 64.

``--json`` prints one JSON object; without it, one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


class CountingBackend:
    """The local rollout backend, counting generated tokens and the seconds spent in retrieval."""

    def __init__(self, inner):
        self.inner = inner
        self.generated_tokens = 0
        self.generate_calls = 0
        self.retrieval_seconds = 0.0

    def submit_generate(self, *a):
        fut = self.inner.submit_generate(*a)
        self.generate_calls += 1
        self.generated_tokens += sum(len(r.token_ids) for r in self.inner.get(fut))
        return fut

    def submit_retrieve(self, requests):
        t = time.perf_counter()
        out = self.inner.submit_retrieve(requests)
        self.retrieval_seconds += time.perf_counter() - t
        return out

    def wait_one(self, futures):
        return self.inner.wait_one(futures)

    def get(self, fut):
        return self.inner.get(fut)


DEMO_ROLLOUT = dict(max_response_tokens=160, max_turn_tokens=64, max_observation_tokens=64, waves=2)
DEMO_ENV = dict(dialect="routerag", top_k=2, retrieval_budget=2, max_observation_chars=400)


class TimedRetrieval:
    """The local backend of the async loop, adding up the seconds its retrieval batches take."""

    def __init__(self, inner):
        self.inner = inner
        self.retrieval_seconds = 0.0
        self.serial_retrieval = inner.serial_retrieval

    async def generate(self, *args):
        return await self.inner.generate(*args)

    def end_session(self, session_id):
        self.inner.end_session(session_id)

    async def retrieve(self, requests):
        t = time.perf_counter()
        try:
            return await self.inner.retrieve(requests)
        finally:
            self.retrieval_seconds += time.perf_counter() - t


def _run_loop(loop: str, engine, retriever, questions, group_size: int, seed: int) -> dict:
    from actors.engines.base import SamplingParams
    from envs import RagSearchEnv
    from envs.rollout import EpisodeRequest, LocalBackend, MultiTurnRollout, RolloutConfig

    requests = [EpisodeRequest(q, f"0:{q.id}", g) for q in questions for g in range(group_size)]
    envs = [RagSearchEnv(retriever, questions, **DEMO_ENV) for _ in requests]
    local = LocalBackend(engine)
    backend = CountingBackend(local) if loop == "waves" else TimedRetrieval(local)
    rollout = MultiTurnRollout(backend, engine.tokenizer, SamplingParams(temperature=1.0, seed=seed),
                               RolloutConfig(loop=loop, **DEMO_ROLLOUT))
    t, cpu = time.perf_counter(), time.process_time()
    trajs = rollout.run(envs, requests)
    seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    tokens = sum(r.response_length for r in trajs)
    return {"loop": loop, "episodes": len(requests), "model_tokens": tokens, "seconds": round(seconds, 3),
            "cpu_seconds": round(cpu_seconds, 3),
            "tok_s": round(tokens / seconds, 2), "retrieval_seconds": round(backend.retrieval_seconds, 3),
            "turns_mean": round(sum(len(r.turns) for r in trajs) / len(trajs), 2),
            "searches": sum(r.episode.get("num_retrievals", 0) for r in trajs),
            "prompts": [list(r.token_ids[: r.prompt_length]) for r in trajs]}


def _plain_generate(engine, async_run: dict, seed: int) -> dict:
    """Plain generate of an async run's prompts, as many tokens per prompt as that run's mean."""
    from actors.engines.base import SamplingParams

    prompts = async_run["prompts"]
    per_prompt = max(1, round(async_run["model_tokens"] / len(prompts)))
    eos, engine.eos_token_ids = engine.eos_token_ids, set()  # run every prompt to max_new_tokens
    try:
        t, cpu = time.perf_counter(), time.process_time()
        plain = engine.generate(prompts, SamplingParams(temperature=1.0, seed=seed), (), per_prompt)
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    finally:
        engine.eos_token_ids = eos
    return {"tokens": sum(len(r.token_ids) for r in plain), "seconds": seconds, "cpu_seconds": cpu_seconds}


def bench_rollout(world, retriever, *, model: str = "smollm2-135m", questions: int = 4, group_size: int = 4,
                  threads: int = 1, repeats: int = 1, seed: int = 1) -> dict:
    """The async and wave loops side by side on one demo-sized step, and plain generate (see above)."""
    import torch

    from actors.engines.hf import HFEngine

    torch.set_num_threads(threads)
    engine = HFEngine(model, num_threads=threads)
    qs = world.questions[:questions]
    _run_loop("async", engine, retriever, qs[:1], 1, seed + 999)  # warm-up: first-call costs of both paths
    _run_loop("waves", engine, retriever, qs[:1], 1, seed + 999)
    runs: dict[str, list[dict]] = {"async": [], "waves": []}
    plains: list[dict] = []
    for r in range(repeats):
        for loop in (("async", "waves") if r % 2 == 0 else ("waves", "async")):
            runs[loop].append(_run_loop(loop, engine, retriever, qs, group_size, seed + r))
        plains.append(_plain_generate(engine, runs["async"][-1], seed + r))
    tok_s = {loop: sum(x["model_tokens"] for x in rs) / sum(x["seconds"] for x in rs) for loop, rs in runs.items()}
    tok_cpu_s = {loop: sum(x["model_tokens"] for x in rs) / sum(x["cpu_seconds"] for x in rs) for loop, rs in runs.items()}
    plain_tokens = sum(x["tokens"] for x in plains)
    plain_seconds, plain_cpu_seconds = sum(x["seconds"] for x in plains), sum(x["cpu_seconds"] for x in plains)
    plain_tok_s, plain_tok_cpu_s = plain_tokens / plain_seconds, plain_tokens / plain_cpu_seconds
    stats = engine.session_stats() if hasattr(engine, "session_stats") else {}
    engine_close = getattr(engine, "close", None)
    if engine_close is not None:
        engine_close()
    for rs in runs.values():
        for x in rs:
            x.pop("prompts")
    return {"bench": "rollout_loops", "model": model, "threads": threads, "episodes": questions * group_size,
            "rollout": DEMO_ROLLOUT, "env": DEMO_ENV, "runs": runs, "session_stats": stats,
            "async_tok_s": round(tok_s["async"], 2), "waves_tok_s": round(tok_s["waves"], 2),
            "plain_tokens": plain_tokens, "plain_seconds": round(plain_seconds, 3), "plain_tok_s": round(plain_tok_s, 2),
            "plain_cpu_seconds": round(plain_cpu_seconds, 3),
            # each repeat's async run over the plain generate run right after it (the spread of the pooled figure)
            "rollout_over_generate_per_repeat": [
                round((a["model_tokens"] / a["seconds"]) / (x["tokens"] / x["seconds"]), 3) for a, x in zip(runs["async"], plains)],
            "async_over_waves": round(tok_s["async"] / tok_s["waves"], 3),
            "rollout_over_generate": round(tok_s["async"] / plain_tok_s, 3),
            "waves_over_generate": round(tok_s["waves"] / plain_tok_s, 3),
            # the same ratios in tokens per CPU-second of this process (less sensitive to other load)
            "cpu_time": {"async_over_waves": round(tok_cpu_s["async"] / tok_cpu_s["waves"], 3),
                         "rollout_over_generate": round(tok_cpu_s["async"] / plain_tok_cpu_s, 3),
                         "waves_over_generate": round(tok_cpu_s["waves"] / plain_tok_cpu_s, 3)}}


def bench_retrieval(index_dir: str, queries: list[str], batches=(32, 64), repeats: int = 3) -> list[dict]:
    import ray

    from actors.cluster import init_ray
    from actors.retrieval_service import start_retrieval_service
    from raggym.retrieval import Retriever

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="raggym bench runtime")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--questions", type=int, default=4, help="questions per step (the demo's prompts_per_step)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per question (the demo's G)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each loop (alternating) and of plain generate, seeds 1..R, pooled: one run's "
                        "episodes vary enough in length to move the ratio by 0.1 (about 4 min a repeat here)")
    p.add_argument("--skip-rollout", action="store_true")
    p.add_argument("--skip-retrieval", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = p.parse_args(argv)
    from raggym.data.synthetic import generate_world
    from raggym.retrieval import Retriever

    world = generate_world(seed=0, n_entities=1000, n_questions=80)
    retriever = Retriever.build(world.corpus, openie=world.openie, shards=2, show_progress=False)
    out: dict = {}

    def emit(key, value):
        out[key] = value
        if not args.json:
            print(json.dumps(value), flush=True)

    if not args.skip_rollout:
        rollout = bench_rollout(world, retriever, model=args.model, questions=args.questions,
                                group_size=args.group_size, threads=args.threads, repeats=args.repeats)
        emit("rollout", rollout)
        out["rollout_over_generate"] = rollout["rollout_over_generate"]
        out["async_over_waves"] = rollout["async_over_waves"]
    if not args.skip_retrieval:
        with tempfile.TemporaryDirectory() as d:
            retriever.save(f"{d}/idx")
            emit("retrieval", bench_retrieval(f"{d}/idx", [q.question for q in world.questions]))
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
