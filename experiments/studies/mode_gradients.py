"""Why the routing policy does not split its mode choice by question type: the mode slot's gradients.

The learning proof (``experiments.studies.routing``) needs one policy to prefer ``[graph]`` on
``graph_only`` questions and ``[passage]`` on ``direct`` ones. Every RL update moves the mode
logit z = log p(graph) − log p(passage) of both types at once. This tool measures how much, from
the gradients of z at the held-out probes' mode slots (``experiments.recipe.routing.mode_logit``):

* ``g_rewarded``: the mean gradient of z over the ``graph_only`` probes (the type whose reward
  points at the graph), ``g_other``: over the ``direct`` probes;
* ``cosine``: cos(g_rewarded, g_other). Near 1, the two types share one mode slot;
* ``sign_step_ratio``: how far a step that raises z on ``graph_only`` by 1 raises it on ``direct``,
  for AdamW's early, sign-like step u = sign(g_rewarded):  ⟨g_other, u⟩ / ⟨g_rewarded, u⟩;
* ``sgd_step_ratio``: the same for a plain gradient step u = g_rewarded:  ⟨g_other, g_rewarded⟩ / |g_rewarded|²;
* ``differential_share``: |g_rewarded − g_other| / |(g_rewarded + g_other) / 2|, the size of the
  part of the gradient that tells the types apart, against the part they share; the two sizes
  themselves are ``differential_norm`` |d| and ``shared_norm`` |m| (d and m below), in logit per
  unit of L2 parameter step, which is what sizes a plain gradient step's learning rate;
* ``differential_sign_shared_per_gap``: for a step along the part that tells the types apart,
  d = g_rewarded − g_other (what a credit centred per route gives the slot, e.g.
  ``learner.loss.mode_pg_centring: route``), how far the level both types share,
  z̄ = (z_rewarded + z_other) / 2, moves per unit of gap z_rewarded − z_other it opens, for AdamW's
  sign-like step u = sign(d):  ⟨m, u⟩ / ⟨d, u⟩ with m = (g_rewarded + g_other) / 2;
* ``differential_sgd_shared_per_gap``: the same for a plain gradient step u = d:  ⟨m, d⟩ / |d|².
  Both are None when d = 0 (no step opens a gap). Far from 0, a credit that is right for each
  type still moves the shared level more than the gap.
* ``spread_over_gap``: per type, how far one probe's gradient lies from its type's mean (root
  mean square), in units of |d|; ``gap_error_over_gap``: the standard error of d estimated from
  ``--batch-per-type`` examples of each type, in units of |d|. Above 1, a training batch of that
  size mostly sees its examples' own variation, not the type difference.
* ``spread_along_shared_over_gap`` (``--along-shared``): per type, the part of that spread that
  lies along m, in units of |d|. A credit centred per route cancels the batch's mean gradient,
  not this part, so where it is large, a few credited episodes a type can move the shared level.

A ratio near 1 means the types cannot be moved apart by the updates RL makes on either alone:
the reward must push the two types in opposite directions with nearly equal weight in the same
batch before the differential part acts.

``--batch STEP.jsonl`` (a trajectories file of a routing-study run, e.g. ``grpo/trajectories/
step-000006.jsonl``, read with the policy that drew it) predicts what one plain gradient step on
that batch's mode-choice term does to the probes (``batch_step_moves``): the step's direction is
u = (1/N)·Σ_i c_i·w_i·∇z_i over the episodes' first searches, c_i the advantage centred per route
(``route_centred_mode_advantages``), w_i = d log π(route_i) / dz_i in the two-mode approximation
(1 − p_i for graph, −p_i for passage); the step is ``--batch-lr`` times u, clipped to L2 norm
``--grad-clip`` as the learner clips it. It reports the step's moves of the probes' shared level
and gap, ⟨m, step⟩ and ⟨d, step⟩, and the same with the batch's own shared direction
m_b = mean_i ∇z_i projected out of u first. Temperatures and the rollout's importance weights are
left out, so a learner's actual step is read against it, not from it.

``--split-steps N`` then measures how learnable the split is at all (``supervised_split``): from
each policy, N AdamW steps on the cleanest signal RL could give the mode slot, every step a
type-balanced batch of training-question prefixes whose target is the right mode for their type
(graph for ``graph_only``, passage for ``direct``): loss = mean of −log σ(y·z), y = ±1. After each
step, the held-out probes' mean p(graph) per type and the routing accuracy (the share of held-out
probes whose more likely mode is their type's right one: what greedy decoding would route). RL
sees this signal only through sampled, noisy advantages, so the steps this needs are a lower bound
on the RL steps that could split the route at that learning rate.

    python -m experiments.studies.mode_gradients --task /tmp/routing --heldout 48 POLICY [POLICY ...]

``--task`` is an ``experiments.studies.routing --out`` folder (its world and index are reused, with the
same ``--world-seed``, ``--entities``, ``--questions`` and ``--heldout`` or ``--heldout-per-type``;
``--kind-cues``, the study's ``--sft-kind-cues``, opens each probe's thought with its type's cue,
as the study's own probes do); a POLICY is a model spec,
an HF folder, a checkpoint or a run folder (its last checkpoint). One JSON line per policy.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.eval.harness import resolve_policy
from experiments.recipe.routing import (EVAL_KWARGS, build_task, first_route, graph_preference, mode_logit, mode_logits,
                                        mode_probes, mode_slot_tokens, routing_accuracy)
from raggym.algorithms.batch import route_centred_mode_advantages
from raggym.models import load_policy, load_policy_tokenizer
from raggym.retrieval import Retriever

REWARDED, OTHER = "graph_only", "direct"


def gradient_alignment(g_rewarded, g_other) -> dict:
    """The alignment figures of the module docstring for two flat gradient tensors."""
    if g_rewarded.shape != g_other.shape:
        raise ValueError(f"gradients differ in shape: {tuple(g_rewarded.shape)} vs {tuple(g_other.shape)}")
    g_r, g_o = g_rewarded.double(), g_other.double()
    if not torch.any(g_r != 0):
        raise ValueError("the rewarded type's gradient is zero: no step direction to compare against")
    sign = torch.sign(g_r)  # AdamW's first bias-corrected step: m̂/√v̂ = g/|g| per parameter
    shared, gap = (g_r + g_o) / 2, g_r - g_o  # m: how z̄ moves, d: how z_r − z_o moves, per unit step
    gap_sign = torch.sign(gap)
    opens_gap = bool(torch.any(gap != 0))
    return {
        "cosine": float(torch.dot(g_r, g_o) / (g_r.norm() * g_o.norm())),
        "sign_step_ratio": float(torch.dot(g_o, sign) / torch.dot(g_r, sign)),  # ⟨g_o, u⟩ / ⟨g_r, u⟩
        "sgd_step_ratio": float(torch.dot(g_o, g_r) / torch.dot(g_r, g_r)),  # ⟨g_o, g_r⟩ / |g_r|²
        "differential_share": float(gap.norm() / shared.norm()),
        # |d| and |m|: a plain step of L2 size s along d opens the gap by s·|d| (to first order),
        # so these size an SGD learning rate; the shared part's move per unit L2 along m is |m|
        "differential_norm": float(gap.norm()),
        "shared_norm": float(shared.norm()),
        # ⟨m, sign d⟩ / ⟨d, sign d⟩ and ⟨m, d⟩ / |d|²: the shared level's move per unit of gap
        "differential_sign_shared_per_gap": (float(torch.dot(shared, gap_sign) / torch.dot(gap, gap_sign))
                                             if opens_gap else None),
        "differential_sgd_shared_per_gap": float(torch.dot(shared, gap) / torch.dot(gap, gap)) if opens_gap else None,
    }


def mean_mode_gradient(model, tokenizer, examples: list[dict]):
    """Mean over ``examples`` of d z / d θ (z: ``mode_logit``), flattened over the trainable
    parameters, and the per-example z values."""
    mean, _, logits = mode_gradient_moments(model, tokenizer, examples)
    return mean, logits


def example_mode_gradients(model, tokenizer, examples: list[dict]):
    """Each example's d z / d θ, flattened over the trainable parameters, with its z: one at a
    time (a 135M model's gradient is 0.5 GB)."""
    if not examples:
        raise ValueError("no examples to take the mode gradient of")
    slot, continuations = mode_slot_tokens(tokenizer)
    params = [p for p in model.parameters() if p.requires_grad]
    model.eval()  # no dropout: the gradient of the policy the evaluation reads
    try:
        for example in examples:
            model.zero_grad(set_to_none=True)
            z = mode_logit(model, example, slot, continuations)
            z.backward()
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params])
            yield flat, float(z.detach())
    finally:
        model.zero_grad(set_to_none=True)


