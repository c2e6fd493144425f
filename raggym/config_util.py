"""Building settings dataclasses from plain mappings (YAML, OmegaConf, JSON, keyword dicts).

``dataclass_from_mapping(cls, mapping, where)`` is the one strict parser behind
``LearnerConfig.from_dict`` and ``raggym.models.lora_settings``: a key the dataclass does not
have, or a required field it lacks (``required_fields``), is an error that names the key and where
it was found, a field typed as a dataclass (optionally ``| None``) is built from a nested mapping
the same way, and a list given for a tuple-typed field becomes a tuple (YAML has no tuples). Value
checks beyond that belong in the dataclass's own ``__post_init__``.

``config_type(annotation)`` is the type a config value can have there, one OmegaConf checks (None
where YAML cannot spell one), and ``describe_type`` names it in an error message.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Literal, Mapping, Optional, TypeVar

T = TypeVar("T")


def dataclass_from_mapping(cls: type[T], mapping: Mapping[str, Any] | T, where: str | None = None) -> T:
    """An instance of the dataclass ``cls`` from ``mapping`` (an instance of ``cls`` passes through).

    ``where`` names the mapping in error messages (default: the class name); nested sections are
    reported as ``where.field``. Raises ``ValueError`` for unknown or missing required keys and
    ``TypeError`` when ``mapping`` is not a mapping.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"dataclass_from_mapping needs a dataclass, got {cls!r}")
    where = where or cls.__name__
    if isinstance(mapping, cls):
        return mapping
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{where}: expected a mapping of settings, got {type(mapping).__name__}")
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(str(k) for k in mapping if k not in known)
    if unknown:
        raise ValueError(f"unknown {where} key(s) {unknown}; known: {', '.join(sorted(known))}")
    missing = [name for name in required_fields(cls) if name not in mapping]
    if missing:  # the constructor would say so too, but as a TypeError that names no section
        raise ValueError(f"missing required {where} key(s) {missing}")
    hints = typing.get_type_hints(cls)
    kwargs = {key: _convert(hints.get(key), value, f"{where}.{key}") for key, value in mapping.items()}
    return cls(**kwargs)


def required_fields(cls) -> list[str]:
    """The fields of the dataclass ``cls`` that its constructor needs (no default)."""
    return [f.name for f in dataclasses.fields(cls)
            if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _union_members(hint) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return (hint,)


def _convert(hint, value, where: str):
    if value is None or hint is None:
        return value
    members = _union_members(hint)
    nested = [m for m in members if isinstance(m, type) and dataclasses.is_dataclass(m)]
    if len(nested) == 1 and isinstance(value, Mapping):
        return dataclass_from_mapping(nested[0], value, where)
    wants_tuple = any(m is tuple or typing.get_origin(m) is tuple for m in members)
    if wants_tuple and isinstance(value, typing.Sequence) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return value


def config_type(tp) -> Any:
    """``tp`` as a type OmegaConf checks, or None when YAML cannot spell it (a callable, an object,
    a section)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (Any, int, float, bool, str) or origin is Literal:
        return tp
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if str in members:  # e.g. torch.dtype | str | None: YAML can only give the string form
            inner = str
        else:
            inner = float if set(members) == {int, float} else config_type(members[0]) if len(members) == 1 else None
        return inner if inner is None or len(members) == len(args) else Optional[inner]
    if origin in (tuple, list, collections.abc.Sequence):
        items = {a for a in args if a is not Ellipsis}
        return list[items.pop()] if len(items) == 1 and items <= {int, float, str} else None
    return list[Any] if tp in (tuple, list) else None  # a bare tuple or list: YAML spells a list of anything


def describe_type(tp) -> str:
    """What a value of type ``tp`` must be, as an error says it: int, float or null, one of [...]..."""
    spelled = config_type(tp)
    origin, args = typing.get_origin(spelled), typing.get_args(spelled)
    if spelled is None:
        return "a section (a mapping)"
    if origin is typing.Union:  # Optional[X]
        return f"{describe_type(args[0])} or null"
    if origin is Literal:
        return f"one of {list(args)}"
    if origin is list:
        return f"list[{describe_type(args[0])}]"
    return "any" if spelled is Any else spelled.__name__


__all__ = ["config_type", "dataclass_from_mapping", "describe_type", "required_fields"]
