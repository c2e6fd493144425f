"""``make demo`` / ``raggym demo``: the main job on the embedded default, end to end on this CPU.

1. generate a seeded synthetic multi-hop world and split its questions into train / held-out;
2. build the dense index and the knowledge graph (MiniLM + HippoRAG 2-style graph);
3. evaluate the untrained policy (SmolLM2-135M) on the held-out questions;
4. SFT cold start on golden trajectories of the training questions (driven through the real env);
5. two-stage RouteRAG GRPO for a few steps on local Ray (stage 1: EM, stage 2: EM + efficiency);
6. evaluate again after SFT and after GRPO on the same held-out questions;
7. write ``report.md`` / ``report.json`` and PNG plots (reward, EM, retrieval turns, mode mix).

Every number in the report is measured in this run; nothing is filled in. ``--world-only``
keeps the old behaviour (build the world, print its statistics) for a quick look.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RL_CONFIG = REPO / "experiments" / "configs" / "demo_grpo.yaml"  # the GRPO step's settings


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[demo] {msg}", flush=True)


def run_demo(args) -> int:
    if getattr(args, "world_only", False):
        return _world_only(args)
    return run_pipeline(args)


# ----------------------------------------------------------------------------- the pipeline


def run_pipeline(args) -> dict | int:
    from actors.cluster import init_ray
    from experiments.evaluate import evaluate
    from raggym.data.splits import split_questions
    from experiments.report import read_jsonl, write_report
    from experiments.sft import golden_examples, run_sft
    from experiments.train import load_config, train
    from raggym.atomic import atomic_write_json
    from raggym.data import write_corpus, write_questions
    from raggym.data.synthetic import generate_world
    from raggym.models import load_policy_tokenizer
    from raggym.retrieval import Retriever, ensure_index

    quiet = bool(args.json)
    started = time.perf_counter()
    out = Path(args.out or "runs/demo")
    if out.exists() and not args.resume:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def lap(name: str, t0: float) -> None:
        timings[name] = round(time.perf_counter() - t0, 1)
        _say(f"{name}: {timings[name]:.0f} s", quiet)

    # 1. world ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    world = generate_world(args.seed, n_entities=args.entities, n_questions=args.questions, max_hops=args.max_hops)
    train_q, heldout_q = split_questions(world.questions, args.heldout_fraction, args.seed)
    heldout_q = heldout_q[: args.eval_questions]
    wdir = out / "world"
    wdir.mkdir(parents=True, exist_ok=True)
    write_corpus(wdir / "corpus.jsonl", world.corpus)
    atomic_write_json(wdir / "openie.json", world.openie, indent=None)
    write_questions(wdir / "train_questions.jsonl", train_q)
    write_questions(wdir / "heldout_questions.jsonl", heldout_q)
    _say(f"world: {len(world.corpus)} passages, {len(train_q)} training and {len(heldout_q)} held-out questions", quiet)
    lap("world", t0)

    # 2. index ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    index_dir = ensure_index(out / "index", world.corpus, openie=world.openie, shards=2, show_progress=not quiet)
    retriever = Retriever.load(index_dir)
    lap("index", t0)

    init_ray(num_cpus=8)  # stays up for the evaluations and training below; ends with the process
    heldout = [{"name": "synthetic-heldout", "source": "files", "corpus": str(wdir / "corpus.jsonl"),
                "questions": str(wdir / "heldout_questions.jsonl"), "openie": str(wdir / "openie.json"),
                "index_dir": str(index_dir)}]
    eval_kwargs = dict(dialect="routerag", max_response_tokens=args.eval_response_tokens, max_turn_tokens=args.turn_tokens,
                       top_k=2, retrieval_budget=2, workers=2, temperature=0.0, seed=args.seed, show_progress=not quiet,
                       max_observation_tokens=64)
    systems = list(args.systems)
    evaluations: list[tuple[str, dict]] = []

    # 3. evaluate the untrained policy -------------------------------------------------------
    t0 = time.perf_counter()
    evaluations.append(("untrained", evaluate(args.policy, heldout, systems, out / "eval" / "untrained", **eval_kwargs)))
    lap("eval_untrained", t0)

    # 4. SFT cold start ----------------------------------------------------------------------
    t0 = time.perf_counter()
    tokenizer = load_policy_tokenizer(args.policy)
    examples = golden_examples(train_q[: args.sft_examples], retriever, "routerag", tokenizer, corpus=world.corpus,
                               top_k=2, max_observation_tokens=64, show_progress=not quiet)
    sft = run_sft(args.policy, examples, out / "sft", epochs=args.sft_epochs, lr=args.sft_lr, batch_size=args.sft_batch,
                  seed=args.seed, show_progress=not quiet)
    lap("sft", t0)
    t0 = time.perf_counter()
    evaluations.append(("after SFT", evaluate(sft["policy_dir"], heldout, systems, out / "eval" / "sft", **eval_kwargs)))
    lap("eval_sft", t0)

    # 5. two-stage RouteRAG GRPO -------------------------------------------------------------
    t0 = time.perf_counter()
    run_dir = out / "grpo"
    overrides = [f"run.out_dir={run_dir}", f"run.seed={args.seed}", f"policy.model={sft['policy_dir']}",
                 f"data.corpus={wdir / 'corpus.jsonl'}", f"data.questions={wdir / 'train_questions.jsonl'}",
                 f"data.openie={wdir / 'openie.json'}", f"data.index_dir={index_dir}",
                 f"rollout.max_response_tokens={args.eval_response_tokens}", f"rollout.max_turn_tokens={args.turn_tokens}"]
    given = {"run.steps": args.rl_steps, "reward.stage2_start": args.stage2_start, "learner.optimizer.lr": args.rl_lr,
             "rollout.prompts_per_step": args.prompts_per_step, "rollout.group_size": args.group_size}
    overrides += [f"{key}={value}" for key, value in given.items() if value is not None]
    if args.prompts_per_step is not None or args.group_size is not None:  # keep one optimizer step per RL step
        base = load_config(str(RL_CONFIG), overrides).rollout
        overrides.append(f"learner.mini_batch_size={base.prompts_per_step * base.group_size}")
    overrides += list(args.overrides)
    cfg = load_config(str(RL_CONFIG), overrides)
    train(cfg)
    lap("grpo", t0)
    t0 = time.perf_counter()
    evaluations.append(("after SFT+GRPO", evaluate(str(run_dir), heldout, systems, out / "eval" / "grpo", **eval_kwargs)))
    lap("eval_grpo", t0)

    # 6. report --------------------------------------------------------------------------------
    t0 = time.perf_counter()
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    timings["total"] = round(time.perf_counter() - started, 1)
    meta = {"title": "raggym demo: SmolLM2-135M learns RouteRAG search on a synthetic world (CPU)",
            "policy": args.policy, "world": f"seed {args.seed}, {args.entities} entities, max {args.max_hops} hops",
            "passages": len(world.corpus), "train questions": len(train_q), "held-out questions": len(heldout_q),
            "SFT": f"{sft['examples']} golden episodes, {sft['steps']} steps, loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f}",
            "GRPO": f"{cfg.run.steps} steps (stage 2 from step {cfg.reward.stage2_start}), "
                    f"{cfg.rollout.prompts_per_step} prompts x G={cfg.rollout.group_size}",
            "seconds": timings}
    report = write_report(out, evaluations=evaluations, train_metrics=metrics, trajectory_dir=run_dir / "trajectories", meta=meta)
    lap("report", t0)
    summary = _summary(report)
    if args.json:
        print(json.dumps({"out_dir": str(out), "summary": summary, "seconds": timings}))
    else:
        for line in summary["lines"]:
            print(line)
        print(f"[demo] report: {out / 'report.md'} (JSON: {out / 'report.json'}, plots: {out / 'plots'})")
    return 0


def _summary(report: dict) -> dict:
    lines, em = [], {}
    for row in report["comparison"]:
        if row["system"] != "agent":
            continue
        em = {stage: row["em"].get(stage) for stage in report["stages"]}
        parts = ", ".join(f"{stage} {v:.3f}" for stage, v in em.items() if v is not None)
        lines.append(f"[demo] held-out EM ({row['dataset']}, agent): {parts}")
    values = [v for v in em.values() if v is not None]
    if len(values) >= 2:
        verdict = "rose" if values[-1] > values[0] else "did not rise"
        lines.append(f"[demo] EM {verdict} from {values[0]:.3f} to {values[-1]:.3f}")
    return {"em": em, "lines": lines}


# ----------------------------------------------------------------------------- world only


def _world_only(args) -> int:
    from raggym.data.synthetic import WorldConfig, generate_world, write_world

    started = time.perf_counter()
    cfg = WorldConfig(seed=args.seed, n_entities=args.entities)
    if args.world_out:
        stats = write_world(cfg, args.world_out, progress=not args.json)
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
    if args.world_out:
        print(f"\nfiles written to {args.world_out}")
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