def mode_gradient_moments(model, tokenizer, examples: list[dict]):
    """``mean_mode_gradient``'s mean and z values, with the mean over ``examples`` of |d z / d θ|²
    between them (for ``gradient_spread``)."""
    total, squared, logits = None, 0.0, []
    for flat, z in example_mode_gradients(model, tokenizer, examples):
        logits.append(z)
        squared += float(flat.double().square().sum())
        total = flat if total is None else total.add_(flat)  # one running sum
    return total / len(examples), squared / len(examples), logits


def spread_along(model, tokenizer, examples: list[dict], mean, direction) -> float:
    """The part of ``gradient_spread`` along ``direction``: √(E⟨g_i − mean, u⟩²), u = direction / |direction|
    (a second pass over the examples' gradients)."""
    unit = direction.double() / direction.double().norm()
    offsets = [float(torch.dot(flat.double() - mean.double(), unit))
               for flat, _ in example_mode_gradients(model, tokenizer, examples)]
    return math.sqrt(statistics.fmean(o * o for o in offsets))


def gradient_spread(mean, mean_squared_norm: float) -> float:
    """How far one example's gradient lies from its type's mean, root-mean-square over the examples:
    √(E|g_i|² − |E g_i|²) (0 when every example has the same gradient)."""
    return math.sqrt(max(mean_squared_norm - float(mean.double().square().sum()), 0.0))


