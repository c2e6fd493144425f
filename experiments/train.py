"""GRPO-family training: one controller that reads like the papers' Algorithm 1.

    python -m experiments.train --config experiments/configs/cpu_tiny.yaml run.steps=4
    ray job submit --working-dir . -- python -m experiments.train --config experiments/configs/X.yaml key=value

Each step: sample prompts -> G rollouts each (env runners + rollout workers + retrieval service)
-> terminal rewards -> batch transforms (inside the stage's batch reward, e.g. RouteRAG's
batch-centred efficiency) -> advantages (GRPO or PathRouter's route-conditioned GRPO) -> learner
update (DeepSpeed group) -> weight sync -> log (JSONL + TensorBoard) -> checkpoint.

Checkpoints (``<out_dir>/checkpoints/step-NNNNNN``) hold the policy in HF format, the optimizer
state, the trainer step, the prompt sampler's cursor and RNG state, all as safetensors/JSON. With
``run.resume=true`` the latest complete checkpoint is picked up: the batch and the parameters of
the next step equal those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DEFAULTS: dict[str, Any] = {
    "run": {"name": "run", "out_dir": "runs/run", "seed": 0, "steps": 2, "checkpoint_every": 1, "resume": True,
            "keep_checkpoints": 2, "dump_trajectories": False},
    "method": "routerag",
    "reward": {"method": "routerag", "stage2_start": 20},
    "data": {"source": "synthetic", "synthetic": {"seed": 0, "n_entities": 300, "n_questions": 60},
             "corpus": None, "questions": None, "openie": None, "index_dir": None, "split": "train"},
    "env": {"id": "raggym/RouteRAG-v0", "kwargs": {}},
    "policy": {"model": "smollm2-135m"},
    "rollout": {"engine": "hf", "workers": 2, "env_runners": 1, "prompts_per_step": 2, "group_size": 2,
                "temperature": 1.0, "top_p": 1.0, "max_response_tokens": 64, "max_turn_tokens": 32,
                "max_observation_tokens": 128, "waves": 2, "worker_cpus": 0.5, "worker_gpus": 0.0,
                "engine_kwargs": {}},
    "advantage": {"estimator": "grpo", "normalize_by_std": True, "eps": 1.0e-6, "unbiased_std": True,
                  "route_weights": [1.0, 0.5, 0.3, 1.0]},
    "learner": {},
    "num_learners": 2,
    "learner_resources": None,
    "retrieval": {"shards": 2, "replicas": 1, "routing": "round_robin", "replica_per_node": False},
    "ray": {"address": None, "num_cpus": None},
}


# ----------------------------------------------------------------------------- config


def load_config(path: str | None, overrides: list[str] | None = None):
    """Defaults <- YAML file <- ``key=value`` overrides. Unknown top-level keys are an error."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(DEFAULTS)
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        loaded = OmegaConf.load(path)
        unknown = set(loaded) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"{path}: unknown config sections {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        cfg = OmegaConf.merge(cfg, loaded)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"overrides must look like key=value, got {bad}")
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return cfg


def _plain(node) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if node is not None and not isinstance(node, (int, float, str, bool)) else node


# ----------------------------------------------------------------------------- data


