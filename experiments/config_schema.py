"""What the open sections of a training config accept, derived from where their values go.

Four config sections stay plain mappings because their keys depend on another key's value, which
a dataclass field cannot say: ``reward`` (the schedule of ``reward.method``), ``env.kwargs`` and
``eval.env_kwargs`` (the constructor gymnasium registered for ``env.id``) and
``rollout.engine_kwargs`` (the constructor of ``rollout.engine``). Every other section, ``learner``
and ``data.synthetic`` included, is a dataclass that OmegaConf checks (``experiments.config``).
The open sections' schemas are built from the reward configs' dataclasses and the constructors'
signatures, so they cannot drift from them: a schema maps each key to a typed ``Leaf``, a nested
schema, an ``OptionalSection`` or a ``Forbidden`` key (one the trainer sets from elsewhere).
``open_section_errors`` also checks the names of the open registries (reward methods, advantage
estimators, policy-loss terms, env ids, engines).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Sequence


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


def unknown_key(leaf: str, key: str, parent: str, known) -> str:
    where = f"under '{parent}'" if parent else f"at the top level (unknown config sections ['{key}'])"
    return f"unknown config key '{leaf}': no '{key}' {where}; known: {sorted(known)}"


def dataclass_in(tp):
    """The dataclass ``tp`` is, or is optional of; None if neither."""
    return next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)


@dataclass(frozen=True)
class Leaf:
    """One typed value: ``kind`` is int, float, bool, str, any or list[int|float|str]."""

    kind: str
    nullable: bool = False
    choices: tuple = ()

    def describe(self) -> str:
        text = f"one of {list(self.choices)}" if self.choices else self.kind
        return text + (" or null" if self.nullable else "")

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable or self.kind == "any"
        if self.choices:
            return value in self.choices
        if self.kind.startswith("list["):
            return isinstance(value, (list, tuple)) and all(Leaf(self.kind[5:-1]).accepts(v) for v in value)
        expected = {"int": int, "float": (int, float), "bool": bool, "str": str, "any": object}[self.kind]
        return isinstance(value, expected) and not (isinstance(value, bool) and self.kind in ("int", "float"))


@dataclass(frozen=True)
class OptionalSection:
    """A section that may also be null (``learner.lora``)."""

    schema: dict


@dataclass(frozen=True)
class Forbidden:
    """A key of the underlying class that the trainer sets from elsewhere."""

    hint: str


def cannot_set_here(hint: str) -> str:
    """The problem of a key the trainer sets from elsewhere; ``hint`` says where."""
    return f"cannot be set here: {hint}"


class _BadKey(ValueError):
    """A key whose value makes its open section impossible to check (unknown env id, engine...)."""

    def __init__(self, key: str, problem: str):
        super().__init__(problem)
        self.key, self.problem = key, problem


def leaf_from_type(tp) -> Optional[Leaf]:
    """The Leaf of an annotation, or None when YAML cannot spell it (a callable, an object)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return Leaf("any")
    if tp in (int, float, bool, str):
        return Leaf(tp.__name__)
    if origin is Literal:
        return Leaf(type(args[0]).__name__, choices=args)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        nullable = len(members) < len(args)
        if str in members:  # e.g. torch.dtype | str | None: YAML can only give the string form
            return Leaf("str", nullable=nullable)
        if set(members) == {int, float}:
            return Leaf("float", nullable=nullable)
        inner = leaf_from_type(members[0]) if len(members) == 1 else None
        return None if inner is None else dataclasses.replace(inner, nullable=nullable)
    if origin in (tuple, list, Sequence, typing.Sequence):
        items = {a for a in args if a is not Ellipsis}
        if len(items) == 1 and next(iter(items)) in (int, float, str):
            return Leaf(f"list[{next(iter(items)).__name__}]")
    if tp in (tuple, list):  # a bare ``tuple``/``list`` annotation: YAML spells it as a list of anything
        return Leaf("list[any]")
    return None


