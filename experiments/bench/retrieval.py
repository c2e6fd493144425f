"""Retrieval benchmarks: quality (recall@k) and speed (PPR, encoding, dense search). Prints JSON.

    python -m experiments.bench.retrieval                      # everything (about 15 min on 2 cores)
    python -m experiments.bench.retrieval --sections quality ppr --out bench.json

Sections:

- ``quality``: recall@2/@5 of passage, graph and hybrid retrieval on ../shared/data/musique_sub
  (60 questions, 1,890 passages, the shipped GPT-3.5 OpenIE file) and dense recall on
  ../shared/data/hotpotqa_sub; plus a graph ablation without NER-only phrase nodes.
- ``ppr``: batched torch PPR (batch 64) against igraph prpack one query at a time, on the MuSiQue
  graph and on a synthetic-world graph with >= 1M nodes; top-10 agreement and max score error;
  the memory-bound limit (bytes per iteration / measured copy bandwidth).
- ``encoding``: passages/s of MiniLM, naive (corpus order, padded batches) vs length-bucketed,
  fp32 and bf16 autocast.
- ``dense``: exact search q/s unsharded vs sharded (in-process, FAISS at 1 and 2 threads), and
  HNSW/IVF recall@10 vs exact (50k clustered synthetic vectors and the MuSiQue MiniLM vectors).
- ``openie``: SmolLM2-135M generation speed, to estimate LLM OpenIE over hotpotqa_sub.

Threads: unless OMP_NUM_THREADS is already set, this script sets it to 1 before importing igraph
and torch, because on a shared machine OpenMP with more threads than free cores stalls (both
igraph's prpack and torch's sparse kernels slowed 10x in measurements here). Torch sections then
choose their thread counts explicitly and record them.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from raggym.data import load_corpus, load_questions  # noqa: E402
from raggym.data.synthetic import entities_for_passages, generate_world  # noqa: E402
from raggym.models import load_embedder  # noqa: E402
from raggym.openie import HFGenerator, ner_messages, triple_messages  # noqa: E402
from raggym.retrieval import GraphConfig, Retriever  # noqa: E402
from raggym.retrieval.dense import DenseIndex  # noqa: E402
from raggym.retrieval.encoding import EmbeddingCache, encode_texts, passage_text  # noqa: E402
from raggym.retrieval.graph import KnowledgeGraph  # noqa: E402
from raggym.retrieval.openie_io import align_openie  # noqa: E402
from raggym.retrieval.ppr import IgraphPPR, TorchPPR, top_k_rows  # noqa: E402

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
SECTIONS = ("quality", "ppr", "encoding", "dense", "openie")


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def timed(fn, repeats: int = 3):
    """Median wall seconds of ``repeats`` calls (after one warm-up call) and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": os.getloadavg(),
    }


def recall_at(results, questions, k: int) -> float:
    return round(float(np.mean([len(set(r.ids[:k]) & set(q.gold_passage_ids)) / len(q.gold_passage_ids)
                                for r, q in zip(results, questions)])), 4)


# ----------------------------------------------------------------------------- quality


def bench_quality() -> dict:
    out: dict = {}
    mdir = SHARED / "musique_sub"
    corpus = load_corpus(mdir / "corpus.json")
    questions = load_questions(mdir / "questions.json", corpus)
    texts = [q.question for q in questions]
    for label, gconf in (("musique_sub", GraphConfig()), ("musique_sub_without_ner_phrases", GraphConfig(include_entities=False))):
        log(f"quality: building {label}")
        t = time.perf_counter()
        retriever = Retriever.build(corpus, embedder="minilm", openie=mdir / "openie_gpt-3.5-turbo-1106.json",
                                    graph_config=gconf, show_progress=False)
        build_s = time.perf_counter() - t
        row = {"questions": len(questions), "passages": len(corpus), "graph_stats": retriever.graph.stats,
               "build_seconds_with_warm_embedding_cache": round(build_s, 2)}
        for mode in ("passage", "graph", "hybrid"):
            results = retriever.retrieve(texts, mode, 5)
            row[mode] = {"recall@2": recall_at(results, questions, 2), "recall@5": recall_at(results, questions, 5),
                         "mean_seconds_per_query_batch60": round(float(np.mean([r.seconds for r in results])), 5),
                         "mean_cost": float(np.mean([r.cost for r in results]))}
        out[label] = row
        log(f"quality {label}: " + json.dumps({m: row[m] for m in ("passage", "graph", "hybrid")}))

    hdir = SHARED / "hotpotqa_sub"
    hcorpus = load_corpus(hdir / "corpus.json")
    hquestions = load_questions(hdir / "questions.json", hcorpus)
    retriever = Retriever.build(hcorpus, embedder="minilm", show_progress=False)
    results = retriever.retrieve([q.question for q in hquestions], "passage", 5)
    out["hotpotqa_sub"] = {
        "questions": len(hquestions), "passages": len(hcorpus),
        "passage": {"recall@2": recall_at(results, hquestions, 2), "recall@5": recall_at(results, hquestions, 5)},
        "graph": "not run: no shipped OpenIE file; LLM OpenIE over 994 passages with SmolLM2-135M on this CPU "
                 "is estimated in the 'openie' section",
    }
    log("quality hotpotqa: " + json.dumps(out["hotpotqa_sub"]["passage"]))
    return out


