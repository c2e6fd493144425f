"""The training recipe's components: run data, episode requests, rewards, metrics, checkpoints, SFT.

Each is a small function the recipe (``experiments/train.py``) calls in Algorithm-1 order, tested
on its own. Nothing here starts Ray; the runtime (``experiments/runtime.py``) does.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from envs.rollout import EpisodeRequest
from experiments.config import ConfigError, to_plain
from raggym.rewards.r1_router import TABLE_KB, TEXT_KB


# ----------------------------------------------------------------------------- data


@dataclass
class RunData:
    """A run's questions (training and held out), corpus and index directory per knowledge base."""

    corpus: Any
    questions: list
    heldout: list
    index_dirs: dict[str, Path] = field(default_factory=dict)


def load_run_data(cfg, out_dir: Path, *, multi_kb: bool = False) -> RunData:
    """Questions and corpus from ``data.*``; the index (and R1-Router's table index) built once."""
    from raggym.data import load_corpus, load_questions
    from raggym.retrieval import ensure_index

    data = cfg.data
    world = None
    if data.source == "synthetic":
        from raggym.data.synthetic import generate_world

        world = generate_world(**to_plain(data.synthetic))
        corpus, questions, openie = world.corpus, world.questions, world.openie
    else:
        if not data.corpus or not data.questions:
            raise ConfigError("data.source=files needs data.corpus and data.questions")
        corpus = load_corpus(data.corpus)
        questions = load_questions(data.questions, corpus)
        openie = data.openie
    index_dir = Path(data.index_dir) if data.index_dir else out_dir / "index"
    index_dirs = {TEXT_KB: ensure_index(index_dir, corpus, openie=openie, shards=int(cfg.retrieval.shards))}
    if multi_kb:
        if world is not None and world.table_corpus is None:
            raise ConfigError("data.synthetic.attribute_kb: R1-Router needs a table knowledge base; set it to 'table'")
        if world is None and not data.table_corpus:
            raise ConfigError("data.table_corpus: R1-Router with data.source=files needs the table corpus file")
        tables = world.table_corpus if world is not None else load_corpus(data.table_corpus)
        table_dir = Path(data.table_index_dir) if data.table_index_dir else out_dir / "index_table"
        index_dirs[TABLE_KB] = ensure_index(table_dir, tables, shards=1)
    n = int(cfg.eval.questions)  # the last eval.questions questions are held out, the rest train
    if n >= len(questions):
        raise ConfigError(f"eval.questions={n} leaves no training questions (the data has {len(questions)})")
    questions = list(questions)
    return RunData(corpus, questions[: len(questions) - n], questions[len(questions) - n:], index_dirs)


# ----------------------------------------------------------------------------- rollout requests


def episode_requests(questions: Sequence, tag: str, group_size: int, golden_steps=None) -> list[EpisodeRequest]:
    """G requests per question sharing the prompt id ``tag:question-id``.

    With ``golden_steps`` (an env class's ``golden_step_options``), Step-GRPO: G requests per
    teacher-forced step of each question, all G with identical reset options, grouped by
    ``(prompt id, step index)``. A question without golden steps is an error naming it.
    """
    requests = []
    for q in questions:
        for options in (golden_steps(q) if golden_steps else [{}]):
            options = dict(options)
            step_index = int(options.pop("step_index", 0))
            requests += [EpisodeRequest(q, f"{tag}:{q.id}", g, options, step_index) for g in range(group_size)]
    return requests


def golden_steps_for(cfg, questions: Sequence = ()):
    """Step-GRPO is defined over teacher-forced steps: the env class lists them; else None.

    Every training question is checked up front, so data without golden steps fails before any
    actor starts, with an error naming the question (never a silent reward against a None gold).
    """
    if cfg.advantage.estimator != "step_grpo":
        return None
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    import envs  # noqa: F401

    creator = gymnasium.spec(cfg.env.id).entry_point
    creator = load_env_creator(creator) if isinstance(creator, str) else creator
    if not hasattr(creator, "golden_step_options"):
        raise ConfigError(f"advantage.estimator: step_grpo needs an env with golden_step_options; {cfg.env.id} has none")
    for q in questions:
        creator.golden_step_options(q)
    return creator.golden_step_options


