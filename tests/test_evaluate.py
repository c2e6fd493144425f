"""Evaluation harness: metric aggregation, the Markdown layout, the split helper, graph-less
indexes, and one small real run (SmolLM2 through the Ray rollout path)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.eval.harness import (SYSTEMS, aggregate, average_over_datasets, episode_metrics, markdown_table,
                                  plan_systems, resolve_policy, split_questions)
from raggym.data import Question


def _traj(answer, gold, *, modes=(), texts=(), gold_passages=(), seconds=0.0, cost=0.0, loss_mask=(), errors=0,
          truncated=False):
    return {"loss_mask": list(loss_mask),
            "episode": {"question_id": "q", "answer": answer, "gold_answers": list(gold), "modes": list(modes),
                        "queries": [f"query {i}" for i in range(len(modes))],
                        "retrieved_texts": [list(t) for t in texts], "gold_passages": list(gold_passages),
                        "retrieval_seconds": seconds, "retrieval_cost": cost, "num_format_errors": errors,
                        "truncated": truncated}}


def test_aggregate_matches_hand_computed_metrics():
    episodes = [
        _traj("Paris", ["Paris"], modes=["passage", "graph"], texts=[["Paris is a city"], ["France capital"]],
              gold_passages=["Paris is a city"], seconds=0.5, cost=10.0, loss_mask=[1, 1, 1, 0, 0, 1]),
        _traj("the big apple", ["New York"], modes=["hybrid"], texts=[["big city"]], seconds=0.1, cost=4.0,
              loss_mask=[1] * 6, errors=1),
        _traj(None, ["x"], loss_mask=[1, 1], errors=2, truncated=True),
    ]
    per = [episode_metrics(t) for t in episodes]
    assert [p["tokens"] for p in per] == [4, 6, 2]
    # EO of episode 1: retrieved tokens {paris, is, city, france, capital} vs gold {paris, is, city}:
    # P = 3/5, R = 1, F1 = 2·0.6·1 / 1.6 = 0.75. Episodes 2 and 3 have no gold passages.
    assert per[0]["eo"] == pytest.approx(0.75) and per[1]["eo"] is None and per[2]["eo"] is None
    # UAR: "paris" is supported (0); "big apple" -> "apple" is not (1/2); no answer -> undefined.
    assert per[0]["uar"] == 0.0 and per[1]["uar"] == pytest.approx(0.5) and per[2]["uar"] is None
    m = aggregate(per)
    assert m["n"] == 3
    assert m["em"] == pytest.approx(1 / 3) and m["f1"] == pytest.approx(1 / 3)
    assert m["eo"] == pytest.approx(0.75) and m["eo_questions"] == 1
    assert m["uar"] == pytest.approx(0.25) and m["uar_questions"] == 2
    assert m["retrieval_turns"] == pytest.approx(1.0)
    assert m["retrieval_seconds"] == pytest.approx(0.2) and m["retrieval_cost"] == pytest.approx(14 / 3)
    assert m["mode_counts"] == {"passage": 1, "graph": 1, "hybrid": 1}
    assert m["mode_mix"] == pytest.approx({"passage": 1 / 3, "graph": 1 / 3, "hybrid": 1 / 3, "searches": 3})
    assert m["tokens"] == pytest.approx(4.0)
    assert m["answered"] == pytest.approx(2 / 3) and m["truncated"] == pytest.approx(1 / 3)
    assert m["format_errors"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no episodes"):
        aggregate([])


def _metrics(em, f1, n=2, passage=0, graph=0):
    per = {"n": n, "em": em, "f1": f1, "cover_em": em, "eo": None, "uar": None, "retrieval_turns": 1.0,
           "retrieval_seconds": 0.01, "retrieval_cost": 5.0, "tokens": 10.0, "answered": 1.0, "format_errors": 0.0,
           "truncated": 0.0, "mode_counts": {"passage": passage, "graph": graph, "hybrid": 0}}
    s = passage + graph
    per["mode_mix"] = {"passage": passage / s if s else 0.0, "graph": graph / s if s else 0.0, "hybrid": 0.0, "searches": s}
    return per


def test_average_and_markdown_layout():
    by_dataset = {"musique": {"direct": _metrics(0.1, 0.2), "graph_only": _metrics(0.3, 0.5, graph=4)},
                  "hotpotqa": {"direct": _metrics(0.3, 0.4, passage=2)}}
    avg = average_over_datasets(by_dataset)
    assert avg["direct"]["em"] == pytest.approx(0.2) and avg["direct"]["f1"] == pytest.approx(0.3)
    assert avg["direct"]["datasets"] == ["musique", "hotpotqa"] and avg["direct"]["n"] == 4
    assert avg["direct"]["mode_mix"]["passage"] == 1.0 and avg["direct"]["mode_mix"]["searches"] == 2
    assert avg["direct"]["eo"] is None  # undefined everywhere stays undefined
    assert avg["graph_only"]["datasets"] == ["musique"]
    results = {"datasets": by_dataset, "average": avg,
               "skipped": [{"dataset": "hotpotqa", "system": "graph_only", "reason": "no graph"}], "notes": []}
    md = markdown_table(results).splitlines()
    assert md[0] == "| System | musique EM | musique F1 | hotpotqa EM | hotpotqa F1 | Avg EM | Avg F1 |"
    assert md[1] == "|---|---|---|---|---|---|---|"
    assert md[2] == "| direct | 10.0 | 20.0 | 30.0 | 40.0 | 20.0 | 30.0 |"
    assert md[3] == "| graph_only | 30.0 | 50.0 | – | – | 30.0† | 50.0† |"
    text = "\n".join(md)
    assert "skipped graph_only on hotpotqa: no graph" in text and "† averaged over" in text
    assert "| musique | graph_only | 2 | – | – | 1.00 | 10.0 | 5 | 0% / 100% / 0% | 10.0 | 100.0% |" in text


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), fraction=st.floats(0, 1), seed=st.integers(0, 2**31), shift=st.integers(0, 39))
def test_split_is_deterministic_disjoint_and_covering(n, fraction, seed, shift):
    qs = [Question(id=f"q{i}", question=f"question {i}?", answers=("a",)) for i in range(n)]
    train, heldout = split_questions(qs, fraction, seed)
    assert len(heldout) == round(fraction * n) and len(train) + len(heldout) == n
    assert {q.id for q in train}.isdisjoint({q.id for q in heldout})
    assert {q.id for q in train} | {q.id for q in heldout} == {q.id for q in qs}
    assert split_questions(qs, fraction, seed) == (train, heldout)
    # both parts keep the input order, and the split does not depend on it
    assert [qs.index(q) for q in train] == sorted(qs.index(q) for q in train)
    rotated = qs[shift % max(n, 1):] + qs[: shift % max(n, 1)]
    assert {q.id for q in split_questions(rotated, fraction, seed)[1]} == {q.id for q in heldout}


def test_split_rejects_bad_fraction():
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_questions([], 1.5, 0)


def test_graph_systems_are_skipped_without_a_graph():
    plan, skipped, notes = plan_systems(list(SYSTEMS), has_graph=False, dialect="routerag")
    assert [s for s, _ in plan] == ["direct", "vanilla_rag", "agent", "passage_only"]
    assert [s["system"] for s in skipped] == ["graph_only", "hybrid_only"]
    assert all("knowledge graph" in s["reason"] for s in skipped)
    specs = dict(plan)
    assert specs["agent"]["allowed_modes"] == ("passage",) and notes
    assert specs["direct"]["budget"] == 0 and specs["direct"]["prompt"] == "direct"
    plan, skipped, notes = plan_systems(list(SYSTEMS), has_graph=True, dialect="routerag")
    assert len(plan) == len(SYSTEMS) and not skipped and not notes
    assert dict(plan)["agent"]["allowed_modes"] is None and dict(plan)["hybrid_only"]["allowed_modes"] == ("hybrid",)
    with pytest.raises(ValueError, match="unknown system"):
        plan_systems(["oracle"], has_graph=True, dialect="routerag")


def test_policy_resolution_picks_the_latest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    for step, complete in ((1, True), (2, True), (3, False)):
        ckpt = run / "checkpoints" / f"step-{step:06d}"
        (ckpt / "policy").mkdir(parents=True)
        (ckpt / "policy" / "config.json").write_text("{}")
        if complete:
            (ckpt / "trainer_state.json").write_text("{}")
    assert resolve_policy(str(run)) == str(run / "checkpoints" / "step-000002" / "policy")
    assert resolve_policy(str(run / "checkpoints" / "step-000001")) == str(run / "checkpoints" / "step-000001" / "policy")
    from raggym.models import ModelSpecError

    with pytest.raises(ModelSpecError, match="no complete checkpoint"):
        (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
        resolve_policy(str(tmp_path / "empty"))


# ----------------------------------------------------------------------------- CLI


def test_cli_help_and_bad_arguments(capsys, tmp_path):
    from experiments.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["eval", "--help"])
    assert exc.value.code == 0 and "--max-questions" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--systems", "direct,oracle"])
    assert exc.value.code == 2 and "unknown system 'oracle'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--max-questions", "0"])
    assert exc.value.code == 2 and "positive integer" in capsys.readouterr().err
    assert main(["eval", "--dataset", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", "--dataset", "synthetic", "--dataset", "other=synthetic", "--index", str(tmp_path)]) == 2
    assert "exactly one --dataset" in capsys.readouterr().err
    assert main(["eval", "--policy", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "model spec" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- real run


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.integration  # ~100 s of SmolLM2 through Ray: CI runs it in make test-integration
def test_small_real_run_through_ray(ray_local, tmp_path):
    """SmolLM2 on a tiny synthetic world written without OpenIE (a graph-less index): 4 questions,
    vanilla RAG and the agent; hybrid_only is skipped with its reason."""
    import ray

    from experiments.eval.harness import evaluate
    from raggym.data import write_corpus, write_questions
    from raggym.data.synthetic import generate_world

    world = generate_world(seed=3, n_entities=60, n_questions=12, max_hops=1)
    write_corpus(tmp_path / "data" / "corpus.jsonl", world.corpus)
    write_questions(tmp_path / "data" / "questions.jsonl", world.questions)
    dataset = {"name": "tiny", "source": "files", "corpus": str(tmp_path / "data" / "corpus.jsonl"),
               "questions": str(tmp_path / "data" / "questions.jsonl"), "openie": None, "index_dir": None}
    out = tmp_path / "eval"
    res = evaluate("smollm2-135m", [dataset], ["vanilla_rag", "agent", "hybrid_only"], out, max_questions=4,
                   max_response_tokens=12, max_turn_tokens=12, top_k=2, retrieval_budget=1, workers=1,
                   show_progress=False, index_cache=tmp_path / "indexes")
    assert ray.is_initialized()  # the caller's Ray is left running
    assert res["skipped"] == [{"dataset": "tiny", "system": "hybrid_only",
                               "reason": "the index has no knowledge graph (no OpenIE triples)"}]
    assert any("passage mode only" in n for n in res["notes"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["datasets"] == json.loads(json.dumps(res["datasets"]))
    assert saved["skipped"] == res["skipped"] and set(saved["average"]) == {"vanilla_rag", "agent"}
    md = (out / "results.md").read_text()
    assert md.startswith("| System | tiny EM | tiny F1 | Avg EM | Avg F1 |") and "skipped hybrid_only on tiny" in md
    assert not (out / "trajectories" / "tiny__hybrid_only.jsonl").exists()
    for system in ("vanilla_rag", "agent"):
        lines = [json.loads(x) for x in (out / "trajectories" / f"tiny__{system}.jsonl").read_text().splitlines()]
        assert len(lines) == 4 and {x["question_id"] for x in lines} == {q.id for q in world.questions[:4]}
        for line in lines:
            assert line["metrics"] == json.loads(json.dumps(episode_metrics(line)))
            assert 0 < line["metrics"]["tokens"] <= 12 and line["metrics"]["tokens"] == sum(line["loss_mask"])
            assert line["episode"]["gold_passages"]  # gold evidence travelled to the runner
        again = aggregate([x["metrics"] for x in lines])
        got = res["datasets"]["tiny"][system]
        for key, value in again.items():
            assert got[key] == (pytest.approx(value) if isinstance(value, float) else value), key
        assert got["eo"] is not None and got["eo_questions"] == 4
        assert not math.isnan(got["f1"])
    rag = res["datasets"]["tiny"]["vanilla_rag"]
    assert rag["retrieval_turns"] == 1.0 and rag["mode_mix"]["passage"] == 1.0 and rag["retrieval_cost"] > 0
    agent_modes = {m for x in (out / "trajectories" / "tiny__agent.jsonl").read_text().splitlines()
                   for m in json.loads(x)["episode"]["modes"]}
    assert agent_modes <= {"passage"}