# ----------------------------------------------------------------------------- PPR


def copy_bandwidth(threads: int) -> float:
    """Bytes/s of a large torch tensor copy (read + write counted) with ``threads`` threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(64 * 1024 * 1024)  # 256 MB
        dst = torch.empty_like(src)
        seconds, _ = timed(lambda: dst.copy_(src), repeats=5)
        return 2 * src.numel() * 4 / seconds
    finally:
        torch.set_num_threads(old)


def hipporag_like_resets(kg, batch: int, seed: int) -> np.ndarray:
    """Personalization like graph retrieval produces: dense seeds on passages, five phrase seeds."""
    rng = np.random.default_rng(seed)
    reset = np.zeros((batch, kg.n_nodes), dtype=np.float32, order="F")  # the layout seed_weights uses
    reset[:, : kg.n_passages] = rng.random((batch, kg.n_passages), dtype=np.float32) * 0.05
    for b in range(batch):
        nodes = kg.n_passages + rng.choice(len(kg.phrases), size=min(5, len(kg.phrases)), replace=False)
        reset[b, nodes] = rng.random(len(nodes)) / 3.0
    return reset


def ppr_case(name: str, kg, *, rounds: int, igraph_per_round: int, batch: int = 64, bandwidth: dict) -> dict:
    """Torch batch vs igraph one-at-a-time, interleaved round by round.

    The machine is shared, so its load drifts within seconds; each round times one torch batch
    and ``igraph_per_round`` igraph queries back to back, and the reported speedup is the median
    of the per-round ratios (plus the medians of each side).
    """
    log(f"ppr {name}: {kg.n_nodes} nodes, {kg.csr.nnz} nonzeros")
    reset = hipporag_like_resets(kg, batch, seed=1)
    t = time.perf_counter()
    ig = IgraphPPR(kg.csr, 0.5)
    ig_build = time.perf_counter() - t
    row = {"nodes": kg.n_nodes, "nnz": kg.csr.nnz, "batch": batch, "igraph_graph_build_seconds": round(ig_build, 2)}
    passages = np.arange(kg.n_passages)
    reference: dict[int, np.ndarray] = {}
    for threads, tol in ((1, 1e-5), (1, 1e-6), (2, 1e-5)):
        eng = TorchPPR(kg.csr, 0.5, tol=tol, threads=threads)
        result = eng.run(reset)  # warm-up
        torch_times, ig_times, ratios = [], [], []
        for r in range(rounds):
            t = time.perf_counter()
            result = eng.run(reset)
            torch_s = time.perf_counter() - t
            times = []
            for j in range(igraph_per_round):
                b = (r * igraph_per_round + j) % batch
                t = time.perf_counter()
                reference[b] = ig.run_one(reset[b])
                times.append(time.perf_counter() - t)
            ig_s = statistics.median(times)
            torch_times.append(torch_s)
            ig_times.extend(times)
            ratios.append((batch / torch_s) * ig_s)
        checked = sorted(reference)
        ref = np.stack([reference[b] for b in checked])
        got = result.scores[checked]
        same_top10 = int((top_k_rows(ref[:, passages], 10) == top_k_rows(got[:, passages], 10)).all(axis=1).sum())
        seconds = statistics.median(torch_times)
        iters = int(result.iterations.max())
        per_iter = seconds / iters
        bw = bandwidth[threads]
        best = eng.bytes_per_iteration(batch)
        worst = eng.bytes_per_iteration(batch, row_reuse=False)
        key = f"torch_threads{threads}_tol{tol:g}"
        row[key] = {
            "rounds": rounds,
            "seconds_per_batch_median": round(seconds, 4),
            "queries_per_second": round(batch / seconds, 1),
            "igraph_queries_per_second_same_rounds": round(1.0 / statistics.median(ig_times), 2),
            "speedup_vs_igraph_median_of_rounds": round(statistics.median(ratios), 1),
            "speedup_range_over_rounds": [round(min(ratios), 1), round(max(ratios), 1)],
            "speedup_vs_igraph_anchor_133qps": round(batch / seconds / 133.0, 1) if kg.n_nodes < 100_000 else None,
            "iterations": iters,
            "max_abs_score_error_vs_igraph": float(np.abs(got - ref).max()),
            "top10_identical_queries": f"{same_top10}/{len(checked)}",
            "copy_bandwidth_GBps": round(bw / 1e9, 2),
            "bytes_per_iteration_rows_reused": best,
            "bytes_per_iteration_rows_gathered_per_nonzero": worst,
            "memory_bound_seconds_per_iteration": best / bw,
            "memory_bound_seconds_per_iteration_no_reuse": worst / bw,
            "measured_seconds_per_iteration": per_iter,
            "fraction_of_memory_bound": round((best / bw) / per_iter, 3),
            "fraction_of_memory_bound_no_reuse": round((worst / bw) / per_iter, 3),
        }
        log(f"ppr {name} {key}: " + json.dumps(row[key]))
    return row


def bench_ppr(million_passages: int) -> dict:
    bandwidth = {t: copy_bandwidth(t) for t in (1, 2)}
    out = {"copy_bandwidth_GBps": {f"threads{t}": round(b / 1e9, 2) for t, b in bandwidth.items()}}
    mdir = SHARED / "musique_sub"
    corpus = load_corpus(mdir / "corpus.json")
    alignment = align_openie(mdir / "openie_gpt-3.5-turbo-1106.json", corpus)
    # Structure only (synonymy edges need embeddings; PPR speed depends on the structure).
    kg18 = KnowledgeGraph.build(alignment.per_passage, config=GraphConfig(include_entities=False))
    out["musique_18k_hipporag_nodes"] = ppr_case("musique (subject/object phrases, 18k nodes)", kg18, rounds=15, igraph_per_round=8, bandwidth=bandwidth)
    kg21 = KnowledgeGraph.build(alignment.per_passage)
    out["musique_default_graph_no_synonyms"] = ppr_case("musique (default phrases)", kg21, rounds=15, igraph_per_round=8, bandwidth=bandwidth)

    log(f"ppr: generating a synthetic world with about {million_passages} passages")
    t = time.perf_counter()
    world = generate_world(seed=0, n_entities=entities_for_passages(million_passages), n_questions=10)
    corpus = world.corpus
    kg = KnowledgeGraph.build(align_openie(world.openie, corpus).per_passage)
    gen_s = time.perf_counter() - t
    del world
    row = ppr_case("synthetic world", kg, rounds=2, igraph_per_round=2, bandwidth=bandwidth)
    row["source"] = (f"raggym.data.synthetic world (seed 0, {len(corpus)} passages, gold OpenIE triples), "
                     f"graph built in {gen_s:.0f} s, structure only (no synonymy edges)")
    out["synthetic_world_1M"] = row
    return out


# ----------------------------------------------------------------------------- encoding


def bench_encoding(n: int) -> dict:
    """Naive vs bucketed encoding, interleaved round by round (the machine load drifts)."""
    corpus = load_corpus(SHARED / "musique_sub" / "corpus.json")
    texts = [passage_text(p.title, p.text) for p in corpus][:n]
    emb = load_embedder("minilm")
    lengths = [len(x) for x in emb.tokenizer(texts, truncation=True, max_length=emb.max_length)["input_ids"]]
    out = {"passages": len(texts), "naive_batch_size": 64, "bucket_token_budget": 4096,
           "tokens_mean": round(float(np.mean(lengths)), 1), "tokens_max_after_truncation": int(max(lengths))}
    variants = {
        "naive_fp32": dict(bucketed=False, precision="fp32"),
        "sorted_batches_of_64_fp32": None,  # Embedder.encode(sort_by_length=True), for reference
        "bucketed_fp32": dict(bucketed=True, precision="fp32"),
        "bucketed_bf16": dict(bucketed=True, precision="bf16"),
    }
    reference = encode_texts(emb, texts, bucketed=False)
    for threads, rounds in ((1, 3), (2, 2)):
        torch.set_num_threads(threads)
        encode_texts(emb, texts[:64])  # warm-up
        speeds: dict[str, list[float]] = {k: [] for k in variants}
        cosines: dict[str, float] = {}
        for _ in range(rounds):
            for name, kwargs in variants.items():
                t = time.perf_counter()
                vecs = emb.encode(texts, batch_size=64, sort_by_length=True) if kwargs is None else encode_texts(emb, texts, **kwargs)
                speeds[name].append(len(texts) / (time.perf_counter() - t))
                cosines[name] = round(float((vecs * reference).sum(1).min()), 6)
        ratios = [b / a for a, b in zip(speeds["naive_fp32"], speeds["bucketed_fp32"])]
        row = {name: {"passages_per_second_median": round(statistics.median(v), 1), "per_round": [round(x, 1) for x in v],
                      "min_cosine_to_naive_fp32": cosines[name]} for name, v in speeds.items()}
        row["speedup_bucketed_fp32_vs_naive_median_of_rounds"] = round(statistics.median(ratios), 2)
        row["speedup_bucketed_bf16_vs_naive_fp32"] = round(statistics.median(speeds["bucketed_bf16"]) / statistics.median(speeds["naive_fp32"]), 2)
        out[f"torch_threads{threads}"] = row
        log(f"encoding threads={threads}: {json.dumps(row)}")
    return out


# ----------------------------------------------------------------------------- dense


def _clustered_unit_vectors(rng, n: int, dim: int, noise: float = 0.6) -> np.ndarray:
    """A mixture of 1,000 Gaussian blobs on the unit sphere (a stand-in for a large corpus)."""
    centers = rng.standard_normal((1000, dim)).astype(np.float32)
    vecs = centers[rng.integers(0, 1000, n)] + noise * rng.standard_normal((n, dim)).astype(np.float32)
    return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


def bench_dense(n_vectors: int, ann_vectors: int) -> dict:
    rng = np.random.default_rng(0)
    dim = 384
    vecs = _clustered_unit_vectors(rng, n_vectors, dim)
    queries = vecs[rng.integers(0, n_vectors, 256)] + 0.3 * rng.standard_normal((256, dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    out: dict = {"vectors": n_vectors, "dim": dim, "data": "clustered synthetic unit vectors (1,000 blobs)"}
    indexes = {1: DenseIndex.build(vecs)}
    for shards in (4, 8):
        indexes[shards] = DenseIndex.build(vecs, shards=shards)
    for threads in (1, 2):
        faiss.omp_set_num_threads(threads)
        exact_rows = indexes[1].search(queries[:64], 10)[1]
        for batch in (1, 32, 64):
            q = queries[:batch]
            speeds: dict[int, list[float]] = {s: [] for s in indexes}
            identical = {}
            for _ in range(3):  # interleaved rounds
                for shards, index in indexes.items():
                    t = time.perf_counter()
                    _, rows = index.search(q, 10)
                    speeds[shards].append(batch / (time.perf_counter() - t))
                    identical[shards] = bool((rows == exact_rows[:batch]).all())
            row = {f"shards{s}_qps": round(statistics.median(v), 1) for s, v in speeds.items()}
            row.update({f"shards{s}_identical_to_unsharded": identical[s] for s in indexes if s > 1})
            for s in (4, 8):
                row[f"shards{s}_over_unsharded"] = round(row[f"shards{s}_qps"] / row["shards1_qps"], 2)
            out[f"faiss_threads{threads}_batch{batch}"] = row
            log(f"dense threads={threads} batch={batch}: {row}")
    faiss.omp_set_num_threads(1)
    ann_base = vecs[:ann_vectors]
    ann_queries = queries[:128]
    exact = DenseIndex.build(ann_base).search(ann_queries, 10)[1]
    out["ann_vectors"] = ann_vectors
    for kind in ("hnsw", "ivf"):
        t = time.perf_counter()
        ann = DenseIndex.build(ann_base, kind=kind)
        build_s = time.perf_counter() - t
        seconds, (_, rows) = timed(lambda: ann.search(ann_queries, 10), repeats=1)
        recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, exact)]))
        out[kind] = {"recall@10_vs_exact": round(recall, 4), "qps_batch128_1thread": round(len(ann_queries) / seconds, 1),
                     "build_seconds_1thread": round(build_s, 1), "mean_vectors_scanned": float(ann.cost(ann_queries[:32]).mean()),
                     "config": ann.config.__dict__}
        log(f"dense {kind}: {out[kind]}")
    # Real embeddings: the MuSiQue passages (MiniLM).

    corpus = load_corpus(SHARED / "musique_sub" / "corpus.json")
    real = EmbeddingCache().encode(load_embedder("minilm"), [passage_text(p.title, p.text) for p in corpus])
    rq = real[rng.integers(0, len(real), 200)] + 0.05 * rng.standard_normal((200, real.shape[1])).astype(np.float32)
    exact = DenseIndex.build(real).search(rq, 10)[1]
    for kind in ("hnsw", "ivf"):
        rows = DenseIndex.build(real, kind=kind).search(rq, 10)[1]
        out[f"{kind}_musique_minilm_recall@10_vs_exact"] = round(float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, exact)])), 4)
    log(f"dense musique: hnsw {out['hnsw_musique_minilm_recall@10_vs_exact']}, ivf {out['ivf_musique_minilm_recall@10_vs_exact']}")
    return out


# ----------------------------------------------------------------------------- LLM OpenIE speed


def bench_openie() -> dict:
    corpus = load_corpus(SHARED / "hotpotqa_sub" / "corpus.json")
    passages = list(corpus)[:4]
    out = {}
    for threads in (1, 2):
        gen = HFGenerator(spec="smollm2-135m", threads=threads)
        t = time.perf_counter()
        texts = gen([ner_messages(p.title, p.text) for p in passages], 64)
        ner_s = time.perf_counter() - t
        new_tokens = sum(len(gen.tokenizer(x)["input_ids"]) for x in texts)
        t = time.perf_counter()
        gen([triple_messages(p.title, p.text, ["x"]) for p in passages], 64)
        tri_s = time.perf_counter() - t
        out[f"threads{threads}"] = {"batch": len(passages), "ner_seconds_64_new_tokens": round(ner_s, 2),
                                    "triples_seconds_64_new_tokens": round(tri_s, 2),
                                    "generated_tokens_per_second": round(new_tokens / ner_s, 1)}
        log(f"openie threads={threads}: {out[f'threads{threads}']}")
    best = max(v["generated_tokens_per_second"] for v in out.values())
    # HippoRAG's NER answers run ~60 tokens and triple answers ~250 tokens per passage.
    est = len(corpus) * (60 + 250) / best
    out["estimated_hours_for_hotpotqa_sub"] = round(est / 3600, 2)
    out["torch_threads_restored"] = torch.get_num_threads()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--million-passages", type=int, default=760_000,
                        help="synthetic-world passages for the large PPR graph (760k gives about 1.02M nodes)")
    parser.add_argument("--encoding-passages", type=int, default=256)
    parser.add_argument("--dense-vectors", type=int, default=200_000)
    parser.add_argument("--ann-vectors", type=int, default=50_000, help="vectors for the HNSW/IVF recall check")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not SHARED.is_dir():
        print(f"bench.retrieval: error: {SHARED} is absent; the benchmarks need ../shared/data", file=sys.stderr)
        return 2
    report = {"command": "python -m experiments.bench.retrieval " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine()}
    started = time.perf_counter()
    for section in args.sections:
        t = time.perf_counter()
        if section == "quality":
            report["quality"] = bench_quality()
        elif section == "ppr":
            report["ppr"] = bench_ppr(args.million_passages)
        elif section == "encoding":
            report["encoding"] = bench_encoding(args.encoding_passages)
        elif section == "dense":
            report["dense"] = bench_dense(args.dense_vectors, args.ann_vectors)
        elif section == "openie":
            report["openie"] = bench_openie()
        report.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t, 1)
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    text = json.dumps(report, indent=2, default=float)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
