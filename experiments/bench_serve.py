"""Load benchmark of the served agent (JSON): many concurrent HTTP clients, batched vs one at a time.

    python -m experiments.bench_serve [--clients 100] [--requests 1] [--max-batch-size 32]
    raggym bench serve --clients 100 --requests 1

Builds a seeded synthetic world and its index (dense + graph) in a temp dir, starts a private
local Ray, and deploys the app twice in turn on the same port: with ``max_batch_size`` (batched)
and with ``max_batch_size=1`` (every turn its own engine call). For each, ``clients`` asyncio
clients (aiohttp, one connection each) send ``requests`` ``POST /v1/answer`` each, back to back.
Reported per run: throughput (requests/s over the wall time of the whole load), p50/p99 latency,
errors (non-200 answers or failed connections; the target is 0), the engine's batch sizes; and
the batched/unbatched throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _load(url: str, questions: list[str], clients: int, per_client: int, max_turns: int) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=1800)

    async def client(i: int, session):
        for j in range(per_client):
            q = questions[(i * per_client + j) % len(questions)]
            t = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/answer", json={"question": q, "max_turns": max_turns}) as r:
                    body = await r.json()
                    if r.status != 200:
                        errors.append(f"{r.status}: {body.get('error', {}).get('message')}")
                        continue
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(f"{type(e).__name__}: {e}")
                continue
            latencies.append(time.perf_counter() - t)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(i, session) for i in range(clients)])
        wall = time.perf_counter() - t0
        async with session.get(f"{url}/v1/status") as r:
            status = await r.json()
    lat = np.array(latencies) if latencies else np.zeros(1)
    return {
        "requests": clients * per_client, "ok": len(latencies), "errors": len(errors), "error_examples": errors[:3],
        "wall_seconds": round(wall, 2), "throughput_rps": round(len(latencies) / wall, 3),
        "latency_p50_s": round(float(np.percentile(lat, 50)), 3), "latency_p99_s": round(float(np.percentile(lat, 99)), 3),
        "engine_batching": status.get("engine", {}).get("batching"),
        "retrieval_batching": status.get("retrieval", {}).get("batching"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="raggym bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--requests", type=int, default=1, help="requests per client")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-timeout-s", type=float, default=0.02)
    p.add_argument("--max-turns", type=int, default=1, help="model turns per episode")
    p.add_argument("--max-turn-tokens", type=int, default=16)
    p.add_argument("--entities", type=int, default=120)
    p.add_argument("--engine-threads", type=int, default=0, help="torch threads of the policy (0 = all cores)")
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the private Ray")
    p.add_argument("--skip-unbatched", action="store_true")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from actors.cluster import init_ray
    from experiments.serve import start
    from raggym.data.synthetic import generate_world
    from raggym.retrieval import Retriever

    world = generate_world(seed=0, n_entities=args.entities, n_questions=max(20, args.clients))
    questions = [q.question for q in world.questions]
    out = {"bench": "serve", "clients": args.clients, "requests_per_client": args.requests, "max_turns": args.max_turns,
           "max_turn_tokens": args.max_turn_tokens, "model": "smollm2-135m", "engine": "hf (CPU)",
           "cpu_count": os.cpu_count(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        index = os.path.join(tmp, "index")
        Retriever.build(world.corpus, openie=world.openie, show_progress=False).save(index)
        init_ray("local", num_cpus=args.num_cpus)  # a private instance: the numbers are this machine's
        port = _free_port()
        try:
            sizes = [args.max_batch_size] + ([] if args.skip_unbatched else [1])
            for size in sizes:
                t = time.perf_counter()
                url = start({"checkpoint": "smollm2-135m", "index": index, "max_batch_size": size,
                             "batch_wait_timeout_s": args.batch_wait_timeout_s, "max_turn_tokens": args.max_turn_tokens,
                             "default_max_turns": args.max_turns, "max_turns_limit": max(8, args.max_turns),
                             "engine_threads": args.engine_threads, "policy_cpus": 1, "retrieval_cpus": 0.5,
                             "ingress_cpus": 0.5, "status_endpoint": True}, port=port, name=f"bench-{size}")
                startup = time.perf_counter() - t
                result = asyncio.run(_load(url, questions, args.clients, args.requests, args.max_turns))
                out["runs"].append({"max_batch_size": size, "startup_seconds": round(startup, 1), **result})
                print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
                serve.delete(f"bench-{size}")
        finally:
            serve.shutdown()
            ray.shutdown()
    if len(out["runs"]) == 2 and out["runs"][1]["throughput_rps"] > 0:
        out["batched_over_unbatched_throughput"] = round(out["runs"][0]["throughput_rps"] / out["runs"][1]["throughput_rps"], 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
