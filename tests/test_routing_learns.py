"""A short RL run moves the mode choice on graph-needing questions the way the reward points (issue #14).

The routing task's ``graph_only`` questions can be answered only from graph retrieval (passage
recall@3 about 0.1, graph 1.0: ``docs/results.md``), so under RouteRAG's stage-1 reward (EM) a
search in graph mode is the rewarded choice. This test runs the real pipeline at a small size with
``make demo``'s own settings (``raggym demo``'s defaults, read from its parser): the routing world;
the demo's format-only SFT (``routing.format_only_sft``: every SFT question written once with a
passage search and once with a graph search, an even prior blind to the question); then stage-1
GRPO at the demo's rollout temperature on ``graph_only`` training questions through
``experiments.train`` (``runtime=local``: the rollout loop, rewards, estimator and DeepSpeed learner
of a real run, in this process). It reads the policy's graph preference at the mode slot of
held-out ``graph_only`` questions before and after (``graph_preference``: the logits'
p(graph) / (p(graph) + p(passage)), deterministic for given weights).

It fails when the loop stops learning in the rewarded direction: an advantage or loss sign
flipped, a loss mask that misses the model's tokens, log-probs that no longer belong to the
sampled ids. docs/results.md records the preference this run reaches, and where the same run goes
with the advantages negated (``centred = mean - rewards`` in ``raggym.algorithms.advantages``).
"""

from __future__ import annotations

import statistics

import pytest

from experiments.recipe.config import load_config
from experiments.eval.report import read_jsonl
from experiments.recipe.routing import (EVAL_KWARGS, RL_CONFIG, build_task, format_only_sft, graph_preference,
                                        mode_probes)

# `make test-slow`, not CI: docs/development.md says which CI tests catch what this one would.
pytestmark = pytest.mark.slow

STEPS = 6
MIN_RISE = 0.05  # mean graph preference, absolute; measured rise and its negated-advantage fall: docs/results.md


def test_stage1_rl_raises_the_graph_preference_on_graph_needing_questions(tmp_path):
    import torch

    from experiments.cli import build_parser
    from experiments.demo import demo_settings
    from experiments.eval.harness import resolve_policy
    from experiments.train import train
    from raggym.data import write_questions
    from raggym.models import load_policy, load_policy_tokenizer
    from raggym.retrieval import Retriever

    torch.manual_seed(0)
    settings = demo_settings(build_parser().parse_args(["demo"]))
    task = build_task(tmp_path, seed=0, entities=300, questions=400, heldout=48, show_progress=False)
    retriever = Retriever.load(task.index_dir)
    tokenizer = load_policy_tokenizer(settings.policy)
    sft = format_only_sft(task, retriever, tokenizer, settings, 0, tmp_path / "sft", EVAL_KWARGS, show_progress=False)
    probes = mode_probes(task, retriever, tokenizer, EVAL_KWARGS)["graph_only"]
    before = graph_preference(load_policy(sft["policy_dir"])[0], tokenizer, probes)
    assert statistics.mean(before) <= 1 - 2 * MIN_RISE, (
        f"the SFT policy already prefers graph (mean p(graph) {statistics.mean(before):.3f}): no room for RL to show a rise")

    graph_only_train = [q for q in task.train if task.kinds[q.id] == "graph_only"]
    write_questions(tmp_path / "graph_only_train.jsonl", graph_only_train)
    run_dir = tmp_path / "grpo"
    train(load_config(str(RL_CONFIG), [
        "runtime=local", "rollout.workers=1", "rollout.env_runners=1", "num_learners=1",
        f"run.out_dir={run_dir}", "run.seed=0", f"run.steps={STEPS}", f"reward.stage2_start={STEPS + 1}",
        f"policy.model={sft['policy_dir']}", f"data.corpus={task.world_dir / 'corpus.jsonl'}",
        f"data.questions={tmp_path / 'graph_only_train.jsonl'}", f"data.openie={task.world_dir / 'openie.json'}",
        f"data.index_dir={task.index_dir}", f"rollout.prompts_per_step={settings.prompts_per_step}",
        f"rollout.group_size={settings.group_size}",
        f"learner.mini_batch_size={settings.prompts_per_step * settings.group_size}", *settings.overrides]))
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert len(steps) == STEPS
    assert sum(s["advantage_abs_mean"] for s in steps) > 0, "no group had differing rewards: no learning signal"
    after = graph_preference(load_policy(resolve_policy(run_dir))[0], tokenizer, probes)

    rise = statistics.mean(after) - statistics.mean(before)
    print(f"graph preference, held-out graph_only: {statistics.mean(before):.3f} -> {statistics.mean(after):.3f}; "
          f"reward per step {[round(s['reward_mean'], 3) for s in steps]}")
    assert rise >= MIN_RISE, (f"graph preference on held-out graph_only questions moved {rise:+.3f} in {STEPS} steps "
                              f"(before {statistics.mean(before):.3f}, after {statistics.mean(after):.3f}); "
                              f"rewards per step {[round(s['reward_mean'], 3) for s in steps]}")
