"""Methods mixed into every vLLM GPU worker (``LLM(worker_extension_cls=...)``).

vLLM imports this class by its qualified name inside its worker processes and adds its methods to
the worker, so ``self`` here is a vLLM worker: ``self.model_runner.model`` is the loaded model and
``self.device`` its GPU. ``VLLMEngine`` calls the methods through ``LLM.collective_rpc``, which
runs them on every tensor-parallel worker; ``model.load_weights`` takes full (unsharded) HF-named
tensors and shards them itself, so every TP worker receives the same full tensors.

This module must stay importable without vllm (it only touches vllm objects through ``self``).
"""

from __future__ import annotations

import json

import torch

from actors.weight_sync import FlatWeights, TensorSpec, WeightSyncGroup


class WeightSyncWorkerExtension:
    def raggym_load_flat_weights(self, header: str, buffer: torch.Tensor) -> int:
        """Object-store path: load a packed ``FlatWeights`` buffer (CPU uint8) into the model."""
        specs = [TensorSpec.from_json(s) for s in json.loads(header)]
        flat = FlatWeights(version=-1, specs=specs, buffer=buffer.numpy())
        self.model_runner.model.load_weights(weights=((n, t.to(self.device)) for n, t in flat.named_tensors()))
        torch.cuda.synchronize()
        return len(specs)

    def raggym_init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> int:
        """Join the learner's ``WeightSyncGroup``; this worker's rank is offset + its vLLM rank."""
        local = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        rank = rank_offset + local
        self._raggym_sync = WeightSyncGroup(host, port, rank, world_size, backend=backend, device=self.device)
        return rank

    def raggym_receive_weights(self) -> int:
        """Receive one broadcast bucket by bucket and load it as it arrives."""
        version, tensors = self._raggym_sync.receive()
        self.model_runner.model.load_weights(weights=tensors)
        torch.cuda.synchronize()
        return version
