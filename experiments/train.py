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

Per-paper recipes live in ``experiments/configs`` (see docs/recipes.md). Every key is checked
against ``SCHEMA``: an unknown key at any depth, a value of the wrong type or two sections that
contradict each other is an error naming the file and the dotted key. What the sections switch
on: ``advantage.estimator`` (grpo | route for PathRouter | step_grpo for R1-Router, whose
episodes run step-wise on MultiKBRouteEnv), ``advantage.dynamic_sampling`` (DAPO),
``reward.*`` (the stage/phase schedule), ``learner.loss.teacher_kl`` (PathRouter's teacher),
``learner.lora`` (peft adapters), ``sft.enabled`` (GraphRAG-R1's cold start before RL),
``eval.every`` (held-out evaluation with ``eval.env_kwargs``) and ``runtime`` (ray | local).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

# ----------------------------------------------------------------------------- config schema
#
# Every key the trainer reads is in this tree, so a YAML key that is misspelt (or a key of a
# section that means something else) is an error naming its full dotted path and its file. Leaves
# are typed; a few sections depend on another key (``env.kwargs`` on ``env.id``, ``reward`` on
# ``reward.method``, ``rollout.engine_kwargs`` on ``rollout.engine``) and are derived from the
# constructor or dataclass they are passed to, so they cannot drift from it.

METHODS = ("routerag", "pathrouter", "lws", "graphrag_r1", "r1_router", "search_r1")
STEPWISE_ENV = "raggym/MultiKBRoute-v0"
TABLE_KB, TEXT_KB = "Table Retriever", "Text Retriever"


@dataclass(frozen=True)
class Leaf:
    """One typed config value: ``kind`` is int, float, bool, str or list[int|float|str]."""

    kind: str
    nullable: bool = False
    choices: tuple = ()

    def describe(self) -> str:
        text = f"one of {list(self.choices)}" if self.choices else self.kind
        return text + (" or null" if self.nullable else "")

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.choices and value not in self.choices:
            return False
        if self.kind.startswith("list["):
            inner = Leaf(self.kind[5:-1])
            return isinstance(value, (list, tuple)) and all(inner.accepts(v) for v in value)
        if self.kind == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if self.kind == "float":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str)
        raise AssertionError(self.kind)


@dataclass(frozen=True)
class Optional_:
    """A section that may also be null (``learner.lora``, ``learner_resources``)."""

    schema: dict


@dataclass(frozen=True)
class Dynamic:
    """A section whose keys depend on the rest of the (merged) config."""

    build: Callable[[dict], dict]
    why: str


@dataclass(frozen=True)
class Forbidden:
    """A key that exists in the underlying class but is set by the trainer from elsewhere."""

    hint: str


def _leaf_from_type(tp) -> Leaf | None:
    """The Leaf of a Python annotation, or None when it has no YAML spelling."""
    import types
    import typing

    origin = typing.get_origin(tp)
    if tp in (int, float, bool, str):
        return Leaf(tp.__name__)
    if origin is typing.Literal:
        values = typing.get_args(tp)
        return Leaf(type(values[0]).__name__, choices=tuple(values))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(tp))
        if str in args:  # e.g. torch.dtype | str | None: YAML can only give the string form
            return Leaf("str", nullable=nullable)
        if len(args) == 2 and set(args) == {int, float}:
            return Leaf("float", nullable=nullable)
        if len(args) == 1:
            inner = _leaf_from_type(args[0])
            return None if inner is None else Leaf(inner.kind, nullable=nullable, choices=inner.choices)
        return None
    if origin in (tuple, list, typing.Sequence, __import__("collections.abc").abc.Sequence):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        kinds = {a for a in args}
        if len(kinds) == 1 and next(iter(kinds)) in (int, float, str):
            return Leaf(f"list[{next(iter(kinds)).__name__}]")
        return None
    return None


def _dataclass_schema(cls, forbidden: Mapping[str, str] | None = None, exclude: Sequence[str] = ()) -> dict:
    """Schema of a dataclass's fields; nested dataclasses become sections."""
    import dataclasses
    import types
    import typing

    hints = typing.get_type_hints(cls)
    out: dict = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if forbidden and f.name in forbidden:
            out[f.name] = Forbidden(forbidden[f.name])
            continue
        tp = hints[f.name]
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out[f.name] = _dataclass_schema(tp)
        elif typing.get_origin(tp) in (typing.Union, types.UnionType) and any(dataclasses.is_dataclass(a) for a in args):
            inner = next(a for a in args if dataclasses.is_dataclass(a))
            out[f.name] = Optional_(_dataclass_schema(inner))
        else:
            leaf = _leaf_from_type(tp)
            if leaf is None:
                raise TypeError(f"{cls.__name__}.{f.name}: annotation {tp} has no config spelling")
            out[f.name] = leaf
    return out


def _signature_schema(fn, exclude: Sequence[str]) -> dict:
    """Schema of the keyword parameters of ``fn`` that a YAML file can spell."""
    import inspect
    import typing

    hints = typing.get_type_hints(fn)
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in ("self", *exclude) or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        leaf = _leaf_from_type(hints.get(name, typing.Any))
        if leaf is None and name == "allowed_modes":  # Any: a mode name or a list of them
            leaf = Leaf("list[str]", nullable=True)
        if leaf is not None:
            out[name] = leaf
    return out


# Env constructor arguments the trainer supplies itself (objects, or values it derives).
_ENV_SUPPLIED = ("retriever", "questions", "dialect", "reward_fn", "corpus", "prompt_fn", "token_counter",
                 "max_episode_tokens", "render_mode", "question_order", "knowledge_bases",
                 "knowledge_base_modes", "gold_knowledge_base_names")


def _env_kwargs_schema(cfg: dict) -> dict:
    env_id = (cfg.get("env") or {}).get("id")
    if env_id == STEPWISE_ENV:
        from envs.multi_kb_route_env import MultiKBRouteEnv

        return _signature_schema(MultiKBRouteEnv.__init__, _ENV_SUPPLIED)
    import envs

    if env_id not in envs.SEARCH_ENV_IDS:
        raise ValueError(f"env.id: unknown environment {env_id!r}; known: {list(envs.ENV_IDS)}")
    from envs.rag_search_env import RagSearchEnv

    return _signature_schema(RagSearchEnv.__init__, _ENV_SUPPLIED)


def _engine_kwargs_schema(cfg: dict) -> dict:
    engine = (cfg.get("rollout") or {}).get("engine", "hf")
    if engine == "vllm":
        import importlib

        try:
            cls = importlib.import_module("actors.engines.vllm_engine").VLLMEngine
        except ImportError as exc:  # pragma: no cover - vllm-less machines
            raise ValueError(f"rollout.engine=vllm but the vLLM engine cannot be imported: {exc}") from exc
        return _signature_schema(cls.__init__, ("model", "weight_version"))
    from actors.engines.hf import HFEngine

    return _signature_schema(HFEngine.__init__, ("model", "tokenizer", "weight_version"))


