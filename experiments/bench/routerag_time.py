"""RouteRAG's retrieval time per mode: the passage/graph ratio under each way of measuring ``t``.

    python -m experiments.bench.routerag_time                       # synthetic world + musique_sub
    python -m experiments.bench.routerag_time --sources synthetic --out ratio.json

RouteRAG's efficiency reward compares trajectories by their retrieval time, so what matters is
how much a passage search costs relative to a graph search. For each source this prints (JSON)
the mean per query and the passage/graph ratio of:

- ``batch_split``: the call's wall time divided evenly over its queries (``timing="batch"``, the
  behaviour before per-query timing), with every mode served as one batch of ``--batch``
  queries, and again one query per call; the two disagree because a query's share of a batch
  depends on the batch;
- ``per_query``: each query's own work timed alone (``timing="per_query"``, the default);
- ``cost``: the deterministic work units (vectors scanned, PPR iterations x nonzeros).

Threads are pinned to 1 (``OMP_NUM_THREADS``) so that the numbers are comparable on a shared
machine; the timings are medians over ``--repeats`` passes after a warm-up pass.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

from raggym.data import load_corpus, load_questions  # noqa: E402
from raggym.data.synthetic import generate_world  # noqa: E402
from raggym.retrieval import Retriever  # noqa: E402

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MODES = ("passage", "graph", "hybrid")


def _mean_seconds(retriever, queries: list[str], k: int, per_call: dict[str, int], repeats: int) -> dict[str, float]:
    """Per mode, the median over passes of the mean ``seconds`` per query, serving ``per_call[mode]``
    queries per call. The modes take turns chunk by chunk, so a drift in the machine's load
    reaches all of them alike (the ratio is what matters)."""
    def one_pass() -> dict[str, float]:
        seconds: dict[str, list[float]] = {m: [] for m in per_call}
        for start in range(0, len(queries), max(per_call.values())):
            for mode, n in per_call.items():
                chunk = queries[start:start + max(per_call.values())]
                for at in range(0, len(chunk), n):
                    seconds[mode].extend(r.seconds for r in retriever.retrieve(chunk[at:at + n], mode, k))
        return {m: sum(v) / len(v) for m, v in seconds.items()}

    one_pass()  # warm-up: caches, the PPR engine, the tokenizer
    passes = [one_pass() for _ in range(repeats)]
    return {m: statistics.median(p[m] for p in passes) for m in per_call}


def measure(retriever, queries: list[str], *, k: int, batch: int, repeats: int) -> dict:
    """Per-mode means and passage/graph ratios for the three ways of measuring a query's time."""
    def variant(timing: str) -> Retriever:
        return Retriever(retriever.corpus, retriever.passage_vectors, retriever.dense, retriever.graph,
                         embedder=retriever.embedder, config=replace(retriever.config, timing=timing))

    batched, alone = variant("batch"), variant("per_query")
    table: dict[str, dict[str, float]] = {
        f"batch_split_{batch}_per_call": _mean_seconds(batched, queries, k, dict.fromkeys(MODES, batch), repeats),
        "batch_split_1_per_call": _mean_seconds(batched, queries, k, dict.fromkeys(MODES, 1), repeats),
        "per_query": _mean_seconds(alone, queries, k, dict.fromkeys(MODES, batch), repeats),
        "cost": {m: statistics.fmean(r.cost for r in alone.retrieve(queries, m, k)) for m in MODES},
    }
    out = {name: {"mean_per_mode": {m: round(v, 7) for m, v in row.items()},
                  "passage_over_graph": round(row["passage"] / row["graph"], 4)} for name, row in table.items()}
    # What a rollout wave typically sees before the change: many passage queries in one call,
    # a few graph queries in another; the passage/graph ratio of the split wall times.
    mixed = _mean_seconds(batched, queries, k, {"passage": batch, "graph": 2}, repeats)
    out["batch_split_mixed_wave"] = {"passage_batch": batch, "graph_batch": 2,
                                     "passage_over_graph": round(mixed["passage"] / mixed["graph"], 4)}
    return out


def synthetic_source(n_entities: int, n_queries: int):
    world = generate_world(seed=0, n_entities=n_entities, n_questions=n_queries)
    retriever = Retriever.build(world.corpus, openie=world.openie, show_progress=False)
    info = {"passages": len(world.corpus), "facts": len(retriever.graph.facts), "queries": n_queries,
            "world": f"generate_world(seed=0, n_entities={n_entities}, n_questions={n_queries})"}
    return retriever, [q.question for q in world.questions][:n_queries], info


def musique_source(n_queries: int):
    root = SHARED / "musique_sub"
    if not (root / "corpus.json").exists():
        return None
    corpus = load_corpus(root / "corpus.json")
    retriever = Retriever.build(corpus, openie=root / "openie_gpt-3.5-turbo-1106.json", show_progress=False)
    questions = [q.question for q in load_questions(root / "questions.json")][:n_queries]
    info = {"passages": len(corpus), "facts": len(retriever.graph.facts), "queries": len(questions),
            "data": str(root)}
    return retriever, questions, info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", nargs="+", default=["synthetic", "musique"], choices=["synthetic", "musique"])
    ap.add_argument("--queries", type=int, default=60)
    ap.add_argument("--entities", type=int, default=2000, help="synthetic world size")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=30, help="queries per call in the batched variants")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    report: dict = {"threads": os.environ.get("OMP_NUM_THREADS"), "k": args.k}
    for source in args.sources:
        built = synthetic_source(args.entities, args.queries) if source == "synthetic" else musique_source(args.queries)
        if built is None:
            report[source] = {"skipped": f"{SHARED / 'musique_sub'} not found"}
            continue
        retriever, queries, info = built
        print(f"[bench] {source}: {info}", file=sys.stderr, flush=True)
        report[source] = {**info, **measure(retriever, queries, k=args.k, batch=args.batch, repeats=args.repeats)}
        print(f"[bench] {source}: {json.dumps(report[source])}", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
