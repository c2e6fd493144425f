"""GRPO-family training: the recipe, top to bottom, as the papers' Algorithm 1.

    python -m experiments.train --config experiments/configs/cpu_tiny.yaml run.steps=4
    ray job submit --working-dir . -- python -m experiments.train --config experiments/configs/X.yaml key=value

Each step: sample prompts -> G rollouts each (env runners + rollout workers + retrieval service)
-> rewards (the stage's batch reward, e.g. RouteRAG's batch-centred efficiency) -> advantages
(the registered estimator: GRPO, PathRouter's route-conditioned GRPO, R1-Router's Step-GRPO over
teacher-forced steps) -> learner update (DeepSpeed group) -> weight sync -> log (JSONL +
TensorBoard) -> checkpoint -> held-out evaluation.

One typed ``raggym.trajectory.Rollout`` flows from the rollout loop to the learner; rewards read
its ``outcome``. Config: ``experiments/config.py`` (one YAML per paper in ``experiments/configs``,
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
from experiments.config import ConfigError, load_config, to_plain, validate_config
from experiments.evaluate import evaluate_episodes
from experiments.sft import golden_examples, run_sft
from experiments.training import (RunData, episode_requests, golden_steps_for, latest_checkpoint, load_run_data,
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
    ``train(cfg_i, runtime=rt)`` for each stage, ``experiments.evaluate.evaluate(..., runtime=rt)``
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


def train(cfg, runtime=None, stop_at: float | None = None) -> dict:
    """Run ``cfg`` (from ``load_config``) to ``run.steps``; returns the last step's record.

    ``runtime``: an open runtime from ``open_runtime`` to train on and leave open (the next stage
    resumes on it with ``run.resume=true``); by default the run builds its own and shuts it down.
    ``stop_at``: a ``time.time()`` after which the run checkpoints the step it has just finished
    and returns early, its record marked ``stopped_early`` (a run split over several sittings: the
    same config with ``run.resume=true`` goes on from that checkpoint)."""
    validate_config(cfg)
    cfg = copy.deepcopy(cfg)  # the SFT cold start may point policy.model at its output
    if cfg.runtime == "ray":
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
    storage = open_run_storage(cfg)  # run.out_dir: a path every node sees, or a URI (docs/cluster.md)
    out_dir = storage.local()  # the driver's logs (on remote storage: its staging copy)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")

    # ---- hyperparameters, named once
    steps, G, P = int(cfg.run.steps), int(cfg.rollout.group_size), int(cfg.rollout.prompts_per_step)
    adv = to_plain(cfg.advantage)
    estimate_advantages = get_advantage_estimator(adv.pop("estimator"))
    dynamic_sampling, max_rounds = bool(adv.pop("dynamic_sampling")), int(adv.pop("max_sampling_rounds"))
    adv.pop("stop_route_group")  # which step groups exist, not how they are scored: golden_steps_for reads it
    if cfg.reward.method == "pathrouter":  # the routes use the reward's own C and P thresholds
        adv.update({k: cfg.reward[k] for k in ("correct_f1_threshold", "evidence_threshold") if k in cfg.reward})
    teacher_kl = teacher_evidence_tokens(cfg) is not None  # the rollouts then record the teacher's prompt
    mode_slot = mode_choice_slot(cfg)  # a mode-choice loss term is on (the rollouts record the mode choices)
    eval_every, eval_kwargs = int(cfg.eval.every), {**to_plain(cfg.env.kwargs), **to_plain(cfg.eval.env_kwargs)}

    data = load_run_data(cfg, storage, multi_kb=takes_knowledge_bases(cfg.env.id))
    schedule = reward_schedule(cfg)  # before the cold start: a judge's "policy" is the base model
    if runtime is not None:
        _check_shared_runtime(runtime, cfg)
        if cfg.sft.enabled:
            raise ValueError("train: a run with an SFT cold start (sft.enabled) builds its own runtime")
    sft = sft_cold_start(cfg, storage, data)
    if sft is not None:
        cfg.policy.model = str(sft["policy_dir"])  # RL starts from the SFT policy
    golden_steps = golden_steps_for(cfg, data.questions)  # Step-GRPO: teacher-forced step groups
    mini_batch = LearnerConfig.from_dict(learner_config(cfg)).mini_batch_size
    sampler = make_prompt_sampler(data.questions, int(cfg.run.seed), cfg.data.balance_by)  # data.balance_by: equal shares
    rt = runtime if runtime is not None else make_runtime(cfg, data.index_dirs, data.corpus)
    logger = MetricsLogger(out_dir)
    start_step, last = 0, {}
    try:
        ckpt = latest_checkpoint(storage) if cfg.run.resume else None
        if ckpt is not None:  # resume: learner state, sampler state, then the engines' weights
            state = restore_checkpoint(rt.learners, storage, ckpt)
            if state.get("sft_policy_dir") != (sft or {}).get("policy_dir"):
                raise RuntimeError(f"{ckpt} was trained from SFT policy {state.get('sft_policy_dir')!r}, "
                                   f"this run starts from {(sft or {}).get('policy_dir')!r}")
            sampler.load_state_dict(state["sampler"])
            start_step = int(state["step"])
            logger.rewind(start_step)  # steps logged after this checkpoint are about to be redone
            rt.sync_weights()
            print(f"[train] resumed from {ckpt} at step {start_step}", flush=True)
        elif runtime is not None and rt.learners.version != 0:
            raise ValueError(f"train: the given runtime's learners have taken {rt.learners.version} steps and "
                             f"{storage.uri()} has no checkpoint to resume from (run.resume=true with one)")

        bar = tqdm(range(start_step, steps), initial=start_step, total=steps, desc="train", unit="step")
        for step in bar:
            t0 = time.perf_counter()
            # 1.-3. sample P prompts, roll out G samples each, score them; DAPO's dynamic sampling
            # resamples until P groups with non-uniform rewards are kept (at most max_rounds rounds).
            kept, kept_rewards, dropped, rounds, stale_dropped = [], torch.zeros(0), 0, 0, 0
            retrieval: dict[str, int] = {}  # the rollouts' retrieval counts, over the rounds
            for rounds in range(1, (max_rounds if dynamic_sampling else 1) + 1):
                questions = [data.questions[i] for i in sampler.next_batch(P)]                      # 1. sample
                tag = f"{step}" if rounds == 1 else f"{step}.{rounds - 1}"
                requests = episode_requests(questions, tag, G, golden_steps)
                rollouts = rt.rollout(requests, sampling_params(cfg, round_seed_index(step, rounds - 1)))  # 2. rollout
                for name, value in (getattr(rt, "rollout_stats", None) or {}).items():
                    retrieval[name] = retrieval.get(name, 0) + int(value)
                # whole groups sampled by weights more than rollout.max_staleness versions old are dropped
                rollouts, stale = bound_staleness(cfg, rollouts, rt.learners.version)
                stale_dropped += int(stale["stale_rollouts_dropped"])
                # 3. reward: the stage's batch reward, one float per rollout, a tensor from here on
                rewards = torch.as_tensor(schedule(step)([r.outcome for r in rollouts]), dtype=torch.float32)
                keep = torch.ones(len(rollouts), dtype=torch.bool)
                if dynamic_sampling:
                    keep = dynamic_sampling_filter(rewards, [r.group_key for r in rollouts]).keep
                    dropped += P - int(keep.sum()) // G
                kept += [rollouts[i] for i in keep.nonzero().flatten().tolist()]
                kept_rewards = torch.cat([kept_rewards, rewards[keep]])
                if len(kept) >= P * G:
                    break
            if dynamic_sampling:
                kept, kept_rewards = kept[: P * G], kept_rewards[: P * G]
            t1 = time.perf_counter()

            # 4. advantages: the registered estimator over groups of identical (prompt id, step index)
            advantages = torch.zeros(0)
            if kept:
                advantages = estimate_advantages(kept_rewards, [r.group_key for r in kept], [r.outcome for r in kept], **adv)
                routes, advantages = advantages.routes, advantages.advantages
            record = {"step": step + 1, "stage": schedule.stage_at(step), "method": cfg.method,
                      **step_metrics(kept or rollouts, kept_rewards if kept else rewards, advantages),
                      "sampling/rounds": rounds, "sampling/sampled_groups": P * rounds, "sampling/dropped_groups": dropped,
                      "sampling/stale_rollouts_dropped": stale_dropped,
                      **{f"rollout/{name}": value for name, value in retrieval.items()}}

            # 5. update, 6. sync (skipped when dynamic sampling kept no group with a learning signal)
            t2 = t3 = time.perf_counter()
            if kept:
                extra = teacher_fields(kept, int(rt.tokenizer.pad_token_id)) if teacher_kl else {}
                if mode_slot:
                    extra.update(mode_choice_fields(kept))
                batch, fillers = assemble_batch(kept, advantages, int(rt.tokenizer.pad_token_id), mini_batch, extra)
                learned = rt.learners.update(batch, step)                                          # 5. update
                t2 = time.perf_counter()
                synced = rt.sync_weights()                                                         # 6. sync
                t3 = time.perf_counter()
                record.update({f"learner/{k}": v for k, v in learned.items()}, **{f"sync/{k}": v for k, v in synced.items()},
                              train_sequences=len(kept), filler_sequences=fillers)
                if routes is not None:
                    record["routes"] = [int(x) for x in routes]
            else:
                record.update(train_sequences=0, skipped_update=1)
            record.update({"time/rollout": t1 - t0, "time/learn": t2 - t1, "time/sync": t3 - t2,
                           "time/retrieval": float(sum(r.outcome.retrieval_seconds for r in kept)),
                           "weight_versions": sorted({v for r in kept for v in r.weight_versions})})

            # 7. log, checkpoint, evaluate
            if eval_every > 0 and (step + 1) % eval_every == 0:
                _, held = evaluate_episodes(rt, data.heldout, sampling_params(cfg, round_seed_index(step + 1, 999),
                                                                              float(cfg.eval.temperature)),
                                            env_kwargs=eval_kwargs, tag=f"eval{step + 1}",
                                            judge=getattr(schedule, "judge", None))
                record.update({"eval/em": held["em"], "eval/f1": held["f1"],
                               "eval/retrievals_mean": held["retrieval_turns"], "eval/questions": held["n"]})
                with (out_dir / "eval.jsonl").open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"step": step + 1, **{k: v for k, v in record.items() if k.startswith("eval/")}}) + "\n")
            logger.log(record, trajectories=[r.as_dict() for r in kept], rewards=kept_rewards.tolist(),
                       advantages=advantages.tolist())
            if cfg.run.dump_trajectories:
                dump_rollouts(out_dir, step + 1, kept, kept_rewards.tolist(), advantages.tolist())
            every = int(cfg.run.checkpoint_every)
            stopping = stop_at is not None and time.time() >= stop_at and step + 1 < steps
            if stopping or (every > 0 and ((step + 1) % every == 0 or step + 1 == steps)):
                state = {"sampler": sampler.state_dict(), "weight_version": rt.learners.version,
                         "sft_policy_dir": (sft or {}).get("policy_dir")}
                record["checkpoint"] = str(save_checkpoint(rt.learners, storage, step + 1, state,
                                                           int(cfg.run.keep_checkpoints),
                                                           int(cfg.run.keep_policy_every)))
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", em=f"{record['em']:.2f}")
            last = record
            if stopping:
                print(f"[train] stopped after step {step + 1} of {steps} (its time is up); "
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
