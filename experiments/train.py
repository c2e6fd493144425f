"""GRPO-family training: the recipe, top to bottom, as the papers' Algorithm 1.

    python -m experiments.train --config experiments/configs/cpu_tiny.yaml run.steps=4
    ray job submit --working-dir . -- python -m experiments.train --config experiments/configs/X.yaml key=value

Each step: sample prompts -> G rollouts each (env runners + rollout workers + retrieval service)
-> rewards (the stage's batch reward, e.g. RouteRAG's batch-centred efficiency) -> advantages
(the registered estimator: GRPO, PathRouter's route-conditioned GRPO, R1-Router's Step-GRPO over
teacher-forced steps) -> learner update (DeepSpeed group) -> weight sync -> log (JSONL +
TensorBoard) -> checkpoint -> held-out evaluation.

One typed ``raggym.trajectory.Rollout`` flows from the rollout loop to the learner; rewards read
its ``outcome``. Config: ``experiments/recipe/config.py`` (one YAML per paper in ``experiments/configs``,
see docs/recipes.md). Checkpoints (``<out_dir>/checkpoints/step-NNNNNN``) hold the policy in HF
format, the optimizer state, the step, the prompt sampler's cursor and RNG state (safetensors and
JSON); with ``run.resume=true`` the latest complete one is picked up and the next step's batch and
parameters equal those of an uninterrupted run. docs/architecture.md follows one batch hop by hop.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

import envs
from actors.cluster import init_ray
from actors.learner import LearnerConfig
from actors.runtime import (bound_staleness, learner_config, make_runtime, takes_knowledge_bases,
                            teacher_evidence_tokens)
from actors.storage import RunStorage, StorageError, stage_on_every_node
from actors.sync_verify import WeightSyncError
from experiments.recipe.config import ConfigError, load_config, to_plain, validate_config
from experiments.eval.harness import evaluate_episodes
from experiments.recipe.sft import golden_examples, run_sft
from experiments.recipe.training import (RunData, episode_requests, golden_steps_for, latest_checkpoint, load_run_data,
                                  open_run_storage, restore_checkpoint, reward_schedule, round_seed_index,
                                  sampling_params, save_checkpoint, step_metrics, dump_rollouts, mode_choice_slot)
from raggym.algorithms import dynamic_sampling_filter, get_advantage_estimator
from raggym.algorithms.batch import assemble_batch, mode_choice_fields, teacher_fields
from raggym.config_nodes import EPISODE_LIMITS, check_runtime_serves
from raggym.data.sampler import make_prompt_sampler
from raggym.learning_log import MetricsLogger
from raggym.models import load_policy_tokenizer
from raggym.retrieval import Retriever
from raggym.rewards.r1_router import TEXT_KB


def open_runtime(cfg):
    """The runtime ``train(cfg)`` would build (engines, env runners, retrieval, learners), for a
    caller that runs several trainings and evaluations on one engine and one learner group:
    ``train(cfg_i, runtime=rt)`` for each stage, ``experiments.eval.harness.evaluate(..., runtime=rt)``
    between them. The caller shuts it down. Not for runs with an SFT cold start (the cold start
    decides the policy the runtime would load)."""
    validate_config(cfg)
    if cfg.sft.enabled:
        raise ValueError("open_runtime: this run starts with an SFT cold start (sft.enabled), which decides the "
                         "policy its runtime loads; let train(cfg) build the runtime")
    if cfg.runtime == "ray":
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
    data = load_run_data(cfg, open_run_storage(cfg), multi_kb=takes_knowledge_bases(cfg.env.id))
    return make_runtime(cfg, data.index_dirs, data.corpus)


def _check_shared_runtime(runtime, cfg) -> None:
    """A runtime from ``open_runtime`` must serve this run: the same policy, engine and rollout limits."""
    check_runtime_serves(runtime.cfg, cfg, ("policy.model", "rollout.engine", *EPISODE_LIMITS, "runtime"), "train")
    # The teacher KL reads the teacher prompt the runtime's rollouts record; a runtime built for a run
    # without it records none.
    if teacher_evidence_tokens(cfg) not in (None, teacher_evidence_tokens(runtime.cfg)):
        raise ValueError("train: this run's learner.loss.teacher_kl needs rollouts that record the teacher prompt; "
                         "the given runtime was built without learner.loss.teacher_kl")
    if runtime.learners is None:
        raise ValueError("train: the given runtime has no learners (it was built for evaluation only)")


def sft_cold_start(cfg, storage: RunStorage, data: RunData) -> dict | None:
    """GraphRAG-R1's cold start: SFT on golden episodes before RL, once per run.

    Its summary (``sft/sft_summary.json`` on the run's storage, written last and atomically)
    records the fine-tuned policy directory; a resumed run reads it instead of training again.
    ``storage``: the run's (``open_run_storage``).
    """
    if not cfg.sft.enabled:
        return None
    summary_rel = "sft/sft_summary.json"
    if storage.exists(summary_rel) and storage.exists("sft/policy/config.json"):
        summary = json.loads(storage.read_text(summary_rel))
        stage_on_every_node(storage, "sft/policy")  # remote storage: a local copy on every node
        print(f"[train] SFT cold start already done: {summary['policy_dir']}", flush=True)
        return summary
    if cfg.run.resume and latest_checkpoint(storage) is not None:
        raise RuntimeError(f"{storage.uri()} has RL checkpoints but no SFT summary at {storage.uri(summary_rel)}; "
                           "the RL policy's starting point is unknown (restore the sft/ folder or start a new run)")
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
    # The policy is written to sft/policy under the storage (its staging copy when remote), whose
    # local path is the same on every node: that path is what the summary records.
    summary = run_sft(cfg.policy.model, examples, storage.local("sft"), epochs=int(s.epochs), lr=float(s.lr),
                      batch_size=int(s.batch_size), grad_accum=int(s.grad_accum), max_seq_tokens=int(s.max_seq_tokens),
                      seed=int(cfg.run.seed), lora=to_plain(s.lora), num_threads=cfg.learner.get("num_threads"))
    if storage.is_remote:
        storage.upload(storage.local("sft/policy"), "sft/policy")
        storage.write_text(summary_rel, json.dumps(summary))  # last: its presence means the policy is stored
        stage_on_every_node(storage, "sft/policy")
    return summary


@dataclass
class Hyperparameters:
    """The recipe's hyperparameters, named once (read from the config)."""

    steps: int
    group_size: int  # G
    prompts_per_step: int  # P
    estimate_advantages: Callable  # the registered advantage estimator
    estimator_kwargs: dict
    dynamic_sampling: bool  # DAPO: resample until P groups with non-uniform rewards are kept
    max_rounds: int
    teacher_kl: bool  # the rollouts record the teacher's prompt
    mode_slot: bool  # a mode-choice loss term is on: the rollouts record the mode choices
    route_centred_slot: bool  # learner.loss.mode_pg_centring: route (the batch carries the centred slot credit)
    eval_every: int
    eval_kwargs: dict
    checkpoint_every: int

    @classmethod
    def from_config(cls, cfg) -> "Hyperparameters":
        adv = to_plain(cfg.advantage)
        estimator = get_advantage_estimator(adv.pop("estimator"))
        dynamic_sampling, max_rounds = bool(adv.pop("dynamic_sampling")), int(adv.pop("max_sampling_rounds"))
        adv.pop("stop_route_group")  # which step groups exist, not how they are scored: golden_steps_for reads it
        if cfg.reward.method == "pathrouter":  # the routes use the reward's own C and P thresholds
            adv.update({k: cfg.reward[k] for k in ("correct_f1_threshold", "evidence_threshold") if k in cfg.reward})
        return cls(steps=int(cfg.run.steps), group_size=int(cfg.rollout.group_size),
                   prompts_per_step=int(cfg.rollout.prompts_per_step), estimate_advantages=estimator,
                   estimator_kwargs=adv, dynamic_sampling=dynamic_sampling, max_rounds=max_rounds,
                   teacher_kl=teacher_evidence_tokens(cfg) is not None, mode_slot=mode_choice_slot(cfg),
                   route_centred_slot=((cfg.learner or {}).get("loss") or {}).get("mode_pg_centring") == "route",
                   eval_every=int(cfg.eval.every),
                   eval_kwargs={**to_plain(cfg.env.kwargs), **to_plain(cfg.eval.env_kwargs)},
                   checkpoint_every=int(cfg.run.checkpoint_every))


@dataclass
class Run:
    """One training run besides its runtime: config, storage, data, reward schedule, prompt sampler."""

    cfg: Any
    hp: Hyperparameters
    storage: RunStorage
    out_dir: Path  # the driver's logs (on remote storage: its staging copy)
    data: RunData
    schedule: Any  # training step -> the stage's batch reward
    sft: dict | None  # the SFT cold start's summary
    golden_steps: Any  # Step-GRPO: teacher-forced step groups
    mini_batch: int
    sampler: Any


def prepare_run(cfg, runtime=None) -> Run:
    """Validate ``cfg``, open its storage (writing config.yaml there), load its data and reward
    schedule, run the SFT cold start (RL then starts from its policy), make the prompt sampler."""
    validate_config(cfg)
    cfg = copy.deepcopy(cfg)  # the SFT cold start may point policy.model at its output
    if cfg.runtime == "ray":
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
    storage = open_run_storage(cfg)  # run.out_dir: a path every node sees, or a URI (docs/cluster.md)
    out_dir = storage.local()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    hp = Hyperparameters.from_config(cfg)
    data = load_run_data(cfg, storage, multi_kb=takes_knowledge_bases(cfg.env.id))
    schedule = reward_schedule(cfg)  # before the cold start: a judge's "policy" is the base model
    if runtime is not None:
        _check_shared_runtime(runtime, cfg)
        if cfg.sft.enabled:
            raise ValueError("train: a run with an SFT cold start (sft.enabled) builds its own runtime")
    sft = sft_cold_start(cfg, storage, data)
    if sft is not None:
        cfg.policy.model = str(sft["policy_dir"])  # RL starts from the SFT policy
    return Run(cfg=cfg, hp=hp, storage=storage, out_dir=out_dir, data=data, schedule=schedule, sft=sft,
               golden_steps=golden_steps_for(cfg, data.questions),
               mini_batch=LearnerConfig.from_dict(learner_config(cfg)).mini_batch_size,
               sampler=make_prompt_sampler(data.questions, int(cfg.run.seed), cfg.data.balance_by))


def resume(run: Run, rt, logger: MetricsLogger, shared: bool) -> int:
    """The step to start from: 0, or with ``run.resume`` the latest checkpoint's, once the learners,
    the sampler and the logs are restored to it and the engines synced."""
    ckpt = latest_checkpoint(run.storage) if run.cfg.run.resume else None
    if ckpt is None:
        if shared and rt.learners.version != 0:
            raise ValueError(f"train: the given runtime's learners have taken {rt.learners.version} steps and "
                             f"{run.storage.uri()} has no checkpoint to resume from (run.resume=true with one)")
        return 0
    state = restore_checkpoint(rt.learners, run.storage, ckpt)
    if state.get("sft_policy_dir") != (run.sft or {}).get("policy_dir"):
        raise RuntimeError(f"{ckpt} was trained from SFT policy {state.get('sft_policy_dir')!r}, "
                           f"this run starts from {(run.sft or {}).get('policy_dir')!r}")
    run.sampler.load_state_dict(state["sampler"])
    start_step = int(state["step"])
    logger.rewind(start_step)  # steps logged after this checkpoint are about to be redone
    rt.sync_weights()
    print(f"[train] resumed from {ckpt} at step {start_step}", flush=True)
    return start_step


@dataclass
class SampledGroups:
    """Steps 1.-3. of one training step: the kept rollouts, their rewards, what sampling did."""

    kept: list
    rewards: torch.Tensor  # the stage's batch reward of each kept rollout
    last_round: list  # the last round's rollouts and rewards: the step's metrics when none was kept
    last_rewards: torch.Tensor
    metrics: dict  # sampling/* and rollout/* (the retrieval counts)


def sample_groups(run: Run, rt, step: int) -> SampledGroups:
    """1. sample P prompts, 2. roll out G samples each, 3. reward them with the stage's batch reward.
    DAPO's dynamic sampling resamples until P groups with non-uniform rewards are kept (at most
    ``max_rounds`` rounds); whole groups sampled by weights more than rollout.max_staleness
    versions old are dropped."""
    hp, P, G = run.hp, run.hp.prompts_per_step, run.hp.group_size
    kept, kept_rewards, dropped, stale_dropped = [], torch.zeros(0), 0, 0
    retrieval: dict[str, int] = {}  # the rollouts' retrieval counts, over the rounds
    for rounds in range(1, (hp.max_rounds if hp.dynamic_sampling else 1) + 1):
        questions = [run.data.questions[i] for i in run.sampler.next_batch(P)]                    # 1. sample
        tag = f"{step}" if rounds == 1 else f"{step}.{rounds - 1}"
        requests = episode_requests(questions, tag, G, run.golden_steps)
        rollouts = rt.rollout(requests, sampling_params(run.cfg, round_seed_index(step, rounds - 1)))  # 2. roll out
        for name, value in (getattr(rt, "rollout_stats", None) or {}).items():
            retrieval[name] = retrieval.get(name, 0) + int(value)
        rollouts, stale = bound_staleness(run.cfg, rollouts, rt.learners.version)
        stale_dropped += int(stale["stale_rollouts_dropped"])
        # 3. reward: the stage's batch reward, one float per rollout, a tensor from here on
        rewards = torch.as_tensor(run.schedule(step)([r.outcome for r in rollouts]), dtype=torch.float32)
        keep = torch.ones(len(rollouts), dtype=torch.bool)
        if hp.dynamic_sampling:
            keep = dynamic_sampling_filter(rewards, [r.group_key for r in rollouts]).keep
            dropped += P - int(keep.sum()) // G
        kept += [rollouts[i] for i in keep.nonzero().flatten().tolist()]
        kept_rewards = torch.cat([kept_rewards, rewards[keep]])
        if len(kept) >= P * G:
            break
    if hp.dynamic_sampling:
        kept, kept_rewards = kept[: P * G], kept_rewards[: P * G]
    metrics = {"sampling/rounds": rounds, "sampling/sampled_groups": P * rounds, "sampling/dropped_groups": dropped,
               "sampling/stale_rollouts_dropped": stale_dropped, **{f"rollout/{k}": v for k, v in retrieval.items()}}
    return SampledGroups(kept, kept_rewards, rollouts, rewards, metrics)


def update_and_sync(run: Run, rt, kept: list, advantages: torch.Tensor, step: int) -> dict:
    """5. the learners' update on the assembled batch, 6. the weight sync (and its check): their
    metrics, and the sync's seconds as ``time/sync``."""
    pad = int(rt.tokenizer.pad_token_id)
    extra = teacher_fields(kept, pad) if run.hp.teacher_kl else {}
    if run.hp.mode_slot:
        extra.update(mode_choice_fields(kept, advantages if run.hp.route_centred_slot else None))
    batch, fillers = assemble_batch(kept, advantages, pad, run.mini_batch, extra)
    learned = rt.learners.update(batch, step)
    t0 = time.perf_counter()
    synced = rt.sync_weights()
    return {**{f"learner/{k}": v for k, v in learned.items()}, **{f"sync/{k}": v for k, v in synced.items()},
            "train_sequences": len(kept), "filler_sequences": fillers, "time/sync": time.perf_counter() - t0}


def evaluate_heldout(run: Run, rt, step: int) -> dict:
    """The held-out evaluation after ``step`` + 1 steps (``eval/*``), appended to eval.jsonl too."""
    params = sampling_params(run.cfg, round_seed_index(step + 1, 999), float(run.cfg.eval.temperature))
    _, held = evaluate_episodes(rt, run.data.heldout, params, env_kwargs=run.hp.eval_kwargs, tag=f"eval{step + 1}",
                                judge=getattr(run.schedule, "judge", None))
    record = {"eval/em": held["em"], "eval/f1": held["f1"], "eval/retrievals_mean": held["retrieval_turns"],
              "eval/questions": held["n"]}
    with (run.out_dir / "eval.jsonl").open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step + 1, **record}) + "\n")
    return record


