"""The demo's report: before/after evaluation metrics and training curves, as Markdown, JSON and PNG.

Inputs are plain data the pipeline already wrote:

* ``evaluations``: ``[(stage name, experiments.eval.harness.evaluate result)]`` in pipeline order,
  e.g. untrained -> after SFT -> after GRPO (``{"datasets": {name: {system: metrics}}, ...}``);
* ``train_metrics``: the trainer's ``metrics.jsonl`` records (one dict per RL step);
* ``trajectory_dir``: the trainer's ``trajectories/step-NNNNNN.jsonl`` dumps, from which the
  per-step mode mix is counted (the metrics lines do not carry it).

Everything is written atomically (temp file, then rename), so an interrupted demo never leaves a
report that looks complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from raggym.atomic import atomic_write, atomic_write_json, atomic_write_text

MODES = ("passage", "graph", "hybrid")
# Metrics the before/after table shows, in order, with their display names.
TABLE_METRICS = (("em", "EM"), ("f1", "F1"), ("eo", "EO"), ("uar", "UAR"), ("retrieval_turns", "turns"),
                 ("tokens", "tokens/q"))


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
    return out


def mode_mix(episodes: Iterable[dict]) -> dict[str, float]:
    """Share of searches in each retrieval mode over ``episodes`` (episode dicts with ``modes``).

    Returns zeros (and ``searches`` = 0) when no episode searched, so a step without searches
    plots as an empty bar instead of dividing by zero.
    """
    counts = dict.fromkeys(MODES, 0)
    for ep in episodes:
        for m in ep.get("modes") or ():
            if m in counts:
                counts[m] += 1
    total = sum(counts.values())
    return {**{m: (c / total if total else 0.0) for m, c in counts.items()}, "searches": total}


def mode_mix_by_step(trajectory_dir: str | Path) -> list[dict]:
    """``[{"step": s, passage/graph/hybrid shares, "searches": n}]`` from the trainer's dumps."""
    folder = Path(trajectory_dir)
    rows = []
    for path in sorted(folder.glob("step-*.jsonl")) if folder.is_dir() else []:
        step = int(path.stem.split("-")[1])
        rows.append({"step": step, **mode_mix(t.get("episode", {}) for t in read_jsonl(path))})
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def comparison_rows(evaluations: list[tuple[str, dict]]) -> list[dict]:
    """One row per (dataset, system) of the last evaluation, with each stage's metrics and the
    change from the first stage to the last."""
    if not evaluations:
        return []
    first, last = evaluations[0][1], evaluations[-1][1]
    rows = []
    for dataset, systems in (last.get("datasets") or {}).items():
        for system in systems:
            row: dict[str, Any] = {"dataset": dataset, "system": system}
            for key, _ in TABLE_METRICS:
                values = {stage: (res.get("datasets") or {}).get(dataset, {}).get(system, {}).get(key)
                          for stage, res in evaluations}
                a = (first.get("datasets") or {}).get(dataset, {}).get(system, {}).get(key)
                b = systems[system].get(key)
                delta = (b - a) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
                row[key] = {**values, "delta": delta}
            row["mode_mix"] = {stage: (res.get("datasets") or {}).get(dataset, {}).get(system, {}).get("mode_mix")
                               for stage, res in evaluations}
            rows.append(row)
    return rows


