"""Learner and weight-sync benchmark: DeepSpeed ``Learner`` vs a plain torch loop, and sync seconds.

Both sides train the same policy on the same micro-batches with the same loss
(``raggym.algorithms.losses.clipped_policy_loss`` against fixed old logprobs), the same AdamW
settings, gradient accumulation over ``--micro-batches`` micro-batches and gradient clipping; the
first step of each is a warm-up and is not timed. Throughput counts every (non-padding) token that
went through a training forward+backward.

Weight sync (``--sync``) starts Ray, one HF ``RolloutWorker`` and times: packing the learner's
weights into ``FlatWeights``; ``ray.put`` + the worker fetching and loading them (object store);
and a gloo ``WeightSyncGroup`` broadcast into the same worker (collective path).

    python -m experiments.bench.learner --json
    python -m experiments.bench.learner --seq-len 128 --micro-batch 2 --micro-batches 2 --steps 2 --sync --json

GRPO step (``--grpo-step``): the demo's RL step shape (``experiments/configs/demo_grpo.yaml``:
4 prompts × G = 4 samples, a 290-token prompt shared within each group, continuations of
40–100 tokens, about 360 tokens a sequence, micro-batch 4, one optimizer step, β = 0.001 so the
reference pass runs). One step is timed three ways on the same batch, each after one warm-up
micro-batch: a plain torch loop doing GRPO's three passes (old log-probs, reference, forward +
backward) and AdamW; the ``Learner`` doing the same passes (``old_logprobs="recompute"``,
``share_prompts=False``); and the ``Learner`` with its defaults (old log-probs from the update
forward, shared prompts). ``learner_over_plain`` = plain seconds ÷ same-pass learner seconds and
``shared_prompt_speedup`` = learner seconds without ÷ with prompt sharing (higher is better)::

    python -m experiments.bench.learner --grpo-step --json

Logits memory (``--memory``): peak host memory of one forward + backward of a policy-gradient
loss with Qwen2.5-3B's vocabulary (151,936) and width (2,048) on a randomly initialised Qwen2
(``--layers`` decoder layers, Qwen2.5-3B's other sizes, gradient checkpointing as in the GPU
recipes, no download) over one ``--seq-len``-token sequence whose every position is trained. The
tied embedding is frozen unless ``--train-embeddings``: its ``[V, H]`` gradients are the same in
both variants. ``naive`` is the learner's former path (the model's
``[T, V]`` logits, a float32 copy divided by the temperature, ``log_softmax`` at the targets and
the entropy over all of them); ``chunked`` is the learner's path now (final hidden states, then
``raggym.algorithms.logprobs.head_token_stats`` with ``--chunk`` positions at a time). Each
variant runs in a fresh subprocess; its peak is the kernel's resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before the pass) minus the resident set
right before it, so it counts every allocation torch makes (activations, logits, gradients,
parameter gradients), and nothing from building the model::

    python -m experiments.bench.learner --memory --json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace

import ray
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from actors.cluster import init_ray
from actors.engines import RolloutWorker
from actors.learner import Learner, LearnerConfig, make_train_batch, token_logprobs
from actors.weight_sync import pick_free_port
from raggym.algorithms.logprobs import DEFAULT_CHUNK_SIZE, final_hidden_states, head_token_stats, output_head
from raggym.algorithms.losses import clipped_policy_loss, entropy_from_logits, kl_loss
from raggym.algorithms.shared_prompt import entry_logprobs
from raggym.models import load_policy


def synthetic_batch(n: int, seq_len: int, prompt_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(100, 20000, (seq_len,), generator=g).tolist() for _ in range(n)]
    masks = [[0] * prompt_len + [1] * (seq_len - prompt_len) for _ in range(n)]
    advantages = (torch.randn(n, generator=g)).tolist()
    return make_train_batch(ids, masks, advantages)


def bench_deepspeed(args, batch) -> dict:
    cfg = LearnerConfig.from_dict({
        "model": args.model,
        "zero_stage": args.zero_stage,
        "micro_batch_size": args.micro_batch,
        "mini_batch_size": args.micro_batch * args.micro_batches,
        "gradient_checkpointing": args.gradient_checkpointing,
        "optimizer": {"lr": 1e-6},
        "shuffle": False,
    })
    t0 = time.perf_counter()
    learner = Learner(cfg)
    setup = time.perf_counter() - t0
    batch = replace(batch)
    batch.old_logprobs = learner.compute_logprobs(batch.token_ids, batch.attention_mask)
    learner.update(batch)  # warm-up
    times, tokens = [], 0
    for _ in range(args.steps):
        t = time.perf_counter()
        m = learner.update(batch)
        times.append(time.perf_counter() - t)
        tokens += int(m["tokens"])
    out = {
        "setup_seconds": setup,
        "seconds_per_step": sum(times) / len(times),
        "tokens_per_s": tokens / sum(times),
        "zero_stage": args.zero_stage,
    }
    return out, learner, batch


def bench_plain_torch(args, batch) -> dict:
    model, _ = load_policy(args.model, dtype=torch.float32)
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    micro = args.micro_batch
    n = batch.token_ids.shape[0]

    def step() -> int:
        tokens = 0
        mask_all = batch.loss_mask.clone()
        mask_all[:, 0] = 0
        total = float(mask_all.sum())
        for s in range(0, n, micro):
            ids = batch.token_ids[s : s + micro]
            attn = batch.attention_mask[s : s + micro]
            mask = mask_all[s : s + micro]
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            lp = token_logprobs(logits.float(), ids)
            loss, _ = clipped_policy_loss(lp, batch.old_logprobs[s : s + micro], batch.advantages[s : s + micro], mask)
            (loss * float(mask.sum()) / total).backward()  # the same global token mean
            tokens += int(attn.sum())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return tokens

    step()  # warm-up
    times, tokens = [], 0
    for _ in range(args.steps):
        t = time.perf_counter()
        tokens += step()
        times.append(time.perf_counter() - t)
    return {"seconds_per_step": sum(times) / len(times), "tokens_per_s": tokens / sum(times)}


def bench_sync(args, learner) -> dict:
    t = time.perf_counter()
    flat = learner.get_weights()
    pack = time.perf_counter() - t
    init_ray("local", num_cpus=2)  # a private instance: the broadcast below goes over 127.0.0.1
    try:
        worker = RolloutWorker.as_remote(num_cpus=1).remote(engine="hf", model=args.model)
        ray.get(worker.ping.remote())
        object_store = []
        for version in range(1, args.sync_repeats + 1):
            flat.version = version
            t = time.perf_counter()
            ref = ray.put(flat)
            ray.get(worker.update_weights_async.remote(ref))
            object_store.append(time.perf_counter() - t)
            del ref
        port = pick_free_port("127.0.0.1")
        join = worker.init_weight_sync_async.remote("127.0.0.1", port, 1, 2, "gloo")
        learner.init_weight_sync("127.0.0.1", port, 2, "gloo")
        ray.get(join)
        collective = []
        for _ in range(args.sync_repeats):
            t = time.perf_counter()
            received = worker.receive_weights_async.remote()
            learner.broadcast_weights()
            ray.get(received)
            collective.append(time.perf_counter() - t)
    finally:
        ray.shutdown()
    return {
        "bytes": flat.nbytes,
        "pack_seconds": pack,
        "object_store_seconds": min(object_store),
        "gloo_broadcast_seconds": min(collective),
        "repeats": args.sync_repeats,
    }


# ----------------------------------------------------------------------------- GRPO step


def grpo_step_batch(groups: int, group_size: int, prompt_len: int, min_tail: int, max_tail: int, seed: int):
    """Demo-shaped batch: ``groups`` random prompts, each followed by ``group_size`` continuations."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(groups):
        prompt = torch.randint(100, 20000, (prompt_len,), generator=g).tolist()
        for _ in range(group_size):
            tail = int(torch.randint(min_tail, max_tail + 1, (1,), generator=g))
            ids.append(prompt + torch.randint(100, 20000, (tail,), generator=g).tolist())
            masks.append([0] * prompt_len + [1] * tail)
    advantages = torch.randn(len(ids), generator=g).tolist()
    return make_train_batch(ids, masks, advantages)


