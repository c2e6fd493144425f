"""What every reader of a training config shares: its nodes as plain Python, and its error.

``to_plain(node)`` turns an OmegaConf node (``DictConfig``/``ListConfig``) into dicts, lists and
scalars; anything else passes through. ``ConfigError`` is the one error a bad config raises.
``check_runtime_serves`` refuses an open runtime built from a config that differs where it matters. The
config itself (``experiments/recipe/config.py``) and the runtime that reads it (``actors/runtime.py``)
both use them, so they live below both.
"""

from __future__ import annotations

from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A config problem; the message names the file (or override) and the dotted key."""


def to_plain(node) -> Any:
    """A config node as plain Python (dicts, lists, scalars); scalars and None pass through."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


# What an episode is: its env and its token limits. A runtime shared by a training stage or an
# evaluation must have been built with the same (``check_runtime_serves``).
EPISODE_LIMITS = ("env.id", "rollout.max_response_tokens", "rollout.max_turn_tokens", "rollout.max_observation_tokens",
                  "rollout.response_budget_counts")


def check_runtime_serves(runtime_cfg, cfg, keys: Sequence[str], caller: str) -> None:
    """Raise ``ValueError`` naming the first of ``keys`` (dotted) where the config an open runtime
    was built from differs from ``cfg``: a runtime shared by a training stage or an evaluation
    must run what that run asks for, or it silently changes what is trained or measured."""
    for key in keys:
        theirs, ours = OmegaConf.select(runtime_cfg, key), OmegaConf.select(cfg, key)
        if theirs != ours:
            raise ValueError(f"{caller}: the given runtime was built with {key}={theirs!r}, this run asks for {key}={ours!r}")