def markdown_report(meta: dict, stages: list[str], rows: list[dict], train_metrics: list[dict], plots: dict[str, str],
                    sections: list[str] = ()) -> str:
    lines = [f"# {meta.get('title', 'raggym demo report')}", ""]
    for key, value in meta.items():
        if key != "title":
            lines.append(f"- **{key}**: {_fmt(value) if not isinstance(value, (dict, list)) else json.dumps(value)}")
    lines += ["", "## Held-out evaluation by stage", ""]
    for key, name in TABLE_METRICS:
        if not any(row[key].get(stage) is not None for row in rows for stage in stages):
            continue
        lines += [f"**{name}**", "", "| dataset | system | " + " | ".join(stages) + " | change |",
                  "|" + "---|" * (3 + len(stages))]
        for row in rows:
            cells = [row["dataset"], row["system"], *(_fmt(row[key].get(s)) for s in stages), _fmt(row[key]["delta"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for section in sections:
        lines += [section.rstrip(), ""]
    if train_metrics:
        # the drift: |engine log-prob - learner log-prob| of the sampled tokens, before the update
        lines += ["## Training steps", "", "| step | stage | reward | EM | retrievals | answered | loss | "
                  "log-prob drift mean | drift max |", "|---|---|---|---|---|---|---|---|---|"]
        for m in train_metrics:
            lines.append("| " + " | ".join(_fmt(m.get(k)) for k in ("step", "stage", "reward_mean", "em", "retrievals_mean",
                                                                     "answered", "learner/loss", "learner/logprob_drift_mean",
                                                                     "learner/logprob_drift_max")) + " |")
    if plots:
        lines += ["", "## Curves", ""]
        lines += [f"![{name}]({path})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


def plot_curves(out_dir: Path, train_metrics: list[dict], mix: list[dict], evaluations: list[tuple[str, dict]]) -> dict[str, str]:
    """PNG plots of reward, EM, retrieval turns and mode mix over steps; returns {name: relative path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: dict[str, str] = {}
    steps = [m["step"] for m in train_metrics]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        atomic_write(out_dir / "plots" / f"{name}.png", lambda fh: fig.savefig(fh, format="png", dpi=110), mode="wb")
        plt.close(fig)
        plots[name] = f"plots/{name}.png"

    for name, key, label in (("reward", "reward_mean", "mean reward"), ("retrieval_turns", "retrievals_mean", "retrievals per episode")):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(steps, [m.get(key) for m in train_metrics], marker="o")
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        save(fig, name)

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(steps, [m.get("em") for m in train_metrics], marker="o", label="training rollouts")
    marks = [(f"held-out, {stage}", res, steps[-1] if (i == len(evaluations) - 1 and steps) else 0)
             for i, (stage, res) in enumerate(evaluations)]
    for label, res, x in marks:
        ems = [sys_m.get("em") for systems in (res.get("datasets") or {}).values() for name, sys_m in systems.items()
               if name == "agent" and sys_m.get("em") is not None]
        if ems:
            ax.scatter([x], [ems[0]], marker="s", s=60, label=label, zorder=3)
    ax.set_xlabel("RL step")
    ax.set_ylabel("exact match")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "em")

    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = [r["step"] for r in mix]
    bottom = [0.0] * len(mix)
    for mode in MODES:
        vals = [r[mode] for r in mix]
        ax.bar(xs, vals, bottom=bottom, label=mode)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("RL step")
    ax.set_ylabel("share of searches")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    save(fig, "mode_mix")
    return plots


def write_report(out_dir: str | Path, *, evaluations: list[tuple[str, dict]], train_metrics: list[dict],
                 trajectory_dir: str | Path | None = None, meta: dict | None = None, plots: bool = True,
                 extra: dict | None = None, sections: list[str] = ()) -> dict:
    """Write ``report.md``, ``report.json`` and ``plots/*.png`` under ``out_dir``; returns the JSON.

    ``extra`` adds top-level keys to ``report.json`` (the demo's ``rl_effect``); ``sections`` are
    markdown blocks inserted after the evaluation tables."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mix = mode_mix_by_step(trajectory_dir) if trajectory_dir else []
    rows = comparison_rows(evaluations)
    stages = [stage for stage, _ in evaluations]
    images = plot_curves(out, train_metrics, mix, evaluations) if plots else {}
    meta = dict(meta or {})
    report = {"meta": meta, "stages": stages, "comparison": rows, **(extra or {}), "train_metrics": train_metrics,
              "mode_mix_by_step": mix, "evaluations": dict(evaluations), "plots": images}
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", markdown_report(meta, stages, rows, train_metrics, images, sections))
    return report