class PromptSampler:
    """Shuffled passes over the training questions; its cursor and RNG state are checkpointed."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise ValueError("no training questions")
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n)
        self.cursor = 0
        self.epoch = 0

    def next_batch(self, size: int) -> list[int]:
        out = []
        while len(out) < size:
            if self.cursor == self.n:
                self.order, self.cursor, self.epoch = self.rng.permutation(self.n), 0, self.epoch + 1
            out.append(int(self.order[self.cursor]))
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"n": self.n, "order": self.order.tolist(), "cursor": self.cursor, "epoch": self.epoch,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"checkpoint sampler covers {state['n']} questions, this run has {self.n}")
        self.order = np.asarray(state["order"], dtype=np.int64)
        self.cursor, self.epoch = int(state["cursor"]), int(state["epoch"])
        self.rng.bit_generator.state = state["rng"]


def prepare_data(cfg, out_dir: Path):
    """Questions and an index directory for the run (built once under ``out_dir/index``)."""
    from raggym.data import load_corpus, load_questions
    from raggym.retrieval import Retriever

    data = cfg.data
    index_dir = Path(data.index_dir) if data.index_dir else out_dir / "index"
    if data.source == "synthetic":
        from raggym.data.synthetic import generate_world

        world = generate_world(**_plain(data.synthetic))
        corpus, questions, openie = world.corpus, world.questions, world.openie
    elif data.source == "files":
        if not data.corpus or not data.questions:
            raise ValueError("data.source=files needs data.corpus and data.questions")
        corpus = load_corpus(data.corpus)
        questions = load_questions(data.questions, corpus)
        openie = data.openie
    else:
        raise ValueError(f"data.source must be 'synthetic' or 'files', got {data.source!r}")
    if not (index_dir / "manifest.json").exists():
        print(f"[train] building the index under {index_dir}", flush=True)
        Retriever.build(corpus, openie=openie, shards=int(cfg.retrieval.shards), show_progress=True).save(index_dir)
    return corpus, questions, index_dir


# ----------------------------------------------------------------------------- runtime


@dataclass
class Runtime:
    service: Any
    workers: list
    runners: list
    learners: Any
    tokenizer: Any
    others: list

    def shutdown(self) -> None:
        """Release every actor this run created (needed when the cluster outlives the driver)."""
        import ray

        self.learners.shutdown()
        for actor in [*self.runners, *self.workers, self.service, *self.others]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass


def start_runtime(cfg, index_dir: Path) -> Runtime:
    import ray

    from actors.engines.rollout_worker import RolloutWorker
    from actors.env_runner import EnvRunner
    from actors.learner import LearnerGroup
    from actors.retrieval_service import RESTARTS, start_retrieval_service
    from raggym.models import load_policy_tokenizer

    r = cfg.retrieval
    service, shards, replicas = start_retrieval_service(str(index_dir), num_replicas=int(r.replicas), routing=r.routing,
                                            replica_per_node=bool(r.replica_per_node))
    ro = cfg.rollout
    Worker = RolloutWorker.as_remote(num_cpus=float(ro.worker_cpus), num_gpus=float(ro.worker_gpus), **RESTARTS)
    engine_kwargs = {"model": cfg.policy.model, **(_plain(ro.engine_kwargs) or {})}
    if ro.engine == "hf":
        engine_kwargs.setdefault("num_threads", 1)
    workers = [Worker.remote(engine=ro.engine, **engine_kwargs) for _ in range(int(ro.workers))]
    Runner = EnvRunner.as_remote(num_cpus=0.25, **RESTARTS)
    rollout_cfg = {k: int(ro[k]) for k in ("max_response_tokens", "max_turn_tokens", "max_observation_tokens", "waves")}
    runners = [Runner.remote(cfg.env.id, service, workers, cfg.policy.model, _plain(cfg.env.kwargs), rollout_cfg)
               for _ in range(int(ro.env_runners))]
    learner_cfg = {"model": cfg.policy.model, "temperature": float(ro.temperature), "seed": int(cfg.run.seed),
                   **(_plain(cfg.learner) or {})}
    learners = LearnerGroup(learner_cfg, num_learners=int(cfg.num_learners), resources=_plain(cfg.learner_resources))
    ray.get([w.ping.remote() for w in workers] + [x.ping.remote() for x in runners])
    return Runtime(service, workers, runners, learners, load_policy_tokenizer(cfg.policy.model), [*shards, *replicas])


# ----------------------------------------------------------------------------- one step's pieces


def rollout(rt: Runtime, cfg, questions, step: int, corpus=None) -> list[dict]:
    """G samples of each question, spread over the env runners; one trajectory dict each."""
    import ray

    from actors.engines.base import SamplingParams, derive_seed

    G = int(cfg.rollout.group_size)
    sampling = SamplingParams(temperature=float(cfg.rollout.temperature), top_p=float(cfg.rollout.top_p),
                              seed=derive_seed(int(cfg.run.seed), step))
    items = [(q, f"{step}:{q.id}", g) for q in questions for g in range(G)]
    n = len(rt.runners)
    chunks = [items[i::n] for i in range(n)]
    refs = []
    for runner, chunk in zip(rt.runners, chunks):
        if chunk:
            gold = [] if corpus is None else [corpus.by_id(pid).as_dict() for q in {q.id: q for q, _, _ in chunk}.values()
                                              for pid in q.gold_passage_ids if pid in corpus]
            refs.append(runner.rollout.remote([q.as_dict() for q, _, _ in chunk], [gid for _, gid, _ in chunk],
                                              [g for _, _, g in chunk], sampling, gold))
    trajectories = [t for part in ray.get(refs) for t in part]
    # Put trajectories back in (question, sample) order regardless of which runner ran them.
    order = {(gid, g): i for i, (_, gid, g) in enumerate(items)}
    trajectories.sort(key=lambda t: order[(t["group_id"], t["sample_index"])])
    if len(trajectories) != len(items) or len(order) != len(items):
        raise RuntimeError(f"expected {len(items)} trajectories, got {len(trajectories)}")
    return trajectories


def compute_rewards(schedule, step: int, trajectories: list[dict]):
    from raggym.rewards import EpisodeOutcome

    outcomes = [EpisodeOutcome.from_dict(t["episode"]) for t in trajectories]
    return outcomes, [float(r) for r in schedule(step)(outcomes)]


def compute_advantages(cfg, outcomes, rewards, group_ids):
    import torch

    from raggym.algorithms import grpo_advantages, route_conditioned_advantages

    a = cfg.advantage
    r = torch.tensor(rewards, dtype=torch.float32)
    kwargs = {"eps": float(a.eps), "normalize_by_std": bool(a.normalize_by_std), "unbiased_std": bool(a.unbiased_std)}
    if a.estimator == "grpo":
        return grpo_advantages(r, group_ids, **kwargs), None
    if a.estimator == "route":
        from raggym.rewards.pathrouter import pathrouter_flags

        flags = [pathrouter_flags(o) for o in outcomes]
        correct = torch.tensor([c for c, _ in flags], dtype=torch.bool)
        supported = torch.tensor([p for _, p in flags], dtype=torch.bool)
        return route_conditioned_advantages(r, group_ids, correct, supported, tuple(a.route_weights), **kwargs)
    raise ValueError(f"advantage.estimator must be 'grpo' or 'route', got {a.estimator!r}")


def summarize(trajectories, outcomes, rewards, advantages) -> dict:
    from raggym.rewards.metrics import exact_match, token_f1

    em = [exact_match(o.answer, o.gold_answers) for o in outcomes]
    f1 = [token_f1(o.answer, o.gold_answers) for o in outcomes]
    return {
        "reward_mean": float(np.mean(rewards)),
        "reward_std": float(np.std(rewards)),
        "em": float(np.mean(em)),
        "f1": float(np.mean(f1)),
        "advantage_abs_mean": float(np.mean(np.abs(advantages))),
        "retrievals_mean": float(np.mean([o.retrieval_count for o in outcomes])),
        "answered": float(np.mean([o.answer is not None for o in outcomes])),
        "response_tokens_mean": float(np.mean([sum(t["loss_mask"]) for t in trajectories])),
        "sequence_tokens_mean": float(np.mean([len(t["token_ids"]) for t in trajectories])),
    }


# ----------------------------------------------------------------------------- checkpoints


def latest_checkpoint(out_dir: Path) -> Path | None:
    root = out_dir / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").exists()) if root.exists() else []
    return done[-1] if done else None


def save_checkpoint(rt: Runtime, out_dir: Path, step: int, sampler: PromptSampler, keep: int) -> Path:
    """Write into a temp dir, then rename: a crash never leaves a checkpoint that looks complete."""
    root = out_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    rt.learners.save_checkpoint(str(tmp))
    state = {"step": step, "sampler": sampler.state_dict(), "weight_version": rt.learners.version}
    (tmp / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- the loop


def train(cfg) -> dict:
    import ray

    from raggym.learning_log import MetricsLogger
    from raggym.rewards.schedules import reward_schedule_from_config

    out_dir = Path(cfg.run.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    if not ray.is_initialized():
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
        if address:  # a cluster (or a Ray job, which sets RAY_ADDRESS)
            ray.init(address=address, log_to_driver=False)
        else:  # standalone: a local Ray instance for this process
            ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    corpus, questions, index_dir = prepare_data(cfg, out_dir)
    schedule = reward_schedule_from_config(_plain(cfg.reward))
    sampler = PromptSampler(len(questions), int(cfg.run.seed))
    rt = start_runtime(cfg, index_dir)
    start = 0
    ckpt = latest_checkpoint(out_dir) if cfg.run.resume else None
    if ckpt is not None:
        state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
        rt.learners.load_checkpoint(str(ckpt))
        sampler.load_state_dict(state["sampler"])
        start = int(state["step"])
        rt.learners.sync_weights(rt.workers)  # the rollout workers start from the restored policy
        print(f"[train] resumed from {ckpt} at step {start}", flush=True)
    logger = MetricsLogger(out_dir)
    try:
        return _loop(cfg, rt, out_dir, questions, corpus, schedule, sampler, start, logger)
    finally:
        logger.close()
        rt.shutdown()


def _loop(cfg, rt, out_dir, questions, corpus, schedule, sampler, start, logger) -> dict:
    from tqdm.auto import tqdm

    from actors.learner import make_train_batch

    last: dict = {}
    bar = tqdm(range(start, int(cfg.run.steps)), initial=start, total=int(cfg.run.steps), desc="train", unit="step")
    for step in bar:
        t0 = time.perf_counter()
        batch_questions = [questions[i] for i in sampler.next_batch(int(cfg.rollout.prompts_per_step))]  # 1. sample prompts
        trajectories = rollout(rt, cfg, batch_questions, step, corpus)                                       # 2. G rollouts each
        t1 = time.perf_counter()
        outcomes, rewards = compute_rewards(schedule, step, trajectories)                                # 3.+4. rewards, batch transforms
        group_ids = [t["group_id"] for t in trajectories]
        advantages, routes = compute_advantages(cfg, outcomes, rewards, group_ids)                      # 5. advantages
        t2 = time.perf_counter()
        batch = make_train_batch([t["token_ids"] for t in trajectories], [t["loss_mask"] for t in trajectories],
                                 advantages.tolist(), pad_token_id=int(rt.tokenizer.pad_token_id))
        learn = rt.learners.update(batch, step)                                                          # 6. learner update
        t3 = time.perf_counter()
        sync = rt.learners.sync_weights(rt.workers)                                                      # 7. sync
        t4 = time.perf_counter()
        record = {"step": step + 1, "stage": schedule.stage_at(step), **summarize(trajectories, outcomes, rewards, advantages.numpy()),
                  **{f"learner/{k}": v for k, v in learn.items()}, **{f"sync/{k}": v for k, v in sync.items()},
                  "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/learn": t3 - t2, "time/sync": t4 - t3,
                  "time/retrieval": float(sum(o.retrieval_seconds for o in outcomes)),
                  "weight_versions": sorted({v for t in trajectories for v in [x["weight_version"] for x in t["turns"]]})}
        if routes is not None:
            record["routes"] = [int(x) for x in routes]
        logger.log(record, trajectories=trajectories, rewards=rewards, advantages=advantages.tolist())    # 8. log
        if cfg.run.dump_trajectories:
            _dump(out_dir, step + 1, trajectories, rewards, advantages.tolist())
        if int(cfg.run.checkpoint_every) > 0 and ((step + 1) % int(cfg.run.checkpoint_every) == 0 or step + 1 == int(cfg.run.steps)):
            record["checkpoint"] = str(save_checkpoint(rt, out_dir, step + 1, sampler, int(cfg.run.keep_checkpoints)))  # 9. checkpoint
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", em=f"{record['em']:.2f}")
        last = record
    return last


def _dump(out_dir: Path, step: int, trajectories, rewards, advantages) -> None:
    folder = out_dir / "trajectories"
    folder.mkdir(exist_ok=True)
    with (folder / f"step-{step:06d}.jsonl").open("w", encoding="utf-8") as fh:
        for t, r, a in zip(trajectories, rewards, advantages):
            fh.write(json.dumps({**t, "reward": r, "advantage": a}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config (experiments/configs/*.yaml)")
    parser.add_argument("--json", action="store_true", help="print the last step's metrics as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.steps=4")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    last = train(cfg)
    if args.json:
        print(json.dumps(last))
    else:
        print(f"[train] done: step {last.get('step')}, reward {last.get('reward_mean', float('nan')):.3f}, "
              f"EM {last.get('em', float('nan')):.2f}; outputs in {cfg.run.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
