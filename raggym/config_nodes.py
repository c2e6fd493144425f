"""What every reader of a training config shares: its nodes as plain Python, and its error.

``to_plain(node)`` turns an OmegaConf node (``DictConfig``/``ListConfig``) into dicts, lists and
scalars; anything else passes through. ``ConfigError`` is the one error a bad config raises. The
config itself (``experiments/config.py``) and the runtime that reads it (``actors/runtime.py``)
both use them, so they live below both.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A config problem; the message names the file (or override) and the dotted key."""


def to_plain(node) -> Any:
    """A config node as plain Python (dicts, lists, scalars); scalars and None pass through."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
