"""``make demo`` / ``raggym demo``: the learning proof on the embedded default, end to end on this CPU.

1. generate the seeded **routing task** (``raggym.data.synthetic``, ``task="routing"``): ``direct``
   questions that a passage search answers, and ``graph_only`` ones (a person's facts, stated only
   in a biography that never names the person) that only graph retrieval reaches; build the dense
   index and the knowledge graph and measure each mode's recall@k on the held-out questions;
2. SFT of SmolLM2-135M on golden episodes of 48 training questions, each written once with a
   passage search and once with a graph search (an even mode prior, blind to the question), so it
   learns the format but not when to use which mode;
3. RouteRAG GRPO on local Ray at rollout temperature 0.7: stage 1 (reward = EM), then stage 2
   (EM + batch-centred efficiency over the retriever's deterministic cost);
4. after SFT, after stage 1 and after stage 2: greedy evaluation on the held-out questions, and
   the policy's graph preference read from its logits at the mode slot of held-out questions
   (``experiments.recipe.routing.graph_preference``);
5. ``report.md`` / ``report.json`` — with ``rl_effect``: what RL changed on the graph-only
   questions, and what stage 2 did to retrieval cost — and PNG plots.

Every number in the report is measured in this run; nothing is filled in. The same pipeline over
three seeds and more steps is ``python -m experiments.studies.routing`` (docs/results.md).
``--world-only`` builds a multi-hop world and prints its statistics.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from actors.cluster import init_ray
from experiments.eval.report import write_report
from experiments.recipe.sft import LR_SCHEDULES
from experiments.recipe.routing import (EVAL_KWARGS, SFT_MODE_SAMPLING, SFT_ORDERS, SeedSettings, build_task, plot,
                                        recall_by_mode, rl_effect, run_seed, sft_modes, summarise)
from raggym.data.synthetic import WorldConfig, generate_world, write_world
from raggym.retrieval import Retriever


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[demo] {msg}", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's arguments (``raggym demo`` and ``python -m experiments.demo``)."""
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo; replaced unless --resume)")
    p.add_argument("--resume", action="store_true", help="keep --out and reuse its index")
    p.add_argument("--seed", type=int, default=0, help="world, SFT and RL seed (default 0)")
    p.add_argument("--entities", type=int, default=300, help="synthetic world size (default 300)")
    p.add_argument("--questions", type=int, default=400, help="questions generated (default 400)")
    p.add_argument("--eval-questions", type=int, default=48, help="held-out questions evaluated at every stage (default 48)")
    p.add_argument("--policy", default="smollm2-135m", help="starting policy (model spec or HF dir)")
    p.add_argument("--sft-examples", type=int, default=48,
                   help="training questions written as golden episodes for SFT (default 48; under "
                        "--sft-mode-sampling every, each is written once per mode: 96 episodes)")
    p.add_argument("--sft-epochs", type=int, default=1)
    p.add_argument("--sft-lr", type=float, default=2e-4)
    p.add_argument("--sft-batch", type=int, default=4)
    p.add_argument("--sft-modes", default="passage,graph",
                   help="search modes of the SFT episodes (default passage,graph: an even prior that is blind to "
                        "the question; repeat a mode to weight it)")
    p.add_argument("--sft-mode-sampling", default="every", choices=SFT_MODE_SAMPLING,
                   help="every (default): each question once per listed mode; draw: one episode per question, "
                        "its modes drawn from --sft-modes")
    p.add_argument("--sft-order", default="per-question", choices=tuple(SFT_ORDERS),
                   help="SFT batch order (default per-question: a question's episodes share a batch, so every "
                        "batch holds the modes equally)")
    p.add_argument("--sft-lr-schedule", default="linear", choices=LR_SCHEDULES,
                   help="SFT learning rate over its steps (default linear decay to 0)")
    p.add_argument("--stage1-steps", type=int, default=5, help="GRPO steps of stage 1, reward EM (default 5)")
    p.add_argument("--stage2-steps", type=int, default=1, help="GRPO steps of stage 2, EM + efficiency (default 1)")
    p.add_argument("--prompts-per-step", type=int, default=4, help="questions per RL step (default 4)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per question, G (default 4)")
    p.add_argument("--rl-lr", type=float, default=None, help="RL learning rate (default: routing_grpo.yaml, 2e-5)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="RL rollout temperature (default 0.7; the learner divides its logits by the same value)")
    p.add_argument("--world-only", action="store_true", help="only build a multi-hop world and print its statistics")
    p.add_argument("--world-out", default=None, help="with --world-only: also write the world's files here")
    p.add_argument("--json", action="store_true", help="print the summary (or world statistics) as one JSON object")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of experiments/configs/routing_grpo.yaml")


def run_demo(args) -> int:
    if getattr(args, "world_only", False):
        return _world_only(args)
    return run_pipeline(args)


# ----------------------------------------------------------------------------- the pipeline


def run_pipeline(args) -> int:
    settings = demo_settings(args)  # a bad setting fails here, before --out is touched
    quiet = bool(args.json)
    started = time.perf_counter()
    out = Path(args.out or "runs/demo")
    if out.exists() and not args.resume:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    # 1. the routing task and its index --------------------------------------------------------
    t0 = time.perf_counter()
    task = build_task(out, seed=args.seed, entities=args.entities, questions=args.questions, heldout=args.eval_questions,
                      show_progress=not quiet)
    recall = recall_by_mode(Retriever.load(task.index_dir), task.heldout, EVAL_KWARGS["top_k"])
    timings = {"task_and_index": round(time.perf_counter() - t0, 1)}
    _say(f"routing task: {len(task.train)} training, {len(task.heldout)} held-out questions; recall@{EVAL_KWARGS['top_k']} "
         + "; ".join(f"{kind}: passage {r['passage_recall']:.2f}, graph {r['graph_recall']:.2f}" for kind, r in recall.items()), quiet)

    # 2.-4. format-only SFT (no mode by question type) -> eval -> stage 1 -> eval -> stage 2 -> eval ----
    init_ray(num_cpus=8)  # stays up for the evaluations and training below; ends with the process
    run = run_seed(task, args.seed, out, settings, {**EVAL_KWARGS, "show_progress": not quiet}, show_progress=not quiet)
    timings.update(run["seconds"])

    # 5. report ----------------------------------------------------------------------------------
    table = summarise([run])
    effect = rl_effect(table, 1)
    timings["total"] = round(time.perf_counter() - started, 1)
    meta = {"title": "raggym demo: RL teaches SmolLM2-135M when to search the graph (routing task, CPU)",
            "policy": args.policy, "task": f"routing, seed {args.seed}, {args.entities} entities",
            "train questions": len(task.train), "held-out questions": len(task.heldout),
            "SFT": f"{run['sft']['examples']} golden episodes ({settings.sft_examples} questions, search modes "
                   f"{settings.sft_modes}, {settings.sft_mode_sampling}), {run['sft']['steps']} steps, "
                   f"loss {run['sft']['loss_first']:.3f} -> {run['sft']['loss_last']:.3f}",
            "GRPO": f"stage 1 (EM) {settings.stage1_steps} steps, stage 2 (EM + efficiency, deterministic cost) "
                    f"{settings.stage2_steps} steps, {settings.prompts_per_step} prompts x G={settings.group_size}, "
                    f"rollout temperature {args.temperature}",
            "rollout engine": run["rollout_engine"],
            "engine-learner log-prob drift": drift_summary(run["train_metrics"]),
            "seconds": timings}
    images = plot(out, [run], settings.stage1_steps)
    report = write_report(out, evaluations=list(run["results"].items()), train_metrics=run["train_metrics"],
                          trajectory_dir=out / "grpo" / "trajectories", meta=meta,
                          extra={"rl_effect": effect, "by_question_type": table, "recall_by_mode": recall,
                                 "routing_curves": run["curves"]},
                          sections=[_effect_markdown(effect, table, recall, images)])
    summary = _summary(report)
    if args.json:
        print(json.dumps({"out_dir": str(out), "summary": summary, "rl_effect": effect, "seconds": timings}))
    else:
        for line in summary["lines"]:
            print(line)
        for e in effect:
            print(f"[demo] RL effect, {e['question_type']} questions, {e['metric']} ({e['decoding']}): {_change(e)}")
        print(f"[demo] rollout engine {meta['rollout engine']}; engine-learner log-prob drift: "
              f"{meta['engine-learner log-prob drift']}")
        print(f"[demo] report: {out / 'report.md'} (JSON: {out / 'report.json'}, plots: {out / 'plots'})")
    return 0


def drift_summary(train_metrics: list[dict]) -> str:
    """The worst per-step mean and max |engine log-prob - learner log-prob| over the RL steps."""
    means = [m["learner/logprob_drift_mean"] for m in train_metrics if m.get("learner/logprob_drift_mean") is not None]
    maxes = [m["learner/logprob_drift_max"] for m in train_metrics if m.get("learner/logprob_drift_max") is not None]
    if not means:
        return "not logged"
    return f"per-token mean at most {max(means):.2e} over {len(means)} steps (max {max(maxes):.2e})"


def demo_settings(args):
    """The ``SeedSettings`` of ``raggym demo``'s arguments; the rollout temperature goes in as an
    override of routing_grpo.yaml (before the user's own overrides, which win)."""
    sft_modes(args.sft_modes)
    return SeedSettings(sft_examples=args.sft_examples, sft_epochs=args.sft_epochs, sft_lr=args.sft_lr,
                        sft_batch=args.sft_batch, sft_modes=args.sft_modes, sft_mode_sampling=args.sft_mode_sampling,
                        sft_order=args.sft_order, sft_lr_schedule=args.sft_lr_schedule,
                        stage1_steps=args.stage1_steps, stage2_steps=args.stage2_steps,
                        prompts_per_step=args.prompts_per_step, group_size=args.group_size, lr=args.rl_lr,
                        eval_samples=0, policy=args.policy,
                        overrides=(f"rollout.temperature={args.temperature}", *args.overrides))


def _change(entry: dict) -> str:
    """``after SFT x -> after stage 1 y`` (and ``-> after stage 2 z`` for stage 2's entries)."""
    text = f"after SFT {entry['after_sft']:.3f}"
    if "after_stage1" in entry and entry["rl_stage"] == "stage 2":
        text += f" -> after stage 1 {entry['after_stage1']:.3f}"
    return text + f" -> after {entry['rl_stage']} {entry['after_rl']:.3f}"


def _effect_markdown(effect: list[dict], table: dict, recall: dict, images: dict) -> str:
    """The routing section of report.md: recall by mode, the per-type table and ``rl_effect``."""
    lines = ["## What RL changed", "", "`graph_only` questions need graph retrieval; `direct` ones are answered by a "
             "passage search as well, at a fraction of the cost. Retrieval on the held-out questions (golden sub-query):", "",
             "| type | questions | passage recall | graph recall | passage cost / search | graph cost / search |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {kind} | {r['questions']} | {r['passage_recall']:.3f} | {r['graph_recall']:.3f} | {r['passage_cost']:.0f} | "
              f"{r['graph_cost']:.0f} |" for kind, r in recall.items()]
    lines += ["", "| stage | type | EM (greedy) | graph share of searches (greedy) | p(graph) at the mode slot | "
              "searches / question | retrieval cost / question |", "|---|---|---|---|---|---|---|"]
    for stage, kinds in table.items():
        for kind, m in kinds.items():
            share, preference = m["graph_share"]["mean"], m.get("graph_preference", {}).get("mean")
            lines.append(f"| {stage} | {kind} | {m['em']['mean']:.3f} | {'–' if share is None else f'{share:.3f}'} | "
                         f"{'–' if preference is None else f'{preference:.3f}'} | {m['searches_per_question']['mean']:.2f} | "
                         f"{m['cost_per_question']['mean']:.0f} |")
    lines += ["", "`rl_effect` (also in report.json):", ""]
    lines += [f"- {e['question_type']} {e['metric']} ({e['decoding']}): {_change(e)}" for e in effect]
    lines += ["", *(f"![{name}]({path})" for name, path in images.items())]
    return "\n".join(lines)


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
    parser = argparse.ArgumentParser(prog="python -m experiments.demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