def spread_figures(spread_rewarded: float, spread_other: float, gap_norm: float, batch_per_type: int) -> dict:
    """The examples' spread against the gap between the type means, |d| = |g_rewarded − g_other|:

    * ``spread_over_gap``: each type's ``gradient_spread`` / |d|;
    * ``gap_error_over_gap``: the standard error of the difference of two type means of
      ``batch_per_type`` examples each, √((s_r² + s_o²) / n) / |d|. Above 1, a batch of that size
      cannot tell the direction d from its examples' own variation.

    None where d = 0."""
    if batch_per_type < 1:
        raise ValueError(f"batch_per_type must be at least 1, got {batch_per_type}")
    if gap_norm == 0:
        return {"spread_over_gap": {REWARDED: None, OTHER: None}, "gap_error_over_gap": None}
    error = math.sqrt((spread_rewarded ** 2 + spread_other ** 2) / batch_per_type)
    return {"spread_over_gap": {REWARDED: spread_rewarded / gap_norm, OTHER: spread_other / gap_norm},
            "gap_error_over_gap": error / gap_norm}


def mode_gradient_alignment(model, tokenizer, probes: dict[str, list[dict]], batch_per_type: int = 16,
                            along_shared: bool = False) -> dict:
    """``gradient_alignment`` of the two types' mean mode gradients and the probes' ``spread_figures``
    (for batches of ``batch_per_type`` examples a type), with each type's mean p(graph) and the
    probes' ``routing_accuracy``; with ``along_shared``, also each type's ``spread_along`` the
    shared part m, over |d| (``spread_along_shared_over_gap``; a second pass over the probes)."""
    return alignment_figures(model, tokenizer, probes, *type_gradients(model, tokenizer, probes),
                             batch_per_type=batch_per_type, along_shared=along_shared)


def type_gradients(model, tokenizer, probes: dict[str, list[dict]]):
    """Per question type: the probes' mean mode gradient, its ``gradient_spread``, and each probe's p(graph)."""
    missing = {REWARDED, OTHER} - set(probes)
    if missing:
        raise ValueError(f"probes lack question type(s) {sorted(missing)}; have {sorted(probes)}")
    grads, spreads, p_graph = {}, {}, {}
    for kind in (REWARDED, OTHER):
        grads[kind], squared, logits = mode_gradient_moments(model, tokenizer, probes[kind])
        spreads[kind] = gradient_spread(grads[kind], squared)
        p_graph[kind] = [1 / (1 + math.exp(-z)) for z in logits]  # sigmoid(z)
    return grads, spreads, p_graph


