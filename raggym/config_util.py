"""Building settings dataclasses from plain mappings (YAML, OmegaConf, JSON, keyword dicts).

``dataclass_from_mapping(cls, mapping, where)`` is the one strict parser behind
``LearnerConfig.from_dict`` and ``raggym.models.lora_settings``: a key the dataclass does not
have is an error that names the key and where it was found, a field typed as a dataclass
(optionally ``| None``) is built from a nested mapping the same way, and a list given for a
tuple-typed field becomes a tuple (YAML has no tuples). Value checks beyond that belong in the
dataclass's own ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def dataclass_from_mapping(cls: type[T], mapping: Mapping[str, Any] | T, where: str | None = None) -> T:
    """An instance of the dataclass ``cls`` from ``mapping`` (an instance of ``cls`` passes through).

    ``where`` names the mapping in error messages (default: the class name); nested sections are
    reported as ``where.field``. Raises ``ValueError`` for unknown keys and ``TypeError`` when
    ``mapping`` is not a mapping.
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
    hints = typing.get_type_hints(cls)
    kwargs = {key: _convert(hints.get(key), value, f"{where}.{key}") for key, value in mapping.items()}
    return cls(**kwargs)


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


__all__ = ["dataclass_from_mapping"]
