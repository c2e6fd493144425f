"""The ``raggym`` console script.

Subcommands: index, retrieve, train, eval, serve, demo, bench, synth, data. Each has ``--help``; the
ones that print results accept ``--json``. Errors in user input print one line on stderr and
exit with status 2; nothing prints a traceback for a bad file or a bad argument.

The script lives in ``experiments`` (the top layer) because train/eval/serve/bench drive Ray;
the pure-library parts it calls live in ``raggym``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from experiments import demo
from experiments.eval import harness as evaluate
from experiments.serve import app as serve
from raggym.data import DataFormatError
from raggym.data.cli import add_data_arguments, run_data
from raggym.data.synthetic import WorldConfig, entities_for_passages, write_world
from raggym.models import ModelSpecError

# Subcommands whose implementation arrives with a later issue. Calling one says so and fails;
# it never pretends to have done the work.
_PENDING = {
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage wall
        self.exit(2, f"raggym: error: {message}\n")


def _add_demo(sub):
    p = sub.add_parser("demo", help="the learning proof on the embedded default: routing task -> SFT -> RouteRAG GRPO stage 1 and 2 -> report",
                       description="Generate the routing task (questions that need graph retrieval and questions a passage "
                                   "search answers), build its index and graph, SFT SmolLM2-135M on golden episodes with "
                                   "random search modes, run RouteRAG GRPO stage 1 (EM) and stage 2 (EM + efficiency) on "
                                   "local Ray, evaluate after each stage on held-out questions and write "
                                   "report.md/report.json (with rl_effect)/plots under --out.")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run_demo)


def _add_synth(sub):
    p = sub.add_parser("synth", help="write a synthetic world (corpus, OpenIE triples, questions) to disk",
                       description="Stream a seeded synthetic world to DIR in the formats the loaders read.")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--entities", type=int, default=None, help="entity count (default 2000)")
    p.add_argument("--passages", type=int, default=None, help="approximate passage count; overrides --entities")
    p.add_argument("--max-hops", type=int, default=4)
    p.add_argument("--distractors", type=float, default=0.5, help="distractor passages per fact passage")
    p.add_argument("--alias-share", type=float, default=0.1, help="share of bridge facts reachable only via the graph")
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--tables", action="store_true", help="put year attributes in a table KB (tables.jsonl)")
    p.add_argument("--task", choices=["multihop", "routing"], default="multihop",
                   help="multihop: bridge chains and comparisons; routing: the one-hop world the demo and the routing "
                        "study learn on, where the right search mode depends on the question (graph-only or direct)")
    p.add_argument("--graph-only-share", type=float, default=0.5,
                   help="--task routing: share of questions about facts only the graph reaches (default 0.5)")
    p.add_argument("--heldout", type=int, default=0,
                   help="also write train_questions.jsonl and heldout_questions.jsonl, holding out this many "
                        "questions (the demo's split: --task routing --entities 300 --questions 400 --heldout 48)")
    p.add_argument("--format", choices=["jsonl", "json", "parquet"], default="jsonl")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_synth)


def _run_synth(args) -> int:
    cfg = WorldConfig(
        seed=args.seed,
        n_entities=args.entities or 2000,
        max_hops=args.max_hops,
        distractors_per_fact=args.distractors,
        alias_share=args.alias_share,
        n_questions=args.questions,
        attribute_kb="table" if args.tables else "text",
        task=args.task,
        graph_only_share=args.graph_only_share,
    )
    if args.passages:
        cfg.n_entities = entities_for_passages(args.passages, cfg)
    stats = write_world(cfg, args.out, corpus_format=args.format, progress=not args.json, heldout=args.heldout)
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"wrote {stats['passages']:,} passages, {stats['triples']:,} triples and {stats['questions']} questions "
              f"to {args.out} in {stats['seconds']:.1f} s"
              + (f" ({stats['split']['train']} train, {stats['split']['heldout']} held out)" if args.heldout else ""))
    return 0


def _add_retrieval(sub):
    for name, helptext in (("index", "build a dense index and knowledge graph from a corpus"),
                           ("retrieve", "query an index in passage, graph or hybrid mode")):
        p = sub.add_parser(name, help=helptext, description=helptext)
        try:
            mod = importlib.import_module("raggym.retrieval.cli")
        except ImportError:
            p.set_defaults(func=lambda a, n=name: _pending(n, "the retrieval stack (retrieval issue #3)"))
            continue
        getattr(mod, f"add_{name}_arguments")(p)
        p.set_defaults(func=getattr(mod, f"run_{name}"))


def _add_train(sub):
    p = sub.add_parser("train", help="GRPO-family training on Ray (same as python -m experiments.train)",
                       description="Train a policy with a YAML config plus key=value overrides; resumes from the latest checkpoint.")
    p.add_argument("--config", default=None, help="YAML config, e.g. experiments/configs/cpu_tiny.yaml")
    p.add_argument("--json", action="store_true", help="print the last step's metrics as JSON")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.steps=4")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    # Imported on use: experiments.train imports torch (about 1.5 s), which `raggym --help` and the
    # other subcommands should not wait for.
    from experiments.train import main as train_main

    return train_main((["--config", args.config] if args.config else []) + (["--json"] if args.json else []) + list(args.overrides))


def _add_eval(sub):
    p = sub.add_parser("eval", help="evaluate a policy: datasets x systems (same as python -m experiments.eval)",
                       description="Evaluate a policy on datasets with baseline systems (direct, vanilla_rag, agent, "
                                   "single-mode ablations) through the Ray rollout path; writes results.json, "
                                   "results.md and trajectories/*.jsonl under --out.")
    evaluate.add_arguments(p)
    p.set_defaults(func=evaluate.run)


def _add_bench(sub):
    p = sub.add_parser("bench", help="run a benchmark script and print JSON",
                       description="Run experiments/bench/NAME.py; remaining arguments go to the script.")
    p.add_argument("name", help="benchmark name, e.g. synthetic, retrieval, env")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    # A benchmark is imported by its name, the one that runs: each pulls in its own stack (torch, Ray, vLLM).
    try:
        mod = importlib.import_module(f"experiments.bench.{args.name}")
    except ModuleNotFoundError as e:
        if e.name != f"experiments.bench.{args.name}":
            raise
        here = os.path.join(os.path.dirname(__file__), "bench")
        names = sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py") and not f.startswith("_"))
        print(f"raggym: error: no benchmark named {args.name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    return int(mod.main(args.rest) or 0)


def _add_serve(sub):
    p = sub.add_parser("serve", help="serve a trained agent over HTTP with Ray Serve (blocks until Ctrl-C)",
                       description="Deploy the retrieval service, the policy engine and the agent loop; "
                                   "POST /v1/answer, OpenAI-compatible /v1/chat/completions. See docs/serving.md.")
    serve.add_arguments(p)
    p.set_defaults(func=serve.run_serve)


def _pending(name: str, what: str) -> int:
    print(f"raggym {name}: not implemented yet; it arrives with {what}.", file=sys.stderr)
    return 3


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raggym", description="Multi-turn retrieval-augmented agents: index, retrieve, train, evaluate, serve.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_retrieval(sub)
    _add_train(sub)
    _add_eval(sub)
    for name, what in _PENDING.items():
        p = sub.add_parser(name, help=f"(pending) {what}", description=f"Not implemented yet: {what}.")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda a, n=name, w=what: _pending(n, w))
    _add_serve(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_synth(sub)
    _add_data(sub)
    return parser


def _add_data(sub):
    p = sub.add_parser("data", help="inspect question and corpus files: format, counts, gold passages, samples",
                       description="Detect a question or corpus file's layout and report what raggym reads from it.")
    add_data_arguments(p)
    p.set_defaults(func=run_data)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (DataFormatError, ModelSpecError, ValueError, FileNotFoundError) as e:
        print(f"raggym {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"raggym {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