def save_step(run: Run, rt, step: int) -> str:
    """A checkpoint after ``step`` + 1 steps: the learners, the sampler's cursor and the SFT policy."""
    state = {"sampler": run.sampler.state_dict(), "weight_version": rt.learners.version,
             "sft_policy_dir": (run.sft or {}).get("policy_dir")}
    return str(save_checkpoint(rt.learners, run.storage, step + 1, state, int(run.cfg.run.keep_checkpoints),
                               int(run.cfg.run.keep_policy_every)))


def train(cfg, runtime=None, stop_at: float | None = None) -> dict:
    """Run ``cfg`` (from ``load_config``) to ``run.steps``; returns the last step's record.

    ``runtime``: an open runtime from ``open_runtime`` to train on and leave open (the next stage
    resumes on it with ``run.resume=true``); by default the run builds its own and shuts it down.
    ``stop_at``: a ``time.time()`` after which the run checkpoints the step it has just finished
    and returns early, its record marked ``stopped_early`` (a run split over several sittings: the
    same config with ``run.resume=true`` goes on from that checkpoint)."""
    run = prepare_run(cfg, runtime)
    hp = run.hp
    rt = runtime if runtime is not None else make_runtime(run.cfg, run.data.index_dirs, run.data.corpus)
    logger, last = MetricsLogger(run.out_dir), {}
    try:
        start_step = resume(run, rt, logger, shared=runtime is not None)
        bar = tqdm(range(start_step, hp.steps), initial=start_step, total=hp.steps, desc="train", unit="step")
        for step in bar:
            t0 = time.perf_counter()
            sampled = sample_groups(run, rt, step)                               # 1.-3. sample, roll out, reward
            t1 = time.perf_counter()
            kept, rewards, advantages, routes = sampled.kept, sampled.rewards, torch.zeros(0), None
            if kept:                              # 4. advantages over groups of identical (prompt id, step index)
                estimate = hp.estimate_advantages(rewards, [r.group_key for r in kept], [r.outcome for r in kept],
                                                  **hp.estimator_kwargs)
                routes, advantages = estimate.routes, estimate.advantages
            record = {"step": step + 1, "stage": run.schedule.stage_at(step), "method": run.cfg.method,
                      **step_metrics(kept or sampled.last_round, rewards if kept else sampled.last_rewards, advantages),
                      **sampled.metrics}
            if kept:                              # 5. update, 6. sync (none when dynamic sampling kept nothing)
                record.update(update_and_sync(run, rt, kept, advantages, step))
                if routes is not None:
                    record["routes"] = [int(x) for x in routes]
            else:
                record.update(train_sequences=0, skipped_update=1)
            sync_seconds = record.pop("time/sync", 0.0)
            record.update({"time/rollout": t1 - t0, "time/learn": time.perf_counter() - t1 - sync_seconds,
                           "time/sync": sync_seconds,
                           "time/retrieval": float(sum(r.outcome.retrieval_seconds for r in kept)),
                           "weight_versions": sorted({v for r in kept for v in r.weight_versions})})
            if hp.eval_every > 0 and (step + 1) % hp.eval_every == 0:           # 7. evaluate, log, checkpoint
                record.update(evaluate_heldout(run, rt, step))
            samples = [r.as_dict() for r in kept[:logger.samples_per_step]]  # only the logged few become dicts
            logger.log(record, trajectories=samples, rewards=rewards.tolist(), advantages=advantages.tolist())
            if run.cfg.run.dump_trajectories:
                dump_rollouts(run.out_dir, step + 1, kept, rewards.tolist(), advantages.tolist())
            stopping = stop_at is not None and time.time() >= stop_at and step + 1 < hp.steps
            every = hp.checkpoint_every
            if stopping or (every > 0 and ((step + 1) % every == 0 or step + 1 == hp.steps)):
                record["checkpoint"] = save_step(run, rt, step)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", em=f"{record['em']:.2f}")
            last = record
            if stopping:
                print(f"[train] stopped after step {step + 1} of {hp.steps} (its time is up); "
                      f"run.resume=true goes on from {record['checkpoint']}", flush=True)
                return {**record, "stopped_early": True}
        return last
    finally:
        logger.close()
        if runtime is None:
            rt.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config (experiments/configs/*.yaml)")
    parser.add_argument("--json", action="store_true", help="print the last step's metrics as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.steps=4")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    try:
        last = train(cfg)
    except StorageError as exc:  # a run location some node cannot use: say which, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WeightSyncError as exc:  # an engine that did not take the learner's weights: stop, say which
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(last))
    else:
        print(f"[train] done: step {last.get('step')}, reward {last.get('reward_mean', float('nan')):.3f}, "
              f"EM {last.get('em', float('nan')):.2f}; outputs in {cfg.run.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
