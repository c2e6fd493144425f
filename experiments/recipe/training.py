"""The training recipe's components: run data, episode requests, rewards, metrics, checkpoints.

Each is a small function the recipe (``experiments/train.py``) calls in Algorithm-1 order, tested
on its own. Nothing here starts Ray; the runtime (``actors/runtime.py``) does.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import gymnasium
import numpy as np
import ray
import torch
from gymnasium.envs.registration import load_env_creator

import envs  # noqa: F401  (registers the env ids)
from actors.engines.base import SamplingParams
from actors.storage import RunStorage, check_storage_on_every_node, stage_on_every_node
from envs.rollout import EpisodeRequest
from experiments.recipe.config import MODE_CHOICE_COEFFICIENTS, ConfigError, mode_slot_of, to_plain
from experiments.recipe.judge import make_judge
from raggym.atomic import atomic_write
from raggym.data import load_corpus, load_questions
from raggym.data.synthetic import generate_world
from raggym.models import load_embedder
from raggym.retrieval import ensure_index
from raggym.rewards.r1_router import TABLE_KB, TEXT_KB
from raggym.rewards.schedules import reward_schedule_from_config
from raggym.seeding import derive_seed


# ----------------------------------------------------------------------------- data


@dataclass
class RunData:
    """A run's questions (training and held out), corpus and index directory per knowledge base."""

    corpus: Any
    questions: list
    heldout: list
    index_dirs: dict[str, Path] = field(default_factory=dict)


def open_run_storage(cfg) -> "RunStorage":
    """``run.out_dir`` as the run's storage (docs/cluster.md).

    With Ray running, a relative path on a cluster of several nodes is an error, and every alive
    node is probed: it must read what the driver wrote and the driver what it wrote.
    """
    nodes = 1
    if cfg.runtime == "ray":
        if ray.is_initialized():
            nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    for key in ("index_dir", "table_index_dir"):
        if cfg.data.get(key):
            RunStorage.resolve(cfg.data[key], nodes=nodes, what=f"data.{key}")
    storage = RunStorage.resolve(cfg.run.out_dir, nodes=nodes)
    if cfg.runtime == "ray" and nodes > 1:
        check_storage_on_every_node(storage)
    return storage


def _stored_index(location, default: "RunStorage", rel: str, corpus, **build) -> Path:
    """An index at ``location`` (or ``rel`` under the run's storage): built once, uploaded, and
    staged on every node when the storage is remote; returns the local path every node can read."""
    storage, rel = (RunStorage.resolve(location), "") if location else (default, rel)
    if storage.is_remote and not storage.exists(f"{rel}/manifest.json".lstrip("/")):
        storage.upload(ensure_index(storage.local(rel), corpus, **build), rel)
    elif not storage.is_remote:
        return ensure_index(storage.local(rel), corpus, **build)
    local = stage_on_every_node(storage, rel)
    return ensure_index(local, corpus, **build)  # checks the staged index was built from this corpus


def load_run_data(cfg, out_dir, *, multi_kb: bool = False) -> RunData:
    """Questions and corpus from ``data.*``; the index (and R1-Router's table index) built once.

    ``out_dir`` is the run's storage (``open_run_storage``) or a local directory.
    """
    storage = out_dir if isinstance(out_dir, RunStorage) else RunStorage.resolve(out_dir)
    data = cfg.data
    world = None
    if data.source == "synthetic":
        world = generate_world(**to_plain(data.synthetic))
        corpus, questions, openie = world.corpus, world.questions, world.openie
    else:
        if not data.corpus or not data.questions:
            raise ConfigError("data.source=files needs data.corpus and data.questions")
        corpus = load_corpus(data.corpus)
        questions = load_questions(data.questions, corpus)
        openie = data.openie
    index_dirs = {TEXT_KB: _stored_index(data.index_dir, storage, "index", corpus, openie=openie,
                                         shards=int(cfg.retrieval.shards))}
    if multi_kb:
        if world is not None and world.table_corpus is None:
            raise ConfigError("data.synthetic.attribute_kb: R1-Router needs a table knowledge base; set it to 'table'")
        if world is None and not data.table_corpus:
            raise ConfigError("data.table_corpus: R1-Router with data.source=files needs the table corpus file")
        tables = world.table_corpus if world is not None else load_corpus(data.table_corpus)
        index_dirs[TABLE_KB] = _stored_index(data.table_index_dir, storage, "index_table", tables, shards=1)
    n = int(cfg.eval.questions)  # the last eval.questions questions are held out, the rest train
    if n >= len(questions):
        raise ConfigError(f"eval.questions={n} leaves no training questions (the data has {len(questions)})")
    questions = list(questions)
    return RunData(corpus, questions[: len(questions) - n], questions[len(questions) - n:], index_dirs)


