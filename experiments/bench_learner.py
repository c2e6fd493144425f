"""Learner and weight-sync benchmark: DeepSpeed ``Learner`` vs a plain torch loop, and sync seconds.

Both sides train the same policy on the same micro-batches with the same loss
(``raggym.algorithms.losses.clipped_policy_loss`` against fixed old logprobs), the same AdamW
settings, gradient accumulation over ``--micro-batches`` micro-batches and gradient clipping; the
first step of each is a warm-up and is not timed. Throughput counts every (non-padding) token that
went through a training forward+backward.

Weight sync (``--sync``) starts Ray, one HF ``RolloutWorker`` and times: packing the learner's
weights into ``FlatWeights``; ``ray.put`` + the worker fetching and loading them (object store);
and a gloo ``WeightSyncGroup`` broadcast into the same worker (collective path).

    python -m experiments.bench_learner --json
    python -m experiments.bench_learner --seq-len 128 --micro-batch 2 --micro-batches 2 --steps 2 --sync --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def synthetic_batch(n: int, seq_len: int, prompt_len: int, seed: int):
    from actors.learner import make_train_batch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(100, 20000, (seq_len,), generator=g).tolist() for _ in range(n)]
    masks = [[0] * prompt_len + [1] * (seq_len - prompt_len) for _ in range(n)]
    advantages = (torch.randn(n, generator=g)).tolist()
    return make_train_batch(ids, masks, advantages)


def bench_deepspeed(args, batch) -> dict:
    from actors.learner import Learner, LearnerConfig

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
    batch = dict(batch)
    batch["old_logprobs"] = learner.compute_logprobs(batch["token_ids"], batch["attention_mask"])
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
    from raggym.algorithms.losses import clipped_policy_loss
    from raggym.models import load_policy
    from actors.learner import token_logprobs

    model, _ = load_policy(args.model, dtype=torch.float32)
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    micro = args.micro_batch
    n = batch["token_ids"].shape[0]

    def step() -> int:
        tokens = 0
        mask_all = batch["loss_mask"].clone()
        mask_all[:, 0] = 0
        total = float(mask_all.sum())
        for s in range(0, n, micro):
            ids = batch["token_ids"][s : s + micro]
            attn = batch["attention_mask"][s : s + micro]
            mask = mask_all[s : s + micro]
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            lp = token_logprobs(logits.float(), ids)
            loss, _ = clipped_policy_loss(lp, batch["old_logprobs"][s : s + micro], batch["advantages"][s : s + micro], mask)
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
    import ray

    from actors.cluster import init_ray
    from actors.engines import RolloutWorker
    from actors.weight_sync import pick_free_port

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
            ray.get(worker.update_weights.remote(ref))
            object_store.append(time.perf_counter() - t)
            del ref
        port = pick_free_port("127.0.0.1")
        join = worker.init_weight_sync.remote("127.0.0.1", port, 1, 2, "gloo")
        learner.init_weight_sync("127.0.0.1", port, 2, "gloo")
        ray.get(join)
        collective = []
        for _ in range(args.sync_repeats):
            t = time.perf_counter()
            received = worker.receive_weights.remote()
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation steps per optimizer step")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one warm-up)")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--sync", action="store_true", help="also time weight sync (starts Ray)")
    p.add_argument("--sync-repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

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
