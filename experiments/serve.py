"""Serve a trained agent over HTTP with Ray Serve: the application builder and ``raggym serve``.

Two ways to start it::

    raggym serve --checkpoint runs/cpu_tiny --index index/ [--port 8000] [--json]
    serve run experiments.serve:app checkpoint=runs/cpu_tiny index=index/ max_batch_size=16

``app(args)`` is a Ray Serve application builder: ``serve run`` passes its ``key=value``
arguments as a dict of strings. Settings not given there are read from ``RAGGYM_SERVE_<KEY>``
environment variables (``RAGGYM_SERVE_CHECKPOINT``, ``RAGGYM_SERVE_INDEX``, ...), then defaults.

Inputs are checked before anything starts: the checkpoint must hold safetensors (or GGUF)
weights and the index must be a raggym index directory. See ``docs/serving.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

# Files that can run code when loaded (pickle-based formats); refused unless safetensors are there.
UNSAFE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
SAFE_WEIGHT_SUFFIXES = (".safetensors", ".gguf")

# Options of the app that are not ServeSettings fields.
APP_KEYS = {
    "checkpoint": "smollm2-135m",
    "index": None,
    "engine": "hf",  # "hf" (CPU or GPU) or "vllm" (GPU)
    "engine_threads": 0,  # torch threads of the policy replica (0 = all cores)
    "retrieval_threads": 1,
    "policy_cpus": 1.0,
    "policy_gpus": -1.0,  # -1: 1 GPU for vllm, 0 for hf
    "retrieval_cpus": 1.0,
    "ingress_cpus": 0.5,
    "gpu_memory_utilization": 0.5,
}


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
    for k in ("engine_threads", "retrieval_threads"):
        app[k] = int(app[k])
    for k in ("policy_cpus", "policy_gpus", "retrieval_cpus", "ingress_cpus", "gpu_memory_utilization"):
        app[k] = float(app[k])
    if app["engine"] not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf' or 'vllm', got {app['engine']!r}")
    settings = {k: merged[k] for k in setting_names if k in merged}
    return {"app": app, "settings": settings}


def build_app(args: dict | None = None):
    """The Ray Serve application (validates the checkpoint and index first)."""
    from actors.serving import _CONCURRENT_BATCHES, AgentCore, ServeSettings, make_deployments

    config = load_config(args)
    app = config["app"]
    policy = resolve_checkpoint(str(app["checkpoint"]))
    manifest = check_index(app["index"])
    modes = supported_modes(manifest)
    settings_dict = dict(config["settings"])
    settings_dict.setdefault("model_name", model_name_for(str(app["checkpoint"]), policy))
    settings = ServeSettings.from_dict(settings_dict)
    AgentCore(None, None, None, settings, modes)  # fails early on an unservable dialect
    Policy, Retrieval, Agent = make_deployments()
    threads = app["engine_threads"] or os.cpu_count() or 1
    gpus = app["policy_gpus"] if app["policy_gpus"] >= 0 else (1.0 if app["engine"] == "vllm" else 0.0)
    engine_kwargs = {"gpu_memory_utilization": app["gpu_memory_utilization"]} if app["engine"] == "vllm" else {}
    policy_app = Policy.options(
        ray_actor_options={"num_cpus": app["policy_cpus"], "num_gpus": gpus},
        max_ongoing_requests=max(settings.max_concurrent_requests, _CONCURRENT_BATCHES * settings.max_batch_size),
    ).bind(policy, app["engine"], engine_kwargs, settings.max_batch_size, settings.batch_wait_timeout_s,
           threads if app["engine"] == "hf" else None)
    retrieval_app = Retrieval.options(
        ray_actor_options={"num_cpus": app["retrieval_cpus"]},
        max_ongoing_requests=max(settings.max_concurrent_requests, _CONCURRENT_BATCHES * settings.retrieval_max_batch_size),
    ).bind(str(Path(app["index"]).expanduser().resolve()), settings.retrieval_max_batch_size,
           settings.retrieval_batch_wait_timeout_s, app["retrieval_threads"])
    return Agent.options(
        ray_actor_options={"num_cpus": app["ingress_cpus"]},
        max_ongoing_requests=settings.max_concurrent_requests,
    ).bind(policy_app, retrieval_app, settings.as_dict(), modes, policy)


def app(args: dict):
    """Application builder for ``serve run experiments.serve:app checkpoint=DIR index=DIR ...``."""
    return build_app(args)


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default="smollm2-135m",
                   help="HF policy dir, step-NNNNNN dir, run dir (latest complete checkpoint) or 'smollm2-135m'")
    p.add_argument("--index", required=True, help="raggym index directory (holds manifest.json)")
    p.add_argument("--dialect", default="routerag", help="search dialect the policy was trained with (default routerag)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="hf (CPU/GPU) or vllm (GPU)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--route-prefix", default="/", help="URL prefix of the API (default /)")
    p.add_argument("--address", default="local", help="Ray address; 'local' starts a private Ray (default)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the private Ray (default: all)")
    p.add_argument("--model-name", default=None, help="name reported by /v1/models (default: from the checkpoint)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-wait-timeout-s", type=float, default=0.01)
    p.add_argument("--max-turns", type=int, default=5, help="default model turns per episode")
    p.add_argument("--max-turns-limit", type=int, default=8, help="largest max_turns a request may ask for")
    p.add_argument("--max-turn-tokens", type=int, default=256)
    p.add_argument("--max-question-chars", type=int, default=2000)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--engine-threads", type=int, default=0, help="torch threads of the policy replica (0 = all cores)")
    p.add_argument("--json", action="store_true", help="print the endpoint info as one JSON object once serving")


def args_to_app(args) -> dict:
    out = {
        "checkpoint": args.checkpoint, "index": args.index, "engine": args.engine, "dialect": args.dialect,
        "max_batch_size": args.max_batch_size, "batch_wait_timeout_s": args.batch_wait_timeout_s,
        "default_max_turns": args.max_turns, "max_turns_limit": args.max_turns_limit,
        "max_turn_tokens": args.max_turn_tokens, "max_question_chars": args.max_question_chars,
        "top_k": args.top_k, "temperature": args.temperature, "engine_threads": args.engine_threads,
    }
    if args.model_name:
        out["model_name"] = args.model_name
    return out


def start(app_args: dict, *, host: str = "127.0.0.1", port: int = 8000, route_prefix: str = "/",
          name: str = "raggym") -> str:
    """Deploy on the already initialised Ray; returns the base URL once every replica is up."""
    from ray import serve

    application = build_app(app_args)
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run(application, name=name, route_prefix=route_prefix, blocking=False)
    prefix = "" if route_prefix == "/" else "/" + route_prefix.strip("/")
    return f"http://{host}:{port}{prefix}"


def run_serve(args) -> int:
    import ray
    from ray import serve

    app_args = args_to_app(args)
    build_app(app_args)  # validate the checkpoint, index and settings before Ray starts
    # Without --address: a private local Ray (never silently join a cluster found on this machine).
    init = {"address": args.address or "local", "include_dashboard": False}
    if args.num_cpus:
        init["num_cpus"] = args.num_cpus
    ray.init(**init, log_to_driver=not args.json)
    try:
        url = start(app_args, host=args.host, port=args.port, route_prefix=args.route_prefix)
        info = {"url": url, "endpoints": {"answer": f"{url}/v1/answer", "chat": f"{url}/v1/chat/completions",
                                          "models": f"{url}/v1/models", "health": f"{url}/healthz"},
                "openai_base_url": f"{url}/v1", "checkpoint": args.checkpoint, "index": args.index,
                "engine": args.engine, "dialect": args.dialect}
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"raggym serve: serving {args.checkpoint} over {args.index} at {url} "
                  f"(POST {url}/v1/answer, OpenAI base URL {url}/v1); Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("raggym serve: stopping", file=sys.stderr)
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.serve", description="Serve a trained agent over HTTP.")
    add_arguments(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