def _reward_schema(cfg: dict) -> dict:
    """``reward.*`` keys: the schedule's own keys plus the fields of the method's reward config."""
    from raggym.rewards import GraphRAGR1Config, LWSConfig, PathRouterConfig, RouteRAGConfig

    method = (cfg.get("reward") or {}).get("method")
    base = {"method": Leaf("str", choices=METHODS)}
    if method == "routerag":
        return {**base, "stage2_start": Leaf("int"), **_dataclass_schema(RouteRAGConfig)}
    if method == "lws":
        return {**base, "stage2_start": Leaf("int"), "embedder": Leaf("str"), **_dataclass_schema(LWSConfig)}
    if method == "graphrag_r1":
        return {**base, "phase3_start": Leaf("int"),
                "sft_steps": Forbidden("the SFT cold start is the sft: section (sft.enabled, sft.epochs)"),
                **_dataclass_schema(GraphRAGR1Config)}
    if method == "pathrouter":
        return {**base, **_dataclass_schema(PathRouterConfig, {"route_weights": "set advantage.route_weights"})}
    if method == "r1_router":
        return {**base, "embedder": Leaf("str")}
    return base


def _learner_schema(cfg: dict) -> dict:
    from actors.learner import LearnerConfig

    return _dataclass_schema(LearnerConfig, {
        "model": "the learner trains policy.model (or the SFT policy)",
        "temperature": "set rollout.temperature (the learner divides logits by it)",
        "seed": "set run.seed",
    })


def _world_schema(cfg: dict) -> dict:
    from raggym.data.synthetic import WorldConfig

    return _dataclass_schema(WorldConfig)


LORA_SCHEMA = {"r": Leaf("int"), "alpha": Leaf("int"), "dropout": Leaf("float"), "target_modules": Leaf("list[str]")}

SCHEMA: dict = {
    "run": {"name": Leaf("str"), "out_dir": Leaf("str"), "seed": Leaf("int"), "steps": Leaf("int"),
            "checkpoint_every": Leaf("int"), "resume": Leaf("bool"), "keep_checkpoints": Leaf("int"),
            "dump_trajectories": Leaf("bool")},
    "runtime": Leaf("str", choices=("ray", "local")),
    "method": Leaf("str", choices=METHODS),
    "reward": Dynamic(_reward_schema, "depends on reward.method"),
    "data": {"source": Leaf("str", choices=("synthetic", "files")),
             "synthetic": Dynamic(_world_schema, "raggym.data.synthetic.WorldConfig"),
             "corpus": Leaf("str", nullable=True), "questions": Leaf("str", nullable=True),
             "openie": Leaf("str", nullable=True), "index_dir": Leaf("str", nullable=True),
             "table_corpus": Leaf("str", nullable=True), "table_index_dir": Leaf("str", nullable=True)},
    "env": {"id": Leaf("str"), "kwargs": Dynamic(_env_kwargs_schema, "depends on env.id")},
    "policy": {"model": Leaf("str")},
    "rollout": {"engine": Leaf("str", choices=("hf", "vllm")), "workers": Leaf("int"), "env_runners": Leaf("int"),
                "prompts_per_step": Leaf("int"), "group_size": Leaf("int"), "temperature": Leaf("float"),
                "top_p": Leaf("float"), "max_response_tokens": Leaf("int"), "max_turn_tokens": Leaf("int"),
                "max_observation_tokens": Leaf("int"), "waves": Leaf("int"), "worker_cpus": Leaf("float"),
                "worker_gpus": Leaf("float"), "engine_kwargs": Dynamic(_engine_kwargs_schema, "depends on rollout.engine")},
    "advantage": {"estimator": Leaf("str", choices=("grpo", "route", "step_grpo")), "normalize_by_std": Leaf("bool"),
                  "eps": Leaf("float"), "unbiased_std": Leaf("bool"), "route_weights": Leaf("list[float]"),
                  "dynamic_sampling": Leaf("bool"), "max_sampling_rounds": Leaf("int")},
    "learner": Dynamic(_learner_schema, "actors.learner.LearnerConfig"),
    "num_learners": Leaf("int"),
    "learner_resources": Optional_({"num_cpus": Leaf("float", nullable=True), "num_gpus": Leaf("float", nullable=True),
                                    "memory": Leaf("int", nullable=True)}),
    "retrieval": {"shards": Leaf("int"), "replicas": Leaf("int"), "routing": Leaf("str"),
                  "replica_per_node": Leaf("bool")},
    "ray": {"address": Leaf("str", nullable=True), "num_cpus": Leaf("int", nullable=True)},
    "sft": {"enabled": Leaf("bool"), "epochs": Leaf("int"), "lr": Leaf("float"), "batch_size": Leaf("int"),
            "grad_accum": Leaf("int"), "max_seq_tokens": Leaf("int"), "max_examples": Leaf("int", nullable=True),
            "lora": Optional_(LORA_SCHEMA)},
    "eval": {"every": Leaf("int"), "questions": Leaf("int"), "temperature": Leaf("float"),
             "env_kwargs": Dynamic(_env_kwargs_schema, "depends on env.id")},
}

DEFAULTS: dict[str, Any] = {
    "run": {"name": "run", "out_dir": "runs/run", "seed": 0, "steps": 2, "checkpoint_every": 1, "resume": True,
            "keep_checkpoints": 2, "dump_trajectories": False},
    "runtime": "ray",
    "method": "routerag",
    "reward": {"method": "routerag"},  # stage2_start defaults to 20 in the schedule
    "data": {"source": "synthetic", "synthetic": {"seed": 0, "n_entities": 300, "n_questions": 60},
             "corpus": None, "questions": None, "openie": None, "index_dir": None,
             "table_corpus": None, "table_index_dir": None},
    "env": {"id": "raggym/RouteRAG-v0", "kwargs": {}},
    "policy": {"model": "smollm2-135m"},
    "rollout": {"engine": "hf", "workers": 2, "env_runners": 1, "prompts_per_step": 2, "group_size": 2,
                "temperature": 1.0, "top_p": 1.0, "max_response_tokens": 64, "max_turn_tokens": 32,
                "max_observation_tokens": 128, "waves": 2, "worker_cpus": 0.5, "worker_gpus": 0.0,
                "engine_kwargs": {}},
    "advantage": {"estimator": "grpo", "normalize_by_std": True, "eps": 1.0e-6, "unbiased_std": True,
                  "route_weights": [1.0, 0.5, 0.3, 1.0], "dynamic_sampling": False, "max_sampling_rounds": 3},
    "learner": {},
    "num_learners": 2,
    "learner_resources": None,
    "retrieval": {"shards": 2, "replicas": 1, "routing": "round_robin", "replica_per_node": False},
    "ray": {"address": None, "num_cpus": None},
    "sft": {"enabled": False, "epochs": 1, "lr": 5.0e-6, "batch_size": 8, "grad_accum": 1, "max_seq_tokens": 1024,
            "max_examples": None, "lora": None},
    "eval": {"every": 0, "questions": 0, "temperature": 0.0, "env_kwargs": {}},
}


class ConfigError(ValueError):
    """A config problem; the message names the file (or override) and the dotted key."""


def _leaf_paths(value, prefix: str) -> list[str]:
    if isinstance(value, Mapping) and value:
        return [p for k, v in value.items() for p in _leaf_paths(v, f"{prefix}.{k}")]
    return [prefix]


