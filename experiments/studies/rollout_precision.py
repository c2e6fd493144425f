"""Rollout precision (issue #68): does RL learn as well from bf16 rollouts as from fp32 ones?

Three variants of ``make demo``'s setting (the routing task, SmolLM2-135M, the 96-episode
format-only SFT, 5 stage-1 GRPO steps of 4 prompts x G=4 at temperature 0.7, then 1 stage-2 step),
each a run of the routing study (``experiments.studies.routing``) in a folder of its own:

    fp32       the vLLM engine rolls out in float32 (the CPU default); it trains each seed's SFT
    bf16       the engine rolls out in bfloat16 (``rollout.dtype``), the learner stays float32
    bf16_tis   as bf16, with token-level truncated importance sampling, min(π_old / π_rollout, 2)
               (``learner.loss.rollout_correction``; π_old from the learner's own pass)

The bf16 variants start from the fp32 run's SFT policy of the same seed (``--sft-from``), so
that per seed the three differ only in their RL. ``--run`` trains what is missing, one variant
and seed at a time (each run alone on the CPU: rollout tokens/s are compared across runs); the
report reads the runs' own files:

- the held-out greedy evaluation after SFT and after stage 1 (EM, graph share, and p(graph) read
  from the float32 policy's logits at the mode slot, which no engine precision touches);
- per stage-1 step, from the run's trajectories and metrics: ``graph_only`` EM and graph share of
  the training rollouts, the rollout-vs-learner diagnostics (KL k1 and k3, perplexity ratio, χ²,
  the truncated share and the IS weights), rollout tokens/s, and seconds of rollout and learning;
- issue #68's target, fixed before the runs: bf16 + truncated IS holds when its mean over seeds of
  the ``graph_only`` EM after stage 1 lies within the fp32 seeds' range; the same reading is
  written for bf16 without correction.

    python -m experiments.studies.rollout_precision --out /root/runs/issue68 --seeds 0 1 2 --run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from experiments.eval.report import read_jsonl

# the routing study's flags for raggym demo's defaults (experiments/demo.py: demo_settings)
DEMO_FLAGS = ("--world-seed", "0", "--heldout", "48", "--sft-examples", "48", "--sft-epochs", "1", "--sft-lr", "2e-4",
              "--sft-batch", "4", "--sft-modes", "passage,graph", "--sft-mode-sampling", "every",
              "--sft-order", "per-question", "--sft-lr-schedule", "linear", "--stage1-steps", "5",
              "--stage2-steps", "1", "--prompts-per-step", "4", "--group-size", "4", "--eval-samples", "0")
STAGE1_STEPS = 5
TRUNCATED_IS = ("learner.old_logprobs=recompute", "learner.loss.rollout_correction.level=token",
                "learner.loss.rollout_correction.kind=truncate", "learner.loss.rollout_correction.threshold=2.0")
VARIANTS: dict[str, tuple[str, ...]] = {
    "fp32": ("rollout.temperature=0.7",),
    "bf16": ("rollout.temperature=0.7", "rollout.dtype=bfloat16"),
    "bf16_tis": ("rollout.temperature=0.7", "rollout.dtype=bfloat16", *TRUNCATED_IS),
}
BASELINE = "fp32"  # trains the SFT policies; its seeds' range is the target's band
DIAGNOSTICS = ("kl_k1", "kl_k3", "ppl_ratio", "chi2_token", "chi2_seq", "changed_share", "weight_mean", "weight_max")


def study_command(out: Path, variant: str, seed: int) -> list[str]:
    """The routing study's command line for one variant and seed."""
    cmd = [sys.executable, "-m", "experiments.studies.routing", "--out", str(out / variant), "--seeds", str(seed),
           *DEMO_FLAGS]
    if variant != BASELINE:
        cmd += ["--sft-from", str(out / BASELINE)]
    return cmd + list(VARIANTS[variant])


def seed_report_path(out: Path, variant: str, seed: int) -> Path:
    return out / variant / f"seed{seed}" / "seed_report.json"


