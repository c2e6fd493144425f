"""``make demo`` / ``raggym demo``: the main job on the embedded default.

Today it builds the seeded synthetic multi-hop world and prints what is in it, fully offline.
The training demo on top of it (SmolLM2 + GRPO on CPU) comes with the experiments issue.
"""

from __future__ import annotations


import json
import sys
import time


def run_demo(args) -> int:
    from raggym.data.synthetic import WorldConfig, generate_world, write_world

    started = time.perf_counter()
    cfg = WorldConfig(seed=args.seed, n_entities=args.entities)
    if args.out:
        stats = write_world(cfg, args.out, progress=not args.json)
    else:
        world = generate_world(args.seed, n_entities=args.entities)
        stats = world.stats()
        stats["example_questions"] = [
            {"question": q.question, "answer": q.answer, "hops": q.hops, "kind": q.kind,
             "golden_trajectory": [s["query"] + f" [{s['mode']}]" for s in q.golden_trajectory]}
            for q in _one_per_kind(world.questions)
        ]
    stats["seconds"] = round(time.perf_counter() - started, 3)
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"synthetic world (seed {stats['seed']}) built in {stats['seconds']:.2f} s")
    for key in ("entities", "aliases", "passages", "triples", "tables", "questions", "graph_only_hops", "mean_gold_passages"):
        print(f"  {key:<20} {stats[key]}")
    print(f"  {'entities by type':<20} {stats['entities_by_type']}")
    print(f"  {'questions by kind':<20} {stats['questions_by_kind']}")
    print(f"  {'questions by hops':<20} {stats['questions_by_hops']}")
    for ex in stats.get("example_questions", []):
        print(f"\n  [{ex['kind']}, {ex['hops']} hop] {ex['question']}\n    answer: {ex['answer']}")
        for step in ex["golden_trajectory"]:
            print(f"    search: {step}")
    if args.out:
        print(f"\nfiles written to {args.out}")
    print("\nThe training demo (SmolLM2 + GRPO on this world) is not wired in yet; see README 'Status'.")
    return 0


def _one_per_kind(questions):
    seen, out = set(), []
    for q in questions:
        key = (q.kind, q.metadata.get("aliased_hops", 0) > 0)
        if key not in seen:
            seen.add(key)
            out.append(q)
    return out


def main(argv=None) -> int:
    from experiments.cli import build_parser

    return run_demo(build_parser().parse_args(["demo", *(argv or [])]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
