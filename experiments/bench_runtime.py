"""Runtime benchmarks (JSON): multi-turn rollout vs plain generate, Ray retrieval vs in-process.

    python -m experiments.bench_runtime [--episodes 16] [--queries 64] [--skip-rollout] [--skip-retrieval]

1. Multi-turn rollout tokens/s divided by plain single-turn ``generate`` tokens/s at equal total
   tokens, same HF engine: the rollout runs episodes on the synthetic world (retrieval in-process);
   then the same prompts are generated once each with ``max_new_tokens`` chosen so the plain run
   produces the same number of tokens. Retrieval time is excluded from the rollout figure.
2. Ray retrieval service throughput divided by the in-process ``Retriever`` (the same index, shards
   and mode) at batch 32 and 64.
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


def bench_rollout(world, retriever, episodes: int, threads: int) -> dict:
    import torch

    from actors.engines.base import SamplingParams
    from actors.engines.hf import HFEngine
    from envs.rollout import MultiTurnRollout, RolloutConfig
    from raggym.trajectory import chat_prompt_ids
    from envs import RagSearchEnv

    torch.set_num_threads(threads)
    engine = HFEngine("smollm2-135m")
    qs = world.questions[:episodes]
    envs = [RagSearchEnv(retriever, qs, dialect="routerag", top_k=2) for _ in qs]
    from envs.rollout import LocalBackend

    backend = CountingBackend(LocalBackend(engine))
    cfg = RolloutConfig(max_response_tokens=96, max_turn_tokens=48, max_observation_tokens=96, waves=1)
    t = time.perf_counter()
    trajs = MultiTurnRollout(backend, engine.tokenizer, SamplingParams(seed=1), cfg).run(envs, qs)
    multi_seconds = time.perf_counter() - t - backend.retrieval_seconds
    multi_tokens = sum(t.response_length for t in trajs)
    prompts = [chat_prompt_ids(engine.tokenizer, e.record.prompt) for e in envs]
    per_prompt = max(1, round(multi_tokens / len(prompts)))
    t = time.perf_counter()
    plain = engine.generate(prompts, SamplingParams(seed=1), (), per_prompt)  # no stop strings
    plain_seconds = time.perf_counter() - t
    plain_tokens = sum(len(r.token_ids) for r in plain)
    return {"bench": "multi_turn_rollout", "episodes": len(qs), "multi_turn_tokens": multi_tokens,
            "multi_turn_seconds": round(multi_seconds, 3), "retrieval_seconds_excluded": round(backend.retrieval_seconds, 3),
            "multi_turn_tok_s": round(multi_tokens / multi_seconds, 2), "plain_tokens": plain_tokens,
            "plain_seconds": round(plain_seconds, 3), "plain_tok_s": round(plain_tokens / plain_seconds, 2),
            "ratio": round((multi_tokens / multi_seconds) / (plain_tokens / plain_seconds), 3),
            "turns_mean": round(sum(len(t.turns) for t in trajs) / len(trajs), 2), "threads": threads}


def bench_retrieval(index_dir: str, queries: list[str], batches=(32, 64), repeats: int = 3) -> list[dict]:
    import ray

    from actors.cluster import init_ray
    from actors.retrieval_service import start_retrieval_service
    from raggym.retrieval import Retriever

    local = Retriever.load(index_dir)
    init_ray("local", num_cpus=4)  # a private instance: the numbers are this machine's
    service, _, _ = start_retrieval_service(index_dir)
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
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-rollout", action="store_true")
    p.add_argument("--skip-retrieval", action="store_true")
    args = p.parse_args(argv)
    from raggym.data.synthetic import generate_world
    from raggym.retrieval import Retriever

    world = generate_world(seed=0, n_entities=1000, n_questions=80)
    retriever = Retriever.build(world.corpus, openie=world.openie, shards=2, show_progress=False)
    if not args.skip_rollout:
        print(json.dumps(bench_rollout(world, retriever, args.episodes, args.threads)), flush=True)
    if not args.skip_retrieval:
        with tempfile.TemporaryDirectory() as d:
            retriever.save(f"{d}/idx")
            for row in bench_retrieval(f"{d}/idx", [q.question for q in world.questions]):
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