def round_seed_index(step: int, sampling_round: int) -> int:
    """Seed index of resampling round ``r`` of ``step`` (round 0 uses ``step`` itself)."""
    return step if sampling_round == 0 else 1_000_003 * (sampling_round + 1) + step


def sampling_params(cfg, seed_index: int, temperature: float | None = None):
    from actors.engines.base import SamplingParams
    from raggym.seeding import derive_seed

    t = float(cfg.rollout.temperature if temperature is None else temperature)
    return SamplingParams(temperature=t, top_p=float(cfg.rollout.top_p) if t > 0 else 1.0,
                          seed=derive_seed(int(cfg.run.seed), seed_index))


# ----------------------------------------------------------------------------- rewards and metrics


def make_embed(spec: str):
    """A cached sentence embedder as ``texts -> [n, d]`` (LWS's query similarity, R1-Router's sim)."""
    from raggym.models import load_embedder

    embedder = load_embedder(spec)
    return lambda texts: embedder.encode(list(texts))


def reward_schedule(cfg):
    """The ``reward:`` section as a schedule; the embedder spec becomes an embedding function and
    LWS's ``judge`` section an LLM judge (``experiments.judge``), kept as ``schedule.judge`` so
    that in-training evaluation decides correctness the same way (None: EM / F1 ≥ 0.5)."""
    from experiments.judge import make_judge
    from raggym.rewards.schedules import reward_schedule_from_config

    options = dict(to_plain(cfg.reward))
    embedder = options.pop("embedder", "minilm")
    embed = make_embed(embedder) if options["method"] in ("lws", "r1_router") else None
    judge = make_judge(options.pop("judge", None), str(cfg.policy.model))
    schedule = reward_schedule_from_config(options, embed=embed, judge=judge)
    schedule.judge = judge
    return schedule


def step_metrics(rollouts: Sequence, rewards: Sequence[float], advantages: Sequence[float]) -> dict:
    """What one step's batch did: reward, answers, searches, tokens (each read once from the outcome)."""
    outcomes = [r.outcome for r in rollouts]
    env_rewards = [o.env_reward for o in outcomes if o.env_reward is not None]
    metrics = {
        "reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
        "em": float(np.mean([o.em for o in outcomes])), "f1": float(np.mean([o.f1 for o in outcomes])),
        "env_reward_mean": float(np.mean(env_rewards)) if env_rewards else float("nan"),
        "advantage_abs_mean": float(np.mean(np.abs(advantages))) if len(advantages) else 0.0,
        "retrievals_mean": float(np.mean([o.retrieval_count for o in outcomes])),
        "answered": float(np.mean([o.answer is not None for o in outcomes])),
        "response_tokens_mean": float(np.mean([r.response_length for r in rollouts])),
        "sequence_tokens_mean": float(np.mean([len(r) for r in rollouts])),
    }
    phases: dict[str, list[float]] = {}
    for o, reward in zip(outcomes, rewards):
        if len(o.steps) == 1:  # Step-GRPO: the reward of each step phase
            phases.setdefault(o.steps[0]["phase"], []).append(reward)
    metrics.update({f"reward/{phase}": float(np.mean(v)) for phase, v in sorted(phases.items())})
    return metrics


def dump_rollouts(out_dir: Path, step: int, rollouts, rewards, advantages) -> None:
    from raggym.atomic import atomic_write

    lines = (json.dumps({**r.as_dict(), "reward": float(rw), "advantage": float(a)}) + "\n"
             for r, rw, a in zip(rollouts, rewards, advantages))
    atomic_write(out_dir / "trajectories" / f"step-{step:06d}.jsonl", lambda fh: fh.writelines(lines))