def mode_choice_slot(cfg) -> str | None:
    """The dialect's ``mode_slot`` pattern when a term that reads the mode choices is on
    (``learner.loss.mode_entropy_coef`` or ``mode_pg_coef``), else None: when set, the recipe hands
    the learner the mode-choice tokens each rollout recorded at that slot (``validate_config`` has
    checked that the env's dialect has one)."""
    loss = (cfg.learner or {}).get("loss") or {}
    if all(float(loss.get(key) or 0.0) <= 0 for key in MODE_CHOICE_COEFFICIENTS):
        return None
    return mode_slot_of(cfg.env.id)


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

    ``advantage.stop_route_group`` adds the stop-route group to each question's steps (see
    ``MultiKBRouteEnv.golden_step_options``). Every training question is checked up front, so data
    without golden steps fails before any actor starts, with an error naming the question (never a
    silent reward against a None gold).
    """
    if cfg.advantage.estimator != "step_grpo":
        return None
    creator = gymnasium.spec(cfg.env.id).entry_point
    creator = load_env_creator(creator) if isinstance(creator, str) else creator
    if not hasattr(creator, "golden_step_options"):
        raise ConfigError(f"advantage.estimator: step_grpo needs an env with golden_step_options; {cfg.env.id} has none")
    step_options = functools.partial(creator.golden_step_options, stop_route_group=bool(cfg.advantage.stop_route_group))
    for q in questions:
        step_options(q)
    return step_options


def round_seed_index(step: int, sampling_round: int) -> int:
    """Seed index of resampling round ``r`` of ``step`` (round 0 uses ``step`` itself)."""
    return step if sampling_round == 0 else 1_000_003 * (sampling_round + 1) + step


def sampling_params(cfg, seed_index: int, temperature: float | None = None):
    """The training rollouts' sampling (``temperature`` None), or an evaluation's at ``temperature``;
    only training rollouts sample the mode slot at ``rollout.mode_slot_temperature``."""
    t = float(cfg.rollout.temperature if temperature is None else temperature)
    slot_t = cfg.rollout.mode_slot_temperature if temperature is None else None
    slot = ({"mode_slot": mode_slot_of(cfg.env.id), "mode_slot_temperature": float(slot_t),
             "mode_slot_min_p": float(cfg.rollout.mode_slot_min_p)} if slot_t and t > 0 else {})
    return SamplingParams(temperature=t, top_p=float(cfg.rollout.top_p) if t > 0 else 1.0,
                          seed=derive_seed(int(cfg.run.seed), seed_index), **slot)


# ----------------------------------------------------------------------------- rewards and metrics


def make_embed(spec: str):
    """A cached sentence embedder as ``texts -> [n, d]`` (LWS's query similarity, R1-Router's sim)."""
    embedder = load_embedder(spec)
    return lambda texts: embedder.encode(list(texts))


def reward_schedule(cfg):
    """The ``reward:`` section as a schedule; the embedder spec becomes an embedding function and
    LWS's ``judge`` section an LLM judge (``experiments.recipe.judge``), kept as ``schedule.judge`` so
    that in-training evaluation decides correctness the same way (None: EM / F1 ≥ 0.5)."""
    options = dict(to_plain(cfg.reward))
    embedder = options.pop("embedder", "minilm")
    embed = make_embed(embedder) if options["method"] in ("lws", "r1_router") else None
    judge = make_judge(options.pop("judge", None), str(cfg.policy.model))
    schedule = reward_schedule_from_config(options, embed=embed, judge=judge)
    schedule.judge = judge
    return schedule


def step_metrics(rollouts: Sequence, rewards: torch.Tensor | Sequence[float], advantages: torch.Tensor | Sequence[float]) -> dict:
    """What one step's batch did: reward, answers, searches, tokens (each read once from the outcome)."""
    rewards, advantages = np.asarray(rewards, dtype=np.float64), np.asarray(advantages, dtype=np.float64)
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
    lines = (json.dumps({**r.as_dict(), "reward": float(rw), "advantage": float(a)}) + "\n"
             for r, rw, a in zip(rollouts, rewards, advantages))
    atomic_write(out_dir / "trajectories" / f"step-{step:06d}.jsonl", lambda fh: fh.writelines(lines))


