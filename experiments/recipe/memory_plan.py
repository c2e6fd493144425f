"""Per-GPU memory plan of the GPU recipes: learner GPUs and rollout-engine GPUs, in bytes.

The learner side adds up, per GPU (bf16 training, AdamW, ``K`` learners):

* weights: bf16, ``2P/K`` under ZeRO-3 plus the gathered working set (DeepSpeed's
  ``stage3_max_live_parameters``, 1e9 parameters by default: at most 2 GB gathered at once);
  ``2P`` under ZeRO 0-2;
* optimizer: fp32 master weights and Adam's two moments, ``12P`` partitioned over ``K`` (ZeRO ≥ 1;
  only the adapters' under LoRA);
* gradients: bf16, ``2P/K`` partitioned (ZeRO 2-3) or ``2P`` (ZeRO 0-1), plus one reduce bucket
  (DeepSpeed's ``reduce_bucket_size``, 5e8 elements);
* the frozen reference (KL or teacher): bf16, partitioned like the policy under ZeRO-3;
* activations of one micro-batch with gradient checkpointing: every layer's input
  (``tokens · H`` bf16) plus one layer's activations and their gradients while it is recomputed;
  attention through SDPA / flash kernels, so nothing grows with ``tokens²``;
* logits: one chunk of ``logit_chunk_size`` positions (``raggym.algorithms.logprobs``: bf16 logits,
  float32 scaled copy, softmax and gradient temporaries, ~18 bytes per entry), the output
  embedding's gradient and its accumulation buffer (two ``[V, H]`` bf16), and the trained
  positions' ``[tokens, H]`` hidden states with their gradient.

A micro-batch holds ``micro_batch_size`` rows of up to ``T`` tokens, or fewer under
``max_tokens_per_micro_batch`` (a row longer than the budget runs alone). ``T`` is the recipe's
``max_sequence_tokens``, else an estimate: a 512-token prompt + ``max_response_tokens`` + one
observation of ``max_observation_tokens`` per allowed retrieval. The rollout engines run on GPUs
of their own (``rollout.worker_gpus``): bf16 weights and vLLM's KV cache inside
``gpu_memory_utilization`` of the GPU.

    python -m experiments.recipe.memory_plan            # markdown tables for every GPU recipe
    python -m experiments.recipe.memory_plan --json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

GIB = 1024**3
GPU_BYTES = 80 * GIB  # an 80 GB H100 / A100
CUDA_CONTEXT_BYTES = 1 * GIB  # CUDA context, NCCL communicators and kernels' workspaces
FIT_FRACTION = 0.9  # what the plan may use of a GPU: the caching allocator fragments
PROMPT_TOKENS_ESTIMATE = 512  # system prompt + question, where the recipe caps only the response
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default
REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size default
LOGIT_BYTES_PER_ENTRY = 18  # bf16 logits 2 + float32 scaled 4 + softmax / exp temporaries 8 + gradient 4
VLLM_OVERHEAD_BYTES = 3 * GIB  # vLLM's activation profile run and CUDA graphs, outside the KV cache
RECIPES = ("routerag", "search_r1", "pathrouter", "graphrag_r1", "lws", "r1_router")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (Qwen2 / Llama layout: GQA attention, SwiGLU MLP)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    tied_embeddings: bool
    qkv_bias: bool = True

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def layer_parameters(self) -> int:
        h, kv = self.hidden, self.kv_dim
        attention = h * h * 2 + h * kv * 2 + ((h + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h  # + the two RMSNorm weights

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * self.layer_parameters() + self.hidden

    def lora_parameters(self, r: int, target_modules) -> int:
        h, kv = self.hidden, self.kv_dim
        shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                  "gate_proj": (h, self.intermediate), "up_proj": (h, self.intermediate), "down_proj": (self.intermediate, h)}
        return self.layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in target_modules)

    def activation_bytes_per_token_layer(self) -> int:
        """bf16 tensors autograd keeps for one token through one layer (SDPA attention, no ``T²`` term):
        6 H-wide (norm outputs, attention output, residuals), q/k/v, 5 intermediate-wide (gate, up,
        SiLU, product, down input), and the two RMSNorms' float32 upcasts."""
        return 2 * (6 * self.hidden + self.hidden + 2 * self.kv_dim + 5 * self.intermediate) + 2 * 4 * self.hidden

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_dim * dtype_bytes  # K and V of every layer


QWEN25_3B = ModelShape(vocab=151_936, hidden=2_048, layers=36, intermediate=11_008, heads=16, kv_heads=2, tied_embeddings=True)
QWEN25_7B = ModelShape(vocab=152_064, hidden=3_584, layers=28, intermediate=18_944, heads=28, kv_heads=4, tied_embeddings=False)
MODEL_SHAPES = {
    "Qwen/Qwen2.5-3B-Instruct": QWEN25_3B, "Qwen/Qwen2.5-3B": QWEN25_3B,
    "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B, "Qwen/Qwen2.5-7B": QWEN25_7B,
}