def _lookup(tree, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _schema_errors(value, schema, path: str, root: dict) -> list[tuple[str, str]]:
    """(dotted key, problem) for every key of ``value`` that ``schema`` does not allow."""
    if isinstance(schema, Dynamic):
        try:
            schema = schema.build(root)
        except ValueError as exc:
            return [(path, str(exc))]
    if isinstance(schema, Optional_):
        if value is None:
            return []
        schema = schema.schema
    if isinstance(schema, Forbidden):
        return [(path, f"cannot be set here: {schema.hint}")]
    if isinstance(schema, Leaf):
        if not schema.accepts(value):
            return [(path, f"must be {schema.describe()}, got {value!r} ({type(value).__name__})")]
        return []
    if not isinstance(value, Mapping):
        return [(path, f"must be a section (a mapping), got {value!r}")]
    errors = []
    for key, sub in value.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in schema:
            known = sorted(k for k, s in schema.items() if not isinstance(s, Forbidden))
            where = f"under '{path}'" if path else f"at the top level (unknown config sections ['{key}'])"
            for leaf in _leaf_paths(sub, dotted):
                errors.append((leaf, f"unknown config key '{leaf}': no '{key}' {where}; known: {known}"))
            continue
        errors.extend(_schema_errors(sub, schema[key], dotted, root))
    return errors


def _cross_errors(c: dict) -> list[tuple[str, str]]:
    """Consistency between sections: what one key means must fit what another says."""
    errs = []
    method, env_id, est = c["method"], c["env"]["id"], c["advantage"]["estimator"]
    if c["reward"].get("method") != method:
        errs.append(("reward.method", f"is {c['reward'].get('method')!r} but method is {method!r}; they must agree"))
    if (method == "r1_router") != (env_id == STEPWISE_ENV):
        errs.append(("env.id", f"method r1_router runs exactly on {STEPWISE_ENV} (got method {method!r}, env {env_id!r})"))
    if (method == "r1_router") != (est == "step_grpo"):
        errs.append(("advantage.estimator", f"step_grpo is R1-Router's estimator and R1-Router needs it (method {method!r}, estimator {est!r})"))
    if est == "route" and c["reward"].get("method") != "pathrouter":
        errs.append(("advantage.estimator", "route-conditioned advantages need the pathrouter reward (its C and P flags)"))
    if c["advantage"]["dynamic_sampling"] and est == "step_grpo":
        errs.append(("advantage.dynamic_sampling", "is defined over episode groups, not Step-GRPO's step groups"))
    if c["advantage"]["max_sampling_rounds"] < 1:
        errs.append(("advantage.max_sampling_rounds", "must be at least 1"))
    if len(c["advantage"]["route_weights"]) != 4:
        errs.append(("advantage.route_weights", "needs 4 weights (C↑P↑, C↑P↓, C↓P↑, C↓P↓)"))
    loss = (c["learner"] or {}).get("loss") or {}
    if loss.get("teacher_kl") and method == "r1_router":
        errs.append(("learner.loss.teacher_kl", "the teacher KL reads single-transcript episodes; R1-Router has none"))
    if method == "lws" and c["reward"].get("stage2_start") is None:
        errs.append(("reward.stage2_start", "is required for lws"))
    if method == "graphrag_r1" and c["reward"].get("phase3_start") is None:
        errs.append(("reward.phase3_start", "is required for graphrag_r1"))
    if c["runtime"] == "local":
        for key in ("rollout.workers", "rollout.env_runners", "num_learners"):
            section, _, name = key.rpartition(".")
            value = c[section][name] if section else c[name]
            if value != 1:
                errs.append((key, f"runtime local runs one engine and one learner in this process; set {key}=1 (got {value})"))
    for key in ("run.steps", "rollout.prompts_per_step", "rollout.group_size", "rollout.max_turn_tokens"):
        section, name = key.split(".")
        if c[section][name] < 1:
            errs.append((key, "must be at least 1"))
    ev = c["eval"]
    if ev["every"] > 0 and ev["questions"] < 1:
        errs.append(("eval.questions", "eval.every > 0 needs held-out questions (eval.questions ≥ 1)"))
    if ev["every"] < 0 or ev["questions"] < 0:
        errs.append(("eval.every", "eval.every and eval.questions must be non-negative"))
    return errs


def validate_config(cfg, sources: Sequence[tuple[str, dict]] = ()) -> None:
    """Raise ``ConfigError`` listing every unknown, mistyped or inconsistent key.

    ``sources`` are ``(name, mapping)`` pairs (the YAML file, the overrides) used to say where a
    bad key came from; a key found in none of them came from the defaults.
    """
    from omegaconf import DictConfig, OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    errors = _schema_errors(c, SCHEMA, "", c)
    if not errors:
        errors = _cross_errors(c)

    def origin(key: str) -> str:
        for name, tree in reversed(list(sources)):
            if _lookup(tree, key):
                return name
        for name, tree in reversed(list(sources)):  # a cross-check key may be implied by a section
            if _lookup(tree, key.split(".")[0]):
                return name
        return "defaults"

    if errors:
        lines = [f"{origin(k)}: {k}: {msg}" if not msg.startswith("unknown config key") else f"{origin(k)}: {msg}"
                 for k, msg in errors]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))


def load_config(path: str | None, overrides: list[str] | None = None):
    """Defaults <- YAML file <- ``key=value`` overrides, validated against ``SCHEMA``.

    Unknown keys at any depth, values of the wrong type and inconsistent sections are errors
    that name the file (or "override") and the full dotted key.
    """
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(DEFAULTS)
    sources: list[tuple[str, dict]] = []
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        loaded = OmegaConf.load(path)
        plain = OmegaConf.to_container(loaded, resolve=True) or {}
        if not isinstance(plain, dict):
            raise ConfigError(f"{path}: a config file must be a mapping of sections")
        sources.append((str(path), plain))
        cfg = OmegaConf.merge(cfg, loaded)
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"overrides must look like key=value, got {bad}")
        dot = OmegaConf.from_dotlist(list(overrides))
        sources.append(("override", OmegaConf.to_container(dot, resolve=True)))
        cfg = OmegaConf.merge(cfg, dot)
    validate_config(cfg, sources)
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


def prepare_table_index(cfg, out_dir: Path) -> Path:
    """R1-Router's second knowledge base: the table corpus, indexed once (passage retrieval)."""
    from raggym.data import load_corpus
    from raggym.retrieval import Retriever

    data = cfg.data
    index_dir = Path(data.table_index_dir) if data.table_index_dir else out_dir / "index_table"
    if (index_dir / "manifest.json").exists():
        return index_dir
    if data.source == "synthetic":
        from raggym.data.synthetic import generate_world

        tables = generate_world(**_plain(data.synthetic)).table_corpus
        if tables is None:
            raise ConfigError("data.synthetic.attribute_kb: R1-Router needs a table knowledge base; set it to 'table'")
    else:
        if not data.table_corpus:
            raise ConfigError("data.table_corpus: R1-Router with data.source=files needs the table corpus file")
        tables = load_corpus(data.table_corpus)
    print(f"[train] building the table index under {index_dir}", flush=True)
    Retriever.build(tables, shards=1, show_progress=True).save(index_dir)
    return index_dir


