"""The dataclass that each open section of a training config is checked against.

Four sections of ``TrainConfig`` are ``dict`` fields because their keys depend on another key's
value: ``reward`` (``reward.method``), ``env.kwargs`` and ``eval.env_kwargs`` (the constructor
gymnasium registered for ``env.id``) and ``rollout.engine_kwargs`` (``rollout.engine``).
``open_sections`` names a dataclass for each, taken from where the values go so that it cannot
drift from it: the reward's section declared beside its schedule
(``raggym.rewards.schedules.REWARD_SECTIONS``), or one made from the constructor's keyword
parameters. ``experiments.recipe.config`` merges each section into its dataclass with OmegaConf, as it
merges the fixed sections, so the errors read the same. A section without a dataclass is not
checked (a reward registered without one, a constructor whose ``**kwargs`` go anywhere).
``open_sections`` also checks the names of the open registries (reward methods, advantage
estimators, policy-loss terms, env ids, engines).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Optional

import gymnasium
from gymnasium.envs.registration import load_env_creator

import envs  # noqa: F401  (registers the raggym ids)
from actors.engines.rollout_worker import engine_factory
from actors.engines.vllm_engine import engine_arguments
from raggym.algorithms.advantages import ADVANTAGE_ESTIMATORS
from raggym.algorithms.policy_loss import get_policy_loss_term
from raggym.config_util import config_type
from raggym.rewards.schedules import reward_methods, reward_section

# Env constructor arguments the trainer supplies itself (objects, or values it derives).
_ENV_SUPPLIED = ("retriever", "questions", "dialect", "reward_fn", "corpus", "prompt_fn", "token_counter",
                 "max_episode_tokens", "render_mode", "question_order", "knowledge_bases",
                 "knowledge_base_modes", "gold_knowledge_base_names")
_ENGINE_SUPPLIED = ("model", "tokenizer", "weight_version")


class _BadKey(ValueError):
    """(key, problem): the key's value leaves its open section without a dataclass (unknown env id...)."""


def _keys_of(name: str, types_by_key: dict) -> type:
    """A dataclass with a field per key; none has a default, as only the keys set are checked."""
    return dataclasses.make_dataclass(name, list(types_by_key.items()))


def _signature_section(target, supplied) -> Optional[type]:
    """The keyword parameters YAML can spell of ``target`` (a class's constructor, or a function),
    less those the trainer ``supplied``.

    A ``**kwargs`` of a class is followed into its base classes' constructors (a subclass that
    forwards to ``RagSearchEnv``); None means the keys are open (``**kwargs`` that no base
    constructor accounts for, or a signature Python cannot read)."""
    chain = [c.__init__ for c in target.__mro__ if "__init__" in vars(c)] if isinstance(target, type) else [target]
    found: dict = {}
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
            if p.name not in ("self", *supplied, *found) and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                if (tp := config_type(hints.get(p.name, Any))) is not None:
                    found[p.name] = tp
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return _keys_of(f"{getattr(target, '__name__', 'Target')}Keys", found)
    return None


def _env_section(c: dict) -> Optional[type]:
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
    return _signature_section(creator, _ENV_SUPPLIED)


def _engine_section(c: dict) -> Optional[type]:
    name = c["rollout"]["engine"]
    try:
        target = engine_factory(name)
    except ValueError as exc:
        raise _BadKey("rollout.engine", str(exc)) from exc
    if name in ("vllm", "vllm-async"):
        return _vllm_section(target)
    # a factory function's keyword arguments go wherever it sends them: accept any
    return _signature_section(target, _ENGINE_SUPPLIED) if isinstance(target, type) else None


def _vllm_section(engine_class) -> Optional[type]:
    """A vLLM engine's keys: its own, ``engine_arguments``' and any of vLLM's ``EngineArgs`` fields
    (which ``engine_arguments`` passes through), any value each, so a misspelt key fails here."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs  # heavy and optional: only when it is the engine
    except ImportError:  # no vLLM here: the engine will say so when it is built
        return None
    names = [f.name for f in dataclasses.fields(AsyncEngineArgs)]
    for target in (engine_class, engine_arguments):
        params = inspect.signature(target).parameters.values()
        names += [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return _keys_of(f"{engine_class.__name__}Keys", {n: Any for n in names if n not in ("self", *_ENGINE_SUPPLIED)})


_SECTION_OF = (("reward", lambda c: reward_section(c["reward"].get("method"))),
               ("env.kwargs", _env_section), ("eval.env_kwargs", _env_section),
               ("rollout.engine_kwargs", _engine_section))


def _registry_errors(c: dict) -> list[tuple[str, str]]:
    """The names of the open registries that no section's dataclass can check."""
    errors = []
    methods = (("method", "method", c["method"]), ("reward.method", "reward method", c["reward"].get("method")))
    for key, label, method in methods:
        if method not in reward_methods():
            errors.append((key, f"unknown {label} {method!r}; known: {reward_methods()} "
                                "(add one with raggym.rewards.schedules.register_reward_schedule)"))
    if c["advantage"]["estimator"] not in ADVANTAGE_ESTIMATORS:
        errors.append(("advantage.estimator", f"unknown estimator {c['advantage']['estimator']!r}; known: "
                       f"{sorted(ADVANTAGE_ESTIMATORS)} (add one with @register_advantage_estimator)"))
    for term in c["learner"]["loss"]["terms"] or ():  # a list of strings (OmegaConf checks the type)
        try:
            get_policy_loss_term(str(term))
        except ValueError as exc:
            errors.append(("learner.loss.terms", str(exc)))
    return errors


def open_sections(c: dict) -> tuple[list[tuple[str, str]], dict[str, type]]:
    """The registries' problems as (dotted key, problem), and each open section's dataclass by path."""
    errors, sections = _registry_errors(c), {}
    for path, section_of in _SECTION_OF:
        try:
            section = section_of(c)
        except _BadKey as bad:
            errors.append(bad.args)
            continue
        if section is not None:
            sections[path] = section
    return list(dict.fromkeys(errors)), sections  # env.kwargs and eval.env_kwargs report a bad env.id once
