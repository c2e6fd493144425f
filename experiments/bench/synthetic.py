"""Benchmark: synthetic-world generation throughput and peak memory.

    raggym bench synthetic [--passages 100000 1000000] [--format jsonl]

Prints one JSON object per size: passages written, seconds, passages/s, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import sys
import tempfile
import time

from raggym.data.synthetic import WorldConfig, entities_for_passages, write_world


def _one(target: int, fmt: str, queue) -> None:
    cfg = WorldConfig(seed=0)
    cfg.n_entities = entities_for_passages(target, cfg)
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        stats = write_world(cfg, f"{d}/world", corpus_format=fmt)
        seconds = time.perf_counter() - start
    queue.put({
        "bench": "synthetic_world",
        "target_passages": target,
        "passages": stats["passages"],
        "entities": stats["entities"],
        "triples": stats["triples"],
        "format": fmt,
        "seconds": round(seconds, 2),
        "passages_per_s": round(stats["passages"] / seconds),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cpu": platform.processor() or platform.machine(),
    })


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="raggym bench synthetic")
    parser.add_argument("--passages", type=int, nargs="+", default=[100_000])
    parser.add_argument("--format", choices=["jsonl", "json", "parquet"], default="jsonl")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")  # a fresh process per size, so peak RSS is per run
    for target in args.passages:
        queue = ctx.Queue()
        proc = ctx.Process(target=_one, args=(target, args.format, queue))
        proc.start()
        result = queue.get()
        proc.join()
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
