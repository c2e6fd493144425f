"""The mode-slot gradient diagnostic (``experiments.studies.mode_gradients``): the alignment maths by hand
and under hypothesis, and the gradient itself on a tiny random Llama against a finite difference."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.studies.mode_gradients import (batch_records, batch_step_moves, clipped_step, gradient_alignment,
                                                gradient_spread, mean_mode_gradient, mode_gradient_alignment,
                                                mode_gradient_moments, route_credits, route_logprob_slope, spread_along,
                                                spread_figures, step_moves, type_gradients, without_component)
from experiments.recipe.routing import graph_preference, mode_logit, mode_logits, mode_slot_tokens, routing_accuracy


def test_alignment_figures_by_hand():
    g_r, g_o = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([1.0, 1.0, 0.0])
    got = gradient_alignment(g_r, g_o)
    # cos = (1 − 2 + 0) / (√5.25 · √2)
    assert got["cosine"] == pytest.approx(-1 / (math.sqrt(5.25) * math.sqrt(2)))
    # u = sign(g_r) = (1, −1, 1): ⟨g_o, u⟩ = 0, ⟨g_r, u⟩ = 3.5
    assert got["sign_step_ratio"] == pytest.approx(0.0)
    # ⟨g_o, g_r⟩ / |g_r|² = −1 / 5.25
    assert got["sgd_step_ratio"] == pytest.approx(-1 / 5.25)
    # |(0, −3, 0.5)| / |(1, −0.5, 0.25)|
    assert got["differential_share"] == pytest.approx(math.sqrt(9.25) / math.sqrt(1.3125))
    assert (got["differential_norm"], got["shared_norm"]) == pytest.approx((math.sqrt(9.25), math.sqrt(1.3125)))
    # a step along d = g_r − g_o = (0, −3, 0.5), m = (1, −0.5, 0.25): sign d = (0, −1, 1),
    # ⟨m, sign d⟩ = 0.75 against ⟨d, sign d⟩ = 3.5; ⟨m, d⟩ = 1.625 against |d|² = 9.25
    assert got["differential_sign_shared_per_gap"] == pytest.approx(0.75 / 3.5)
    assert got["differential_sgd_shared_per_gap"] == pytest.approx(1.625 / 9.25)


def test_a_differential_orthogonal_to_the_shared_part_leaves_the_shared_level():
    # m = (1, 0), d = (0, 2): the gap opens and the shared level stays, for either step
    got = gradient_alignment(torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0]))
    assert got["differential_sign_shared_per_gap"] == pytest.approx(0.0)
    assert got["differential_sgd_shared_per_gap"] == pytest.approx(0.0)


def test_one_shared_gradient_gives_ratio_one_and_no_differential():
    g = torch.tensor([0.3, -0.1, 2.0, 0.0])
    got = gradient_alignment(g, g.clone())
    no_gap = {k: got.pop(k) for k in ("differential_sign_shared_per_gap", "differential_sgd_shared_per_gap")}
    assert no_gap == {"differential_sign_shared_per_gap": None, "differential_sgd_shared_per_gap": None}
    assert got == pytest.approx({"cosine": 1.0, "sign_step_ratio": 1.0, "sgd_step_ratio": 1.0, "differential_share": 0.0,
                                 "differential_norm": 0.0, "shared_norm": float(g.norm())})


def test_alignment_refuses_what_it_cannot_compare():
    with pytest.raises(ValueError, match="shape"):
        gradient_alignment(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="zero"):
        gradient_alignment(torch.zeros(3), torch.ones(3))


finite = st.floats(-10, 10, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, finite), min_size=2, max_size=12), st.floats(0.01, 100))
def test_alignment_is_scale_free_and_bounded(pairs, scale):
    g_r = torch.tensor([a for a, _ in pairs], dtype=torch.float64)  # float64: scaling rounds nothing
    g_o = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    if not torch.any(g_r != 0) or not torch.any(g_o != 0) or not torch.any(g_r + g_o != 0) or torch.equal(g_r, g_o):
        return
    got = gradient_alignment(g_r, g_o)
    swapped = gradient_alignment(g_o, g_r)  # d changes sign, m does not: the shared move per unit of gap flips
    for key in ("differential_sign_shared_per_gap", "differential_sgd_shared_per_gap"):
        assert swapped[key] == pytest.approx(-got[key], rel=1e-9, abs=1e-12)
    scaled = gradient_alignment(scale * g_r, scale * g_o)  # the same policy at another lr scale
    sizes = ("differential_norm", "shared_norm")  # the two sizes scale with the gradient, the ratios do not
    assert [scaled.pop(k) for k in sizes] == pytest.approx([scale * got.pop(k) for k in sizes], rel=1e-6, abs=1e-9)
    assert scaled == pytest.approx(got, rel=1e-6, abs=1e-9)
    assert -1 - 1e-9 <= got["cosine"] <= 1 + 1e-9
    # the rewarded type moves itself by exactly its own step
    assert gradient_alignment(g_r, g_r)["sign_step_ratio"] == pytest.approx(1.0)


def test_spread_figures_by_hand():
    # examples (3, 0) and (1, 0): mean (2, 0), E|g|² = (9 + 1) / 2 = 5, spread √(5 − 4) = 1
    assert gradient_spread(torch.tensor([2.0, 0.0]), 5.0) == pytest.approx(1.0)
    assert gradient_spread(torch.tensor([2.0, 0.0]), 4.0) == 0.0  # every example the same
    # spreads 3 and 4 against |d| = 2, batches of 25 a type: √((9 + 16) / 25) / 2 = 0.5
    got = spread_figures(3.0, 4.0, 2.0, 25)
    assert got["spread_over_gap"] == pytest.approx({"graph_only": 1.5, "direct": 2.0})
    assert got["gap_error_over_gap"] == pytest.approx(0.5)
    assert spread_figures(3.0, 4.0, 0.0, 25) == {"spread_over_gap": {"graph_only": None, "direct": None},
                                                  "gap_error_over_gap": None}
    with pytest.raises(ValueError, match="batch_per_type"):
        spread_figures(3.0, 4.0, 2.0, 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(finite, min_size=3, max_size=3), min_size=1, max_size=8), st.integers(1, 64))
def test_spread_is_the_examples_rms_distance_from_their_mean(rows, batch):
    g = torch.tensor(rows, dtype=torch.float64)
    mean, squared = g.mean(0), float(g.square().sum(1).mean())
    expected = math.sqrt(float((g - mean).square().sum(1).mean()))
    assert gradient_spread(mean, squared) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    # a bigger batch averages the spread down as 1/√n
    one, many = spread_figures(1.0, 2.0, 1.0, 1), spread_figures(1.0, 2.0, 1.0, batch)
    assert many["gap_error_over_gap"] == pytest.approx(one["gap_error_over_gap"] / math.sqrt(batch))


def _example(tokenizer, question: str, thought: str) -> dict:
    """A golden prefix as ``golden_examples`` lays it out: prompt (masked out), then the model's
    turn up to and including the mode slot."""
    prompt = tokenizer.encode(f"Answer the question. Modes: [passage] or [graph].\nQuestion: {question}\n")
    turn = tokenizer.encode(f"<think> {thought} </think>\n<search> [", add_special_tokens=False)
    return {"question_id": question, "token_ids": prompt + turn, "loss_mask": [0] * len(prompt) + [1] * len(turn)}


@pytest.fixture(scope="module")
def tiny(tiny_random_policy):
    from raggym.models import load_policy

    model, tokenizer = load_policy(tiny_random_policy)
    probes = {
        "graph_only": [_example(tokenizer, "What is the birthplace of Adve Viad?", "I need the birthplace of Adve Viad."),
                       _example(tokenizer, "Name the employer of Wentas Peostvi.", "I need the employer of Wentas Peostvi.")],
        "direct": [_example(tokenizer, "Who directed The Glass Ovten?", "I need the director of The Glass Ovten."),
                   _example(tokenizer, "Which country contains Koadhaven?", "I need the country containing Koadhaven.")],
    }
    return model, tokenizer, probes


def test_mode_logits_are_the_preference_the_evaluation_reads(tiny):
    model, tokenizer, probes = tiny
    _, logits = mean_mode_gradient(model, tokenizer, probes["direct"])
    preference = graph_preference(model, tokenizer, probes["direct"])
    assert [1 / (1 + math.exp(-z)) for z in logits] == pytest.approx(preference, abs=1e-6)


def test_a_batch_of_prefixes_reads_what_each_prefix_reads_alone(tiny):
    """``mode_logits`` pads prefixes of different lengths on the left into one forward pass: each
    row's logit and its gradient equal those of the prefix alone (no padding). A row that sees
    its padding fails this (positions counted from the padded start would not: RoPE's scores
    depend on relative positions only)."""
    model, tokenizer, probes = tiny
    slot, continuations = mode_slot_tokens(tokenizer)
    examples = probes["graph_only"] + probes["direct"]
    assert len({len(ex["token_ids"]) for ex in examples}) > 1  # the rows really are padded
    params = [p for p in model.parameters() if p.requires_grad]

    def logits_and_gradient(read):
        model.zero_grad(set_to_none=True)
        z = read()
        z.sum().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        model.zero_grad(set_to_none=True)
        return z.detach(), grad

    model.eval()
    batched, batched_grad = logits_and_gradient(lambda: mode_logits(model, examples, slot, continuations))
    alone, alone_grad = logits_and_gradient(lambda: torch.stack([mode_logit(model, ex, slot, continuations)
                                                                   for ex in examples]))
    assert batched.tolist() == pytest.approx(alone.tolist(), abs=1e-5)
    assert torch.allclose(batched_grad, alone_grad, atol=1e-5, rtol=1e-4)
    assert len(set(alone.tolist())) == len(examples)  # four different questions, four different logits


def test_mean_gradient_predicts_a_small_step_on_the_mode_logit(tiny):
    """A step of ε along the returned gradient raises the mean mode logit by ε·|g| (to first
    order): a dropped, negated or per-example-mismatched gradient fails this."""
    model, tokenizer, probes = tiny
    examples = probes["graph_only"]
    g, before = mean_mode_gradient(model, tokenizer, examples)
    assert g.norm() > 0
    eps = 1e-3
    direction = g / g.norm()
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        offset = 0
        for p in params:
            p.add_(eps * direction[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    try:
        _, after = mean_mode_gradient(model, tokenizer, examples)
    finally:
        with torch.no_grad():
            offset = 0
            for p in params:
                p.sub_(eps * direction[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    rise = sum(after) / len(after) - sum(before) / len(before)
    assert rise == pytest.approx(eps * float(g.norm()), rel=0.05)


def test_alignment_of_two_types_on_a_real_model(tiny):
    model, tokenizer, probes = tiny
    same = mode_gradient_alignment(model, tokenizer, {"graph_only": probes["direct"], "direct": probes["direct"]})
    assert same["cosine"] == pytest.approx(1.0) and same["sign_step_ratio"] == pytest.approx(1.0)
    assert same["differential_share"] == pytest.approx(0.0, abs=1e-6)
    apart = mode_gradient_alignment(model, tokenizer, probes)
    assert apart["differential_share"] > 0 and apart["probes"] == {"graph_only": 2, "direct": 2}
    assert set(apart["p_graph"]) == {"graph_only", "direct"} and all(0 < p < 1 for p in apart["p_graph"].values())
    p_graph = {kind: graph_preference(model, tokenizer, examples) for kind, examples in probes.items()}
    assert apart["routing_accuracy"] == routing_accuracy(p_graph)  # the probes' own reading
    assert same["gap_error_over_gap"] is None and apart["gap_error_over_gap"] > 0
    with pytest.raises(ValueError, match="direct"):
        mode_gradient_alignment(model, tokenizer, {"graph_only": probes["graph_only"]})


def test_moments_hold_each_example_s_own_squared_norm(tiny):
    """The mean squared norm the spread reads is that of each example's own gradient: an
    implementation that squared the running sum, or the mean, fails this."""
    model, tokenizer, probes = tiny
    examples = probes["graph_only"]
    mean, squared, _ = mode_gradient_moments(model, tokenizer, examples)
    alone = [mean_mode_gradient(model, tokenizer, [example])[0].double() for example in examples]
    assert squared == pytest.approx(sum(float(g.square().sum()) for g in alone) / len(alone), rel=1e-5)
    expected = math.sqrt(sum(float((g - mean.double()).square().sum()) for g in alone) / len(alone))
    assert expected > 0 and gradient_spread(mean, squared) == pytest.approx(expected, rel=1e-3)
    # along one direction: the examples' offsets from their mean projected on it
    direction = alone[0] + 0.5 * alone[1]
    unit = direction / direction.norm()
    by_hand = math.sqrt(sum(float(torch.dot(g - mean.double(), unit)) ** 2 for g in alone) / len(alone))
    assert spread_along(model, tokenizer, examples, mean, direction) == pytest.approx(by_hand, rel=1e-4)
    assert spread_along(model, tokenizer, examples, mean, 3 * direction) == pytest.approx(by_hand, rel=1e-4)


def test_the_spread_along_the_shared_part_is_reported_on_request(tiny):
    model, tokenizer, probes = tiny
    plain = mode_gradient_alignment(model, tokenizer, probes)
    along = mode_gradient_alignment(model, tokenizer, probes, along_shared=True)
    assert "spread_along_shared_over_gap" not in plain
    figures = along["spread_along_shared_over_gap"]
    assert set(figures) == {"graph_only", "direct"}
    # a part of a spread is no larger than the whole
    assert all(0 <= figures[k] <= along["spread_over_gap"][k] * (1 + 1e-6) for k in figures)


def test_an_example_without_a_mode_slot_is_named(tiny):
    model, tokenizer, _ = tiny
    bad = _example(tokenizer, "Who?", "no search here")
    bad["loss_mask"] = [0] * len(bad["token_ids"])  # the slot only in the prompt's (unscored) part
    with pytest.raises(ValueError, match="Who"):
        mean_mode_gradient(model, tokenizer, [bad])


def test_cli_refuses_a_folder_that_is_not_a_routing_run(tmp_path, capsys):
    from experiments.studies.mode_gradients import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--task", str(tmp_path), "smollm2-135m"])
    assert exit_info.value.code == 2
    assert "no world/ folder" in capsys.readouterr().err


def test_routing_accuracy_by_hand():
    # graph_only right when p(graph) > 0.5, direct right when < 0.5: right, wrong, right, wrong
    assert routing_accuracy({"graph_only": [0.7, 0.4], "direct": [0.2, 0.6]}) == 0.5
    assert routing_accuracy({"graph_only": [0.9], "direct": [0.1, 0.3]}) == 1.0


def test_the_type_right_signal_splits_the_mode_slot(tiny):
    """Trained on the type-right mode, the graph_only probes come to prefer the graph and the
    direct ones passage; step 0 is the policy as given (a negated target or a dropped step fails)."""
    import copy

    from experiments.studies.mode_gradients import supervised_split

    model, tokenizer, probes = tiny
    model = copy.deepcopy(model)  # the fixture's model stays untrained for the other tests
    start = {kind: graph_preference(model, tokenizer, examples) for kind, examples in probes.items()}
    records = list(supervised_split(model, tokenizer, probes, probes, steps=30, lr=3e-3, per_type=2, chunk=3))
    assert [r["step"] for r in records] == list(range(31))
    assert [r["examples_seen"] for r in records] == [4 * step for step in range(31)]
    assert records[0]["p_graph"] == pytest.approx({k: sum(v) / len(v) for k, v in start.items()})
    assert records[0]["routing_accuracy"] == 0.5  # the random policy prefers the graph for all four
    gap = [r["p_graph"]["graph_only"] - r["p_graph"]["direct"] for r in records]
    assert records[-1]["routing_accuracy"] == 1.0 and gap[-1] > gap[0] + 0.5, gap
    with pytest.raises(ValueError, match="at least 1"):
        next(supervised_split(model, tokenizer, probes, probes, steps=0, lr=1e-3, per_type=2))
    sparse = list(supervised_split(copy.deepcopy(model), tokenizer, probes, probes, steps=5, lr=1e-3, per_type=2,
                                   measure_every=2))
    assert [r["step"] for r in sparse] == [0, 2, 4, 5]  # every second step, and the last


def test_the_plain_step_pieces_by_hand():
    u = torch.tensor([3.0, 4.0])  # |u| = 5
    assert clipped_step(u, 0.1, 1.0).tolist() == pytest.approx([0.06, 0.08])  # clipped to norm 1, times lr
    assert clipped_step(u, 0.1, 10.0).tolist() == pytest.approx([0.3, 0.4])  # under the clip: lr·u
    assert clipped_step(torch.zeros(2), 0.1, 1.0).tolist() == [0.0, 0.0]
    # (3, 4) − (⟨u, a⟩ / |a|²)·a with a = (1, 1): 7/2·(1, 1)
    assert without_component(u, torch.tensor([1.0, 1.0])).tolist() == pytest.approx([-0.5, 0.5])
    assert step_moves(torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])) == \
        pytest.approx({"shared": 1.0, "gap": -0.5})
    for bad in (dict(lr=0.0, clip=1.0), dict(lr=0.1, clip=0.0)):
        with pytest.raises(ValueError, match="positive"):
            clipped_step(u, **bad)
    with pytest.raises(ValueError, match="zero"):
        without_component(u, torch.zeros(2))


def test_route_credits_and_slopes_by_hand():
    # graph: +1, −1, +3 (mean 1) → 0, −2, +2; passage: +2 alone → 0
    assert route_credits([1.0, -1.0, 2.0, 3.0], ["graph", "graph", "passage", "graph"]) == pytest.approx([0, -2, 0, 2])
    assert (route_logprob_slope("graph", 0.8), route_logprob_slope("passage", 0.8)) == pytest.approx((0.2, -0.8))
    with pytest.raises(ValueError, match="routes"):
        route_credits([1.0], ["hybrid"])
    with pytest.raises(ValueError, match="advantages"):
        route_credits([1.0, 2.0], ["graph"])


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=6), st.floats(0.01, 10))
@settings(max_examples=60, deadline=None)
def test_a_projected_direction_is_orthogonal_and_a_clipped_step_bounded(pairs, clip):
    u, a = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    if torch.any(a != 0):
        projected = without_component(u, a)
        assert float(torch.dot(projected, a.double())) == pytest.approx(0.0, abs=1e-6 * (1 + float(u.norm() * a.norm())))
    assert float(clipped_step(u, 0.5, clip).norm()) <= 0.5 * clip * (1 + 1e-9)


def _trajectory(example: dict, route: str, advantage: float, qid: str) -> str:
    return json.dumps({"token_ids": example["token_ids"], "loss_mask": example["loss_mask"], "advantage": advantage,
                       "episode": {"question_id": qid, "modes": [route]}})


def test_batch_records_keep_the_searching_episodes_and_name_a_bad_line(tiny, tmp_path):
    _, tokenizer, probes = tiny
    good = _trajectory(probes["direct"][0], "passage", 0.5, "q1")
    silent = json.dumps({"token_ids": [1], "loss_mask": [0], "advantage": 0.0, "episode": {"question_id": "q2", "modes": []}})
    path = tmp_path / "step-000001.jsonl"
    path.write_text(good + "\n" + silent + "\n")
    records = batch_records(path)
    assert [(r["question_id"], r["route"], r["advantage"]) for r in records] == [("q1", "passage", 0.5)]
    path.write_text(good + "\n" + '{"token_ids": [1]}' + "\n")
    with pytest.raises(ValueError, match=r"step-000001.jsonl:2"):
        batch_records(path)


def test_the_batch_prediction_is_the_move_a_plain_clipped_step_makes(tiny, tmp_path):
    """``batch_step_moves``' plain step, taken for real on the tiny model (torch SGD on the
    two-mode loss −(1/N)·Σ c_i·log π(route_i), gradient clipped), moves the probes' shared level and
    gap as predicted, to first order. The batch here is the probes themselves, two of each type,
    so its own shared direction is the probes' m and the projected step leaves their level alone.
    A negated credit, a dropped slope or an unclipped step fails this."""
    model, tokenizer, probes = tiny
    episodes = [(probes["graph_only"][0], "graph", 1.0), (probes["graph_only"][1], "passage", -1.0),
                (probes["direct"][0], "passage", 1.0), (probes["direct"][1], "graph", -0.5)]
    path = tmp_path / "step.jsonl"
    path.write_text("\n".join(_trajectory(ex, r, a, f"q{i}") for i, (ex, r, a) in enumerate(episodes)) + "\n")
    records = batch_records(path)
    grads, _, _ = type_gradients(model, tokenizer, probes)
    lr, clip = 0.01, 0.1  # a step of L2 size 1e-3: small enough for first order, large against float32's noise
    got = batch_step_moves(model, tokenizer, records, grads["graph_only"], grads["direct"], lr, clip=clip)
    assert got["routes"] == {"graph": 2, "passage": 2} and got["direction_norm"] > clip  # the clip acts
    slot, continuations = mode_slot_tokens(tokenizer)
    credits = route_credits([r["advantage"] for r in records], [r["route"] for r in records])

    def levels():
        with torch.no_grad():
            z = {k: float(mode_logits(model, v, slot, continuations).mean()) for k, v in probes.items()}
        return (z["graph_only"] + z["direct"]) / 2, z["graph_only"] - z["direct"]

    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    before = levels()
    try:
        model.zero_grad(set_to_none=True)
        z = mode_logits(model, [r for r in records], slot, continuations)
        sign = torch.tensor([1.0 if r["route"] == "graph" else -1.0 for r in records])
        loss = -(torch.tensor(credits) * F.logsigmoid(sign * z)).sum() / len(records)  # log π(route) = log σ(±z)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        torch.optim.SGD(params, lr=lr).step()
        after = levels()
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        model.zero_grad(set_to_none=True)
    moved = {"shared": after[0] - before[0], "gap": after[1] - before[1]}
    assert abs(moved["shared"]) > 1e-5 and abs(moved["gap"]) > 1e-5
    assert moved == pytest.approx(got["plain_step"], rel=0.05, abs=1e-6)
    assert abs(got["projected_step"]["shared"]) < 1e-6 * abs(got["plain_step"]["shared"]) + 1e-12
    assert got["cosine_batch_shared_with_probes_shared"] == pytest.approx(1.0)
