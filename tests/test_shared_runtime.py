"""One runtime for several runs: ``open_runtime`` → ``evaluate(..., runtime=)`` → ``train(stage 1,
runtime=)`` → ``train(stage 2, resume, runtime=)``, as the routing study and ``make demo`` do.

The tiny RouteRAG recipe on a local Ray with the default engine (vLLM's ``AsyncLLM`` in a rollout
worker actor) and a small random Llama: one engine start for an evaluation and two training stages. The checks: the
second stage resumes the first's checkpoint on the same learner and engine (steps and weight
versions continue, the engine samples the latest weights), neither ``train`` nor ``evaluate``
shuts the shared runtime down, and a run that does not match the runtime is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from experiments.recipe.config import load_config

pytestmark = pytest.mark.integration  # a vLLM engine and two training stages: about a minute here

CONFIG = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "routerag_tiny.yaml"


def stage_config(policy: str, index_dir: Path, out: Path, steps: int, *overrides: str):
    return load_config(str(CONFIG), [f"run.steps={steps}", "run.resume=true", f"run.out_dir={out}",
                                     f"policy.model={policy}", f"data.index_dir={index_dir}", "run.checkpoint_every=1",
                                     *overrides])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_vllm_policy):
    from experiments.train import open_runtime

    root = tmp_path_factory.mktemp("shared-runtime")
    out = root / "grpo"
    first = stage_config(tiny_vllm_policy, root / "index", out, 1)
    try:
        runtime = open_runtime(first)  # starts a local Ray (the recipe's ray.num_cpus)
        try:
            yield {"runtime": runtime, "root": root, "out": out, "policy": tiny_vllm_policy, "first": first}
        finally:
            runtime.shutdown()
    finally:
        ray.shutdown()


def heldout_dataset(root: Path, cfg) -> list[dict]:
    """The tiny recipe's synthetic world as an evaluation dataset over the runtime's own index."""
    from experiments.recipe.config import to_plain
    from raggym.data import write_corpus, write_questions
    from raggym.data.synthetic import generate_world

    world = generate_world(**to_plain(cfg.data.synthetic))
    write_corpus(root / "corpus.jsonl", world.corpus)
    ids = {p.id for p in world.corpus}  # (this world keeps some facts in a table corpus of its own)
    write_questions(root / "heldout.jsonl", [q for q in world.questions if set(q.gold_passage_ids) <= ids][-4:])
    return [{"name": "tiny-heldout", "source": "files", "corpus": str(root / "corpus.jsonl"),
             "questions": str(root / "heldout.jsonl"), "index_dir": str(root / "index")}]


def test_an_evaluation_and_two_stages_share_one_engine_and_learner(shared):
    from experiments.eval.harness import evaluate
    from experiments.train import train

    rt, root, out = shared["runtime"], shared["root"], shared["out"]
    limits = {k: int(shared["first"].rollout[k]) for k in ("max_response_tokens", "max_turn_tokens", "max_observation_tokens")}
    results = evaluate(shared["policy"], heldout_dataset(root, shared["first"]), ["agent"], root / "eval", runtime=rt,
                       show_progress=False, **limits)
    assert results["datasets"]["tiny-heldout"]["agent"]["n"] == 4
    assert results["settings"]["engine"] == "vllm-async"

    train(shared["first"], runtime=rt)
    assert rt.learners.version == 1
    second = stage_config(shared["policy"], root / "index", out, 2)
    train(second, runtime=rt)  # resumes step 1's checkpoint on the same learner, goes on to step 2
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert [r["learner/weight_version"] for r in records] == [1.0, 2.0]
    assert rt.learners.version == 2
    # still open, and the engine holds the learner's latest weights: its samples carry version 2
    # and the learner's recomputed log-probs of them match the engine's (the logged drift)
    from envs.rollout import EpisodeRequest
    from experiments.recipe.training import load_run_data, sampling_params

    question = load_run_data(second, out).questions[0]
    rollouts = rt.rollout([EpisodeRequest(question, "after:0")], sampling_params(second, 0))
    assert {v for r in rollouts for v in r.weight_versions} == {2}
    assert records[-1]["learner/logprob_drift_mean"] <= 1e-4
    # a run without a checkpoint to resume would start from the shared learner's trained weights
    with pytest.raises(ValueError, match="no checkpoint to resume from"):
        train(stage_config(shared["policy"], root / "index", root / "fresh", 1), runtime=rt)


def test_a_run_that_does_not_match_the_shared_runtime_is_refused(shared):
    from experiments.eval.harness import evaluate
    from experiments.train import train

    rt, root = shared["runtime"], shared["root"]
    other_policy = stage_config("smollm2-135m", root / "index", root / "other", 1)
    with pytest.raises(ValueError, match="policy.model"):
        train(other_policy, runtime=rt)
    with pytest.raises(ValueError, match="max_turn_tokens"):
        evaluate(shared["policy"], heldout_dataset(root, shared["first"]), ["agent"], root / "eval2", runtime=rt,
                 show_progress=False, max_turn_tokens=int(shared["first"].rollout.max_turn_tokens) + 1,
                 max_response_tokens=int(shared["first"].rollout.max_response_tokens),
                 max_observation_tokens=int(shared["first"].rollout.max_observation_tokens))
