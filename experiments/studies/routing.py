"""The learning proof: does RouteRAG's RL, not SFT, teach the agent *when* to search the graph?

``python -m experiments.studies.routing`` runs, for each seed, on this CPU:

1. the **routing task** (``raggym.data.synthetic``, ``task="routing"``): one-hop lookups of two
   types. ``direct`` questions ask a relation of a film, company, university or city, stated in a
   passage titled by its subject, so a dense passage search finds it (and so, mostly, does the
   graph). ``graph_only`` questions ask a person's birthplace, employer or university; a person's
   facts are stated only in an untitled biography ("this person was born in ..."), whose
   coreference-resolved OpenIE triples name the person, so only graph retrieval reaches them.
   What the agent can see: the relation a question asks about, and a passage search's
   observation, which shows the person only in passing;
2. **SFT that teaches the format only**: golden episodes whose search mode is drawn at random
   (passage or graph, per search), so whatever routing the agent ends up with comes from RL.
   ``--sft-mode-sampling every --sft-order per-question --sft-lr-schedule linear`` instead gives
   each question once per listed mode, whole questions per batch, and a decaying lr: every batch's
   gradient at the mode slot then points at the listed share, rather than at whatever mode the
   last batches happened to draw (``docs/results.md`` has the priors measured both ways).
   ``--sft-retry-share 0.5`` repeats the search of half the questions, in the other mode, drawn
   blind to what the first search found: the data then show that a second search is allowed,
   and RL may learn to react to a passage search that missed (give ``--max-response-tokens 144``
   to leave room for it);
3. **stage 1** RouteRAG GRPO (reward = EM), then **stage 2** (EM + batch-centred efficiency with
   the deterministic retrieval cost: a graph search costs about 140x a passage search here), each
   followed by two evaluations on the held-out questions: greedy, and sampled at the training
   temperature with ``--eval-samples`` episodes per question (greedy decoding turns a policy's
   preference for a mode into 0 % or 100 %, so mode shares are read from the sampled one).

It writes ``report.json``, ``report.md`` and PNG curves under ``--out``: per question type and
stage, EM and graph share (mean and spread over seeds), retrieval cost per question, the routing
accuracy read two ways (the first search of each episode, and the mode slot's logits on golden
prefixes), the reward and graph-share curves over training steps, the mean advantage of each
type's episodes by the route of their first search (the sign of the signal RL gets), and issue
#42's targets beside issue #14's. ``docs/results.md`` records a run.
``--sft-from <earlier --out>`` starts each seed's RL from the SFT policy that earlier run trained
(its SFT and task settings must match), so RL variants are compared from the same policies.

A seed may take longer than one sitting. ``--max-minutes M`` stops the study once M minutes have
passed, after the RL step or part of a seed (SFT, an evaluation, a stage) it is in, with exit
status 3; every finished part is in ``<out>/seed<N>/progress.json`` and the RL run has a checkpoint
at its last step, so the same command, run again (in another session, after a reboot, or after
Ctrl-C, which loses the step in progress), goes on from there and redoes nothing. A seed folder
started or finished with other settings (a repeated override counts) is refused, naming what
differs: never mixed, never run over. A sitting that stops prints the seed's RL steps so far in
blocks (training EM, graph share and route advantages per type, minutes per step);
``--show-progress`` prints the same for every seed at any time, from another shell while the
study trains, without training or writing anything.

Issue #64's measurement and options: ``--heldout-per-type 48`` holds out 48 questions of each
type, fixed before training, instead of ``--heldout`` questions of any type; the report adds
routing accuracy per type at the mode slot and the cost regret against the perfect router,
(cost − perfect) / (always-graph − perfect), one search per question with its golden sub-query
(``reference_router_costs``; ``experiments.eval.harness.cost_regret``).
``--stage2-override KEY=VALUE`` (repeatable) sets a key of routing_grpo.yaml for stage 2 only, e.g.
``learner.loss.mode_entropy_coef=0.1``; the trainer options ``data.balance_by=kind`` and
``learner.loss.mode_pg_coef=K`` go in as plain overrides (both stages) or stage-2 ones.
``--probes-per-type N`` reads the mode slot on N held-out questions of each type (default 16; 48
with ``--heldout-per-type 48`` reads every one).
``--snapshot-every N`` trains stage 2 in pieces of N steps and evaluates the policy after each
and after stage 2's last step (greedy, on the engines that hold its weights, the mode slot read
from that step's checkpoint): routing accuracy per type at the mode slot, EM per type, cost per
question and its regret. Each snapshot is a part of the seed (progress.json), never redone by a
later sitting. The headline figures are the mean of each seed's last 3 snapshots
(``experiments.eval.harness.last_snapshots``), each snapshot shown in report.md.
``--em-only-control`` adds, per seed, a branch in ``<seed>/control`` from a copy of stage 1's last
checkpoint (``fork_checkpoint``), as long as stage 2 and with its snapshots, whose reward is EM at
every step: stage 2's config with ``reward.stage2_start`` at the run's end, with stage 2's
overrides but the ``reward.*`` ones (``control_overrides``), so the trainer options, the prompt
batches and the sampling seeds are stage 2's. Stage 2's effect is stage 2 minus the control, per
figure. report.json then carries ``headlines``, ``stage2_effect`` and ``issue64_targets``: issue
#64's targets, fixed here before any run (``issue64_targets``), each with its value and whether
it was met, or undecided with the reason (no control; one seed, whose spread is unavailable).

The same functions run one seed inside ``make demo`` (``experiments.demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

from actors.cluster import init_ray
from experiments.recipe.routing import (EVAL_KWARGS, RL_CONFIG, SFT_MODE_SAMPLING, SFT_ORDERS, SNAPSHOT_BRANCHES,
                                        SeedSettings, SeedStopped, build_task, finished_seed, headlines_over_seeds,
                                        issue64_targets, markdown, plot, read_seed_report, recall_by_mode,
                                        reference_router_costs, regret_by_stage, reused_sft, rl_effect,
                                        route_advantages, routing_targets, run_blocks, run_seed, say, search_costs,
                                        seed_snapshots, settings_key_of_args, sft_modes, snapshot_steps,
                                        snapshots_markdown, stage2_effect, summarise, targets, task_key_of_args,
                                        training_blocks, training_blocks_markdown)
from experiments.recipe.sft import LR_SCHEDULES
from raggym.atomic import atomic_write_json, atomic_write_text
from raggym.data.synthetic import generate_world
from raggym.retrieval import Retriever


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/routing")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--world-seed", type=int, default=0)
    p.add_argument("--entities", type=int, default=300)
    p.add_argument("--questions", type=int, default=400)
    p.add_argument("--heldout", type=int, default=64, help="held-out questions evaluated at every stage")
    for name, default in vars(SeedSettings()).items():
        if name in ("overrides", "stage2_overrides", "lr", "policy", "snapshot_every", "em_only_control"):
            continue
        choices = {"sft_lr_schedule": LR_SCHEDULES, "sft_order": tuple(SFT_ORDERS),
                   "sft_mode_sampling": SFT_MODE_SAMPLING}.get(name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, choices=choices)
    p.add_argument("--lr", type=float, default=None, help="RL learning rate (default: routing_grpo.yaml)")
    p.add_argument("--stage2-override", dest="stage2_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a key=value of routing_grpo.yaml for stage 2 only (repeat it for more), e.g. "
                        "learner.loss.mode_entropy_coef=0.1")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="N",
                   help="evaluate the policy on the held-out questions (greedy, mode slot read) after every N "
                        "stage-2 steps and after the last; the headline figures are the mean of the last 3")
    p.add_argument("--em-only-control", action="store_true",
                   help="for each seed, a second branch from stage 1's last checkpoint, as long as stage 2, rewarded "
                        "with EM only and otherwise as stage 2 (reward.* stage-2 overrides left out), with the same "
                        "snapshots, in <seed>/control")
    p.add_argument("--heldout-per-type", type=int, default=0,
                   help="hold out this many questions of each type (48: 48 direct + 48 graph_only), fixed before "
                        "training, instead of --heldout questions drawn regardless of type")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this many minutes, at the next RL step or part of a seed, with every finished "
                        "part saved (exit status 3); the same command goes on from there")
    p.add_argument("--show-progress", action="store_true",
                   help="train nothing: print each seed's RL steps so far in blocks of --block steps "
                        "(EM, graph share and route advantages per type, minutes per step)")
    p.add_argument("--block", type=int, default=5, help="steps per row of --show-progress (default 5)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of routing_grpo.yaml")
    return p


def show_progress(args) -> int:
    """``--show-progress``: every seed's training blocks so far, read from ``--out`` (nothing is
    trained or written)."""
    kinds = None  # question types: only a seed still training needs them, read from its trajectories
    for seed in args.seeds:
        seed_dir = Path(args.out) / f"seed{seed}"
        run_dir, report = seed_dir / "grpo", seed_dir / "seed_report.json"
        if report.exists():  # finished: its report keeps the curves and metrics (the run folder may be gone)
            finished = read_seed_report(report)
            rows, source = training_blocks(finished["curves"], finished["train_metrics"], args.stage1_steps, args.block), report
        elif (run_dir / "metrics.jsonl").exists():
            if kinds is None:
                world = generate_world(args.world_seed, n_entities=args.entities, n_questions=args.questions, task="routing")
                kinds = {q.id: q.kind for q in world.questions}
            rows, source = run_blocks(run_dir, kinds, args.stage1_steps, args.block), run_dir
        else:
            print(f"seed {seed}: no RL step yet (neither {report} nor {run_dir / 'metrics.jsonl'} exists)")
            continue
        print(f"seed {seed} ({source}):\n{training_blocks_markdown(rows)}")
        control = seed_dir / "control"
        if report.exists() and finished.get("control_curves"):
            rows = training_blocks(finished["control_curves"], finished["control_train_metrics"], args.stage1_steps, args.block)
            print(f"seed {seed}, EM-only control ({report}):\n{training_blocks_markdown(rows)}")
        elif (control / "metrics.jsonl").exists():
            print(f"seed {seed}, EM-only control ({control}):\n"
                  + training_blocks_markdown(run_blocks(control, kinds or {}, args.stage1_steps, args.block)))
        snaps = progress_snapshots(seed_dir, finished if report.exists() else None, args)
        if snaps:
            print(f"seed {seed}, snapshots (greedy, held-out):\n" + "\n".join(snapshots_markdown([(seed, snaps)], None)))
    return 0


def progress_snapshots(seed_dir: Path, finished: dict | None, args) -> dict:
    """A seed's snapshots so far (``seed_snapshots``): from its seed report when it is finished,
    else from its progress.json; {} when it has none."""
    if finished is not None:
        return finished.get("snapshots") or {}
    path = seed_dir / "progress.json"
    if not path.exists():
        return {}
    state = read_seed_report(path)
    return seed_snapshots(state, snapshot_steps(args.stage2_steps, args.snapshot_every), args.stage1_steps)


def run(args) -> dict | None:
    """The study's report, or None when ``--max-minutes`` stopped it first."""
    started = time.perf_counter()
    stop_at = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = build_task(out, seed=args.world_seed, entities=args.entities, questions=args.questions, heldout=args.heldout,
                      heldout_per_type=args.heldout_per_type)
    retriever = Retriever.load(task.index_dir)
    recall = recall_by_mode(retriever, task.heldout, EVAL_KWARGS["top_k"])
    costs = reference_router_costs(search_costs(retriever, task.heldout, EVAL_KWARGS["top_k"]), task.kinds)
    say(f"held-out: {dict(Counter(task.kinds[q.id] for q in task.heldout))}; one search per question costs "
         f"{costs['perfect']:.0f} routed perfectly, {costs['always_graph']:.0f} all to the graph")
    say(f"task: {len(task.train)} training, {len(task.heldout)} held-out questions; recall@{EVAL_KWARGS['top_k']} {json.dumps(recall)}")
    init_ray(num_cpus=8)
    settings = SeedSettings(**{k: getattr(args, k) for k in vars(SeedSettings())
                               if k not in ("overrides", "stage2_overrides", "policy")},
                            overrides=tuple(args.overrides), stage2_overrides=tuple(args.stage2_overrides))
    from experiments.recipe.config import load_config  # torch: on use (see the imports)

    load_config(str(RL_CONFIG), [*settings.overrides, *settings.stage2_overrides])  # a bad key fails now, not in stage 2
    sft_modes(settings.sft_modes)  # a bad spec fails here, not after the first seed's task is built
    if settings.sft_order not in SFT_ORDERS or settings.sft_mode_sampling not in SFT_MODE_SAMPLING:
        raise ValueError(f"sft_order must be one of {tuple(SFT_ORDERS)} and sft_mode_sampling one of {SFT_MODE_SAMPLING}")
    if settings.sft_from:  # every seed's earlier SFT is checked before the first seed's hour of CPU
        for seed in args.seeds:
            reused_sft(Path(settings.sft_from) / f"seed{seed}", settings, task_key_of_args(args))
    runs = []
    for seed in args.seeds:
        done = finished_seed(out / f"seed{seed}", settings, args)
        if done is not None:  # a seed is an hour of CPU: one finished in an earlier invocation is kept
            say(f"seed {seed}: finished earlier with the same settings, read from {out / f'seed{seed}'}")
            runs.append(done)
            continue
        say(f"seed {seed}")
        try:
            run = run_seed(task, seed, out / f"seed{seed}", settings, EVAL_KWARGS, task_key=task_key_of_args(args),
                           resumable=True, stop_at=stop_at)
        except SeedStopped as stopped:
            say(f"{stopped} ({args.max_minutes} minutes are up); the same command goes on from there")
            run_dir = out / f"seed{seed}" / "grpo"
            if (run_dir / "metrics.jsonl").exists():
                say(f"seed {seed}'s RL so far:\n" + training_blocks_markdown(
                    run_blocks(run_dir, task.kinds, settings.stage1_steps, args.block)))
            return None
        runs.append({**run, "settings": settings_key_of_args(settings, args)})
        atomic_write_json(out / f"seed{seed}" / "seed_report.json", runs[-1])
    table, sampled_table = summarise(runs), summarise(runs, "sampled_evaluations")
    report = {"title": "RL teaches routing: SmolLM2-135M on the routing task (CPU)",
              "command": "python -m experiments.studies.routing " + " ".join(sys.argv[1:]),
              "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
              "seeds": list(args.seeds), "settings": vars(settings), "recall": recall, "table": table,
              "sampled_table": sampled_table,
              "rl_effect": rl_effect(table, len(runs)) + rl_effect(sampled_table, len(runs), "sampled"),
              "targets": targets(table) + (targets(sampled_table, "sampled") if sampled_table else []),
              "routing_targets": routing_targets(table) + (routing_targets(sampled_table, "sampled") if sampled_table else []),
              "route_advantages": route_advantages(runs, settings.stage1_steps + 1),
              "reference_router_costs": costs,
              "cost_regret": {"greedy": regret_by_stage(table, costs), "sampled": regret_by_stage(sampled_table, costs)},
              "seed_runs": [{k: v for k, v in r.items() if k != "results"} for r in runs],
              "seconds": round(time.perf_counter() - started, 1)}
    if settings.snapshot_every:  # issue #64's figures, only then: earlier reports keep their keys
        headlines = {branch: headlines_over_seeds(runs, branch, costs) for branch in SNAPSHOT_BRANCHES
                     if any((r.get("snapshots") or {}).get(branch) for r in runs)}
        report.update(snapshot_every=settings.snapshot_every, headlines=headlines, stage2_effect=stage2_effect(headlines),
                      issue64_targets=issue64_targets(headlines))
    report["plots"] = plot(out, runs, settings.stage1_steps)
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", markdown(report))
    say(f"report: {out / 'report.md'}")
    return report


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.show_progress:
        return show_progress(args)
    return 0 if run(args) is not None else 3  # 3: stopped by --max-minutes


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