def _grpo_learner_config(args, **overrides) -> dict:
    n = args.groups * args.group_size
    return {"model": args.model, "zero_stage": args.zero_stage, "micro_batch_size": args.micro_batch,
            "mini_batch_size": n, "optimizer": {"lr": 1e-6}, "shuffle": False,
            "loss": {"clip_low": 0.2, "kl_coef": args.kl_coef, "kl_kind": "low_var_kl"}, **overrides}


def bench_grpo_learner(learner, batch, **settings) -> dict:
    """Seconds of one ``Learner.update`` on ``batch`` with the given speed settings."""
    for key, value in settings.items():
        setattr(learner.config, key, value)  # read at update time; the engine stays the same
    ids, attn = batch.token_ids[:1], batch.attention_mask[:1]
    learner.compute_logprobs(ids, attn)  # warm-up: one forward with these settings
    t, cpu = time.perf_counter(), time.process_time()
    metrics = learner.update(replace(batch))
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    keys = ("tokens", "tokens_computed", "padding_share", "prompt_share_saved", "old_logprobs_recomputed")
    return {"seconds": seconds, "cpu_seconds": cpu, **{k: metrics[k] for k in keys},
            **{k: v for k, v in metrics.items() if k.startswith("seconds_")}}


def bench_grpo_plain(args, batch, model, reference) -> dict:
    """The same step as a plain torch loop: old-logprob pass, reference pass, forward + backward, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    micro, n = args.micro_batch, batch.token_ids.shape[0]
    mask_all = batch.loss_mask.clone()
    mask_all[:, 0] = 0
    total = float(mask_all.sum())

    @torch.no_grad()
    def logprobs_of(net, rows) -> torch.Tensor:
        net.eval()
        ids, attn = batch.token_ids[rows], batch.attention_mask[rows]
        return token_logprobs(net(input_ids=ids, attention_mask=attn, use_cache=False).logits.float(), ids)

    logprobs_of(model, slice(0, 1))  # warm-up: one forward
    out = {}
    t_start = t = time.perf_counter()
    cpu_start = time.process_time()
    old = {s: logprobs_of(model, slice(s, s + micro)) for s in range(0, n, micro)}
    out["seconds_old_logprobs"] = time.perf_counter() - t
    t = time.perf_counter()
    ref = {s: logprobs_of(reference, slice(s, s + micro)) for s in range(0, n, micro)} if reference is not None else {}
    out["seconds_reference"] = time.perf_counter() - t
    t = time.perf_counter()
    model.train()
    for s in range(0, n, micro):
        ids, attn = batch.token_ids[s : s + micro], batch.attention_mask[s : s + micro]
        mask = mask_all[s : s + micro]
        lp = token_logprobs(model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float(), ids)
        loss, _ = clipped_policy_loss(lp, old[s], batch.advantages[s : s + micro], mask)
        if reference is not None:
            loss = loss + args.kl_coef * kl_loss(lp, ref[s], mask)
        (loss * float(mask.sum()) / total).backward()  # the same global token mean
    out["seconds_forward_backward"] = time.perf_counter() - t
    t = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["seconds_optimizer"] = time.perf_counter() - t
    return {"seconds": time.perf_counter() - t_start, "cpu_seconds": time.process_time() - cpu_start, **out}


def run_grpo_step(args) -> dict:
    batch = grpo_step_batch(args.groups, args.group_size, args.prompt_len, args.min_tail, args.max_tail, seed=0)
    learner = Learner(LearnerConfig.from_dict(_grpo_learner_config(args)))
    # The plain loop trains a copy of the same weights next to the learner's frozen reference.
    plain = bench_grpo_plain(args, batch, copy.deepcopy(learner.module), learner.reference)
    same_passes = bench_grpo_learner(learner, batch, old_logprobs="recompute", share_prompts=False)
    unshared = bench_grpo_learner(learner, batch, old_logprobs="rollout", share_prompts=False)
    default = bench_grpo_learner(learner, batch, old_logprobs="rollout", share_prompts=True)
    return {
        "bench": "learner-grpo-step",
        "model": args.model,
        "shape": {"sequences": int(batch.token_ids.shape[0]), "groups": args.groups, "group_size": args.group_size,
                  "prompt_tokens": args.prompt_len, "tokens": int(batch.attention_mask.sum()),
                  "trained_tokens": int(batch.loss_mask.sum()), "micro_batch": args.micro_batch,
                  "kl_coef": args.kl_coef, "zero_stage": args.zero_stage},
        "threads": torch.get_num_threads(),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
                 "cuda": torch.cuda.is_available(), "load_average": os.getloadavg()},
        "plain_torch": plain,
        "learner_same_passes": same_passes,
        "learner_unshared": unshared,
        "learner_default": default,
        "learner_over_plain": plain["seconds"] / same_passes["seconds"],
        "shared_prompt_speedup": unshared["seconds"] / default["seconds"],
        "default_over_plain": plain["seconds"] / default["seconds"],
        # the same ratios in process CPU seconds: steadier than wall time on a shared machine
        "cpu_learner_over_plain": plain["cpu_seconds"] / same_passes["cpu_seconds"],
        "cpu_shared_prompt_speedup": unshared["cpu_seconds"] / default["cpu_seconds"],
    }


# ----------------------------------------------------------------------------- logits memory

QWEN25_3B_SHAPE = {"vocab_size": 151_936, "hidden_size": 2_048, "intermediate_size": 11_008,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": True}


def _proc_bytes(field: str, path: str = "/proc/self/status") -> int:
    """A ``kB`` line of ``/proc/self/status`` (VmRSS, VmHWM) or ``/proc/meminfo`` in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no {field}")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one (Linux ≥ 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def memory_variant(variant: str, seq_len: int, layers: int, chunk: int, temperature: float, freeze_embeddings: bool = False,
                   seed: int = 0) -> dict:
    """One forward + backward of ``variant`` ("naive" | "chunked") in this process; peak bytes and results."""
    torch.manual_seed(seed)
    config = Qwen2Config(**QWEN25_3B_SHAPE, num_hidden_layers=layers, max_position_embeddings=max(32_768, seq_len))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    # as every GPU recipe trains: the layers' activations are recomputed in the backward
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if freeze_embeddings:  # the tied [V, H] embedding: its gradients are a fixed cost both variants pay alike
        model.get_output_embeddings().weight.requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=g)
    attn = torch.ones_like(ids)
    positions = torch.arange(seq_len)[None]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[:, -1] = False  # the last position predicts nothing
    targets = ids[0, 1:]
    advantage = 1.0
    gc.collect()
    baseline = _proc_bytes("VmRSS")
    _reset_peak_rss()
    t0 = time.perf_counter()
    if variant == "naive":
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=keep[0], use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1])
        scaled = logits.float() / temperature
        logprobs = entry_logprobs(scaled, targets)
        with torch.no_grad():
            entropy = entropy_from_logits(scaled)
    elif variant == "chunked":
        hidden = final_hidden_states(model, ids, attn, positions)[keep]
        stats = head_token_stats(hidden, output_head(model), targets, temperature, chunk, entropy=True)
        logprobs, entropy = stats.logprobs, stats.entropy
    else:
        raise ValueError(f"unknown variant {variant!r}")
    loss = -(logprobs * advantage).mean()  # the on-policy policy-gradient loss of one sequence
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = _proc_bytes("VmHWM") - baseline
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {"variant": variant, "peak_bytes": peak, "baseline_rss_bytes": baseline, "param_grad_bytes": grads,
            "seconds": seconds, "logprobs": logprobs.detach().tolist(), "entropy_mean": float(entropy.mean()),
            "norm_grad": model.model.norm.weight.grad.tolist()}