def model_shape(spec: str) -> ModelShape:
    if spec not in MODEL_SHAPES:
        raise ValueError(f"no model shape known for {spec!r}; known: {sorted(MODEL_SHAPES)}")
    return MODEL_SHAPES[spec]


def micro_batch_tokens(micro_batch_size: int, seq_len: int, max_tokens_per_micro_batch: int | None) -> int:
    """Padded tokens of the largest forward pass: ``micro_batch_size`` rows of ``seq_len``, or the
    most whole rows the budget allows (at least one)."""
    rows = int(micro_batch_size)
    if max_tokens_per_micro_batch is not None:
        rows = max(1, min(rows, int(max_tokens_per_micro_batch) // int(seq_len)))
    return rows * int(seq_len)


def learner_gpu_bytes(shape: ModelShape, *, zero_stage: int, num_learners: int, tokens: int, reference: bool,
                      gradient_checkpointing: bool = True, logit_chunk_size: int = 512,
                      lora_parameters: int | None = None) -> dict[str, int]:
    """Bytes per learner GPU by component (module docstring); ``tokens`` = one micro-batch's padded tokens."""
    p, k = shape.parameters(), int(num_learners)
    trained = p if lora_parameters is None else int(lora_parameters)
    zero3 = zero_stage == 3
    weights = 2 * p // k + 2 * min(p, ZERO3_MAX_LIVE_PARAMETERS) if zero3 else 2 * p
    optimizer = 12 * trained // (k if zero_stage >= 1 else 1)
    gradients = 2 * trained // (k if zero_stage >= 2 else 1) + (2 * min(trained, REDUCE_BUCKET_ELEMENTS) if zero_stage >= 2 else 0)
    ref = (2 * p // k if zero3 else 2 * p) if reference else 0
    per_layer = shape.activation_bytes_per_token_layer()
    if gradient_checkpointing:
        activations = shape.layers * tokens * shape.hidden * 2 + 2 * tokens * per_layer  # inputs kept + one layer fwd+bwd
    else:
        activations = shape.layers * tokens * per_layer
    chunk = min(int(logit_chunk_size) or tokens, tokens)
    head_grads = 2 * 2 * shape.vocab * shape.hidden if lora_parameters is None else 0
    logits = chunk * shape.vocab * LOGIT_BYTES_PER_ENTRY + head_grads + 2 * tokens * shape.hidden * 2
    parts = {"weights": weights, "optimizer": optimizer, "gradients": gradients, "reference": ref,
             "activations": activations, "logits": logits, "cuda_context": CUDA_CONTEXT_BYTES}
    parts["total"] = sum(parts.values())
    return parts


def engine_gpu_bytes(shape: ModelShape, *, gpu_memory_utilization: float, seq_len: int, tensor_parallel_size: int = 1,
                     gpu_bytes: int = GPU_BYTES) -> dict[str, int]:
    """A vLLM engine GPU: weights, KV cache (what ``gpu_memory_utilization`` leaves) and its capacity."""
    weights = 2 * shape.parameters() // int(tensor_parallel_size)
    kv = int(gpu_memory_utilization * gpu_bytes) - weights - VLLM_OVERHEAD_BYTES
    per_token = shape.kv_cache_bytes_per_token() // int(tensor_parallel_size)
    return {"weights": weights, "kv_cache": kv, "overhead": VLLM_OVERHEAD_BYTES, "kv_tokens": max(0, kv) // per_token,
            "full_length_sequences": max(0, kv) // per_token // int(seq_len), "total": weights + max(0, kv) + VLLM_OVERHEAD_BYTES}


def sequence_tokens(rollout: Mapping[str, Any], env_kwargs: Mapping[str, Any]) -> int:
    """``T`` of a recipe (module docstring)."""
    if rollout.get("max_sequence_tokens"):
        return int(rollout["max_sequence_tokens"])
    turns = int(env_kwargs.get("retrieval_budget") or env_kwargs.get("max_route_steps") or 1)
    return PROMPT_TOKENS_ESTIMATE + int(rollout.get("max_response_tokens", 0)) + turns * int(rollout.get("max_observation_tokens", 0))


@dataclass
class RecipePlan:
    recipe: str
    model: str
    parameters: int
    zero_stage: int
    num_learners: int
    engines: int
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    seq_len: int
    micro_tokens: int
    logit_chunk_size: int
    learner: dict[str, int]
    engine: dict[str, int]
    gpu_memory_utilization: float

    def fits(self) -> bool:
        return self.learner["total"] <= FIT_FRACTION * GPU_BYTES and self.engine["kv_cache"] > 0 and self.engine["full_length_sequences"] >= 1


def _engine_default_utilization() -> float:
    import inspect

    from actors.engines.vllm_async import AsyncVLLMEngine

    return float(inspect.signature(AsyncVLLMEngine.__init__).parameters["gpu_memory_utilization"].default)


def recipe_plan(recipe: Mapping[str, Any], name: str = "recipe") -> RecipePlan:
    """The plan of one recipe given as its plain YAML mapping."""
    from raggym.algorithms.logprobs import DEFAULT_CHUNK_SIZE

    learner, rollout = dict(recipe.get("learner") or {}), dict(recipe.get("rollout") or {})
    spec = (recipe.get("policy") or {}).get("model") or learner.get("model")
    shape = model_shape(spec)
    loss = learner.get("loss") or {}
    reference = bool(learner.get("reference_model")) if learner.get("reference_model") is not None else (
        float(loss.get("kl_coef", 0.0)) > 0 or bool(loss.get("teacher_kl", False)))
    lora = learner.get("lora")
    lora_params = None
    if lora:
        lora_params = shape.lora_parameters(int(lora.get("r", 16)), lora.get("target_modules", ("q_proj", "k_proj", "v_proj", "o_proj")))
    seq_len = sequence_tokens(rollout, (recipe.get("env") or {}).get("kwargs") or {})
    micro, budget = int(learner.get("micro_batch_size", 2)), learner.get("max_tokens_per_micro_batch")
    chunk = int(learner.get("logit_chunk_size", DEFAULT_CHUNK_SIZE))
    tokens = micro_batch_tokens(micro, seq_len, budget)
    engine_kwargs = rollout.get("engine_kwargs") or {}
    utilization = float(engine_kwargs.get("gpu_memory_utilization", _engine_default_utilization()))
    return RecipePlan(
        recipe=name, model=spec, parameters=shape.parameters(), zero_stage=int(learner.get("zero_stage", 2)),
        num_learners=int(recipe.get("num_learners", 1)), engines=int(rollout.get("workers", 1)), micro_batch_size=micro,
        max_tokens_per_micro_batch=budget, seq_len=seq_len, micro_tokens=tokens, logit_chunk_size=chunk,
        learner=learner_gpu_bytes(shape, zero_stage=int(learner.get("zero_stage", 2)), num_learners=int(recipe.get("num_learners", 1)),
                                  tokens=tokens, reference=reference, gradient_checkpointing=bool(learner.get("gradient_checkpointing", False)),
                                  logit_chunk_size=chunk, lora_parameters=lora_params),
        engine=engine_gpu_bytes(shape, gpu_memory_utilization=utilization, seq_len=seq_len,
                                tensor_parallel_size=int(engine_kwargs.get("tensor_parallel_size", 1))),
        gpu_memory_utilization=utilization,
    )


def load_recipe(name: str) -> dict:
    import yaml

    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    with open(path) as f:
        return yaml.safe_load(f)


def _gb(n: int) -> str:
    return f"{n / GIB:.1f}"


def markdown(plans: list[RecipePlan]) -> str:
    rows = ["| recipe | model | ZeRO | learners + engines (GPUs) | micro-batch | T | tokens / pass | weights | optimizer | gradients | reference | activations (ckpt) | logits (chunk) | CUDA ctx | **learner total** | engine: weights + KV cache | KV tokens (full-length seqs) | fits 80 GB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        lr = p.learner
        micro = f"{p.micro_batch_size}" + (f", ≤ {p.max_tokens_per_micro_batch:,} tok" if p.max_tokens_per_micro_batch else "")
        rows.append(
            f"| {p.recipe} | {p.model.split('/')[-1]} ({p.parameters / 1e9:.2f} B) | {p.zero_stage} | {p.num_learners} + {p.engines} | {micro} | "
            f"{p.seq_len:,} | {p.micro_tokens:,} | {_gb(lr['weights'])} | {_gb(lr['optimizer'])} | {_gb(lr['gradients'])} | "
            f"{_gb(lr['reference'])} | {_gb(lr['activations'])} | {_gb(lr['logits'])} ({p.logit_chunk_size}) | {_gb(lr['cuda_context'])} | "
            f"**{_gb(lr['total'])}** | {_gb(p.engine['weights'])} + {_gb(p.engine['kv_cache'])} (util {p.gpu_memory_utilization}) | "
            f"{p.engine['kv_tokens']:,} ({p.engine['full_length_sequences']}) | {'yes' if p.fits() else '**no**'} |")
    return "\n".join(rows)


def main(argv=None) -> list[RecipePlan]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    plans = [recipe_plan(load_recipe(name), name) for name in args.recipes]
    if args.json:
        print(json.dumps([{**asdict(p), "fits": p.fits()} for p in plans]))
    else:
        print(markdown(plans))
    return plans


if __name__ == "__main__":
    main()
