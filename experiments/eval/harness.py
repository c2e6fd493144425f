"""Evaluation harness: a policy × datasets × systems, through the Ray rollout path.

    python -m experiments.eval --policy smollm2-135m --dataset ../shared/data/musique_sub \\
        --systems direct vanilla_rag agent --out runs/eval
    raggym eval ...   (same arguments)

Systems (none needs training):

``direct``        the question only, a direct-answer prompt, retrieval budget 0;
``vanilla_rag``   one dense (passage) retrieval with the question as the query, the top-k passages
                  placed in the prompt, then an answer (no further search);
``agent``         the dialect's full multi-turn search (RouteRAG: passage, graph and hybrid);
``passage_only``, ``graph_only``, ``hybrid_only``
                  the agent restricted to one retrieval mode (``RagSearchEnv(allowed_modes=...)``).

Every system runs as episodes of the dialect's environment on EnvRunner actors, with generation
on RolloutWorker actors and retrieval on the RetrievalService, exactly as training rollouts do
(``actors.runtime.RayRuntime`` and ``evaluate_episodes``, the one evaluator that
in-training evaluation and the SFT check use too). Graph systems on an index without a
knowledge graph are skipped with a reason; the agent there searches in passage mode only (noted).

Outputs under ``out_dir`` (all written atomically): ``results.json`` (per dataset and system
metrics, their average over datasets, skipped systems, settings), ``results.md`` (the papers'
table: rows = systems, EM/F1 per dataset, then the average; plus an efficiency table) and
``trajectories/<dataset>__<system>.jsonl`` (one line per question: the full trajectory, its
episode record and its metrics).

Metrics per dataset and system (means over questions): EM, F1 (SQuAD normalisation, max over
gold aliases), cover-EM, EO (evidence overlap with gold passages, over questions that have them),
UAR (unsupported-answer rate, over questions whose answer has tokens), retrieval turns, retrieval
seconds and cost, the mode mix (share of searches per mode), generated tokens per question,
answered share, format errors and truncations. Definitions: ``raggym.rewards.metrics``.

``correct`` is the share of answers judged correct: by the LLM judge when one is given
(``--judge-model``, ``evaluate(judge=...)``; the same judge LWS training uses, see
``experiments.recipe.judge``), else by the fallback rule EM = 1 or F1 ≥ 0.5. ``settings.judge`` says which.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tqdm.auto import tqdm

from actors.cluster import init_ray
from envs import SEARCH_ENV_IDS
from experiments.recipe.judge import make_judge
from raggym.atomic import atomic_write_json, atomic_write_text
from raggym.config_nodes import EPISODE_LIMITS, check_runtime_serves
from raggym.data import DataFormatError, load_corpus, load_questions, write_jsonl
from raggym.data.splits import split_questions
from raggym.data.synthetic import generate_world
from raggym.judge import judge_many, lexical_correct
from raggym.models import ModelSpecError, cache_dir, resolve_model_spec
from raggym.protocol import get_dialect
from raggym.retrieval import ensure_index
from raggym.retrieval.retriever import corpus_fingerprint
from raggym.retrieval.storage import read_manifest

# Ray, torch and the modules that import torch (raggym.rewards, envs.rollout, actors.runtime,
# experiments.recipe.training, experiments.recipe.config) are imported in the functions that use them: `raggym` imports this module
# when it starts (the eval subcommand's arguments); torch would add about 1.5 s and Ray 0.3 s to
# every command, --help too.

MODES = ("passage", "graph", "hybrid")
SYSTEMS = ("direct", "vanilla_rag", "agent", "passage_only", "graph_only", "hybrid_only")
SINGLE_MODE = {"passage_only": "passage", "graph_only": "graph", "hybrid_only": "hybrid"}
GRAPH_SYSTEMS = ("graph_only", "hybrid_only")
DEFAULT_RESPONSE_TOKENS = 256
DEFAULT_TURN_TOKENS = 96
DEFAULT_BUDGET = 4
EVAL_KV_CACHE_GIB = 1  # vLLM's KV cache per engine on a CPU (GiB): an evaluation's contexts are short
CHUNK_QUESTIONS = 32  # questions per rollout call: larger engine batches; the progress bar moves once per call


# ----------------------------------------------------------------------------- prompts


def _answer_example() -> str:
    return "<answer> Paris </answer>"


class DirectPrompt:
    """Closed-book prompt: answer from the model's own knowledge, in the dialect's answer tags."""

    def __call__(self, question, dialect) -> str:
        return (
            "Answer the question below from your own knowledge; no search is available. You may "
            "reason briefly inside <think> and </think>, then give the answer inside <answer> and "
            f"</answer> as a short phrase without explanation, for example {_answer_example()}.\n\n"
            f"Question: {question.question}\n"
        )


class ContextPrompt:
    """Retrieve-then-read prompt: the passages retrieved for each question (by id) come first."""

    def __init__(self, documents: dict[str, str]):
        self.documents = dict(documents)

    def __call__(self, question, dialect) -> str:
        if question.id not in self.documents:
            raise ValueError(f"no retrieved passages for question {question.id!r}")
        return (
            "Answer the question below using the documents. You may reason briefly inside <think> "
            "and </think>, then give the answer inside <answer> and </answer> as a short phrase "
            f"without explanation, for example {_answer_example()}.\n\n"
            f"Documents:\n{self.documents[question.id]}\n"
            f"Question: {question.question}\n"
        )


# ----------------------------------------------------------------------------- metrics


def episode_metrics(trajectory: dict, correct: bool | None = None) -> dict:
    """Metrics of one evaluated episode (a trajectory dict with ``episode`` and ``loss_mask``).

    ``correct`` is a judge's verdict on the answer; without one the fallback rule decides."""
    from raggym.rewards import EpisodeOutcome  # torch: on use (see the imports)
    from raggym.rewards.metrics import outcome_metrics

    ep = trajectory["episode"]
    outcome = EpisodeOutcome.from_dict(ep)
    m = outcome_metrics(outcome)
    if correct is None:
        correct = lexical_correct(outcome.answer, outcome.gold_answers)
    return {
        "em": m["em"], "f1": m["f1"], "correct": bool(correct), "cover_em": m["cover_em"], "eo": m["eo"], "uar": m["uar"],
        "retrieval_turns": int(m["retrieval_count"]), "retrieval_seconds": float(m["retrieval_seconds"]),
        "retrieval_cost": float(m["retrieval_cost"]), "modes": [str(x) for x in ep.get("modes") or ()],
        "tokens": int(sum(trajectory.get("loss_mask") or ())), "answered": ep.get("answer") is not None,
        "format_errors": int(ep.get("num_format_errors") or 0), "truncated": bool(ep.get("truncated")),
    }


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def aggregate(per_episode: Sequence[dict]) -> dict:
    """Means over questions of ``episode_metrics`` records.

    ``eo`` averages over questions with gold passages and ``uar`` over answers with tokens
    (``None`` when there are none); ``mode_mix`` is each mode's share of all searches.
    """
    n = len(per_episode)
    if n == 0:
        raise ValueError("no episodes to aggregate")
    counts = dict.fromkeys(MODES, 0)
    for e in per_episode:
        for mode in e["modes"]:
            if mode in counts:
                counts[mode] += 1
    searches = sum(counts.values())
    out: dict[str, Any] = {"n": n}
    for key in ("em", "f1", "cover_em", "retrieval_turns", "retrieval_seconds", "retrieval_cost", "tokens",
                "format_errors"):
        out[key] = sum(float(e[key]) for e in per_episode) / n
    out["correct"] = _mean(float(e["correct"]) for e in per_episode if "correct" in e)
    out["eo"] = _mean(e["eo"] for e in per_episode)
    out["eo_questions"] = sum(e["eo"] is not None for e in per_episode)
    out["uar"] = _mean(e["uar"] for e in per_episode)
    out["uar_questions"] = sum(e["uar"] is not None for e in per_episode)
    out["answered"] = sum(bool(e["answered"]) for e in per_episode) / n
    out["truncated"] = sum(bool(e["truncated"]) for e in per_episode) / n
    out["mode_counts"] = counts
    out["mode_mix"] = {**{m: (c / searches if searches else 0.0) for m, c in counts.items()}, "searches": searches}
    return out