def run_missing(out: Path, seeds: list[int]) -> None:
    """Train every (seed, variant) without a seed report, seed by seed, the baseline first."""
    for seed in seeds:
        for variant in VARIANTS:
            if seed_report_path(out, variant, seed).exists():
                continue
            log = out / f"{variant}.seed{seed}.log"
            print(f"[rollout-precision] {variant}, seed {seed} (log: {log})", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            with log.open("w", encoding="utf-8") as handle:
                subprocess.run(study_command(out, variant, seed), stdout=handle, stderr=subprocess.STDOUT, check=True)


def question_kinds(variant_dir: Path) -> dict[str, str]:
    return {q["id"]: q["kind"] for q in read_jsonl(variant_dir / "world" / "train_questions.jsonl")}


def step_rows(seed_dir: Path, kinds: dict[str, str]) -> list[dict]:
    """Per stage-1 step: the training rollouts' EM and graph share by question type (the stage-1
    reward is EM), the learner's diagnostics, and the step's timings."""
    metrics = {m["step"]: m for m in read_jsonl(seed_dir / "grpo" / "metrics.jsonl")}
    rows = []
    for step in range(1, STAGE1_STEPS + 1):
        trajectories = read_jsonl(seed_dir / "grpo" / "trajectories" / f"step-{step:06d}.jsonl")
        m = metrics[step]
        model_tokens = sum(sum(t["loss_mask"]) for t in trajectories)
        row = {"step": step, "rollout_seconds": m["time/rollout"], "learn_seconds": m["time/learn"],
               "rollout_model_tokens": model_tokens, "rollout_tokens_per_s": model_tokens / m["time/rollout"]}
        for kind in ("graph_only", "direct"):
            episodes = [t for t in trajectories if kinds.get(t["episode"]["question_id"]) == kind]
            modes = [mode for t in episodes for mode in t["episode"].get("modes") or ()]
            row[f"em/{kind}"] = statistics.fmean(t["reward"] for t in episodes) if episodes else None
            row[f"graph_share/{kind}"] = modes.count("graph") / len(modes) if modes else None
        row.update({name: m.get(f"learner/rollout_is/{name}") for name in DIAGNOSTICS})
        rows.append(row)
    return rows


def _by_type(evaluation: dict, kind: str, metric: str):
    return evaluation[kind].get(metric)


def seed_summary(out: Path, variant: str, seed: int, kinds: dict[str, str]) -> dict:
    report = json.loads(seed_report_path(out, variant, seed).read_text(encoding="utf-8"))
    evals = report["evaluations"]
    held_out = {stage: {f"{metric}/{kind}": _by_type(evals[stage], kind, metric)
                        for kind in ("graph_only", "direct") for metric in ("em", "graph_share", "graph_preference")}
                for stage in ("after SFT", "after stage 1")}
    steps = step_rows(out / variant / f"seed{seed}", kinds)
    tokens = sum(r["rollout_model_tokens"] for r in steps)
    seconds = sum(r["rollout_seconds"] for r in steps)
    return {"seed": seed, "held_out": held_out, "steps": steps,
            "stage1_seconds": report["seconds"].get("stage1"),
            "stage1_rollout_seconds": seconds, "stage1_learn_seconds": sum(r["learn_seconds"] for r in steps),
            "stage1_rollout_tokens_per_s": tokens / seconds}


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "per_seed": values}


def target(runs: dict[str, list[dict]], variant: str) -> dict:
    """Issue #68's reading for ``variant``: its mean graph_only EM after stage 1 within the fp32 seeds' range."""
    def em(run):
        return run["held_out"]["after stage 1"]["em/graph_only"]

    band = [em(r) for r in runs[BASELINE]]
    mean = statistics.fmean(em(r) for r in runs[variant])
    return {"variant": variant, "graph_only_em_after_stage1": mean, "fp32_range": [min(band), max(band)],
            "met": min(band) <= mean <= max(band),
            "paired_difference_per_seed": [em(r) - em(b) for r, b in zip(runs[variant], runs[BASELINE])]}


def summary(out: Path, seeds: list[int]) -> dict:
    runs = {}
    for variant in VARIANTS:
        kinds = question_kinds(out / variant)
        runs[variant] = [seed_summary(out, variant, seed, kinds) for seed in seeds]
    headline = {variant: {key: _spread([r[key] for r in rs]) for key in
                          ("stage1_rollout_tokens_per_s", "stage1_seconds", "stage1_rollout_seconds", "stage1_learn_seconds")}
                for variant, rs in runs.items()}
    for variant, rs in runs.items():
        for stage in ("after SFT", "after stage 1"):
            for key in rs[0]["held_out"][stage]:
                headline[variant][f"{stage}: {key}"] = _spread([r["held_out"][stage][key] for r in rs])
        for name in DIAGNOSTICS:
            values = [row[name] for r in rs for row in r["steps"] if row[name] is not None]
            if values:
                headline[variant][f"stage 1 steps: {name}"] = {"mean": statistics.fmean(values), "max": max(values)}
    speed = {variant: headline[variant]["stage1_rollout_tokens_per_s"]["mean"]
             / headline[BASELINE]["stage1_rollout_tokens_per_s"]["mean"] for variant in VARIANTS}
    return {"seeds": seeds, "variants": {v: list(o) for v, o in VARIANTS.items()}, "runs": runs, "headline": headline,
            "rollout_speed_vs_fp32": speed, "targets": [target(runs, v) for v in VARIANTS if v != BASELINE]}


