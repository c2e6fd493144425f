"""Load benchmark of the served agent (JSON): concurrent clients, then an overload burst.

    python -m experiments.bench.serve [--clients 100] [--max-turns 2] [--overload-clients 300] [--overload-cap 8]
    raggym bench serve --clients 100 --requests 1

Builds a seeded synthetic world and its index (dense + graph) in a temp dir, starts a private
local Ray and deploys the app with an API key (every request sends it). Two phases:

1. ``load``: ``clients`` asyncio clients (aiohttp, one connection each) send ``requests``
   ``POST /v1/answer`` each, back to back, with ``max_turns`` >= 2 so that episodes can search.
   The episode cap is ``clients``, so no request is refused. Reported: throughput (requests/s over
   the wall time of the whole load), p50/p99 latency, errors (non-200 answers or failed
   connections; the target is 0), the turns and searches the episodes made, the engine's and the
   retriever's batch sizes.
2. ``overload``: the ingress is redeployed with ``max_episodes_in_flight=overload_cap`` (the
   policy and retrieval replicas stay) and ``overload_clients`` clients send one request each, all
   at once. Every response must be 200 or 503 (with ``Retry-After``); reported are the counts per
   status, the latency of the refusals and whether ``/healthz`` and one more answer succeed after.

``--unbatched`` adds the old comparison: the load phase again with ``max_batch_size=1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import sys
import tempfile
import time

import numpy as np
import ray
from ray import serve

from actors.cluster import init_ray
from experiments.serve.app import API_KEY_ENV, start
from raggym.data.synthetic import generate_world
from raggym.retrieval import Retriever


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _load(url: str, questions: list[str], clients: int, per_client: int, max_turns: int, key: str) -> dict:
    import aiohttp  # on use: aiohttp comes with the dev extra

    latencies: list[float] = []
    statuses: dict[str, int] = {}
    refusal_latencies: list[float] = []
    errors: list[str] = []
    turns = searches = 0
    timeout = aiohttp.ClientTimeout(total=1800)

    async def client(i: int, session):
        nonlocal turns, searches
        for j in range(per_client):
            q = questions[(i * per_client + j) % len(questions)]
            t = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/answer", json={"question": q, "max_turns": max_turns}) as r:
                    body = await r.json(content_type=None)
                    statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
                    if r.status == 503 and r.headers.get("Retry-After"):
                        refusal_latencies.append(time.perf_counter() - t)
                    if r.status != 200:
                        errors.append(f"{r.status}: {(body or {}).get('error', {}).get('message')}")
                        continue
            except Exception as e:  # noqa: BLE001 - counted, reported
                statuses["connection_error"] = statuses.get("connection_error", 0) + 1
                errors.append(f"{type(e).__name__}: {e}")
                continue
            latencies.append(time.perf_counter() - t)
            turns += len(body["turns"])
            searches += sum(1 for turn in body["turns"] if turn["action"] == "search")

    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(i, session) for i in range(clients)])
        wall = time.perf_counter() - t0
        async with session.get(f"{url}/v1/status") as r:
            status = await r.json()
    lat = np.array(latencies) if latencies else np.zeros(1)
    out = {
        "requests": clients * per_client, "ok": len(latencies), "errors": len(errors), "error_examples": errors[:3],
        "statuses": statuses, "wall_seconds": round(wall, 2), "throughput_rps": round(len(latencies) / wall, 3),
        "latency_p50_s": round(float(np.percentile(lat, 50)), 3), "latency_p99_s": round(float(np.percentile(lat, 99)), 3),
        "turns_per_episode": round(turns / max(1, len(latencies)), 2), "searches": searches,
        "server_requests": status.get("requests"),
        "engine_batching": status.get("engine", {}).get("batching"),
        "retrieval_batching": status.get("retrieval", {}).get("batching"),
    }
    if refusal_latencies:
        out["refusal_latency_p50_s"] = round(float(np.percentile(refusal_latencies, 50)), 3)
        out["refusal_latency_p99_s"] = round(float(np.percentile(refusal_latencies, 99)), 3)
    return out


async def _healthy_after(url: str, question: str, key: str) -> dict:
    import aiohttp  # on use: aiohttp comes with the dev extra

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        async with session.get(f"{url}/healthz") as r:
            health = r.status
        async with session.post(f"{url}/v1/answer", json={"question": question, "max_turns": 1}) as r:
            answer = r.status
    return {"healthz_status": health, "answer_status": answer}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="raggym bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--requests", type=int, default=1, help="requests per client")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-timeout-s", type=float, default=0.02)
    p.add_argument("--max-turns", type=int, default=2, help="model turns per episode (>= 2 lets episodes search)")
    p.add_argument("--max-turn-tokens", type=int, default=16)
    p.add_argument("--entities", type=int, default=120)
    p.add_argument("--checkpoint", default="smollm2-135m",
                   help="policy to serve (a trained run searches; the untrained default mostly answers at once)")
    p.add_argument("--index", default=None, help="an existing raggym index (default: build the synthetic world's)")
    p.add_argument("--questions", default=None,
                   help="questions JSONL for the clients (with --index; default: the synthetic world's)")
    p.add_argument("--engine-threads", type=int, default=0, help="torch threads of the policy (0 = all cores)")
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the private Ray")
    p.add_argument("--overload-clients", type=int, default=300, help="clients of the overload burst (0 skips it)")
    p.add_argument("--overload-cap", type=int, default=8, help="max_episodes_in_flight during the overload burst")
    p.add_argument("--request-deadline-s", type=float, default=1800.0,
                   help="the server's per-request deadline and per-call timeout (default 1800: a loaded machine "
                        "must not turn slow answers into 504s)")
    p.add_argument("--unbatched", action="store_true", help="also run the load phase with max_batch_size=1")
    args = p.parse_args(argv)

    if bool(args.index) != bool(args.questions):
        p.error("--index and --questions go together")
    if args.questions:
        with open(args.questions, encoding="utf-8") as f:
            questions = [json.loads(line)["question"] for line in f if line.strip()]
    else:
        world = generate_world(seed=0, n_entities=args.entities, n_questions=max(20, args.clients))
        questions = [q.question for q in world.questions]
    key = secrets.token_urlsafe(32)
    os.environ[API_KEY_ENV] = key  # read by the app builder; only its digest is deployed
    out = {"bench": "serve", "clients": args.clients, "requests_per_client": args.requests, "max_turns": args.max_turns,
           "max_turn_tokens": args.max_turn_tokens, "model": args.checkpoint, "engine": "hf (CPU)",
           "cpu_count": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        index = args.index or os.path.join(tmp, "index")
        if not args.index:
            Retriever.build(world.corpus, openie=world.openie, show_progress=False).save(index)
        init_ray("local", num_cpus=args.num_cpus)  # a private instance: the numbers are this machine's
        port = _free_port()

        def deploy(size: int, cap: int) -> tuple[str, float]:
            t = time.perf_counter()
            url = start({"checkpoint": args.checkpoint, "index": index, "max_batch_size": size,
                         "batch_wait_timeout_s": args.batch_wait_timeout_s, "max_turn_tokens": args.max_turn_tokens,
                         "default_max_turns": args.max_turns, "max_turns_limit": max(8, args.max_turns),
                         "engine_threads": args.engine_threads, "policy_cpus": 1, "retrieval_cpus": 0.5,
                         "ingress_cpus": 0.5, "status_endpoint": True, "max_episodes_in_flight": cap,
                         "request_deadline_s": args.request_deadline_s, "request_timeout_s": args.request_deadline_s},
                        port=port, name=f"bench-{size}")
            return url, time.perf_counter() - t

        try:
            sizes = [args.max_batch_size] + ([1] if args.unbatched else [])
            for size in sizes:
                url, startup = deploy(size, max(args.clients, 1))
                result = asyncio.run(_load(url, questions, args.clients, args.requests, args.max_turns, key))
                out["runs"].append({"phase": "load", "max_batch_size": size, "startup_seconds": round(startup, 1), **result})
                print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
                if size != args.max_batch_size or not args.overload_clients:
                    serve.delete(f"bench-{size}")
                    continue
                # Only the ingress' arguments change: Serve keeps the policy and retrieval replicas.
                url, startup = deploy(size, args.overload_cap)
                result = asyncio.run(_load(url, questions, args.overload_clients, 1, args.max_turns, key))
                result["unexpected_statuses"] = {s: n for s, n in result["statuses"].items() if s not in ("200", "503")}
                result.update(asyncio.run(_healthy_after(url, questions[0], key)))
                out["runs"].append({"phase": "overload", "max_batch_size": size, "max_episodes_in_flight": args.overload_cap,
                                    "redeploy_seconds": round(startup, 1), **result})
                print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
                serve.delete(f"bench-{size}")
        finally:
            serve.shutdown()
            ray.shutdown()
    loads = [r for r in out["runs"] if r["phase"] == "load"]
    if len(loads) == 2 and loads[1]["throughput_rps"] > 0:
        out["batched_over_unbatched_throughput"] = round(loads[0]["throughput_rps"] / loads[1]["throughput_rps"], 2)
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