def split_eval(cfg, questions: list) -> tuple[list, list]:
    """The last ``eval.questions`` questions are held out for evaluation, the rest train."""
    n = int(cfg.eval.questions)
    if n >= len(questions):
        raise ConfigError(f"eval.questions={n} leaves no training questions (the data has {len(questions)})")
    return (questions[: len(questions) - n], questions[len(questions) - n :]) if n else (questions, [])


# ----------------------------------------------------------------------------- runtime


@dataclass
class Runtime:
    """What a run drives: rollout engines, env runners, retrieval and the learner(s).

    ``kind="ray"``: Ray actors (retrieval service, rollout workers, env runners, a DeepSpeed
    ``LearnerGroup``). ``kind="local"``: one engine, the environments' retriever and one
    ``Learner`` in this process (``runtime: local``; quick single-machine runs and tests).
    """

    service: Any
    workers: list
    runners: list
    learners: Any
    tokenizer: Any
    others: list
    kind: str = "ray"
    retriever: Any = None  # local: the in-process Retriever
    extra_runners: dict = field(default_factory=dict)  # ray: env-kwargs (JSON) -> runners, for evaluation

    def backend(self):
        """A rollout backend for generation (``actors.rollout`` interface)."""
        if self.kind == "local":
            from actors.rollout import LocalBackend

            return LocalBackend(self.workers[0])
        from actors.env_runner import RayBackend

        return RayBackend(self.workers, self.service)

    def shutdown(self) -> None:
        """Release every actor this run created (needed when the cluster outlives the driver)."""
        if self.kind == "local":
            return
        import ray

        if self.learners is not None:
            self.learners.shutdown()
        extra = [r for runners in self.extra_runners.values() for r in runners]
        for actor in [*self.runners, *extra, *self.workers, self.service, *self.others]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass


class LocalLearnerGroup:
    """One in-process ``Learner`` behind the ``LearnerGroup`` interface the loop uses."""

    num_learners = 1

    def __init__(self, config):
        from actors.learner import Learner

        self.learner = Learner(config)
        self.config = self.learner.config
        self.version = 0

    def update(self, batch, step: int | None = None) -> dict[str, float]:
        metrics = self.learner.update(batch, step)
        self.version = self.learner.version
        metrics["weight_version"] = float(self.version)
        return metrics

    def sync_weights(self, workers, dtype=None) -> dict[str, float]:
        t0 = time.perf_counter()
        flat = self.learner.get_weights(dtype)
        versions = [w.update_weights(flat, self.version) for w in workers]
        if set(versions) != {self.version}:
            raise RuntimeError(f"engines report weight versions {versions}, expected {self.version}")
        return {"weight_version": float(self.version), "sync_seconds": time.perf_counter() - t0}

    def save_checkpoint(self, out_dir: str, policy: bool = True) -> str:
        return self.learner.save_checkpoint(out_dir, policy)

    def load_checkpoint(self, in_dir: str) -> dict:
        meta = self.learner.load_checkpoint(in_dir)
        self.version = int(meta["version"])
        self.learner.version = self.version
        return meta

    def shutdown(self) -> None:
        pass


def _learner_config(cfg) -> dict:
    return {"model": cfg.policy.model, "temperature": float(cfg.rollout.temperature), "seed": int(cfg.run.seed),
            **(_plain(cfg.learner) or {})}


def _engine_kwargs(cfg) -> dict:
    kwargs = {"model": cfg.policy.model, **(_plain(cfg.rollout.engine_kwargs) or {})}
    if cfg.rollout.engine == "hf" and cfg.runtime != "local":
        kwargs.setdefault("num_threads", 1)
    return kwargs


def start_env_runners(cfg, service, workers, env_kwargs: dict | None = None) -> list:
    """``rollout.env_runners`` EnvRunner actors for ``cfg.env.id`` (kwargs: ``env_kwargs`` or ``cfg.env.kwargs``)."""
    from actors.env_runner import EnvRunner
    from actors.retrieval_service import RESTARTS

    ro = cfg.rollout
    Runner = EnvRunner.as_remote(num_cpus=0.25, **RESTARTS)
    rollout_cfg = {k: int(ro[k]) for k in ("max_response_tokens", "max_turn_tokens", "max_observation_tokens", "waves")}
    kwargs = _plain(cfg.env.kwargs) if env_kwargs is None else env_kwargs
    return [Runner.remote(cfg.env.id, service, workers, cfg.policy.model, kwargs, rollout_cfg)
            for _ in range(int(ro.env_runners))]


def start_local_runtime(cfg, index_dir: Path, *, with_learners: bool = True) -> Runtime:
    """Engine, retriever and learner in this process (``runtime: local``)."""
    from actors.engines.rollout_worker import make_engine
    from raggym.models import load_policy_tokenizer
    from raggym.retrieval import Retriever

    engine = make_engine(cfg.rollout.engine, **_engine_kwargs(cfg))
    learners = LocalLearnerGroup(_learner_config(cfg)) if with_learners else None
    return Runtime(None, [engine], [], learners, load_policy_tokenizer(cfg.policy.model), [], kind="local",
                   retriever=Retriever.load(str(index_dir)))


def start_runtime(cfg, index_dir: Path, *, with_learners: bool = True) -> Runtime:
    """Retrieval service, rollout workers, env runners and (unless ``with_learners=False``, as
    evaluation does) the learner group; with ``runtime: local`` the in-process equivalents."""
    if cfg.get("runtime", "ray") == "local":
        return start_local_runtime(cfg, index_dir, with_learners=with_learners)
    import ray

    from actors.engines.rollout_worker import RolloutWorker
    from actors.learner import LearnerGroup
    from actors.retrieval_service import RESTARTS, start_retrieval_service
    from raggym.models import load_policy_tokenizer

    r = cfg.retrieval
    service, shards, replicas = start_retrieval_service(str(index_dir), num_replicas=int(r.replicas), routing=r.routing,
                                            replica_per_node=bool(r.replica_per_node))
    ro = cfg.rollout
    Worker = RolloutWorker.as_remote(num_cpus=float(ro.worker_cpus), num_gpus=float(ro.worker_gpus), **RESTARTS)
    workers = [Worker.remote(engine=ro.engine, **_engine_kwargs(cfg)) for _ in range(int(ro.workers))]
    # R1-Router's step-wise episodes are driven from the trainer process (see rollout_stepwise).
    runners = [] if cfg.env.id == STEPWISE_ENV else start_env_runners(cfg, service, workers)
    if not with_learners:
        ray.get([w.ping.remote() for w in workers] + [x.ping.remote() for x in runners])
        return Runtime(service, workers, runners, None, load_policy_tokenizer(cfg.policy.model), [*shards, *replicas])
    learners = LearnerGroup(_learner_config(cfg), num_learners=int(cfg.num_learners), resources=_plain(cfg.learner_resources))
    ray.get([w.ping.remote() for w in workers] + [x.ping.remote() for x in runners])
    return Runtime(service, workers, runners, learners, load_policy_tokenizer(cfg.policy.model), [*shards, *replicas])


# ----------------------------------------------------------------------------- rollouts


