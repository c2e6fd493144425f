"""vLLM engine (GPU): the same token-in/token-out interface as ``HFEngine``, backed by ``vllm.LLM``.

vllm is imported lazily: importing this module never needs it, constructing ``VLLMEngine``
without it raises ``VLLMUnavailableError`` with the install hint. vllm is in raggym's ``gpu``
extra (``pip install 'raggym[gpu]'``).

Mapping onto vLLM:

* prompts go in as ``TokensPrompt(prompt_token_ids=...)``, so vLLM never re-tokenizes;
* ``SamplingParams(logprobs=0)`` returns the log-probability of each sampled token;
  ``logprobs_mode="processed_logprobs"`` (vLLM ≥ 0.10.2) makes it the temperature/top-k/top-p
  processed distribution, as ``HFEngine`` reports by default. On older vLLM the engine falls back
  to vLLM's raw logprobs and says so in ``self.logprobs_mode``;
* each prompt gets its own ``seed = derive_seed(seed, i)``, like ``HFEngine``;
* ``stop=stop_strings`` with ``include_stop_str_in_output=True``; vLLM's ``token_ids`` already
  keep every sampled id up to and including the one that completed the stop string;
* vLLM reports both EOS and stop strings as ``finish_reason="stop"``; a string ``stop_reason``
  means a stop string, anything else (``None`` or a stop token id) maps to ``"eos"``.

Model sources: an embedded GGUF spec such as ``"smollm2-135m"`` loads the de-quantized HF copy that
``raggym.models.converted_checkpoint`` writes (``use_gguf=True`` loads the GGUF file itself, with
the tokenizer from the converted dir); local HF dirs and hub ids load as they are.

Weights: vLLM's workers run in their own processes, so updates go through
``LLM.collective_rpc`` into ``actors.engines.vllm_worker.WeightSyncWorkerExtension`` (installed
with ``worker_extension_cls``): either a packed ``FlatWeights`` buffer (object-store path) or a
``WeightSyncGroup`` broadcast (NCCL path, ``backend="pynccl"``). The prefix cache is reset after
every update, since cached KV blocks were computed with the old weights.

Not exercised in this repository's CPU test suite; ``experiments/gpu_smoke.sh`` runs it on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from actors.engines.base import GenerationResult, SamplingParams, check_prompts, derive_seed
from actors.weight_sync import FlatWeights, named_tensors_of

WORKER_EXTENSION = "actors.engines.vllm_worker.WeightSyncWorkerExtension"


class VLLMUnavailableError(ImportError):
    """vllm is not installed (or cannot be imported) in this environment."""


def import_vllm():
    try:
        import vllm  # noqa: F401
        from vllm import LLM
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable vllm"
        raise VLLMUnavailableError(
            "the vLLM engine needs the 'vllm' package and a CUDA GPU; install the GPU extra with "
            "`pip install 'raggym[gpu]'`, or use the HF engine (engine='hf') on CPU. "
            f"Import failed with: {type(exc).__name__}: {exc}"
        ) from exc
    return LLM, VSamplingParams, TokensPrompt


def vllm_available() -> bool:
    try:
        import_vllm()
    except VLLMUnavailableError:
        return False
    return True


def vllm_model_source(spec: str, use_gguf: bool = False) -> tuple[str, str]:
    """``(model, tokenizer)`` paths for ``vllm.LLM`` from a raggym model spec."""
    from raggym.models import converted_checkpoint, resolve_model_spec

    resolved = resolve_model_spec(spec)
    if resolved.gguf_file is None:
        return resolved.path, resolved.path
    hf_dir = str(converted_checkpoint(resolved))  # tokenizer (and weights unless use_gguf)
    if use_gguf:
        return str(Path(resolved.path) / resolved.gguf_file), hf_dir
    return hf_dir, hf_dir


def flat_weights_payload(named_tensors, version: int | None, current_version: int) -> tuple[str, torch.Tensor, int]:
    """``(header, buffer, version)`` for ``raggym_load_flat_weights``: the tensors packed into one
    CPU uint8 buffer (``FlatWeights``) with a JSON header; the version is ``version`` if given,
    else the one the payload carries, else ``current_version + 1``."""
    if isinstance(named_tensors, FlatWeights):
        flat = named_tensors
    else:
        pairs, _ = named_tensors_of(named_tensors)
        flat = FlatWeights.from_named_tensors(list(pairs), version if version is not None else current_version + 1)
    header = json.dumps([s.to_json() for s in flat.specs])
    buffer = torch.from_numpy(flat.buffer if flat.buffer.flags.writeable else flat.buffer.copy())
    return header, buffer, int(version if version is not None else flat.version)


class VLLMEngine:
    """Token-in/token-out generation with ``vllm.LLM`` (see the module docstring)."""

    kind = "vllm"

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
        use_gguf: bool = False,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        weight_version: int = 0,
        **llm_kwargs,
    ):
        LLM, self._VSamplingParams, self._TokensPrompt = import_vllm()
        if not torch.cuda.is_available():
            raise VLLMUnavailableError("the vLLM engine needs a CUDA GPU; none is visible (use engine='hf' on CPU)")
        model_path, tokenizer_path = vllm_model_source(model, use_gguf)
        kwargs = dict(
            model=model_path,
            tokenizer=tokenizer_path,
            tensor_parallel_size=int(tensor_parallel_size),
            gpu_memory_utilization=float(gpu_memory_utilization),
            dtype=dtype,
            seed=int(seed),
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            worker_extension_cls=WORKER_EXTENSION,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        kwargs.update(llm_kwargs)
        self.logprobs_mode = "processed"
        try:
            self.llm = LLM(logprobs_mode="processed_logprobs", **kwargs)
        except TypeError:  # vLLM < 0.10.2 has no logprobs_mode: it reports raw logprobs
            self.llm = LLM(**kwargs)
            self.logprobs_mode = "raw"
        self.tokenizer = self.llm.get_tokenizer()
        self.sync_ranks = int(tensor_parallel_size)  # each TP worker is one rank of a sync group
        self.weight_version = int(weight_version)
        self.model_path = model_path

    def _sampling_params(self, sampling: SamplingParams, index: int, stop_strings: list[str], max_new_tokens: int):
        return self._VSamplingParams(
            n=1,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k) if sampling.top_k > 0 else -1,
            seed=None if sampling.seed is None else derive_seed(sampling.seed, index),
            max_tokens=int(max_new_tokens),
            stop=stop_strings or None,
            include_stop_str_in_output=True,
            logprobs=0,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
        )

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> list[GenerationResult]:
        prompts = check_prompts(prompt_token_ids, max_new_tokens)
        if not prompts:
            return []
        sampling = sampling or SamplingParams()
        if sampling.logprobs_mode != self.logprobs_mode and not sampling.greedy:
            raise ValueError(
                f"this vLLM engine reports {self.logprobs_mode!r} logprobs (set when the engine was built); "
                f"asked for {sampling.logprobs_mode!r}"
            )
        stops = [s for s in stop_strings if s]
        params = [self._sampling_params(sampling, i, stops, max_new_tokens) for i in range(len(prompts))]
        inputs = [self._TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        results = []
        for out in outputs:
            completion = out.outputs[0]
            ids = [int(t) for t in completion.token_ids]
            logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
            if len(logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
            stop_string = None
            if completion.finish_reason == "length":
                reason = "length"
            elif isinstance(completion.stop_reason, str):
                reason, stop_string = "stop", completion.stop_reason
            else:
                reason = "eos"
            results.append(
                GenerationResult(ids, logprobs, reason, stop_string, self.weight_version, text=completion.text)
            )
        return results

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors, version: int | None = None) -> int:
        """Load new weights into every vLLM worker through the object-store payload."""
        header, buffer, new_version = flat_weights_payload(named_tensors, version, self.weight_version)
        self.llm.collective_rpc("raggym_load_flat_weights", args=(header, buffer))
        self.llm.reset_prefix_cache()
        self.weight_version = new_version
        return self.weight_version

    def load_state_dict(self, state_dict, version: int | None = None) -> int:
        return self.update_weights(state_dict, version)

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "pynccl") -> None:
        """Every TP worker joins the group as rank ``rank_offset + its vLLM rank``."""
        self.llm.collective_rpc("raggym_init_weight_sync", args=(host, int(port), int(rank_offset), int(world_size), backend))

    def receive_weights(self) -> int:
        versions = self.llm.collective_rpc("raggym_receive_weights")
        self.llm.reset_prefix_cache()
        if len(set(versions)) != 1:
            raise RuntimeError(f"vLLM workers received different weight versions: {versions}")
        self.weight_version = int(versions[0])
        return self.weight_version

    def info(self) -> dict:
        return {
            "kind": self.kind,
            "model": self.model_path,
            "tensor_parallel_size": self.sync_ranks,
            "logprobs_mode": self.logprobs_mode,
            "weight_version": self.weight_version,
        }


__all__ = ["VLLMEngine", "VLLMUnavailableError", "WORKER_EXTENSION", "flat_weights_payload", "import_vllm", "vllm_available", "vllm_model_source"]