def alignment_figures(model, tokenizer, probes, grads, spreads, p_graph, batch_per_type: int = 16,
                      along_shared: bool = False) -> dict:
    """``mode_gradient_alignment``'s figures from ``type_gradients``' results."""
    gap_norm = float((grads[REWARDED].double() - grads[OTHER].double()).norm())
    along = {}
    if along_shared and gap_norm > 0:  # how much of each type's spread lies along m, in units of |d|
        shared = (grads[REWARDED] + grads[OTHER]) / 2
        along = {"spread_along_shared_over_gap": {
            kind: spread_along(model, tokenizer, probes[kind], grads[kind], shared) / gap_norm for kind in (REWARDED, OTHER)}}
    return {**gradient_alignment(grads[REWARDED], grads[OTHER]),
            **spread_figures(spreads[REWARDED], spreads[OTHER], gap_norm, batch_per_type),
            "batch_per_type": batch_per_type, **along,
            "p_graph": {kind: statistics.fmean(p) for kind, p in p_graph.items()},
            "routing_accuracy": routing_accuracy(p_graph), "probes": {kind: len(probes[kind]) for kind in (REWARDED, OTHER)}}


def clipped_step(direction, lr: float, clip: float):
    """The weights' move for a descent ``direction`` u: lr·u·min(1, clip / |u|), as the learner's
    gradient clipping to L2 norm ``clip`` and a plain gradient step make it."""
    if not lr > 0 or not clip > 0:
        raise ValueError(f"lr and clip must be positive, got {lr} and {clip}")
    norm = float(direction.double().norm())
    return direction.double() * (lr * min(1.0, clip / norm) if norm > 0 else 0.0)


def without_component(direction, along):
    """``direction`` with its component along ``along`` removed: u − (⟨u, a⟩ / |a|²)·a."""
    a = along.double()
    if not torch.any(a != 0):
        raise ValueError("cannot project out a zero direction")
    return direction.double() - (torch.dot(direction.double(), a) / torch.dot(a, a)) * a


def step_moves(step, shared, gap) -> dict:
    """To first order, a weight move ``step``'s effect on the probes: ``shared`` ⟨m, step⟩ (the
    level both types share) and ``gap`` ⟨d, step⟩ (``graph_only`` − ``direct``)."""
    return {"shared": float(torch.dot(shared.double(), step)), "gap": float(torch.dot(gap.double(), step))}


def route_credits(advantages: list[float], routes: list[str]) -> list[float]:
    """Each episode's advantage centred per route over the batch (``route_centred_mode_advantages``,
    one mode choice per episode: its first search's)."""
    if len(advantages) != len(routes):
        raise ValueError(f"{len(advantages)} advantages for {len(routes)} routes")
    if set(routes) - {"graph", "passage"}:
        raise ValueError(f"routes must be 'graph' or 'passage', got {sorted(set(routes) - {'graph', 'passage'})}")
    codes = torch.tensor([[1 if r == "graph" else 0] for r in routes])
    return route_centred_mode_advantages(torch.tensor(advantages), codes, torch.ones_like(codes))[:, 0].tolist()


def route_logprob_slope(route: str, p_graph: float) -> float:
    """d log π(route) / dz with two modes (log π(graph) = log σ(z), log π(passage) = log σ(−z)):
    1 − p for ``graph``, −p for ``passage``."""
    return 1 - p_graph if route == "graph" else -p_graph


