#!/usr/bin/env bash
# GPU smoke test of the runtime: vLLM engine generation, bf16 ZeRO-3 DeepSpeed learner, and weight
# sync from the learner into the vLLM engine (NCCL broadcast when there are two GPUs, the Ray
# object store otherwise), then the on-policy check: vLLM logprobs ≈ learner logprobs.
#
#   bash experiments/bench/gpu_smoke.sh            # needs a CUDA GPU and `pip install -e '.[gpu]'`
#
# Exits 0 and says "skipped" without a GPU, so it is safe to call from any CI. Writes a JSON report
# to ${GPU_SMOKE_OUT:-gpu_smoke.json}. Not run in this repository's CPU-only development so far.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM=false

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_smoke: skipped (no NVIDIA GPU visible)"
  exit 0
fi
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "gpu_smoke: vllm is not installed; install the GPU extra first: pip install -e '.[gpu]'" >&2
  exit 1
fi
nvidia-smi -L

echo "== GPU-marked tests"
"$PY" -m pytest -q -m gpu tests/test_engines.py

echo "== vLLM generate + bf16 ZeRO-3 learner + weight sync"
GPU_SMOKE_OUT="${GPU_SMOKE_OUT:-gpu_smoke.json}" "$PY" - <<'EOF'
import json, os, time

import ray
import torch

from actors.engines import RolloutWorker, SamplingParams
from actors.learner import LearnerGroup
from experiments.bench.smoke import max_logprob_gap, smoke_batch

gpus = torch.cuda.device_count()
report = {"gpus": gpus, "device": torch.cuda.get_device_name(0)}
ray.init(num_gpus=gpus, include_dashboard=False)
# Two GPUs: learner and vLLM on separate devices, NCCL between them. One GPU: both share it
# (NCCL refuses two ranks on one device), and the weights go through the object store.
share = gpus < 2
Worker = RolloutWorker.as_remote(num_gpus=0.4 if share else 1)
worker = Worker.remote(engine="vllm", model="smollm2-135m", gpu_memory_utilization=0.3, dtype="bfloat16")
group = LearnerGroup(
    {"zero_stage": 3, "dtype": "bfloat16", "device": "cuda", "micro_batch_size": 2, "mini_batch_size": 4,
     "gradient_checkpointing": True, "optimizer": {"lr": 1e-5}},
    num_learners=1, resources={"num_gpus": 0.5 if share else 1},
)
report["learner"] = group.infos[0]

from transformers import AutoTokenizer
from raggym.models import converted_checkpoint, resolve_model_spec
tok = AutoTokenizer.from_pretrained(str(converted_checkpoint(resolve_model_spec("smollm2-135m"))))
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
           for q in ("What is the capital of France?", "Name three colours.")] * 2

def rollout(seed):
    t = time.perf_counter()
    res = ray.get(worker.generate.remote(prompts, SamplingParams(temperature=1.0, seed=seed), ["</answer>"], 32))
    return res, smoke_batch(prompts, res, tok.pad_token_id), time.perf_counter() - t

def gap(batch):
    return max_logprob_gap(group.compute_logprobs(batch.token_ids, batch.attention_mask), batch)

res, batch, secs = rollout(0)
report["generate"] = {"seconds": secs, "tokens": sum(len(r.token_ids) for r in res), "versions": sorted({r.weight_version for r in res})}
report["gap_before_update"] = gap(batch)  # bf16 learner vs bf16 vLLM: small, not zero
report["update"] = group.update(batch)
if share:
    report["sync"] = group.sync_weights([worker], dtype="bfloat16")
else:
    group.init_weight_sync([worker], backend="pynccl")
    report["sync"] = group.broadcast_weights([worker], dtype="bfloat16")
res, batch, _ = rollout(1)
report["versions_after_sync"] = sorted({r.weight_version for r in res})
report["gap_after_sync"] = gap(batch)
print(json.dumps(report, indent=2, default=str))
with open(os.environ["GPU_SMOKE_OUT"], "w") as f:
    json.dump(report, f, default=str)
assert report["versions_after_sync"] == [1], report["versions_after_sync"]
assert report["gap_after_sync"] < 0.5, "vLLM and learner logprobs disagree after sync (bf16 tolerance 0.5 nats max)"
group.shutdown()
ray.shutdown()
print("gpu_smoke: ok")
EOF
