"""raggym.config_util.dataclass_from_mapping: strict keys, nested sections, YAML lists as tuples."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from raggym.config_util import dataclass_from_mapping, required_fields


@dataclass
class Inner:
    betas: tuple[float, float] = (0.9, 0.999)
    name: str = "adamw"


@dataclass
class Outer:
    steps: int = 1
    inner: Inner = field(default_factory=Inner)
    extra: Inner | None = None
    tags: list[str] = field(default_factory=list)


def test_nested_sections_and_tuples_are_built():
    cfg = dataclass_from_mapping(Outer, {"steps": 3, "inner": {"betas": [0.8, 0.9]}, "extra": {"name": "sgd"},
                                         "tags": ["a"]})
    assert cfg == Outer(steps=3, inner=Inner(betas=(0.8, 0.9)), extra=Inner(name="sgd"), tags=["a"])
    assert isinstance(cfg.tags, list)  # only tuple-typed fields are converted
    assert dataclass_from_mapping(Outer, {}) == Outer()
    assert dataclass_from_mapping(Outer, {"extra": None}).extra is None
    same = Outer(steps=7)
    assert dataclass_from_mapping(Outer, same) is same
    assert dataclass_from_mapping(Outer, {"inner": Inner(name="x")}).inner == Inner(name="x")


def test_unknown_keys_name_the_key_and_the_section():
    with pytest.raises(ValueError, match=r"unknown Outer key\(s\) \['stepz'\]; known: extra, inner, steps, tags"):
        dataclass_from_mapping(Outer, {"stepz": 2})
    with pytest.raises(ValueError, match=r"unknown run.inner key\(s\) \['betaz'\]"):
        dataclass_from_mapping(Outer, {"inner": {"betaz": [1, 2]}}, "run")
    with pytest.raises(TypeError, match="Outer: expected a mapping"):
        dataclass_from_mapping(Outer, [("steps", 1)])
    with pytest.raises(TypeError, match="needs a dataclass"):
        dataclass_from_mapping(dict, {})


@dataclass
class Staged:
    start: int
    scale: float = 1.0


def test_a_missing_required_key_is_named():
    assert required_fields(Staged) == ["start"] and required_fields(Outer) == []
    assert dataclass_from_mapping(Staged, {"start": 3}) == Staged(start=3)
    with pytest.raises(ValueError, match=r"missing required reward key\(s\) \['start'\]"):
        dataclass_from_mapping(Staged, {"scale": 2.0}, "reward")


def test_omegaconf_containers_are_accepted():
    from omegaconf import OmegaConf

    cfg = dataclass_from_mapping(Outer, OmegaConf.create({"inner": {"betas": [0.5, 0.6]}}))
    assert cfg.inner.betas == (0.5, 0.6) and isinstance(cfg.inner.betas, tuple)
