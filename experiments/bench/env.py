"""Benchmark the environments: step overhead without retrieval, and a large fuzz run.

    python -m experiments.bench.env                      # both parts, JSON on stdout
    python -m experiments.bench.env --fuzz-examples 0    # overhead only

Step overhead is the wall time of ``env.step`` with retrieval replaced by a precomputed result
(a dict lookup), so it measures parsing, rendering, bookkeeping and the info dict. Each timed
episode is four searches and an answer; the report gives the median and 90th percentile over all
timed steps, per dialect, and per step of ``step_batch`` at batch 64. Target: median <= 50 us.

The fuzz part steps ``--fuzz-examples`` Hypothesis-generated adversarial segments per dialect
(``raggym.protocol.strategies``) through a fresh episode each and checks that nothing raises,
that malformed segments set ``info["format_error"]`` and get a format-error observation in the
dialect's tags, and that they cost one unit of budget.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from envs import MultiKBRouteEnv, RagSearchEnv, step_batch
from raggym.data.types import Question
from raggym.protocol import DIALECT_NAMES, PAPER_KNOWLEDGE_BASES
from raggym.retrieval.base import Hit, QueryResult

SEARCH_DIALECTS = tuple(d for d in DIALECT_NAMES if d != "r1_router")

REASONING = (
    "The question asks where the director of the film was born. I know the film but not who "
    "directed it, so I should look that up first and then search for the director's birthplace."
)

# One realistic search and one answer segment per dialect (what a policy emits in one turn).
SEGMENTS = {
    "routerag": (f"<think>{REASONING}</think>\n<search> [graph] director of the film Inception </search>",
                 f"<think>{REASONING}</think>\n<answer> London </answer>"),
    "search_r1": (f"<think>{REASONING}</think>\n<search> director of the film Inception </search>",
                  f"<think>{REASONING}</think>\n<answer> London </answer>"),
    "graph_r1": (f"<think>{REASONING}</think>\n<query> director of the film Inception </query>",
                 f"<think>{REASONING}</think>\n<answer> London </answer>"),
    "lws": (f"<reflect>{REASONING}</reflect>\n<search> director of the film Inception </search>",
            f"<reflect>{REASONING}</reflect>\n<answer> London </answer>"),
    "graphrag_r1": (f"<think>{REASONING} <|begin_of_query|> director of the film Inception <|end_of_query|>",
                    f"{REASONING}</think>\n<answer> London </answer>"),
}
ROUTE_SEGMENT = f"<think>{REASONING}</think><sub-question>Who directed Inception?</sub-question><ret>Text Retriever</ret>"
ANSWER_SEGMENT = f"<think>{REASONING}</think><answer>London</answer>"

PASSAGE_TEXT = ("Some retrieved passage text about films and their directors. " * 8).strip()
ROUTE_EPISODE = (ROUTE_SEGMENT, ANSWER_SEGMENT) * 3 + (ANSWER_SEGMENT,)  # 3 routes, then the final answer
QUESTION = Question(id="bench", question="Where was the director of Inception born?", answers=("London",))


class PrecomputedRetriever:
    """Returns the same precomputed result for every query: retrieval costs a dict lookup."""

    def __init__(self, k: int = 3):
        hits = [
            Hit(f"p{i}", f"Passage {i}", PASSAGE_TEXT, 1.0 / (i + 1))
            for i in range(k)
        ]
        facts = [("Inception", "directed by", "Christopher Nolan", 0.9), ("Christopher Nolan", "born in", "London", 0.8)]
        self._results = {mode: QueryResult("q", hits, 0.0, 1.0, mode, facts) for mode in ("passage", "graph", "hybrid")}

    def retrieve(self, queries, mode, k):
        result = self._results[mode]
        return [result] * len(queries)


def _percentiles(samples_ns: list[int]) -> dict:
    samples = sorted(samples_ns)
    return {
        "median_us": round(statistics.median(samples) / 1000, 2),
        "p90_us": round(samples[int(0.9 * (len(samples) - 1))] / 1000, 2),
        "steps": len(samples),
    }


def bench_step_overhead(episodes: int) -> dict:
    report: dict = {}
    all_samples: list[int] = []
    clock = time.perf_counter_ns
    retriever = PrecomputedRetriever()
    for dialect in SEARCH_DIALECTS:
        env = RagSearchEnv(retriever, [QUESTION], dialect)
        search, answer = SEGMENTS[dialect]
        samples: list[int] = []
        for episode in range(episodes + 20):
            env.reset(seed=episode)
            for segment in (search, search, search, search, answer):
                start = clock()
                env.step(segment)
                elapsed = clock() - start
                if episode >= 20:  # the first episodes warm caches and are not timed
                    samples.append(elapsed)
        report[dialect] = _percentiles(samples)
        all_samples.extend(samples)

    route_env = MultiKBRouteEnv({"Text Retriever": retriever}, [QUESTION])
    samples = []
    for episode in range(episodes + 20):
        route_env.reset(seed=episode)
        for segment in ROUTE_EPISODE:
            start = clock()
            route_env.step(segment)
            elapsed = clock() - start
            if episode >= 20:
                samples.append(elapsed)
    report["r1_router (MultiKBRouteEnv)"] = _percentiles(samples)

    # step_batch: per-episode cost of one batched step over 64 episodes searching together.
    batch = [RagSearchEnv(retriever, [QUESTION], "routerag") for _ in range(64)]
    search, answer = SEGMENTS["routerag"]
    per_step = []
    for round_ in range(max(episodes // 16, 20)):
        for env in batch:
            env.reset(seed=round_)
        for segments in ([search] * 64, [search] * 64, [answer] * 64):
            start = clock()
            step_batch(batch, segments)
            per_step.append((clock() - start) // 64)
    report["routerag step_batch(64), per episode"] = _percentiles(per_step)
    report["all search dialects"] = _percentiles(all_samples)
    return report


def bench_fuzz(examples: int) -> dict:
    # On use: hypothesis (and raggym.protocol.strategies, built on it) comes with the dev extra.
    from hypothesis import HealthCheck, given, settings

    from raggym.protocol.strategies import segments

    report = {}
    for dialect in DIALECT_NAMES:
        if dialect == "r1_router":
            env = MultiKBRouteEnv({kb: PrecomputedRetriever() for kb in PAPER_KNOWLEDGE_BASES}, [QUESTION])
        else:
            env = RagSearchEnv(PrecomputedRetriever(), [QUESTION], dialect)
        counts = {"examples": 0, "format_errors": 0, "valid": 0, "exceptions": 0, "violations": 0}
        first_failure: list[str] = []

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(segments(dialect))
        def run(segment: str) -> None:
            counts["examples"] += 1
            env.reset(seed=0)
            try:
                observation, reward, terminated, truncated, info = env.step(segment)
            except Exception as error:  # the property under test: this must never happen
                counts["exceptions"] += 1
                if not first_failure:
                    first_failure.append(f"{type(error).__name__}: {error} for {segment[:200]!r}")
                return
            # Judge the segment independently of the env's own bookkeeping.
            action = env.dialect.parse(segment)
            if dialect == "r1_router":  # a fresh episode is in its routing phase
                malformed = action.kind != "route" or len(segment) > env.max_segment_chars
            else:
                malformed = not action.is_valid or len(segment) > env.max_segment_chars
            if malformed:
                counts["format_errors"] += 1
                ok = info["format_error"] and not terminated and observation in env.observation_space
                if dialect != "r1_router":
                    ok = ok and env.dialect.observation_open in observation
                    ok = ok and info["budget_left"] == env.retrieval_budget - 1
            else:
                counts["valid"] += 1
                ok = not info["format_error"]
            if not ok:
                counts["violations"] += 1
                if not first_failure:
                    first_failure.append(f"invariant violated for {segment[:200]!r}")

        start = time.perf_counter()
        run()
        counts["seconds"] = round(time.perf_counter() - start, 1)
        if first_failure:
            counts["first_failure"] = first_failure[0]
        report[dialect] = counts
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=400, help="timed episodes per dialect")
    parser.add_argument("--fuzz-examples", type=int, default=10_000, help="fuzzed segments per dialect (0 skips)")
    parser.add_argument("--json", action="store_true", help="print JSON only (the default output is JSON too)")
    args = parser.parse_args(argv)

    result = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "target_median_us": 50,
        "step_overhead": bench_step_overhead(args.episodes),
    }
    if args.fuzz_examples > 0:
        result["fuzz"] = bench_fuzz(args.fuzz_examples)
    print(json.dumps(result, indent=2))
    failed = any(r["exceptions"] or r["violations"] for r in result.get("fuzz", {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