def batch_records(path: Path) -> list[dict]:
    """The episodes of a trajectories file that searched, each as ``{"token_ids", "loss_mask",
    "advantage", "route", "question_id"}``; a line that is not a trajectory record is an error naming it."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
            route = first_route(record["episode"].get("modes"))
            entry = {"token_ids": record["token_ids"], "loss_mask": record["loss_mask"],
                     "advantage": float(record["advantage"]), "question_id": record["episode"]["question_id"]}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: not a trajectory record ({e})") from e
        if route is not None:
            out.append({**entry, "route": route})
    if not out:
        raise ValueError(f"{path}: no episode that searched")
    return out


def batch_step_moves(model, tokenizer, records: list[dict], g_rewarded, g_other, lr: float, clip: float = 1.0) -> dict:
    """The ``--batch`` prediction (module docstring) for ``records`` (``batch_records``) against
    the probes' type-mean gradients: the plain step's and the projected step's moves of the
    shared level and gap, the cosines of u with m and d, and the episodes' shared-direction scale
    a_i = ⟨∇z_i, m⟩ / |m|² (its spread over the batch is what route-centring cannot cancel)."""
    shared, gap = (g_rewarded.double() + g_other.double()) / 2, g_rewarded.double() - g_other.double()
    credits = route_credits([r["advantage"] for r in records], [r["route"] for r in records])
    u, batch_shared = torch.zeros_like(shared), torch.zeros_like(shared)
    scales = []
    for (flat, z), c, record in zip(example_mode_gradients(model, tokenizer, records), credits, records):
        flat = flat.double()
        weight = c * route_logprob_slope(record["route"], 1 / (1 + math.exp(-z))) / len(records)  # c_i·w_i / N
        u.add_(flat, alpha=weight)
        batch_shared.add_(flat, alpha=1 / len(records))  # m_b = mean_i ∇z_i
        scales.append(float(torch.dot(flat, shared) / torch.dot(shared, shared)))
    projected = without_component(u, batch_shared)
    cos = lambda a, b: float(torch.dot(a, b) / (a.norm() * b.norm())) if a.norm() > 0 and b.norm() > 0 else None
    return {"episodes": len(records), "routes": {r: sum(x["route"] == r for x in records) for r in ("graph", "passage")},
            "lr": lr, "grad_clip": clip, "direction_norm": float(u.norm()),
            "cosine_with_shared": cos(u, shared), "cosine_with_gap": cos(u, gap),
            "cosine_batch_shared_with_probes_shared": cos(batch_shared, shared),
            "plain_step": step_moves(clipped_step(u, lr, clip), shared, gap),
            "projected_step": step_moves(clipped_step(projected, lr, clip), shared, gap),
            "shared_scale": {"mean": statistics.fmean(scales), "stdev": statistics.pstdev(scales)}}


def supervised_split(model, tokenizer, train_probes: dict[str, list[dict]], heldout_probes: dict[str, list[dict]],
                     steps: int, lr: float, per_type: int, seed: int = 0, measure_every: int = 1, chunk: int = 8):
    """``steps`` AdamW steps on −log σ(y·z) over ``per_type`` training prefixes of each type per
    step (y = +1 for ``graph_only``, −1 for ``direct``; cycling through probes shuffled by
    ``seed``), the batch's gradient accumulated over forward passes of ``chunk`` prefixes. Yields
    a record after every ``measure_every``-th step and the last, as it is measured, step 0 the
    policy as given: the training examples seen so far, the held-out mean p(graph) per type and
    ``routing_accuracy``."""
    if steps < 1 or per_type < 1 or measure_every < 1 or chunk < 1:
        raise ValueError("--split-steps, --split-batch, --measure-every and --chunk must be at least 1")
    slot, continuations = mode_slot_tokens(tokenizer)
    target = {REWARDED: 1.0, OTHER: -1.0}
    rng = random.Random(seed)
    queues = {kind: [] for kind in target}

    def next_examples(kind: str) -> list[dict]:
        out = []
        while len(out) < per_type:
            if not queues[kind]:
                queues[kind] = rng.sample(train_probes[kind], len(train_probes[kind]))
            out.append(queues[kind].pop())
        return out

    def measure(step: int, seen: int) -> dict:
        p = {kind: graph_preference(model, tokenizer, heldout_probes[kind]) for kind in target}
        return {"step": step, "examples_seen": seen, "p_graph": {k: statistics.fmean(v) for k, v in p.items()},
                "routing_accuracy": routing_accuracy(p)}

    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=lr, weight_decay=0.01)
    seen = 0
    yield measure(0, seen)
    for step in range(1, steps + 1):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        batch = [(ex, target[kind]) for kind in target for ex in next_examples(kind)]
        for i in range(0, len(batch), chunk):  # −log σ(y·z) = softplus(−y·z), averaged over the batch
            examples, y = zip(*batch[i:i + chunk])
            z = mode_logits(model, list(examples), slot, continuations)
            (F.softplus(-torch.tensor(y) * z).sum() / len(batch)).backward()
        optimizer.step()
        seen += len(batch)
        if step % measure_every == 0 or step == steps:
            yield measure(step, seen)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.mode_gradients", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, help="an experiments.studies.routing --out folder")
    p.add_argument("--world-seed", type=int, default=0)
    p.add_argument("--entities", type=int, default=300)
    p.add_argument("--questions", type=int, default=400)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--heldout-per-type", type=int, default=0,
                   help="the study's --heldout-per-type: that many held-out questions of each type (0: --heldout)")
    p.add_argument("--kind-cues", default="", metavar="KIND=SENTENCE;...",
                   help="the study's --sft-kind-cues: each probe's thought opens with its type's cue")
    p.add_argument("--per-type", type=int, default=16, help="held-out probes per question type")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--along-shared", action="store_true",
                   help="also measure how much of each type's spread lies along the shared part (a second pass)")
    p.add_argument("--batch-per-type", type=int, default=16,
                   help="episodes of each type in a training batch, for gap_error_over_gap (default 16: issue #64's pilots)")
    p.add_argument("--batch", type=Path, default=None, metavar="STEP.jsonl",
                   help="a routing run's trajectories file: predict one plain step's moves on the probes")
    p.add_argument("--batch-lr", type=float, default=0.1, help="the plain step's learning rate for --batch")
    p.add_argument("--grad-clip", type=float, default=1.0, help="the learner's gradient clipping (L2) for --batch")
    p.add_argument("--split-steps", type=int, default=0,
                   help="then train each policy this many steps on the type-right mode (0: gradients only)")
    p.add_argument("--split-lr", type=float, default=2e-5, help="AdamW learning rate of --split-steps")
    p.add_argument("--split-batch", type=int, default=2, help="training prefixes per type in each --split-steps step")
    p.add_argument("--train-per-type", type=int, default=32, help="training questions per type --split-steps cycles through")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the order --split-steps visits the training questions in")
    p.add_argument("--measure-every", type=int, default=1, help="read the held-out probes after every N-th --split-steps step")
    p.add_argument("--chunk", type=int, default=8, help="training prefixes per forward pass (memory, not maths)")
    p.add_argument("--no-alignment", action="store_true",
                   help="skip the gradient alignment (minutes of per-probe gradients); only --split-steps")
    p.add_argument("policies", nargs="+", help="model spec, HF folder, checkpoint or run folder")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (Path(args.task) / "world").is_dir():
        parser.error(f"--task {args.task}: no world/ folder there; pass an experiments.studies.routing --out folder")
    if args.threads:
        torch.set_num_threads(args.threads)
    task = build_task(Path(args.task), seed=args.world_seed, entities=args.entities, questions=args.questions,
                      heldout=args.heldout, show_progress=False, heldout_per_type=args.heldout_per_type)
    tokenizer = load_policy_tokenizer("smollm2-135m")
    retriever = Retriever.load(task.index_dir)
    probes = mode_probes(task, retriever, tokenizer, EVAL_KWARGS, per_type=args.per_type, kind_cues=args.kind_cues)
    train_probes = (mode_probes(task, retriever, tokenizer, EVAL_KWARGS, per_type=args.train_per_type, split="train",
                                kind_cues=args.kind_cues)
                    if args.split_steps else {})  # golden episodes cost retrieval: only when they are trained on
    batch = batch_records(args.batch) if args.batch else []  # a bad file fails before any model loads
    for spec in args.policies:
        started = time.perf_counter()
        model = load_policy(resolve_policy(spec))[0]
        if not args.no_alignment or args.batch:
            grads, spreads, p_graph = type_gradients(model, tokenizer, probes)
        if not args.no_alignment:
            result = alignment_figures(model, tokenizer, probes, grads, spreads, p_graph,
                                       batch_per_type=args.batch_per_type, along_shared=args.along_shared)
            print(json.dumps({"policy": spec, **result, "seconds": round(time.perf_counter() - started, 1)}), flush=True)
        if args.batch:
            moves = batch_step_moves(model, tokenizer, batch, grads[REWARDED], grads[OTHER], args.batch_lr, args.grad_clip)
            print(json.dumps({"policy": spec, "batch": str(args.batch), **moves,
                              "seconds": round(time.perf_counter() - started, 1)}), flush=True)
        if not args.no_alignment or args.batch:
            del grads  # two flat gradients (1 GB for 135M): not held through --split-steps
        if args.split_steps:
            for record in supervised_split(model, tokenizer, train_probes, probes, args.split_steps, args.split_lr,
                                           args.split_batch, seed=args.split_seed, measure_every=args.measure_every,
                                           chunk=args.chunk):
                print(json.dumps({"policy": spec, "split_lr": args.split_lr, "split_batch": args.split_batch,
                                  "split_seed": args.split_seed, **record,
                                  "seconds": round(time.perf_counter() - started, 1)}), flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
