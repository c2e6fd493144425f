"""Fault injection for the weight-sync check: a real vLLM engine whose weight update loads nothing.

``EngineThatLoadsNothing`` is ``AsyncVLLMEngine`` with one fault, the one a sync check exists to
catch: ``update_weights`` advances and reports the new version, as a successful load would, but no
tensor reaches vLLM's worker. Everything else (sampling, scoring, sessions) is vLLM's own. A run
names it as ``rollout.engine=faulty_engines:EngineThatLoadsNothing`` with ``tests/`` on the path.
"""

from __future__ import annotations

from actors.engines.vllm_async import AsyncVLLMEngine
from actors.weight_sync import named_tensors_of


class EngineThatLoadsNothing(AsyncVLLMEngine):
    async def update_weights(self, named_tensors, version: int | None = None) -> int:
        _, carried = named_tensors_of(named_tensors)
        self.weight_version = int(version if version is not None else carried if carried is not None
                                  else self.weight_version + 1)
        return self.weight_version