def rollout(rt: Runtime, cfg, questions, step: int, corpus=None) -> list[dict]:
    """G samples of each question; one trajectory dict each, in (question, sample) order."""
    from actors.engines.base import SamplingParams, derive_seed

    G = int(cfg.rollout.group_size)
    sampling = SamplingParams(temperature=float(cfg.rollout.temperature), top_p=float(cfg.rollout.top_p),
                              seed=derive_seed(int(cfg.run.seed), step))
    items = [(q, f"{step}:{q.id}", g) for q in questions for g in range(G)]
    return rollout_items(rt, cfg, items, sampling, corpus)


def rollout_items(rt: Runtime, cfg, items, sampling, corpus=None, env_kwargs: dict | None = None) -> list[dict]:
    """Episodes for ``(question, group_id, sample_index)`` items; env kwargs default to ``env.kwargs``."""
    if rt.kind == "local":
        import gymnasium

        import envs  # noqa: F401  (registers the ids)
        from actors.rollout import MultiTurnRollout, RolloutConfig

        kwargs = _plain(cfg.env.kwargs) if env_kwargs is None else env_kwargs
        qs = [q for q, _, _ in items]
        made = [gymnasium.make(cfg.env.id, retriever=rt.retriever, questions=qs, corpus=corpus, **kwargs).unwrapped
                for _ in items]
        loop = MultiTurnRollout(rt.backend(), rt.tokenizer, sampling, RolloutConfig(**_rollout_cfg(cfg)))
        return [t.as_dict() for t in loop.run(made, qs, [g for _, g, _ in items], [s for _, _, s in items])]
    import ray

    runners = rt.runners
    if env_kwargs is not None:
        key = json.dumps(env_kwargs, sort_keys=True)
        if key not in rt.extra_runners:
            rt.extra_runners[key] = start_env_runners(cfg, rt.service, rt.workers, env_kwargs)
        runners = rt.extra_runners[key]
    n = len(runners)
    chunks = [items[i::n] for i in range(n)]
    refs = []
    for runner, chunk in zip(runners, chunks):
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


def _rollout_cfg(cfg) -> dict:
    return {k: int(cfg.rollout[k]) for k in ("max_response_tokens", "max_turn_tokens", "max_observation_tokens", "waves")}


def knowledge_bases(text_index: Path, table_index: Path) -> dict:
    """R1-Router's knowledge bases, loaded in the trainer process."""
    from raggym.retrieval import Retriever

    return {TEXT_KB: Retriever.load(str(text_index)), TABLE_KB: Retriever.load(str(table_index))}


def rollout_stepwise(rt: Runtime, cfg, items, sampling, kbs: dict, corpus=None, env_kwargs: dict | None = None) -> list[dict]:
    """R1-Router episodes on ``MultiKBRouteEnv``: every model call gets the env's fresh prompt.

    Returns one dict per episode: ``group_id``, ``sample_index``, ``episode`` (the record) and
    ``calls`` — per model call the prompt ids, the exact sampled ids and their logprobs. Call
    ``i`` is ``episode["steps"][i]``. ``rollout.max_response_tokens`` caps the sampled tokens of a
    whole episode (then it is truncated), ``rollout.max_turn_tokens`` those of one call.
    """
    from dataclasses import replace

    from actors.engines.base import derive_seed
    from actors.rollout import chat_prompt_ids
    from envs.multi_kb_route_env import MultiKBRouteEnv
    from envs.stepping import RetrievalRequest, run_retrieval

    kwargs = _plain(cfg.env.kwargs) if env_kwargs is None else env_kwargs
    ro = cfg.rollout
    budget = int(ro.max_response_tokens)
    backend = rt.backend()
    slots = []
    for q, gid, si in items:
        env = MultiKBRouteEnv(kbs, [q], gold_knowledge_base_names={"text": TEXT_KB, "table": TABLE_KB}, corpus=corpus, **kwargs)
        context, _ = env.reset(options={"question": q})
        slots.append({"env": env, "context": context, "calls": [], "used": 0, "group_id": gid, "sample_index": si, "done": False})

    def after(slot, result) -> None:
        observation, _, terminated, truncated, _ = result
        if terminated or truncated:
            slot["done"] = True
        elif slot["used"] >= budget:
            record = slot["env"].record
            record.truncated, record.truncation_reason = True, "response_tokens"
            slot["done"] = True
        else:
            slot["context"] = observation  # the complete next prompt

    call = 0
    while True:
        active = [s for s in slots if not s["done"]]
        if not active:
            break
        prompts = [chat_prompt_ids(rt.tokenizer, s["context"]) for s in active]
        cap = min(int(ro.max_turn_tokens), max(budget - s["used"] for s in active))
        params = replace(sampling, seed=derive_seed(sampling.seed, call)) if sampling.seed is not None else sampling
        call += 1
        future = backend.submit_generate(prompts, params, list(active[0]["env"].stop_strings), cap)
        results = backend.get(backend.wait_one([future]))
        requests = []
        for slot, prompt, res in zip(active, prompts, results):
            room = budget - slot["used"]
            ids, logprobs = list(res.token_ids)[:room], list(res.logprobs)[:room]
            slot["used"] += len(ids)
            text = rt.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            slot["calls"].append({"prompt_ids": list(prompt), "token_ids": ids, "logprobs": logprobs, "text": text,
                                  "weight_version": int(getattr(res, "weight_version", 0))})
            outcome = slot["env"]._begin_step(text)
            if isinstance(outcome, RetrievalRequest):
                requests.append((slot, outcome))
            else:
                after(slot, outcome)
        if requests:
            for (slot, request), result in zip(requests, run_retrieval([r for _, r in requests])):
                after(slot, slot["env"]._finish_step(request, result))
    out = []
    for s in slots:
        episode = s["env"].record.as_dict()
        if len(episode["steps"]) != len(s["calls"]):
            raise RuntimeError(f"{len(s['calls'])} model calls but {len(episode['steps'])} recorded steps")
        out.append({"group_id": s["group_id"], "sample_index": s["sample_index"], "episode": episode, "calls": s["calls"]})
    return out


# ----------------------------------------------------------------------------- rewards and advantages


def compute_rewards(schedule, step: int, trajectories: list[dict]):
    from raggym.rewards import EpisodeOutcome

    outcomes = [EpisodeOutcome.from_dict(t["episode"]) for t in trajectories]
    return outcomes, [float(r) for r in schedule(step)(outcomes)]


def _pathrouter_config(cfg):
    from raggym.rewards import PathRouterConfig

    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (_plain(cfg.reward) or {}).items() if k != "method"}
    return PathRouterConfig(**fields)


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

        config = _pathrouter_config(cfg)  # the reward's C and P thresholds decide the routes too
        flags = [pathrouter_flags(o, config) for o in outcomes]
        correct = torch.tensor([c for c, _ in flags], dtype=torch.bool)
        supported = torch.tensor([p for _, p in flags], dtype=torch.bool)
        return route_conditioned_advantages(r, group_ids, correct, supported, tuple(a.route_weights), **kwargs)
    raise ValueError(f"advantage.estimator must be 'grpo' or 'route' for episode rewards, got {a.estimator!r}")


def make_embed(spec: str):
    """A cached sentence embedder as ``texts -> [n, d]`` (LWS's query similarity, R1-Router's sim)."""
    from raggym.models import load_embedder

    embedder = load_embedder(spec)
    return lambda texts: embedder.encode(list(texts))