# ----------------------------------------------------------------------------- checkpoints


CHECKPOINT_MARKER = "trainer_state.json"  # written last: a checkpoint directory without it does not exist


def _as_storage(location):
    return location if isinstance(location, RunStorage) else RunStorage.resolve(location)


def _location(storage, rel: str):
    """``rel``'s ``Path`` on a filesystem, its URI on remote storage."""
    return storage.uri(rel) if storage.is_remote else Path(storage.uri(rel))


def _committed_steps(storage, folder: str, marker: str) -> list:
    """The ``step-N`` directories under ``folder`` whose ``marker`` was written (committed), in step order."""
    names = [n for n in storage.list_dirs(folder) if n.startswith("step-") and storage.exists(f"{folder}/{n}/{marker}")]
    return [_location(storage, f"{folder}/{n}") for n in sorted(names)]


def latest_checkpoint(out_dir):
    """The newest committed checkpoint under ``out_dir`` (a local directory or a ``RunStorage``):
    its ``Path`` on a filesystem, its URI on remote storage, ``None`` when there is none."""
    done = _committed_steps(_as_storage(out_dir), "checkpoints", CHECKPOINT_MARKER)
    return done[-1] if done else None


HOLD_CHECKPOINT_ENV = "RAGGYM_TEST_HOLD_CHECKPOINT"


def _hold_before_commit(tmp: str, step: int) -> None:
    """Test hook: with ``RAGGYM_TEST_HOLD_CHECKPOINT=<step>`` the save of that step stops after
    every file is written and before the commit, says so on stdout and waits (an hour), so that a
    test can kill the trainer in the middle of a save at a known point (tests/test_train_e2e.py)."""
    held = os.environ.get(HOLD_CHECKPOINT_ENV)
    if held is not None and int(held) == step:
        print(f"[train] holding checkpoint {tmp} before its commit ({HOLD_CHECKPOINT_ENV}={held})", flush=True)
        time.sleep(3600)


def _learner_actors(learners) -> list:
    """The Ray actors of a ``LearnerGroup`` (rank order); none for the in-process group."""
    return list(getattr(learners, "learners", None) or [])


def _upload_in_actor(actor_self, storage_root: str, local_dir: str, rel: str) -> None:
    RunStorage(storage_root).upload(local_dir, rel)
    shutil.rmtree(local_dir, ignore_errors=True)


def _download_in_actor(actor_self, storage_root: str, rel: str) -> str:
    return str(RunStorage(storage_root).download(rel))