def run_memory(args) -> dict:
    """Both variants, each in a fresh subprocess (see the module docstring), and their comparison."""
    logits_fp32 = (args.seq_len - 1) * QWEN25_3B_SHAPE["vocab_size"] * 4
    available = _proc_bytes("MemAvailable", "/proc/meminfo")
    # the naive pass holds about six float32 copies of the logits at its peak, plus [V, H] gradients
    needed = 6 * logits_fp32 + (0 if not args.train_embeddings else 3 * QWEN25_3B_SHAPE["vocab_size"] * QWEN25_3B_SHAPE["hidden_size"] * 4)
    if available < needed and not args.force:
        raise SystemExit(f"the naive variant needs about {needed / 2**30:.1f} GiB and {available / 2**30:.1f} GiB "
                         f"are available: lower --seq-len, free memory, or pass --force")
    results = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, "-m", "experiments.bench.learner", "--memory-variant", variant, "--seq-len", str(args.seq_len),
               "--layers", str(args.layers), "--chunk", str(args.chunk), "--temperature", str(args.temperature)]
        if args.train_embeddings:
            cmd.append("--train-embeddings")
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the {variant} variant failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    naive, chunked = results["naive"], results["chunked"]
    diff = max(abs(a - b) for a, b in zip(naive["logprobs"], chunked["logprobs"]))
    grad_diff = max(abs(a - b) for a, b in zip(naive["norm_grad"], chunked["norm_grad"]))
    return {
        "bench": "learner-logits-memory",
        "shape": {**QWEN25_3B_SHAPE, "num_hidden_layers": args.layers, "batch": 1, "seq_len": args.seq_len,
                  "trained_positions": args.seq_len - 1, "dtype": "float32", "temperature": args.temperature,
                  "trainable_embeddings": args.train_embeddings, "gradient_checkpointing": True},
        "chunk": args.chunk,
        "naive_peak_bytes": naive["peak_bytes"],
        "chunked_peak_bytes": chunked["peak_bytes"],
        "chunked_over_naive": chunked["peak_bytes"] / naive["peak_bytes"],
        "max_abs_logprob_diff": diff,
        "max_abs_norm_weight_grad_diff": grad_diff,
        "entropy_mean": {"naive": naive["entropy_mean"], "chunked": chunked["entropy_mean"]},
        "param_grad_bytes": naive["param_grad_bytes"],
        "one_fp32_logits_copy_bytes": logits_fp32,
        "seconds": {"naive": naive["seconds"], "chunked": chunked["seconds"]},
        "method": ("each variant in a fresh subprocess: peak = VmHWM after one forward+backward (reset via "
                   "/proc/self/clear_refs right before it) minus VmRSS right before it; counts every torch CPU "
                   "allocation of the pass, parameter gradients included, not the model's weights"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "mem_total_bytes": _proc_bytes("MemTotal", "/proc/meminfo"),
                 "mem_available_bytes_at_start": available, "torch": torch.__version__, "threads": args.threads or torch.get_num_threads()},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=None, help="default 32 (290 with --grpo-step)")
    p.add_argument("--micro-batch", type=int, default=None, help="default 2 (4 with --grpo-step)")
    p.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation steps per optimizer step")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one warm-up)")
    p.add_argument("--zero-stage", type=int, default=None, help="default 2 (0 with --grpo-step)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--sync", action="store_true", help="also time weight sync (starts Ray)")
    p.add_argument("--sync-repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--grpo-step", action="store_true", help="time one demo-shaped GRPO learner step (see above)")
    p.add_argument("--groups", type=int, default=4, help="--grpo-step: prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="--grpo-step: samples per prompt (G)")
    p.add_argument("--min-tail", type=int, default=40, help="--grpo-step: shortest continuation")
    p.add_argument("--max-tail", type=int, default=100, help="--grpo-step: longest continuation")
    p.add_argument("--kl-coef", type=float, default=0.001, help="--grpo-step: β (0 skips the reference pass)")
    p.add_argument("--memory", action="store_true", help="peak memory of full vs chunked logits (see above)")
    p.add_argument("--memory-variant", choices=("naive", "chunked"), help=argparse.SUPPRESS)  # one --memory subprocess
    p.add_argument("--layers", type=int, default=1, help="--memory: decoder layers of the random Qwen2")
    p.add_argument("--chunk", type=int, default=None, help="--memory: positions per chunk (default: the learner's)")
    p.add_argument("--temperature", type=float, default=1.0, help="--memory: the rollout temperature")
    p.add_argument("--force", action="store_true", help="--memory: run even if memory looks short")
    p.add_argument("--train-embeddings", action="store_true",
                   help="--memory: train the tied embedding / output head too (its [V, H] gradients, about 3.7 GB, "
                        "are the same in both variants; off by default so that the logits are what is compared)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory or args.memory_variant:
        args.chunk = args.chunk or DEFAULT_CHUNK_SIZE
        if args.seq_len == p.get_default("seq_len"):
            args.seq_len = 4096
        if args.memory_variant:
            result = memory_variant(args.memory_variant, args.seq_len, args.layers, args.chunk, args.temperature,
                                    freeze_embeddings=not args.train_embeddings)
            print(json.dumps(result))
            return result
        result = run_memory(args)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return result
    if not args.grpo_step:
        for name, default in (("prompt_len", 32), ("micro_batch", 2), ("zero_stage", 2)):
            if getattr(args, name) is None:
                setattr(args, name, default)
    if args.grpo_step:
        # the demo's shape unless given: a 290-token prompt, micro-batch 4, ZeRO 0
        for name, demo in (("prompt_len", 290), ("micro_batch", 4), ("zero_stage", 0)):
            if getattr(args, name) is None:
                setattr(args, name, demo)
        result = run_grpo_step(args)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return result

    batch = synthetic_batch(args.micro_batch * args.micro_batches, args.seq_len, args.prompt_len, seed=0)
    ds, learner, batch = bench_deepspeed(args, batch)
    plain = bench_plain_torch(args, batch)
    result = {
        "bench": "learner",
        "model": args.model,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "micro_batches": args.micro_batches,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "cuda": torch.cuda.is_available()},
        "deepspeed": ds,
        "plain_torch": plain,
        "deepspeed_over_torch": ds["tokens_per_s"] / plain["tokens_per_s"],
    }
    if args.sync:
        result["sync"] = bench_sync(args, learner)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
