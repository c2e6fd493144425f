"""SFT cold start: golden episodes through the real environments, masked loss, a short real run."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.recipe.sft import (balanced_order, build_parser, golden_examples, grouped_order, lr_factor,
                             masked_cross_entropy, run_sft, with_retried_searches, with_search_modes)
from raggym.protocol import DIALECT_NAMES as DIALECTS


@pytest.fixture(scope="module")
def tokenizer():
    from raggym.models import load_policy_tokenizer

    return load_policy_tokenizer("smollm2-135m")


def _pick(world, kind, hops=None):
    for q in world.questions:
        if q.kind == kind and (hops is None or q.hops == hops):
            return q
    raise AssertionError(f"no {kind} question in the test world")


# ---------------------------------------------------------------- golden episodes


def test_loss_mask_covers_exactly_the_model_segments(small_world, small_world_retriever, tokenizer):
    from raggym.trajectory import chat_prompt_ids
    from envs import RagSearchEnv

    q = _pick(small_world, "bridge", 2)
    [ex] = golden_examples([q], small_world_retriever, "routerag", tokenizer, max_observation_tokens=64,
                           show_progress=False)
    # Replay the same episode by hand and lay the tokens out as the rollout rules say.
    env = RagSearchEnv(small_world_retriever, None, "routerag")
    prompt, _ = env.reset(options={"question": q})
    d = env.dialect
    segments = [
        d.search_segment(q.golden_trajectory[0]["query"], mode=q.golden_trajectory[0]["mode"],
                         reasoning=f"To answer this I first need {q.golden_trajectory[0]['query']}.", turn=0),
        d.search_segment(q.golden_trajectory[1]["query"], mode=q.golden_trajectory[1]["mode"],
                         reasoning=f"The search says it is {q.golden_trajectory[0]['answer']}. Next I need "
                                   f"{q.golden_trajectory[1]['query']}.", turn=1),
        d.answer_segment(q.answer, reasoning=f"The search says it is {q.golden_trajectory[1]['answer']}, which "
                                             "answers the question.", turn=2),
    ]
    ids = list(chat_prompt_ids(tokenizer, prompt))
    mask = [0] * len(ids)
    for seg in segments:
        seg_ids = tokenizer(seg, add_special_tokens=False)["input_ids"]
        ids += seg_ids
        mask += [1] * len(seg_ids)
        obs, reward, terminated, _, _ = env.step(seg)
        if not terminated:
            obs_ids = tokenizer(obs, add_special_tokens=False)["input_ids"][:64]
            ids += obs_ids
            mask += [0] * len(obs_ids)
    assert reward == 1.0
    assert ex["token_ids"] == ids and ex["loss_mask"] == mask
    # the masked runs decode to exactly the three segments, in order
    runs, current = [], []
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    assert [tokenizer.decode(r) for r in runs] == segments
    assert ex["text"].endswith(f"<answer> {q.answer} </answer>") and ex["question_id"] == q.id


@pytest.mark.parametrize("dialect", DIALECTS)
def test_golden_episodes_end_with_the_gold_answer_and_em_one(dialect, small_world, small_world_retriever, tokenizer):
    from raggym.protocol import get_dialect

    qs = [_pick(small_world, "single"), _pick(small_world, "bridge", 2), _pick(small_world, "comparison")]
    # a cap large enough that no observation loses its closing tag (the format check needs them)
    examples = golden_examples(qs, small_world_retriever, dialect, tokenizer, max_observation_tokens=1024,
                               show_progress=False)
    assert [e["question_id"] for e in examples] == [q.id for q in qs]
    for q, ex in zip(qs, examples):
        assert ex["reward"] == 1.0  # the env's exact-match reward
        assert ex["num_searches"] == len(q.golden_trajectory)
        assert len(ex["token_ids"]) == len(ex["loss_mask"]) and 0 < sum(ex["loss_mask"]) < len(ex["loss_mask"])
        assert ex["loss_mask"][-1] == 1 and ex["text"].rstrip().endswith(f"<answer> {q.answer} </answer>")
        if dialect != "r1_router":  # the whole response passes the dialect's trajectory check
            prompt_end = ex["loss_mask"].index(1)
            response = tokenizer.decode(ex["token_ids"][prompt_end:])
            assert get_dialect(dialect).format_check(response).ok, response


_SAFE_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<>[]{}|"), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(query=_SAFE_TEXT, answer=_SAFE_TEXT, turn=st.integers(0, 3), dialect=st.sampled_from(DIALECTS[:5]))
def test_written_segments_parse_back_to_their_action(query, answer, turn, dialect):
    from raggym.protocol import get_dialect
    from raggym.protocol.tags import clean_block, clean_inline

    d = get_dialect(dialect)
    if clean_inline(query):
        action = d.parse(d.search_segment(query, mode="graph", reasoning="why", turn=turn))
        assert action.kind == "search" and action.query == clean_inline(query) and action.well_formed
        assert action.mode == ("graph" if dialect == "routerag" else None)
    else:
        with pytest.raises(ValueError, match="does not parse back"):
            d.search_segment(query, reasoning="why", turn=turn)
    if clean_block(answer):
        action = d.parse(d.answer_segment(answer, reasoning="so", turn=turn))
        assert action.kind == "answer" and action.answer == clean_block(answer)


# ---------------------------------------------------------------- loss


def test_masked_cross_entropy_matches_a_hand_computed_value():
    import torch

    logits = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 3.0], [5.0, 5.0, 5.0]]])
    ids = torch.tensor([[2, 1, 0, 2]])
    mask = torch.tensor([[0, 1, 0, 1]])  # targets 1 (predicted at position 0) and 2 (at position 2)
    # position 0: uniform over 3 -> -log(1/3); position 2: logits (0,0,3), target 2
    expected = (math.log(3) + (math.log(2 + math.exp(3)) - 3)) / 2
    assert masked_cross_entropy(logits, ids, mask).item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="no token has loss_mask 1"):
        masked_cross_entropy(logits, ids, torch.tensor([[1, 0, 0, 0]]))


# ---------------------------------------------------------------- a short real run


def _batch_loss(model, examples):
    import torch

    from experiments.recipe.sft import _masked_nll_sum, _pad

    rows = [(e["token_ids"], e["loss_mask"]) for e in examples]
    ids, att, mask = _pad(rows, 0, "cpu")
    with torch.no_grad():
        fast = _masked_nll_sum(model, ids, att, mask) / int(mask[:, 1:].sum())
        full = masked_cross_entropy(model(input_ids=ids, attention_mask=att).logits, ids, mask)
    return float(fast), float(full)


def test_short_sft_run_lowers_the_loss_and_exports_a_loadable_safetensors_policy(
        small_world, small_world_retriever, tokenizer, tmp_path):
    import torch

    from raggym.models import load_policy

    torch.set_num_threads(2)
    qs = [q for q in small_world.questions if q.kind == "single"][:2]
    examples = golden_examples(qs, small_world_retriever, "search_r1", tokenizer, max_observation_tokens=24,
                               show_progress=False)
    base, _ = load_policy("smollm2-135m")
    before, before_full = _batch_loss(base, examples)
    assert before == pytest.approx(before_full, rel=1e-4)  # head-on-masked-positions path == full logits
    del base
    # 3 optimizer steps over the same two sequences, each step two micro-batches of one sequence
    summary = run_sft("smollm2-135m", examples, tmp_path / "run", epochs=3, lr=1e-4, batch_size=1, grad_accum=2,
                      max_seq_tokens=512, show_progress=False)
    assert summary["steps"] == 3 and summary["examples"] == 2 and summary["loss_last"] < summary["loss_first"]
    policy_dir = tmp_path / "run" / "policy"
    names = {p.name for p in policy_dir.iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert not [p for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name]
    lines = [json.loads(line) for line in (tmp_path / "run" / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["loss"] > 0 for r in lines)
    assert json.loads((tmp_path / "run" / "sft_summary.json").read_text())["steps"] == 3
    trained, _ = load_policy(str(policy_dir))
    after, _ = _batch_loss(trained, examples)
    assert after < before - 0.05


def test_lora_run_exports_merged_weights(small_world, small_world_retriever, tokenizer, tmp_path):
    from safetensors import safe_open

    qs = [q for q in small_world.questions if q.kind == "single"][:2]
    examples = golden_examples(qs, small_world_retriever, "graph_r1", tokenizer, max_observation_tokens=16,
                               show_progress=False)
    summary = run_sft("smollm2-135m", examples, tmp_path, epochs=1, lr=1e-3, batch_size=2, max_seq_tokens=256,
                      lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, show_progress=False)
    assert summary["lora"]["r"] == 4 and summary["steps"] == 1
    with safe_open(str(tmp_path / "policy" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "lora" in k.lower()]
    assert any(k.endswith("q_proj.weight") for k in keys)


def test_lr_factor_by_hand():
    assert [lr_factor("linear", k, 4) for k in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_factor("constant", k, 4) for k in range(4)] == [1.0] * 4
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        lr_factor("cosine", 0, 4)


def test_balanced_order_by_hand():
    import random

    # 6 passage-only examples and 2 with a graph search: each half of the order holds one graph one
    labels = ["p", "p", "g", "p", "p", "p", "g", "p"]
    for seed in range(20):
        order = balanced_order(labels, random.Random(seed))
        assert sorted(order) == list(range(8))
        halves = [[labels[i] for i in order[:4]], [labels[i] for i in order[4:]]]
        assert [h.count("g") for h in halves] == [1, 1]
    # a plain shuffle leaves both graph examples in one half for some seeds: the balance is not free
    unbalanced = 0
    for seed in range(20):
        order = list(range(8))
        random.Random(seed).shuffle(order)
        unbalanced += sum(labels[i] == "g" for i in order[:4]) != 1
    assert unbalanced > 0


@settings(max_examples=200, deadline=None)
@given(labels=st.lists(st.integers(0, 4), min_size=1, max_size=60), seed=st.integers(0, 2**16))
def test_balanced_order_keeps_every_prefix_within_one_item_of_each_share(labels, seed):
    import random

    order = balanced_order(labels, random.Random(seed))
    assert sorted(order) == list(range(len(labels)))
    counts = {label: labels.count(label) for label in set(labels)}
    seen = dict.fromkeys(counts, 0)
    for m, i in enumerate(order, 1):
        seen[labels[i]] += 1
        for label, n in counts.items():
            assert abs(seen[label] - m * n / len(labels)) < 1


def test_grouped_order_keeps_each_label_together():
    import random

    labels = ["q1", "q1", "q2", "q3", "q2", "q3", "q1"]
    orders = {tuple(grouped_order(labels, random.Random(seed))) for seed in range(30)}
    # q1 = (0, 1, 6), q2 = (2, 4), q3 = (3, 5): the three runs in any of their 3! orders
    runs = [(0, 1, 6), (2, 4), (3, 5)]
    import itertools
    assert orders == {tuple(i for run in perm for i in run) for perm in itertools.permutations(runs)}


def test_rotated_modes_give_every_step_each_listed_mode_once():
    from raggym.data import Question

    q = Question(id="q", question="?", answers=("a",),
                 golden_trajectory=({"query": "x"}, {"query": "y"}, {"query": "z"}))
    rotations = [[s["mode"] for s in with_search_modes([q], ("passage", "passage", "graph"), rotation=r)[0].golden_trajectory]
                 for r in range(3)]
    assert rotations == [["passage", "passage", "graph"], ["passage", "graph", "passage"], ["graph", "passage", "passage"]]


def test_retried_searches_repeat_one_step_right_after_itself(small_world):
    qs = small_world.questions[:40]
    assert with_retried_searches(qs, 0.0) == qs
    for q, again in zip(qs, with_retried_searches(qs, 1.0, seed=3)):
        steps, repeated = list(q.golden_trajectory), list(again.golden_trajectory)
        [i] = [k for k, step in enumerate(repeated) if step.get("retry")]
        assert i >= 1 and repeated[i] == {**repeated[i - 1], "retry": True}
        assert repeated[:i] + repeated[i + 1:] == steps  # nothing else changed
    some = with_retried_searches(qs, 0.5, seed=3)
    assert 8 < sum(len(a.golden_trajectory) > len(q.golden_trajectory) for q, a in zip(qs, some)) < 32
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="retry share"):
            with_retried_searches(qs, bad)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), share=st.floats(0.0, 1.0), order=st.permutations(range(12)))
def test_retries_depend_only_on_seed_and_question(small_world, seed, share, order):
    qs = small_world.questions[:12]
    base = {q.id: q.golden_trajectory for q in with_retried_searches(qs, share, seed)}
    shuffled = with_retried_searches([qs[i] for i in order], share, seed)
    assert {q.id: q.golden_trajectory for q in shuffled} == base


def test_a_retried_search_is_played_in_the_rotated_other_mode(small_world, small_world_retriever, tokenizer):
    qs = [q for q in small_world.questions if q.kind == "bridge"][:3]
    for rotation, first in ((0, "passage"), (1, "graph")):
        examples = golden_examples(qs, small_world_retriever, "routerag", tokenizer, max_observation_tokens=24,
                                   modes=("passage", "graph"), mode_rotation=rotation, retry_share=1.0,
                                   mode_seed=2, show_progress=False)
        for q, ex in zip(with_retried_searches(qs, 1.0, seed=2), examples):
            i = next(k for k, step in enumerate(q.golden_trajectory) if step.get("retry"))
            assert ex["num_searches"] == len(ex["modes"]) == q.hops + 1 and ex["reward"] == 1.0
            assert ex["modes"][0] == first and ex["modes"][i] != ex["modes"][i - 1]
            # the retry's reasoning names its query and says nothing of what the first search found
            assert ex["text"].count("once more") == 1
            assert f"Let me look up {q.golden_trajectory[i]['query']} once more." in ex["text"]


def test_examples_record_their_modes_and_a_scheduled_balanced_run_logs_its_lr(small_world, small_world_retriever,
                                                                              tokenizer, tmp_path, tiny_random_policy):
    qs = [q for q in small_world.questions if q.kind == "bridge"][:4]
    examples = golden_examples(qs, small_world_retriever, "routerag", tokenizer, max_observation_tokens=24,
                               modes=("passage", "graph"), mode_seed=5, show_progress=False)
    drawn = with_search_modes(qs, ("passage", "graph"), seed=5)
    assert [ex["modes"] for ex in examples] == [[s["mode"] for s in q.golden_trajectory] for q in drawn]
    assert all(len(ex["modes"]) == ex["num_searches"] for ex in examples)
    seen = []

    def by_graph_searches(exs, rng):
        seen.append([ex["question_id"] for ex in exs])
        return balanced_order([ex["modes"].count("graph") for ex in exs], rng)

    # the schedule and the order are the model's business not at all: a small random Llama with SmolLM2's vocabulary
    summary = run_sft(tiny_random_policy, examples, tmp_path, epochs=2, lr=1e-4, batch_size=2, max_seq_tokens=512,
                      lr_schedule="linear", epoch_order=by_graph_searches, show_progress=False)
    assert seen == [[q.id for q in qs]] * 2  # once per epoch, every example
    rows = [json.loads(line) for line in (tmp_path / "sft_metrics.jsonl").read_text().splitlines()]
    # 2 epochs x 2 steps: lr 1e-4 x (1, 3/4, 1/2, 1/4)
    assert [r["lr"] for r in rows] == pytest.approx([1e-4, 0.75e-4, 0.5e-4, 0.25e-4])
    assert summary["lr_schedule"] == "linear" and summary["ordered"] is True and summary["steps"] == 4


# ---------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors(small_world, small_world_retriever, tokenizer, tmp_path):
    from raggym.data import Question

    with pytest.raises(ValueError, match="no examples"):
        run_sft("smollm2-135m", [], tmp_path)
    with pytest.raises(ValueError, match="unknown dialect 'toolformer'"):
        golden_examples(small_world.questions[:1], small_world_retriever, "toolformer", tokenizer)
    with pytest.raises(ValueError, match="no questions"):
        golden_examples([], small_world_retriever, "routerag", tokenizer)
    plain = Question(id="plain-1", question="Who?", answers=("X",))
    with pytest.raises(ValueError, match=r"'plain-1' \(an unnamed dataset\): cannot derive a golden trajectory"):
        golden_examples([plain], small_world_retriever, "routerag", tokenizer)
    with pytest.raises(ValueError, match=r"example 0 \(q7\): 3 token_ids but 2 loss_mask"):
        run_sft("smollm2-135m", [{"token_ids": [1, 2, 3], "loss_mask": [0, 1], "question_id": "q7"}], tmp_path)
    with pytest.raises(ValueError, match="no example has a model token"):
        run_sft("smollm2-135m", [{"token_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}], tmp_path, max_seq_tokens=2)
    with pytest.raises(ValueError, match="unknown LoRA key"):
        run_sft("smollm2-135m", [{"token_ids": [1, 2], "loss_mask": [0, 1]}], tmp_path, lora={"rank": 4})
    with pytest.raises(ValueError, match="lr must be a positive"):
        run_sft("smollm2-135m", [{"token_ids": [1, 2], "loss_mask": [0, 1]}], tmp_path, lr=0)
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        run_sft("smollm2-135m", [{"token_ids": [1, 2], "loss_mask": [0, 1]}], tmp_path, lr_schedule="cosine")
    with pytest.raises(ValueError, match="epoch_order must return a permutation"):
        run_sft("smollm2-135m", [{"token_ids": [1, 2], "loss_mask": [0, 1]}], tmp_path, epoch_order=lambda exs, rng: [0, 0])
    assert not (tmp_path / "policy").exists()


def test_cli_dialect_choices_follow_the_registry(capsys):
    from raggym.protocol import RouteRAGDialect, register_dialect, unregister_dialect

    class ProbeDialect(RouteRAGDialect):
        name = "sft_cli_probe"

    parser = build_parser()  # built before the registration: it must still see the new name
    args = ["--dialect", "sft_cli_probe", "--out", "unused"]
    with pytest.raises(SystemExit):
        parser.parse_args(args)
    assert "invalid choice: 'sft_cli_probe'" in capsys.readouterr().err
    register_dialect(ProbeDialect)
    try:
        assert parser.parse_args(args).dialect == "sft_cli_probe"
        assert "sft_cli_probe" in parser.format_help()
    finally:
        unregister_dialect("sft_cli_probe")
    with pytest.raises(SystemExit):
        parser.parse_args(args)


def test_kind_cues_open_the_first_thought_of_their_kind_only_and_leave_the_modes(small_world, small_world_retriever,
                                                                                  tokenizer):
    from experiments.recipe.sft import parse_kind_cues

    cues = parse_kind_cues("bridge=It chains two facts. ; comparison=It weighs two things.")
    assert cues == {"bridge": "It chains two facts.", "comparison": "It weighs two things."}
    bridge, one_hop = _pick(small_world, "bridge", 2), next(q for q in small_world.questions if q.hops == 1)
    cued, plain = golden_examples([bridge, one_hop], small_world_retriever, "routerag", tokenizer, modes="passage",
                                  kind_cues=cues, max_observation_tokens=64, show_progress=False)
    first_query = bridge.golden_trajectory[0]["query"]
    assert f"<think> It chains two facts. To answer this I first need {first_query}. </think>" in cued["text"]
    assert cued["text"].count("It chains two facts.") == 1  # the first thought only
    assert "It chains" not in plain["text"] and "It weighs" not in plain["text"]
    assert cued["modes"] == ["passage", "passage"] and cued["reward"] == 1.0
    with pytest.raises(ValueError, match="names the mode"):
        golden_examples([bridge], small_world_retriever, "routerag", tokenizer,
                        kind_cues={"bridge": "Search the graph."}, show_progress=False)
    with pytest.raises(ValueError, match="kind=sentence"):
        parse_kind_cues("bridge: It chains two facts.")
    assert parse_kind_cues("") == {}