def save_checkpoint(learners, out_dir, step: int, trainer_state: dict, keep: int, keep_policy_every: int = 0):
    """Write step ``step``'s checkpoint under ``out_dir`` (a ``RunStorage`` or a local directory).

    The learners write the policy and optimizer, the driver ``trainer_state.json``, all into
    ``checkpoints/.tmp-step-N`` on the run's storage; then this process alone commits it
    (``RunStorage.commit_directory``: a rename, or on an object store a copy with the marker
    written last), so a crash never leaves a checkpoint that looks complete, and it does not
    matter which nodes the driver and learner rank 0 run on. With remote storage rank 0 writes
    into its node's staging directory and uploads from there (inside its own actor).
    """
    storage = _as_storage(out_dir)
    tmp_rel, final_rel = f"checkpoints/.tmp-step-{step:06d}", f"checkpoints/step-{step:06d}"
    storage.remove(tmp_rel)
    actors = _learner_actors(learners)
    learners.save_checkpoint(str(storage.local(tmp_rel)))
    if storage.is_remote:
        if actors:  # rank 0 wrote into its own node's staging directory
            ray.get(actors[0].__ray_call__.remote(_upload_in_actor, storage.root, str(storage.local(tmp_rel)), tmp_rel))
        else:
            storage.upload(storage.local(tmp_rel), tmp_rel)
            shutil.rmtree(storage.local(tmp_rel), ignore_errors=True)
    storage.write_text(f"{tmp_rel}/{CHECKPOINT_MARKER}", json.dumps({"step": step, **trainer_state}))
    _hold_before_commit(storage.uri(tmp_rel), step)
    storage.commit_directory(tmp_rel, final_rel, CHECKPOINT_MARKER)  # only now does latest_checkpoint see it
    if keep_policy_every > 0 and step % keep_policy_every == 0:
        keep_policy(storage, final_rel, step)
    steps = [n for n in storage.list_dirs("checkpoints") if n.startswith("step-")]
    for old in steps[:-keep] if keep > 0 else []:
        storage.remove(f"checkpoints/{old}")
    return _location(storage, final_rel)


KEPT_POLICY_MARKER = "kept_policy.json"  # written last, as a checkpoint's marker


def keep_policy(storage, checkpoint_rel: str, step: int) -> None:
    """Copy the committed checkpoint's ``policy/`` to ``policies/step-N``, which pruning never removes.

    Staged and committed like a checkpoint, so ``kept_policies`` never lists a half-copied policy.
    """
    tmp_rel, final_rel = f"policies/.tmp-step-{step:06d}", f"policies/step-{step:06d}"
    storage.remove(tmp_rel)
    storage.upload(storage.download(f"{checkpoint_rel}/policy"), tmp_rel)
    storage.write_text(f"{tmp_rel}/{KEPT_POLICY_MARKER}", json.dumps({"step": step, "checkpoint": checkpoint_rel}))
    storage.commit_directory(tmp_rel, final_rel, KEPT_POLICY_MARKER)


def kept_policies(out_dir) -> list:
    """The policies ``run.keep_policy_every`` kept, in step order (paths or URIs)."""
    return _committed_steps(_as_storage(out_dir), "policies", KEPT_POLICY_MARKER)


def restore_checkpoint(learners, out_dir, checkpoint) -> dict:
    """Load ``checkpoint`` (from ``latest_checkpoint``) into the learners; returns its trainer state.

    With remote storage every learner rank downloads it to its node's staging directory first.
    """
    storage = _as_storage(out_dir)
    rel = str(checkpoint)[len(storage.uri()):].lstrip("/")
    state = json.loads(storage.read_text(f"{rel}/{CHECKPOINT_MARKER}"))
    local = str(storage.local(rel))
    if storage.is_remote:
        actors = _learner_actors(learners)
        if actors:
            ray.get([a.__ray_call__.remote(_download_in_actor, storage.root, rel) for a in actors])
        else:
            storage.download(rel)
    learners.load_checkpoint(local)
    return state