def r1_router_step_rewards(episodes: list[dict], embed, kb_names: Sequence[str]) -> list[float]:
    """One reward per model call (``raggym.rewards.r1_router``).

    Routing step: ``r_format·(½ sim(E q, E q*) + ½ [route = gold])`` with ``None`` standing for
    the stop action and for a step past the golden trajectory. Intermediate answer: token recall
    of the golden step answer (0 when the golden trajectory has none for that step). Final
    answer: 1 if every gold token is recalled.
    """
    from raggym.rewards import final_answer_reward, intermediate_answer_reward, router_step_reward

    valid = [*kb_names, "None"]
    route_steps = [s for e in episodes for s in e["episode"]["steps"] if s["phase"] == "route"]
    texts = [s["sub_question"] or "None" for s in route_steps] + [s["gold_sub_question"] or "None" for s in route_steps]
    vectors = embed(texts) if texts else np.zeros((0, 1))
    vec = {id(s): (vectors[i], vectors[len(route_steps) + i]) for i, s in enumerate(route_steps)}
    rewards = []
    for e in episodes:
        for s in e["episode"]["steps"]:
            if s["phase"] == "route":
                q, gold_q = vec[id(s)]
                rewards.append(router_step_reward(not s["format_error"], q, gold_q, s["knowledge_base"] or "None",
                                                  s["gold_knowledge_base"] or "None", valid))
            elif s["phase"] == "answer":
                rewards.append(intermediate_answer_reward(s["answer"], s["gold_answer"]) if s["gold_answer"] else 0.0)
            else:
                rewards.append(final_answer_reward(s["answer"], e["episode"]["gold_answers"]))
    return [float(r) for r in rewards]


def stepwise_sequences(episodes: list[dict]) -> list[dict]:
    """One training sequence per model call: prompt (masked) + the sampled ids (trained)."""
    seqs = []
    for e in episodes:
        for i, c in enumerate(e["calls"]):
            seqs.append({"token_ids": c["prompt_ids"] + c["token_ids"],
                         "loss_mask": [0] * len(c["prompt_ids"]) + [1] * len(c["token_ids"]),
                         "group_id": e["group_id"], "sample_index": e["sample_index"], "step_index": i,
                         "phase": e["episode"]["steps"][i]["phase"], "episode": e["episode"],
                         "turns": [{"text": c["text"], "weight_version": c["weight_version"]}]})
    return seqs