def _dataclass_schema(cls, forbidden: Mapping[str, str] = {}) -> dict:
    """Schema of a dataclass's fields; nested (optional) dataclasses become (optional) sections."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = dataclass_in(tp)
        if f.name in forbidden:
            out[f.name] = Forbidden(forbidden[f.name])
        elif inner is not None:
            out[f.name] = _dataclass_schema(inner) if inner is tp else OptionalSection(_dataclass_schema(inner))
        elif (leaf := leaf_from_type(tp)) is not None:
            out[f.name] = leaf
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: annotation {tp} has no config spelling")
    return out


def _signature_schema(target, exclude: Sequence[str]) -> Optional[dict]:
    """Keyword parameters YAML can spell of ``target`` (a class's constructor, or a function).

    A ``**kwargs`` of a class is followed into its base classes' constructors (a subclass that
    forwards to ``RagSearchEnv``); None means the keys are open (``**kwargs`` that no base
    constructor accounts for, or a signature Python cannot read)."""
    chain = [c.__init__ for c in target.__mro__ if "__init__" in vars(c)] if isinstance(target, type) else [target]
    out: dict = {}
    for fn in chain:
        if fn is object.__init__:
            return None
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return None
        try:
            hints = typing.get_type_hints(fn)
        except (NameError, TypeError):  # a user's unresolvable annotation: accept any value there
            hints = {}
        for p in params:
            if p.name not in ("self", *exclude, *out) and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                if (leaf := leaf_from_type(hints.get(p.name, Any))) is not None:
                    out[p.name] = leaf
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return out
    return None


def _schema_errors(value, schema, path: str) -> list[tuple[str, str]]:
    """(dotted key, problem) for every key of ``value`` that ``schema`` does not allow."""
    if isinstance(schema, OptionalSection):
        if value is None:
            return []
        schema = schema.schema
    if isinstance(schema, Forbidden):
        return [(path, cannot_set_here(schema.hint))]
    if isinstance(schema, Leaf):
        return [] if schema.accepts(value) else [(path, f"must be {schema.describe()}, got {value!r} ({type(value).__name__})")]
    if not isinstance(value, Mapping):
        return [(path, f"must be a section (a mapping), got {value!r}")]
    errors = []
    for key, sub in value.items():
        dotted = f"{path}.{key}"
        if key in schema:
            errors.extend(_schema_errors(sub, schema[key], dotted))
        else:
            known = [k for k, s in schema.items() if not isinstance(s, Forbidden)]
            errors.extend((leaf, unknown_key(leaf, key, path, known)) for leaf in leaf_paths(sub, dotted))
    return errors


def _reward_methods() -> list[str]:
    from raggym.rewards.schedules import BUILTIN_METHODS, CUSTOM_SCHEDULES

    return sorted({*BUILTIN_METHODS, *CUSTOM_SCHEDULES})


def _reward_schema(c: dict) -> Optional[dict]:
    """``reward.*``: the schedule's own keys plus the fields of the method's reward config."""
    from raggym.rewards import GraphRAGR1Config, LWSConfig, PathRouterConfig, RouteRAGConfig

    method, base = c["reward"].get("method"), {"method": Leaf("str")}
    if method == "routerag":
        return {**base, "stage2_start": Leaf("int"), **_dataclass_schema(RouteRAGConfig)}
    if method == "lws":
        from raggym.judge import JudgeConfig

        return {**base, "stage2_start": Leaf("int"), "embedder": Leaf("str"),
                "judge": OptionalSection(_dataclass_schema(JudgeConfig)), **_dataclass_schema(LWSConfig)}
    if method == "graphrag_r1":
        hint = "the SFT cold start is the sft: section (sft.enabled, sft.epochs)"
        return {**base, "phase3_start": Leaf("int"), "sft_steps": Forbidden(hint), **_dataclass_schema(GraphRAGR1Config)}
    if method == "pathrouter":
        return {**base, **_dataclass_schema(PathRouterConfig, {"route_weights": "set advantage.route_weights"})}
    if method == "r1_router":
        return {**base, "embedder": Leaf("str")}
    if method == "search_r1":
        return base
    if method in _reward_methods():
        return None  # registered with register_reward_schedule: its builder checks its own keys
    raise _BadKey("reward.method", f"unknown reward method {method!r}; known: {_reward_methods()} "
                                   "(add one with raggym.rewards.schedules.register_reward_schedule)")


# Env constructor arguments the trainer supplies itself (objects, or values it derives).
_ENV_SUPPLIED = ("retriever", "questions", "dialect", "reward_fn", "corpus", "prompt_fn", "token_counter",
                 "max_episode_tokens", "render_mode", "question_order", "knowledge_bases",
                 "knowledge_base_modes", "gold_knowledge_base_names")


def _env_kwargs_schema(c: dict) -> Optional[dict]:
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    import envs  # noqa: F401  (registers the raggym ids)

    env_id = c["env"]["id"]
    spec = gymnasium.registry.get(env_id)
    if spec is None:
        known = sorted(i for i in gymnasium.registry if i.startswith("raggym/"))
        raise _BadKey("env.id", f"unknown environment {env_id!r}: gymnasium has no such id; raggym ids: {known} "
                                "(register your own with gymnasium.register)")
    try:
        creator = spec.entry_point if callable(spec.entry_point) else load_env_creator(spec.entry_point)
    except (ImportError, AttributeError, ValueError) as exc:
        raise _BadKey("env.id", f"cannot load the entry point {spec.entry_point!r} of {env_id!r}: {exc}") from exc
    return _signature_schema(creator, _ENV_SUPPLIED)


def _engine_kwargs_schema(c: dict) -> Optional[dict]:
    import importlib

    from actors.engines.rollout_worker import ENGINE_FACTORIES

    name = c["rollout"]["engine"]
    known = {"hf": "actors.engines.hf:HFEngine", "vllm": "actors.engines.vllm_engine:VLLMEngine",
             "vllm-async": "actors.engines.vllm_async:AsyncVLLMEngine"}
    if name in ENGINE_FACTORIES:
        target = ENGINE_FACTORIES[name]
    elif name in known or ":" in name:
        module, _, attr = known.get(name, name).partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise _BadKey("rollout.engine", f"cannot import engine {name!r}: {exc}") from exc
    else:
        raise _BadKey("rollout.engine", f"unknown engine {name!r}; known: {[*known, *ENGINE_FACTORIES]} or "
                                        "'module:Class' (add one with actors.engines.register_engine)")
    if name in ("vllm", "vllm-async"):
        return _vllm_kwargs_schema(target)
    # a factory function's keyword arguments go wherever it sends them: accept any
    return _signature_schema(target, ("model", "tokenizer", "weight_version")) if isinstance(target, type) else None


def _vllm_kwargs_schema(engine_class) -> Optional[dict]:
    """A vLLM engine's keys: its own, ``engine_arguments``' and any of vLLM's ``EngineArgs`` fields
    (which ``engine_arguments`` passes through), so a misspelt key fails here, not in the engine."""
    from actors.engines.vllm_engine import engine_arguments

    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:  # no vLLM here: the engine will say so when it is built
        return None
    any_value = leaf_from_type(Any)
    schema = {f.name: any_value for f in dataclasses.fields(AsyncEngineArgs)}
    for target in (engine_class, engine_arguments):
        params = inspect.signature(target).parameters.values()
        schema.update({p.name: any_value for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)})
    for supplied in ("self", "model", "tokenizer", "weight_version"):
        schema.pop(supplied, None)
    return schema


_OPEN_SECTIONS: tuple[tuple[str, Callable[[dict], Optional[dict]]], ...] = (
    ("reward", _reward_schema), ("env.kwargs", _env_kwargs_schema), ("eval.env_kwargs", _env_kwargs_schema),
    ("rollout.engine_kwargs", _engine_kwargs_schema))


def open_section_errors(c: dict) -> list[tuple[str, str]]:
    """The registries' names and the keys of the open sections."""
    from raggym.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from raggym.algorithms.policy_loss import get_policy_loss_term

    errors = []
    if c["method"] not in _reward_methods():
        errors.append(("method", f"unknown method {c['method']!r}; known: {_reward_methods()} "
                                 "(add one with raggym.rewards.schedules.register_reward_schedule)"))
    if c["advantage"]["estimator"] not in ADVANTAGE_ESTIMATORS:
        errors.append(("advantage.estimator", f"unknown estimator {c['advantage']['estimator']!r}; known: "
                       f"{sorted(ADVANTAGE_ESTIMATORS)} (add one with @register_advantage_estimator)"))
    terms = get_path(c, ("learner", "loss", "terms"))
    for term in terms or ():  # a list of strings (OmegaConf checks the type)
        try:
            get_policy_loss_term(str(term))
        except ValueError as exc:
            errors.append(("learner.loss.terms", str(exc)))
    for path, build in _OPEN_SECTIONS:
        try:
            schema = build(c)
        except _BadKey as bad:
            errors.append((bad.key, bad.problem))
            continue
        if schema is not None:
            errors.extend(_schema_errors(get_path(c, path.split(".")), schema, path))
    return list(dict.fromkeys(errors))  # env.kwargs and eval.env_kwargs report a bad env.id once