_AVERAGED = ("em", "f1", "correct", "cover_em", "eo", "uar", "retrieval_turns", "retrieval_seconds", "retrieval_cost", "tokens",
             "answered", "format_errors", "truncated")


def average_over_datasets(by_dataset: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per system: the unweighted mean over the datasets it ran on (as the papers' Avg column);
    the mode mix pools the searches of those datasets."""
    systems: dict[str, list[tuple[str, dict]]] = {}
    for dataset, per_system in by_dataset.items():
        for system, metrics in per_system.items():
            systems.setdefault(system, []).append((dataset, metrics))
    out = {}
    for system, rows in systems.items():
        avg: dict[str, Any] = {"datasets": [d for d, _ in rows], "n": sum(m["n"] for _, m in rows)}
        for key in _AVERAGED:
            avg[key] = _mean(m.get(key) for _, m in rows)
        counts = {mode: sum(m["mode_counts"][mode] for _, m in rows) for mode in MODES}
        searches = sum(counts.values())
        avg["mode_counts"] = counts
        avg["mode_mix"] = {**{m: (c / searches if searches else 0.0) for m, c in counts.items()}, "searches": searches}
        out[system] = avg
    return out


# ----------------------------------------------------------------------------- routing measures
# Pure functions for a router's evaluation (issue #64): what its retrieval costs against the best
# and the worst fixed routers, and headline figures read from several snapshots.


def router_cost(mode_costs: Mapping[str, Mapping[str, float]], route: Mapping[str, str] | str) -> float:
    """Mean retrieval cost per question of a router that gives each question ``q`` one search in the
    mode ``route[q]`` (or every question the mode ``route`` names): mean_q ``mode_costs[q][route_q]``,
    ``mode_costs[q]`` being one search's cost in each mode."""
    if not mode_costs:
        raise ValueError("no questions to cost")
    return sum(float(costs[route if isinstance(route, str) else route[q]]) for q, costs in mode_costs.items()) / len(mode_costs)


def cost_regret(cost: float, perfect: float, always_graph: float) -> float | None:
    """(cost − perfect) / (always_graph − perfect): 0 at the cost of the perfect router (each
    question to its right mode), 1 at the cost of sending every question to the graph, below 0 for
    a router cheaper than the perfect one (it saves by sending questions the wrong way), above 1 for
    one dearer than always-graph (more searches than one). None when always-graph costs no more than
    the perfect router (no question to route elsewhere)."""
    span = always_graph - perfect
    return (cost - perfect) / span if span > 0 else None  # (cost − perfect) / (always_graph − perfect)


def last_snapshots(snapshots: Iterable[tuple[int, float | None]], count: int = 3) -> dict:
    """A headline figure from a run's last ``count`` snapshots, ``(step, value)`` in any order:
    ``{"mean", "snapshots": [{"step", "value"}, ...]}`` with the snapshots the mean reads, oldest
    first (fewer when the run has fewer). One snapshot swings (routing accuracy moved 0.56–0.97
    between neighbouring snapshots in issue #42's run); the mean of several, each shown, does less.
    ``mean`` is None when a snapshot the mean needs has no value."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    last = sorted(snapshots, key=lambda s: s[0])[-count:]
    if not last:
        raise ValueError("no snapshots")
    values = [v for _, v in last]
    mean = None if None in values else sum(values) / len(values)
    return {"mean": mean, "snapshots": [{"step": int(step), "value": value} for step, value in last]}


def last_snapshots_text(summary: dict, spec: str = ".3f") -> str:
    """``last_snapshots``' figure as text: ``0.810 (steps 8 / 10 / 12: 0.790 / 0.830 / 0.810)``."""
    def number(v):
        return "n/a" if v is None else format(v, spec)

    shown = summary["snapshots"]
    return (f"{number(summary['mean'])} (steps {' / '.join(str(s['step']) for s in shown)}: "
            f"{' / '.join(number(s['value']) for s in shown)})")


# ----------------------------------------------------------------------------- report


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100.0 * v:.1f}"


def _num(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def markdown_table(results: dict) -> str:
    """The papers' layout: one row per system, EM and F1 per dataset, then the average.

    EM/F1 are percentages. An average over fewer datasets than the table has is marked †.
    A second table lists evidence and efficiency numbers per dataset and system.
    """
    datasets = list(results["datasets"])
    systems: list[str] = []
    for per_system in results["datasets"].values():
        systems += [s for s in per_system if s not in systems]
    head = ["System"] + [f"{d} {m}" for d in datasets for m in ("EM", "F1")] + ["Avg EM", "Avg F1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system in systems:
        cells = [system]
        for d in datasets:
            m = results["datasets"][d].get(system)
            cells += [_pct(m["em"]) if m else "–", _pct(m["f1"]) if m else "–"]
        avg = results["average"].get(system)
        mark = "†" if avg and len(avg["datasets"]) < len(datasets) else ""
        cells += [_pct(avg["em"]) + mark if avg else "–", _pct(avg["f1"]) + mark if avg else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if any(len(a["datasets"]) < len(datasets) for a in results["average"].values()):
        notes.append("† averaged over the datasets the system ran on (see skipped).")
    for s in results.get("skipped", []):
        notes.append(f"skipped {s['system']} on {s['dataset']}: {s['reason']}")
    for n in results.get("notes", []):
        notes.append(n)
    lines.append("")
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    lines += ["| Dataset | System | n | EO | UAR | turns | ret. ms/q | ret. cost/q | passage / graph / hybrid | tokens/q | answered |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in datasets:
        for system, m in results["datasets"][d].items():
            mix = m["mode_mix"]
            mix_cell = "–" if not mix["searches"] else " / ".join(f"{100 * mix[x]:.0f}%" for x in MODES)
            lines.append("| " + " | ".join([
                d, system, str(m["n"]), _num(m["eo"], 3), _num(m["uar"], 3), _num(m["retrieval_turns"]),
                _num(1000.0 * m["retrieval_seconds"], 1), _num(m["retrieval_cost"], 0), mix_cell, _num(m["tokens"], 1),
                _pct(m["answered"]) + "%"]) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- inputs


def resolve_policy(policy: str | os.PathLike) -> str:
    """A model spec or HF dir as given; a checkpoint dir -> its ``policy/``; a run dir -> the
    ``policy/`` of its latest complete checkpoint."""
    from experiments.recipe.training import latest_checkpoint  # torch: on use (see the imports)

    path = Path(policy)
    if path.is_dir():
        if (path / "checkpoints").is_dir():
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise ModelSpecError(f"run directory {path} has no complete checkpoint under checkpoints/")
            path = ckpt
        if (path / "trainer_state.json").exists() or (path / "policy" / "config.json").exists():
            if not (path / "policy" / "config.json").exists():
                raise ModelSpecError(f"checkpoint {path} has no policy/ (HF model directory)")
            path = path / "policy"
        resolve_model_spec(str(path))
        return str(path)
    resolve_model_spec(str(policy))
    return str(policy)


def dataset_from_dir(path: str | os.PathLike, name: str | None = None) -> dict:
    """A ``files`` dataset dict for a folder with ``corpus.*``, ``questions.*`` and maybe ``openie*.json``."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"dataset folder {folder} does not exist")

    def one(pattern: str, required: bool) -> str | None:
        found = sorted(p for p in folder.glob(pattern) if p.is_file())
        if not found:
            if required:
                raise FileNotFoundError(f"dataset folder {folder} has no {pattern} file")
            return None
        return str(found[0])

    return {"name": name or folder.name, "source": "files", "corpus": one("corpus.*", True),
            "questions": one("questions.*", True), "openie": one("openie*.json", False), "index_dir": None}


def _check_dataset(d: dict) -> None:
    if not isinstance(d, dict) or not d.get("name"):
        raise ValueError(f"each dataset must be a dict with a 'name', got {d!r}")
    if d.get("source") not in ("synthetic", "files"):
        raise ValueError(f"dataset {d['name']!r}: source must be 'synthetic' or 'files', got {d.get('source')!r}")
    if d["source"] == "files" and (not d.get("corpus") or not d.get("questions")):
        raise ValueError(f"dataset {d['name']!r}: a files dataset needs 'corpus' and 'questions'")
    if d.get("split", "all") not in ("heldout", "train", "all"):
        raise ValueError(f"dataset {d['name']!r}: split must be 'heldout', 'train' or 'all', got {d.get('split')!r}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", str(d["name"])):
        raise ValueError(f"dataset name {d['name']!r} may use letters, digits, '.', '_' and '-' only")


def load_dataset(d: dict, index_cache: Path, max_questions: int | None, show_progress: bool = True):
    """``(questions, corpus, index_dir, has_graph)``; builds and caches the index when needed."""
    if d["source"] == "synthetic":
        knobs = dict(d.get("synthetic") or {})
        world = generate_world(**knobs)
        corpus, questions, openie = world.corpus, list(world.questions), world.openie
        split_seed = int(d.get("split_seed", knobs.get("seed", 0)))
    else:
        corpus = load_corpus(d["corpus"])
        questions = load_questions(d["questions"], corpus)
        openie = d.get("openie")
        split_seed = int(d.get("split_seed", 0))
    split = d.get("split", "heldout" if d["source"] == "synthetic" else "all")
    if split != "all":
        train, heldout = split_questions(questions, float(d.get("heldout_fraction", 0.2)), split_seed)
        questions = heldout if split == "heldout" else train
    if max_questions is not None:
        questions = questions[: int(max_questions)]
    if not questions:
        raise ValueError(f"dataset {d['name']!r} has no questions to evaluate (split {split!r})")
    if d.get("index_dir"):
        index_dir = Path(d["index_dir"])
    else:
        fingerprint = corpus_fingerprint(corpus)
        index_dir = Path(index_cache) / f"{d['name']}-{fingerprint[:12]}-{'graph' if openie else 'dense'}"
    shards = 1 if len(corpus) < 20_000 else 2  # sharding a small corpus only adds actors
    # ensure_index also refuses an index built from another corpus than this dataset's.
    ensure_index(index_dir, corpus, openie=openie, shards=shards, show_progress=show_progress)
    return questions, corpus, index_dir, bool(read_manifest(index_dir).get("has_graph"))


# ----------------------------------------------------------------------------- evaluation


def _env_id(dialect: str) -> str:
    for env_id, name in SEARCH_ENV_IDS.items():
        if name == dialect:
            return env_id
    raise ValueError(f"dialect {dialect!r} has no search environment; expected one of {sorted(SEARCH_ENV_IDS.values())}")


def plan_systems(systems: Sequence[str], has_graph: bool, dialect: str) -> tuple[list[tuple[str, dict]], list[dict], list[str]]:
    """``([(system, env settings)], skipped, notes)`` for one index.

    Env settings: ``allowed_modes``, ``budget`` ("agent" = the configured budget, or 0) and
    ``prompt`` (None, "direct" or "context"). Graph systems are skipped without a graph; the
    agent then searches in passage mode only.
    """
    d = get_dialect(dialect)
    plan, skipped, notes = [], [], []
    for system in systems:
        if system == "direct":
            plan.append((system, {"allowed_modes": None, "budget": 0, "prompt": "direct"}))
        elif system == "vanilla_rag":
            plan.append((system, {"allowed_modes": None, "budget": 0, "prompt": "context"}))
        elif system == "agent":
            modes = None
            if not has_graph and (set(d.modes) - {"passage"} or d.default_mode != "passage"):
                modes = ("passage",)
                notes.append("agent: the index has no knowledge graph, so its searches ran in passage mode only")
            plan.append((system, {"allowed_modes": modes, "budget": "agent", "prompt": None}))
        elif system in SINGLE_MODE:
            if system in GRAPH_SYSTEMS and not has_graph:
                skipped.append({"system": system, "reason": "the index has no knowledge graph (no OpenIE triples)"})
                continue
            plan.append((system, {"allowed_modes": (SINGLE_MODE[system],), "budget": "agent", "prompt": None}))
        else:
            raise ValueError(f"unknown system {system!r}; expected one of {', '.join(SYSTEMS)}")
    return plan, skipped, notes


def _system_env_kwargs(rt, system: str, spec: dict, questions, *, dialect: str, top_k: int,
                       budget: int) -> tuple[dict, dict]:
    """``(env kwargs, prompt retrievals by question id)`` of one system."""
    import ray  # on use (see the imports)

    env_kwargs: dict[str, Any] = {"top_k": top_k, "retrieval_budget": budget if spec["budget"] == "agent" else 0}
    if spec["allowed_modes"] is not None:
        env_kwargs["allowed_modes"] = tuple(spec["allowed_modes"])
    pre: dict = {}
    if spec["prompt"] == "direct":
        env_kwargs["prompt_fn"] = DirectPrompt()
    elif spec["prompt"] == "context":
        # The one retrieval of retrieve-then-read, batched on the same service the agents use.
        results = ray.get(rt.service.retrieve.remote([q.question for q in questions], "passage", int(top_k)))
        d = get_dialect(dialect)
        pre = {q.id: r for q, r in zip(questions, results)}
        env_kwargs["prompt_fn"] = ContextPrompt({qid: d.render_documents(r.hits) for qid, r in pre.items()})
    return env_kwargs, pre


def episode_records(rollouts) -> list[dict]:
    """One plain dict per episode (``Rollout.as_dict()``) from the rollouts of a batch of episodes.

    An episode of a ``replace``-mode env (R1-Router) has one rollout per model call; its record is
    the last call's, with the loss masks of all its calls joined so ``tokens`` counts every call.
    """
    episodes: list[dict] = []
    key = None
    for r in rollouts:
        if (r.prompt_id, r.sample_index) == key:  # a later call of the same episode
            record = r.as_dict()
            record["loss_mask"] = episodes[-1]["loss_mask"] + record["loss_mask"]
            episodes[-1] = record
        else:
            episodes.append(r.as_dict())
        key = (r.prompt_id, r.sample_index)
    return episodes


def evaluate_episodes(runtime, questions, sampling, *, env_kwargs: dict | None = None, tag: str = "eval",
                      prompt_retrievals: dict | None = None, judge=None) -> tuple[list[dict], dict]:
    """The one evaluator (harness, in-training evaluation, the SFT check): one episode per
    question on ``runtime`` (``actors.runtime``), then ``episode_metrics`` and ``aggregate``.
    ``judge(question, answer, golds) -> bool`` decides ``correct`` (default: EM or F1 ≥ 0.5).

    ``prompt_retrievals`` (question id -> ``QueryResult``) are retrievals made for the prompt
    (retrieve-then-read); they are recorded in the episode as a search turn would be.
    Returns ``(episode records, aggregated metrics)``.
    """
    from envs.rollout import EpisodeRequest  # torch: on use (see the imports)

    requests = [EpisodeRequest(q, f"{tag}:{q.id}") for q in questions]
    episodes = episode_records(runtime.rollout(requests, sampling, env_kwargs))
    for t in episodes:
        r = (prompt_retrievals or {}).get(t["episode"].get("question_id"))
        if r is not None:
            t["episode"].update(queries=[r.query], modes=["passage"], retrieved_ids=[[h.id for h in r.hits]],
                                retrieved_texts=[[h.text for h in r.hits]], num_retrievals=1,
                                retrieval_seconds=float(r.seconds), retrieval_cost=float(r.cost),
                                prompt_retrieval=True)
    verdicts = judged_correct(episodes, judge)
    for t, verdict in zip(episodes, verdicts):
        t["metrics"] = episode_metrics(t, verdict)
    return episodes, aggregate([t["metrics"] for t in episodes])


def judged_correct(episodes: Sequence[dict], judge) -> list[bool | None]:
    """The judge's verdict per episode record (all in one batch), or None each without a judge."""
    if judge is None:
        return [None] * len(episodes)
    from raggym.rewards import EpisodeOutcome  # torch: on use (see the imports)

    outcomes = [EpisodeOutcome.from_dict(t["episode"]) for t in episodes]
    return judge_many(judge, [(o.question, o.answer, o.gold_answers) for o in outcomes])


def _eval_config(policy_path: str, dialect: str, *, engine: str, workers: int, temperature: float, seed: int,
                 max_response_tokens: int, max_turn_tokens: int, max_observation_tokens: int):
    from experiments.recipe.config import config_from_dict  # torch: on use (see the imports)

    engine_kwargs = {"kv_cache_gib": EVAL_KV_CACHE_GIB} if engine == "vllm-async" else {}
    return config_from_dict({
        "policy": {"model": policy_path}, "env": {"id": _env_id(dialect)}, "run": {"seed": int(seed)},
        "rollout": {"engine": engine, "engine_kwargs": engine_kwargs, "workers": int(workers), "env_runners": 1,
                    "group_size": 1, "temperature": float(temperature), "top_p": 1.0,
                    "max_response_tokens": int(max_response_tokens), "max_turn_tokens": int(max_turn_tokens),
                    "max_observation_tokens": int(max_observation_tokens)}})


def _check_given_runtime(runtime, cfg, datasets: list[dict]) -> None:
    """An open runtime evaluates one dataset (its retrieval serves one corpus) under the episode
    limits asked for here: a mismatch would silently change what is measured."""
    if len(datasets) != 1:
        raise ValueError(f"evaluate on a given runtime takes one dataset (its retrieval serves one corpus), got {len(datasets)}")
    check_runtime_serves(runtime.cfg, cfg, EPISODE_LIMITS, "evaluate")


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")


def evaluate(policy: str, datasets: list[dict], systems: list[str], out_dir: str | Path, *, dialect: str = "routerag",
             max_questions: int | None = None, max_response_tokens: int = DEFAULT_RESPONSE_TOKENS,
             max_turn_tokens: int = DEFAULT_TURN_TOKENS, top_k: int = 3, retrieval_budget: int = DEFAULT_BUDGET,
             engine: str = "vllm-async", workers: int = 1, temperature: float = 0.0, seed: int = 0,
             show_progress: bool = True, index_cache: str | Path | None = None, max_observation_tokens: int = 256,
             judge: dict | None = None, runtime=None) -> dict:
    """Evaluate ``policy`` on ``datasets`` with ``systems``; write results under ``out_dir``.

    ``runtime``: an open runtime (``experiments.train.open_runtime``) whose engines hold ``policy``
    and whose retrieval serves the one dataset, to evaluate on and leave open (a pipeline that
    alternates training and evaluation keeps one engine); by default each dataset gets a runtime
    of its own, with ``engine`` and ``workers``.

    ``judge`` is a judge section (``raggym.judge.JudgeConfig`` keys; ``model: policy`` is the
    evaluated policy): the LLM judge decides ``correct``; None falls back to EM or F1 ≥ 0.5.

    Returns ``{"datasets": {dataset: {system: metrics}}, "average": {system: metrics},
    "skipped": [...], "notes": [...], "settings": {...}, "seconds": float}``. Uses the running Ray
    instance when there is one, else starts a local one (and shuts it down afterwards).
    """
    import ray  # Ray and torch: on use (see the imports)

    from actors.runtime import RayRuntime
    from experiments.recipe.training import sampling_params
    from raggym.rewards.r1_router import TEXT_KB

    started = time.perf_counter()
    systems = list(dict.fromkeys(systems))
    if not systems:
        raise ValueError("no systems to evaluate; choose from " + ", ".join(SYSTEMS))
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(SYSTEMS)}")
    if not datasets:
        raise ValueError("no datasets to evaluate")
    for d in datasets:
        _check_dataset(d)
    names = [d["name"] for d in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"dataset names must be unique, got {names}")
    for name, value in (("max_response_tokens", max_response_tokens), ("max_turn_tokens", max_turn_tokens),
                        ("top_k", top_k), ("workers", workers), ("max_observation_tokens", max_observation_tokens)):
        _positive(name, value)
    _positive("retrieval_budget", retrieval_budget, allow_zero=True)
    if max_questions is not None:
        _positive("max_questions", max_questions)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    _env_id(dialect)
    policy_path = resolve_policy(policy)

    answer_judge = make_judge(judge, policy_path)
    out = Path(out_dir)
    cache = Path(index_cache) if index_cache else cache_dir() / "indexes"
    cfg = _eval_config(policy_path, dialect, engine=engine, workers=workers, temperature=temperature, seed=seed,
                       max_response_tokens=max_response_tokens, max_turn_tokens=max_turn_tokens,
                       max_observation_tokens=max_observation_tokens)
    if runtime is not None:
        _check_given_runtime(runtime, cfg, datasets)
        engine, workers = str(runtime.cfg.rollout.engine), int(runtime.cfg.rollout.workers)

    # Logical CPUs: enough for every actor's fractional request (service, shards, graph replica,
    # workers at 0.5, one runner per system at 0.25), whatever the core count.
    own_ray = runtime is None and init_ray(min_cpus=max(4, int(3 + 0.5 * workers + 0.25 * len(systems) + 1)))
    by_dataset: dict[str, dict[str, dict]] = {}
    skipped: list[dict] = []
    notes: list[str] = []
    timings: dict[str, dict] = {}
    try:
        for d in datasets:
            t0 = time.perf_counter()
            questions, corpus, index_dir, has_graph = load_dataset(d, cache, max_questions, show_progress)
            timing = timings[d["name"]] = {"data_and_index": round(time.perf_counter() - t0, 2)}
            plan, skip, note = plan_systems(systems, has_graph, dialect)
            for s in skip:
                print(f"[eval] skipping {s['system']} on {d['name']}: {s['reason']}", flush=True)
                skipped.append({"dataset": d["name"], **s})
            notes += [f"{d['name']}: {n}" for n in note]
            by_dataset[d["name"]] = {}
            if not plan:
                continue
            t0 = time.perf_counter()
            rt = runtime if runtime is not None else RayRuntime(cfg, {TEXT_KB: index_dir}, corpus, with_learners=False)
            timing["runtime_start"] = round(time.perf_counter() - t0, 2)
            try:
                systems_kwargs = {}
                for system, spec in plan:  # all systems' runners start together
                    systems_kwargs[system] = _system_env_kwargs(rt, system, spec, questions, dialect=dialect,
                                                                top_k=top_k, budget=retrieval_budget)
                    rt.runners(systems_kwargs[system][0])
                for system, _ in plan:
                    env_kwargs, pre = systems_kwargs[system]
                    t0 = time.perf_counter()
                    episodes: list[dict] = []
                    with tqdm(total=len(questions), desc=f"eval {d['name']}/{system}", unit="q",
                              disable=not show_progress) as bar:
                        for i in range(0, len(questions), CHUNK_QUESTIONS):
                            chunk = questions[i: i + CHUNK_QUESTIONS]
                            episodes += evaluate_episodes(rt, chunk, sampling_params(cfg, i // CHUNK_QUESTIONS),
                                                          env_kwargs=env_kwargs, tag=str(i // CHUNK_QUESTIONS),
                                                          prompt_retrievals=pre, judge=answer_judge)[0]
                            bar.update(len(chunk))
                    by_dataset[d["name"]][system] = aggregate([t["metrics"] for t in episodes])
                    timing[system] = round(time.perf_counter() - t0, 2)
                    write_jsonl(out / "trajectories" / f"{d['name']}__{system}.jsonl",
                                ({"dataset": d["name"], "system": system, "question_id": t["episode"].get("question_id"),
                                  **t} for t in episodes))
            finally:
                if runtime is None:
                    rt.shutdown()
    finally:
        if own_ray:
            ray.shutdown()
    settings = {"policy": str(policy), "policy_path": policy_path, "dialect": dialect, "systems": systems,
                "datasets": datasets, "max_questions": max_questions, "max_response_tokens": max_response_tokens,
                "max_turn_tokens": max_turn_tokens, "max_observation_tokens": max_observation_tokens, "top_k": top_k,
                "retrieval_budget": retrieval_budget, "engine": engine, "workers": workers, "temperature": temperature, "seed": seed,
                "judge": dict(judge) if judge else "em_or_f1 (EM = 1 or F1 >= 0.5)",
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}}
    results = {"datasets": by_dataset, "average": average_over_datasets(by_dataset), "skipped": skipped,
               "notes": notes, "settings": settings, "timings": timings,
               "seconds": round(time.perf_counter() - started, 2)}
    write_results(out, results)
    return results


def write_results(out_dir: str | Path, results: dict) -> None:
    """``results.json`` and ``results.md``, each through a temp file and a rename."""
    out = Path(out_dir)
    atomic_write_json(out / "results.json", results, default=str)
    atomic_write_text(out / "results.md", markdown_table(results))


# ----------------------------------------------------------------------------- command line


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def _system_names(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SYSTEMS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown system {', '.join(bad) or text!r}; choose from {', '.join(SYSTEMS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="smollm2-135m",
                   help="model spec (smollm2-135m), HF model dir, checkpoint dir (<run>/checkpoints/step-N) or run dir "
                        "(its latest complete checkpoint); default smollm2-135m")
    p.add_argument("--dataset", action="append", dest="datasets", metavar="DATASET",
                   help="'synthetic', a data folder (corpus.*, questions.*, optional openie*.json) or NAME=FOLDER; "
                        "repeatable (default: synthetic)")
    p.add_argument("--systems", nargs="+", type=_system_names, default=[["direct", "vanilla_rag", "agent"]],
                   metavar="SYSTEM", help=f"systems, space- or comma-separated: {', '.join(SYSTEMS)} "
                                          "(default: direct vanilla_rag agent)")
    p.add_argument("--out", default="runs/eval", help="output directory (default runs/eval)")
    p.add_argument("--index", default=None, help="a built index to use (only with a single --dataset)")
    p.add_argument("--index-cache", default=None, help="where indexes are built once and reused "
                                                       "(default $RAGGYM_CACHE/indexes or ~/.cache/raggym/indexes)")
    p.add_argument("--dialect", default="routerag", help="agent dialect: routerag, search_r1, graph_r1, lws, graphrag_r1")
    p.add_argument("--max-questions", type=_positive_int, default=None, help="evaluate the first N questions per dataset")
    p.add_argument("--max-response-tokens", type=_positive_int, default=DEFAULT_RESPONSE_TOKENS)
    p.add_argument("--max-turn-tokens", type=_positive_int, default=DEFAULT_TURN_TOKENS)
    p.add_argument("--top-k", type=_positive_int, default=3)
    p.add_argument("--retrieval-budget", type=_non_negative_int, default=DEFAULT_BUDGET)
    p.add_argument("--engine", choices=["vllm-async", "hf"], default="vllm-async",
                   help="rollout engine: vllm-async (vLLM's AsyncLLM, the default) or hf (the reference engine)")
    p.add_argument("--workers", type=_positive_int, default=1, help="rollout-worker actors (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic-seed", type=int, default=0)
    p.add_argument("--synthetic-entities", type=_positive_int, default=300)
    p.add_argument("--synthetic-questions", type=_positive_int, default=60)
    p.add_argument("--synthetic-max-hops", type=_positive_int, default=2)
    p.add_argument("--split", choices=["heldout", "train", "all"], default="heldout",
                   help="which questions of the synthetic world (default heldout)")
    p.add_argument("--heldout-fraction", type=_fraction, default=0.2)
    p.add_argument("--judge-model", default=None,
                   help="decide 'correct' with an LLM judge on this model spec ('policy' = the evaluated policy); "
                        "default: EM = 1 or F1 >= 0.5")
    p.add_argument("--judge-engine", default="hf", help="engine of the judge: hf, vllm, a registered name or module:callable")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def datasets_from_args(args) -> list[dict]:
    specs = args.datasets or ["synthetic"]
    out = []
    for spec in specs:
        name, _, target = spec.partition("=") if "=" in spec else (None, "", spec)
        if target == "synthetic":
            out.append({"name": name or "synthetic", "source": "synthetic",
                        "synthetic": {"seed": args.synthetic_seed, "n_entities": args.synthetic_entities,
                                      "n_questions": args.synthetic_questions, "max_hops": args.synthetic_max_hops},
                        "split": args.split, "heldout_fraction": args.heldout_fraction})
        else:
            out.append(dataset_from_dir(target, name))
    if args.index:
        if len(out) != 1:
            raise ValueError("--index names one index; give exactly one --dataset with it")
        out[0]["index_dir"] = args.index
    return out


def run(args) -> int:
    systems = [s for group in args.systems for s in group]
    results = evaluate(args.policy, datasets_from_args(args), systems, args.out, dialect=args.dialect,
                       max_questions=args.max_questions, max_response_tokens=args.max_response_tokens,
                       max_turn_tokens=args.max_turn_tokens, top_k=args.top_k, retrieval_budget=args.retrieval_budget,
                       engine=args.engine, workers=args.workers, temperature=args.temperature, seed=args.seed,
                       show_progress=not (args.no_progress or args.json), index_cache=args.index_cache,
                       judge={"engine": args.judge_engine, "model": args.judge_model} if args.judge_model else None)
    if args.json:
        print(json.dumps(results, default=str))
    else:
        print(markdown_table(results))
        print(f"[eval] {results['seconds']:.0f} s; results in {Path(args.out) / 'results.json'}, "
              f"{Path(args.out) / 'results.md'} and {Path(args.out) / 'trajectories'}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.eval", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (DataFormatError, ModelSpecError, ValueError, FileNotFoundError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2


__all__ = ["SYSTEMS", "ContextPrompt", "DirectPrompt", "aggregate", "average_over_datasets", "dataset_from_dir",
           "episode_metrics", "evaluate", "markdown_table", "plan_systems", "resolve_policy", "split_questions"]