def teacher_fields(trajectories: list[dict], tokenizer, max_evidence_tokens: int) -> dict:
    """PathRouter's teacher inputs: the same trajectory behind a prompt that shows the gold evidence.

    The teacher prompt is the episode's prompt preceded by the gold passages (capped at
    ``max_evidence_tokens`` tokens) in the chat template; the response tokens are the student's,
    so student token ``t ≥ prompt_length`` is teacher token ``len(teacher prompt) + t − prompt_length``.
    """
    import torch

    from actors.rollout import chat_prompt_ids
    from raggym.algorithms.spans import teacher_kl_mask_from_labels
    from raggym.rewards.metrics import evidence_overlap

    rows, positions, masks, eo = [], [], [], []
    for t in trajectories:
        ep = t["episode"]
        gold = list(ep.get("gold_passages") or [])
        evidence_ids = tokenizer("\n".join(gold), add_special_tokens=False)["input_ids"][:max_evidence_tokens]
        evidence = tokenizer.decode(evidence_ids, skip_special_tokens=True)
        prompt = chat_prompt_ids(tokenizer, f"Evidence:\n{evidence}\n\n{ep.get('prompt', '')}")
        p = int(t["prompt_length"])
        response = list(t["token_ids"][p:])
        rows.append(prompt + response)
        positions.append([-1] * p + [len(prompt) + i for i in range(len(response))])
        masks.append(np.asarray(teacher_kl_mask_from_labels(t["span_labels"]), dtype=np.float32))
        retrieved = [x for call in ep.get("retrieved_texts", []) for x in call]
        eo.append(evidence_overlap(retrieved, gold) if gold else 0.0)
    n, width, student = len(rows), max(len(r) for r in rows), max(len(t["token_ids"]) for t in trajectories)
    ids = torch.full((n, width), int(tokenizer.pad_token_id), dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    pos = torch.full((n, student), -1, dtype=torch.long)
    kl_mask = torch.zeros((n, student), dtype=torch.float32)
    for i, (r, p, m) in enumerate(zip(rows, positions, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        pos[i, : len(p)] = torch.tensor(p)
        kl_mask[i, : len(m)] = torch.from_numpy(m)
    return {"teacher_token_ids": ids, "teacher_attention_mask": attn, "teacher_positions": pos,
            "teacher_kl_mask": kl_mask, "evidence_overlap": torch.tensor(eo, dtype=torch.float32)}


def assemble_batch(sequences: list[dict], advantages, pad_token_id: int, multiple: int, extra: dict | None = None):
    """A ``TrainBatch`` padded with masked-out filler rows to a multiple of the mini-batch size.

    A filler row (a copy of row 0 with loss mask, advantage and teacher mask zeroed) adds
    nothing to any loss term or to the token/sequence counts the aggregation divides by, so the
    update equals one on the real rows; it only lets any number of sequences split into
    mini-batches (Step-GRPO's per-call sequences, DAPO's filtered groups).
    """
    import torch

    from actors.learner import make_train_batch

    batch = make_train_batch([s["token_ids"] for s in sequences], [s["loss_mask"] for s in sequences],
                             list(advantages), pad_token_id=pad_token_id)
    batch.update(extra or {})
    n = len(sequences)
    pad = (-n) % max(1, multiple)
    if pad:
        batch = {k: torch.cat([v, v[:1].expand(pad, *v.shape[1:]).clone()]) for k, v in batch.items()}
        for key in ("loss_mask", "advantages", "teacher_kl_mask"):
            if key in batch:
                batch[key][n:] = 0
    return batch, pad


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


def save_checkpoint(rt: Runtime, out_dir: Path, step: int, sampler: PromptSampler, keep: int, extra: dict | None = None) -> Path:
    """Write into a temp dir, then rename: a crash never leaves a checkpoint that looks complete."""
    root = out_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    rt.learners.save_checkpoint(str(tmp))
    state = {"step": step, "sampler": sampler.state_dict(), "weight_version": rt.learners.version, **(extra or {})}
    (tmp / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- SFT cold start


def sft_phase(cfg, out_dir: Path, questions, corpus, index_dir: Path) -> dict | None:
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
    env_kwargs = dict(_plain(cfg.env.kwargs) or {})
    top_k = int(env_kwargs.pop("top_k", 3))
    n = cfg.sft.max_examples
    chosen = list(questions if n is None else questions[: int(n)])
    examples = golden_examples(chosen, Retriever.load(str(index_dir)), dialect, load_policy_tokenizer(cfg.policy.model),
                               corpus=corpus, top_k=top_k, max_observation_tokens=int(cfg.rollout.max_observation_tokens),
                               env_kwargs=env_kwargs, show_progress=True)
    s = cfg.sft
    return run_sft(cfg.policy.model, examples, out_dir / "sft", epochs=int(s.epochs), lr=float(s.lr),
                   batch_size=int(s.batch_size), grad_accum=int(s.grad_accum), max_seq_tokens=int(s.max_seq_tokens),
                   seed=int(cfg.run.seed), lora=_plain(s.lora), num_threads=cfg.learner.get("num_threads"))


# ----------------------------------------------------------------------------- the loop


def train(cfg) -> dict:
    """Run ``cfg`` (from ``load_config``) to ``run.steps``; returns the last step's record."""
    import copy

    from omegaconf import OmegaConf

    from raggym.learning_log import MetricsLogger

    validate_config(cfg)
    cfg = copy.deepcopy(cfg)  # the SFT phase may point policy.model at its output
    out_dir = Path(cfg.run.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg), encoding="utf-8")
    if cfg.runtime == "ray":
        import ray

        if not ray.is_initialized():
            address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
            if address:  # a cluster (or a Ray job, which sets RAY_ADDRESS)
                ray.init(address=address, log_to_driver=False)
            else:  # standalone: a local Ray instance for this process
                ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    corpus, questions, index_dir = prepare_data(cfg, out_dir)
    questions, heldout = split_eval(cfg, list(questions))
    sft = sft_phase(cfg, out_dir, questions, corpus, index_dir)
    if sft is not None:
        cfg.policy.model = str(sft["policy_dir"])  # RL starts from the SFT policy
    job = Job(cfg, out_dir, questions, heldout, corpus, index_dir, sft)
    rt = start_runtime(cfg, index_dir)
    logger = MetricsLogger(out_dir)
    try:
        job.start(rt)
        return job.loop(rt, logger)
    finally:
        logger.close()
        rt.shutdown()


class Job:
    """One training run's state: data, reward schedule, sampler, and the Algorithm-1 steps."""

    def __init__(self, cfg, out_dir: Path, questions, heldout, corpus, index_dir: Path, sft: dict | None):
        from actors.learner import LearnerConfig
        from raggym.rewards.schedules import reward_schedule_from_config

        self.cfg, self.out_dir, self.questions, self.heldout, self.corpus = cfg, out_dir, questions, heldout, corpus
        self.sft = sft
        self.stepwise = cfg.method == "r1_router"
        reward = dict(_plain(cfg.reward))
        embedder = reward.pop("embedder", "minilm")
        needs_embed = cfg.reward.method in ("lws", "r1_router")
        self.embed = make_embed(embedder) if needs_embed else None
        self.schedule = None if self.stepwise else reward_schedule_from_config(reward, embed=self.embed)
        self.kbs = knowledge_bases(index_dir, prepare_table_index(cfg, out_dir)) if self.stepwise else None
        self.mini_batch = LearnerConfig.from_dict(_learner_config(cfg)).mini_batch_size
        self.sampler = PromptSampler(len(questions), int(cfg.run.seed))
        self.start_step = 0

    def stage_at(self, step: int) -> str:
        return "main" if self.schedule is None else self.schedule.stage_at(step)

    def start(self, rt: Runtime) -> None:
        ckpt = latest_checkpoint(self.out_dir) if self.cfg.run.resume else None
        if ckpt is None:
            return
        state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
        if state.get("sft_policy_dir") != (self.sft or {}).get("policy_dir"):
            raise RuntimeError(f"{ckpt} was trained from SFT policy {state.get('sft_policy_dir')!r}, "
                               f"this run starts from {(self.sft or {}).get('policy_dir')!r}")
        rt.learners.load_checkpoint(str(ckpt))
        self.sampler.load_state_dict(state["sampler"])
        self.start_step = int(state["step"])
        rt.learners.sync_weights(rt.workers)  # the rollout engines start from the restored policy
        print(f"[train] resumed from {ckpt} at step {self.start_step}", flush=True)

    # ------------------------------------------------------------------ sampling

    def _sampling(self, index: int, temperature: float | None = None):
        from actors.engines.base import SamplingParams, derive_seed

        t = float(self.cfg.rollout.temperature if temperature is None else temperature)
        return SamplingParams(temperature=t, top_p=float(self.cfg.rollout.top_p) if t > 0 else 1.0,
                              seed=derive_seed(int(self.cfg.run.seed), index))

    def collect_episodes(self, rt: Runtime, step: int) -> dict:
        """Rollouts, rewards and advantages for one step; with DAPO dynamic sampling, resample
        until ``prompts_per_step`` groups with non-uniform rewards are kept (at most
        ``advantage.max_sampling_rounds`` rounds; groups beyond the target are dropped)."""
        import torch

        from raggym.algorithms import dynamic_sampling_filter

        cfg, G, P = self.cfg, int(self.cfg.rollout.group_size), int(self.cfg.rollout.prompts_per_step)
        dynamic = bool(cfg.advantage.dynamic_sampling)
        rounds = int(cfg.advantage.max_sampling_rounds) if dynamic else 1
        kept_t, kept_o, kept_r, stats = [], [], [], {"sampled_groups": 0, "dropped_groups": 0}
        for rnd in range(rounds):
            batch_q = [self.questions[i] for i in self.sampler.next_batch(P)]                       # 1. sample prompts
            tag = f"{step}" if rnd == 0 else f"{step}.{rnd}"
            items = [(q, f"{tag}:{q.id}", g) for q in batch_q for g in range(G)]
            seed_index = step if rnd == 0 else derive_round_seed(step, rnd)
            trajs = rollout_items(rt, cfg, items, self._sampling(seed_index), self.corpus)          # 2. G rollouts each
            outcomes, rewards = compute_rewards(self.schedule, step, trajs)                          # 3.+4. rewards
            stats["sampled_groups"] += P
            if dynamic:
                keep = dynamic_sampling_filter(torch.tensor(rewards), [t["group_id"] for t in trajs]).keep.tolist()
                stats["dropped_groups"] += P - sum(keep) // G
            else:
                keep = [True] * len(trajs)
            for t, o, r, k in zip(trajs, outcomes, rewards, keep):
                if k:
                    kept_t.append(t), kept_o.append(o), kept_r.append(r)
            if len(kept_t) >= P * G:
                break
        kept_t, kept_o, kept_r = kept_t[: P * G], kept_o[: P * G], kept_r[: P * G]
        stats["rounds"] = rnd + 1
        if not kept_t:
            return {"sequences": [], "outcomes": [], "rewards": [], "advantages": torch.zeros(0), "routes": None,
                    "stats": stats, "all": trajs, "all_outcomes": outcomes, "all_rewards": rewards}
        advantages, routes = compute_advantages(cfg, kept_o, kept_r, [t["group_id"] for t in kept_t])  # 5. advantages
        return {"sequences": kept_t, "outcomes": kept_o, "rewards": kept_r, "advantages": advantages, "routes": routes,
                "stats": stats, "all": kept_t, "all_outcomes": kept_o, "all_rewards": kept_r}

    def collect_stepwise(self, rt: Runtime, step: int) -> dict:
        """R1-Router: episodes, one reward per model call, Step-GRPO advantages per (prompt, call)."""
        import torch

        from raggym.algorithms import step_grpo_advantages
        from raggym.rewards import EpisodeOutcome

        cfg, G = self.cfg, int(self.cfg.rollout.group_size)
        batch_q = [self.questions[i] for i in self.sampler.next_batch(int(cfg.rollout.prompts_per_step))]
        items = [(q, f"{step}:{q.id}", g) for q in batch_q for g in range(G)]
        episodes = rollout_stepwise(rt, cfg, items, self._sampling(step), self.kbs, self.corpus)
        seqs = stepwise_sequences(episodes)
        rewards = r1_router_step_rewards(episodes, self.embed, list(self.kbs))
        a = cfg.advantage
        advantages = step_grpo_advantages(torch.tensor(rewards, dtype=torch.float32), [s["group_id"] for s in seqs],
                                          [s["step_index"] for s in seqs], eps=float(a.eps),
                                          normalize_by_std=bool(a.normalize_by_std), unbiased_std=bool(a.unbiased_std))
        outcomes = [EpisodeOutcome.from_dict(e["episode"]) for e in episodes]
        return {"sequences": seqs, "episodes": episodes, "outcomes": outcomes, "rewards": rewards,
                "advantages": advantages, "routes": None, "stats": {"model_calls": len(seqs)}}

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, rt: Runtime, step: int) -> dict:
        """Greedy (``eval.temperature``) episodes on the held-out questions with ``eval.env_kwargs``."""
        from raggym.rewards import EpisodeOutcome
        from raggym.rewards.metrics import exact_match, token_f1

        cfg = self.cfg
        kwargs = {**(_plain(cfg.env.kwargs) or {}), **(_plain(cfg.eval.env_kwargs) or {})}
        items = [(q, f"eval{step}:{q.id}", 0) for q in self.heldout]
        sampling = self._sampling(derive_round_seed(step, 999), float(cfg.eval.temperature))
        if self.stepwise:
            episodes = [e["episode"] for e in rollout_stepwise(rt, cfg, items, sampling, self.kbs, self.corpus, kwargs)]
        else:
            episodes = [t["episode"] for t in rollout_items(rt, cfg, items, sampling, self.corpus, kwargs)]
        outcomes = [EpisodeOutcome.from_dict(e) for e in episodes]
        result = {"eval/em": float(np.mean([exact_match(o.answer, o.gold_answers) for o in outcomes])),
                  "eval/f1": float(np.mean([token_f1(o.answer, o.gold_answers) for o in outcomes])),
                  "eval/retrievals_mean": float(np.mean([o.retrieval_count for o in outcomes])),
                  "eval/questions": len(outcomes)}
        with (self.out_dir / "eval.jsonl").open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **result}) + "\n")
        return result

    # ------------------------------------------------------------------ Algorithm 1

    def loop(self, rt: Runtime, logger) -> dict:
        from tqdm.auto import tqdm

        cfg = self.cfg
        steps = int(cfg.run.steps)
        last: dict = {}
        bar = tqdm(range(self.start_step, steps), initial=self.start_step, total=steps, desc="train", unit="step")
        for step in bar:
            t0 = time.perf_counter()
            got = self.collect_stepwise(rt, step) if self.stepwise else self.collect_episodes(rt, step)  # 1.-5.
            t1 = time.perf_counter()
            seqs, advantages = got["sequences"], got["advantages"]
            record: dict = {"step": step + 1, "stage": self.stage_at(step), "method": cfg.method}
            if self.stepwise:
                record.update(summarize_stepwise(got))
            else:
                record.update(summarize(got["all"], got["all_outcomes"], got["all_rewards"],
                                        advantages.numpy() if len(advantages) else np.zeros(1)))
            record.update({f"sampling/{k}": v for k, v in got["stats"].items()})
            if seqs:
                extra = teacher_fields(seqs, rt.tokenizer, int(cfg.rollout.max_observation_tokens)) \
                    if (cfg.learner.get("loss") or {}).get("teacher_kl") else None
                batch, fillers = assemble_batch(seqs, advantages.tolist(), int(rt.tokenizer.pad_token_id),
                                                self.mini_batch, extra)
                learn = rt.learners.update(batch, step)                                                  # 6. learner update
                t2 = time.perf_counter()
                sync = rt.learners.sync_weights(rt.workers)                                              # 7. sync
                t3 = time.perf_counter()
                record.update({f"learner/{k}": v for k, v in learn.items()}, **{f"sync/{k}": v for k, v in sync.items()},
                              train_sequences=len(seqs), filler_sequences=fillers)
            else:  # dynamic sampling kept no group with a learning signal
                t2 = t3 = time.perf_counter()
                record.update(train_sequences=0, skipped_update=1)
            record.update({"time/rollout": t1 - t0, "time/learn": t2 - t1, "time/sync": t3 - t2,
                           "time/retrieval": float(sum(o.retrieval_seconds for o in got["outcomes"])),
                           "weight_versions": sorted({int(x["weight_version"]) for s in seqs for x in s["turns"]})})
            if got["routes"] is not None:
                record["routes"] = [int(x) for x in got["routes"]]
            if int(cfg.eval.every) > 0 and (step + 1) % int(cfg.eval.every) == 0:
                record.update(self.evaluate(rt, step + 1))
            logger.log(record, trajectories=seqs, rewards=got["rewards"], advantages=advantages.tolist())  # 8. log
            if cfg.run.dump_trajectories:
                _dump(self.out_dir, step + 1, seqs, got["rewards"], advantages.tolist())
            if int(cfg.run.checkpoint_every) > 0 and ((step + 1) % int(cfg.run.checkpoint_every) == 0 or step + 1 == steps):
                extra_state = {"sft_policy_dir": (self.sft or {}).get("policy_dir")}
                record["checkpoint"] = str(save_checkpoint(rt, self.out_dir, step + 1, self.sampler,
                                                           int(cfg.run.keep_checkpoints), extra_state))  # 9. checkpoint
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", em=f"{record['em']:.2f}")
            last = record
        return last