def markdown(s: dict) -> str:
    lines = [f"Seeds {s['seeds']}; held-out greedy evaluation (48 questions), stage-1 steps from the runs' files.", "",
             "| variant | graph_only EM after SFT | after stage 1 (per seed) | p(graph), graph_only, after stage 1 | "
             "direct EM after stage 1 | rollout tok/s, 5 steps pooled | stage-1 s |", "|---|---|---|---|---|---|---|"]
    for variant, h in s["headline"].items():
        em = h["after stage 1: em/graph_only"]
        lines.append(f"| {variant} | {h['after SFT: em/graph_only']['mean']:.3f} | {em['mean']:.3f} "
                     f"({', '.join(f'{v:.3f}' for v in em['per_seed'])}) | "
                     f"{h['after stage 1: graph_preference/graph_only']['mean']:.3f} | "
                     f"{h['after stage 1: em/direct']['mean']:.3f} | {h['stage1_rollout_tokens_per_s']['mean']:.1f} | "
                     f"{h['stage1_seconds']['mean']:.0f} |")
    lines += ["", "| variant | seed | step | graph_only EM (train) | graph share, graph_only | KL k3 | χ² token | "
              "truncated | IS weight max | rollout tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for variant, runs in s["runs"].items():
        for run in runs:
            for r in run["steps"]:
                cells = [r["em/graph_only"], r["graph_share/graph_only"], r["kl_k3"], r["chi2_token"],
                         r["changed_share"], r["weight_max"], r["rollout_tokens_per_s"]]
                lines.append(f"| {variant} | {run['seed']} | {r['step']} | "
                             + " | ".join("—" if c is None else f"{c:.4g}" for c in cells) + " |")
    lines.append("")
    for t in s["targets"]:
        lines.append(f"- {t['variant']}: mean graph_only EM after stage 1 {t['graph_only_em_after_stage1']:.3f}, "
                     f"fp32 range [{t['fp32_range'][0]:.3f}, {t['fp32_range'][1]:.3f}]: "
                     f"{'within' if t['met'] else 'NOT within'}; per seed minus fp32: "
                     + ", ".join(f"{d:+.3f}" for d in t["paired_difference_per_seed"]))
    lines.append("- rollout speed against fp32: " + ", ".join(f"{v} {x:.3f}x" for v, x in s["rollout_speed_vs_fp32"].items()))
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    """graph_only EM and graph share of the training rollouts per stage-1 step, mean over seeds."""
    import matplotlib  # on use: only the report draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    # equal curves are the expected case (bf16 rarely moves a seeded draw): styles keep each visible
    styles = {"fp32": ("-", "o", 9), "bf16": ("--", "s", 6), "bf16_tis": (":", "^", 4)}
    for variant, runs in s["runs"].items():
        line, marker, size = styles.get(variant, ("-", "o", 5))
        for ax, key in zip(axes, ("em/graph_only", "graph_share/graph_only")):
            per_step = [statistics.fmean(run["steps"][i][key] for run in runs if run["steps"][i][key] is not None)
                        for i in range(STAGE1_STEPS)]
            ax.plot(range(1, STAGE1_STEPS + 1), per_step, linestyle=line, marker=marker, markersize=size, label=variant)
            ax.set_title(f"{key}, training rollouts (mean of seeds)", fontsize=10)
            ax.set_xlabel("stage-1 step")
            ax.set_xticks(range(1, STAGE1_STEPS + 1))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.rollout_precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder of the three variants' runs (each a routing study --out)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--run", action="store_true", help="train the variants and seeds that have no seed report yet")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.run:
        run_missing(out, args.seeds)
    missing = [str(seed_report_path(out, v, s)) for s in args.seeds for v in VARIANTS if not seed_report_path(out, v, s).exists()]
    if missing:
        print(f"no seed report yet (train them with --run): {', '.join(missing)}", file=sys.stderr)
        return 2
    s = summary(out, args.seeds)
    (out / "report.json").write_text(json.dumps(s, indent=1), encoding="utf-8")
    (out / "report.md").write_text(markdown(s), encoding="utf-8")
    plot(s, out / "curves.png")
    print(json.dumps({"headline": s["headline"], "targets": s["targets"], "rollout_speed_vs_fp32": s["rollout_speed_vs_fp32"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