# ----------------------------------------------------------------------------- checkpoints


def latest_checkpoint(out_dir: Path) -> Path | None:
    root = out_dir / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").exists()) if root.exists() else []
    return done[-1] if done else None


HOLD_CHECKPOINT_ENV = "RAGGYM_TEST_HOLD_CHECKPOINT"


def _hold_before_commit(tmp: Path, step: int) -> None:
    """Test hook: with ``RAGGYM_TEST_HOLD_CHECKPOINT=<step>`` the save of that step stops after
    every file is written and before the commit, says so on stdout and waits (an hour), so that a
    test can kill the trainer in the middle of a save at a known point (tests/test_train_e2e.py)."""
    import os
    import time

    held = os.environ.get(HOLD_CHECKPOINT_ENV)
    if held is not None and int(held) == step:
        print(f"[train] holding checkpoint {tmp} before its commit ({HOLD_CHECKPOINT_ENV}={held})", flush=True)
        time.sleep(3600)


def save_checkpoint(learners, out_dir: Path, step: int, trainer_state: dict, keep: int) -> Path:
    """Write into a temp dir, then rename: a crash never leaves a checkpoint that looks complete.

    The learners (possibly remote actors) write the policy and optimizer into the temp dir
    themselves, so it cannot be a helper-owned temporary; ``trainer_state.json`` is written last.
    """
    root = out_dir / "checkpoints"
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    learners.save_checkpoint(str(tmp))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}), encoding="utf-8")
    _hold_before_commit(tmp, step)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # the commit: only now does latest_checkpoint see this step
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- SFT cold start


def sft_cold_start(cfg, out_dir: Path, data: RunData) -> dict | None:
    """GraphRAG-R1's cold start: SFT on golden episodes before RL, once per run.

    Its summary (``<out_dir>/sft/sft_summary.json``, written last and atomically) records the
    fine-tuned policy directory; a resumed run reads it instead of training again.
    """
    if not cfg.sft.enabled:
        return None
    summary_path = out_dir / "sft" / "sft_summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        if (Path(summary["policy_dir"]) / "config.json").exists():
            print(f"[train] SFT cold start already done: {summary['policy_dir']}", flush=True)
            return summary
    if cfg.run.resume and latest_checkpoint(out_dir) is not None:
        raise RuntimeError(f"{out_dir} has RL checkpoints but no SFT summary at {summary_path}; "
                           "the RL policy's starting point is unknown (restore the sft/ folder or start a new run)")
    import envs
    from experiments.sft import golden_examples, run_sft
    from raggym.models import load_policy_tokenizer
    from raggym.retrieval import Retriever

    dialect = envs.SEARCH_ENV_IDS.get(cfg.env.id)
    if dialect is None:
        raise ConfigError(f"sft.enabled: the SFT cold start plays golden episodes of a search environment, not {cfg.env.id}")
    env_kwargs = dict(to_plain(cfg.env.kwargs) or {})
    top_k = int(env_kwargs.pop("top_k", 3))
    s = cfg.sft
    chosen = list(data.questions if s.max_examples is None else data.questions[: int(s.max_examples)])
    examples = golden_examples(chosen, Retriever.load(str(data.index_dirs[TEXT_KB])), dialect,
                               load_policy_tokenizer(cfg.policy.model), corpus=data.corpus, top_k=top_k,
                               max_observation_tokens=int(cfg.rollout.max_observation_tokens), env_kwargs=env_kwargs,
                               show_progress=True)
    return run_sft(cfg.policy.model, examples, out_dir / "sft", epochs=int(s.epochs), lr=float(s.lr),
                   batch_size=int(s.batch_size), grad_accum=int(s.grad_accum), max_seq_tokens=int(s.max_seq_tokens),
                   seed=int(cfg.run.seed), lora=to_plain(s.lora), num_threads=cfg.learner.get("num_threads"))