def derive_round_seed(step: int, rnd: int) -> int:
    """Seed index of resampling round ``rnd`` of ``step`` (round 0 uses ``step`` itself)."""
    return 1_000_003 * (rnd + 1) + step


def summarize_stepwise(got: dict) -> dict:
    from raggym.rewards.metrics import exact_match, token_f1

    outcomes, seqs, rewards = got["outcomes"], got["sequences"], got["rewards"]
    by_phase: dict[str, list[float]] = {}
    for s, r in zip(seqs, rewards):
        by_phase.setdefault(s["phase"], []).append(r)
    return {
        "reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
        **{f"reward/{k}": float(np.mean(v)) for k, v in sorted(by_phase.items())},
        "em": float(np.mean([exact_match(o.answer, o.gold_answers) for o in outcomes])),
        "f1": float(np.mean([token_f1(o.answer, o.gold_answers) for o in outcomes])),
        "advantage_abs_mean": float(np.mean(np.abs(got["advantages"].numpy()))),
        "retrievals_mean": float(np.mean([o.retrieval_count for o in outcomes])),
        "answered": float(np.mean([o.answer is not None for o in outcomes])),
        "response_tokens_mean": float(np.mean([sum(s["loss_mask"]) for s in seqs])),
        "sequence_tokens_mean": float(np.mean([len(s["token_ids"]) for s in seqs])),
    }


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
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    last = train(cfg)
    if args.json:
        print(json.dumps(last))
    else:
        print(f"[train] done: step {last.get('step')}, reward {last.get('reward_mean', float('nan')):.3f}, "
              f"EM {last.get('em', float('nan')):.2f}; outputs in {cfg.run.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
