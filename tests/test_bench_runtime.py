"""experiments/bench/runtime.py's pure helpers: flag parsing, pooled rates, log-prob drift, the
engines' side-by-side summary and the process-tree memory sampler. No engine runs here."""

import argparse
import subprocess
import sys

import pytest

from experiments.bench import runtime as bench
from experiments.bench._rollout_runs import observation_tokens, plain_spec, rollout_summary
from raggym.trajectory import Rollout


def test_engine_and_dtype_flags_keep_order_drop_repeats_and_reject_unknown_names():
    assert bench.parse_choices("vllm, hf,vllm", bench.ENGINES, "--engines") == ["vllm", "hf"]
    assert bench.build_parser().parse_args(["--vllm-dtypes", "bfloat16"]).vllm_dtypes == ["bfloat16"]
    defaults = bench.build_parser().parse_args([])
    assert defaults.engines == ["hf", "vllm"] and defaults.vllm_dtypes == ["float32", "bfloat16"]
    for bad in ("hf,sglang", "", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated subset"):
            bench.parse_choices(bad, bench.ENGINES, "--engines")


def test_pooled_rate_is_total_tokens_over_total_seconds_not_a_mean_of_rates():
    runs = [{"model_tokens": 100, "seconds": 1.0}, {"model_tokens": 100, "seconds": 3.0}]
    assert bench.pooled_tok_s(runs) == pytest.approx(50.0)  # the mean of 100 and 33.3 would be 66.7
    assert bench.pooled_tok_s([{"tokens": 30, "cpu_seconds": 2.0}], "tokens", "cpu_seconds") == pytest.approx(15.0)
    assert bench.ratio(3.0, 2.0) == 1.5 and bench.ratio(None, 2.0) is None and bench.ratio(1.0, 0.0) is None


def test_logprob_drift_counts_only_sampled_tokens_of_every_sequence():
    sampled = [[0.0, -1.0, -2.0], [0.0, -0.5]]
    recomputed = [[-9.0, -1.1, -2.0], [-7.0, -0.2]]  # position 0 (the prompt) differs hugely but is masked
    masks = [[0, 1, 1], [0, 1]]
    drift = bench.logprob_drift(sampled, recomputed, masks)
    assert drift["tokens"] == 3
    assert drift["mean"] == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert drift["max"] == pytest.approx(0.3)
    assert bench.logprob_drift([[0.0]], [[1.0]], [[0]]) == {"mean": None, "max": None, "tokens": 0}
    with pytest.raises(ValueError):  # a recomputation of another length is a bug, not a shorter sum
        bench.logprob_drift([[0.0, -1.0]], [[0.0]], [[0, 1]])


def _phase(rollout, plain, plain_episode_lengths=None):
    same = plain_episode_lengths or plain
    return {"rollout_tok_s": rollout, "plain_tok_s": plain, "rollout_over_generate": round(rollout / plain, 3),
            "rollout_over_generate_episode_lengths": round(rollout / same, 3), "cpu_time": {"rollout_over_generate": 0.5}}


def test_side_by_side_compares_each_vllm_dtype_with_hf_and_checks_both_targets():
    hf = {"plain_tok_s": 100.0, "rollout_tok_s": 80.0, "cpu_time": {"rollout_over_generate": 0.7}}
    vllm = {"float32": _phase(180.0, 200.0, 150.0), "bfloat16": _phase(120.0, 300.0)}
    out = bench.side_by_side(hf, vllm, {"hf": {"total_mib": 1.0}}, {"float32": {"mean": 1e-5}})
    assert out["engines"] == ["hf", "vllm_float32", "vllm_bfloat16"]
    assert out["plain_generate_tok_s"] == {"hf": 100.0, "vllm_float32": 200.0, "vllm_bfloat16": 300.0}
    assert out["rollout_over_generate"] == {"hf": 0.8, "vllm_float32": 0.9, "vllm_bfloat16": 0.4}
    assert out["rollout_over_generate_episode_lengths"] == {"vllm_float32": 1.2, "vllm_bfloat16": 0.4}
    assert out["rollout_over_generate_cpu_time"] == {"hf": 0.7, "vllm_float32": 0.5, "vllm_bfloat16": 0.5}
    assert out["vllm_over_hf"] == {"plain_generate": {"float32": 2.0, "bfloat16": 3.0},
                                   "rollout": {"float32": 2.25, "bfloat16": 1.5}}
    assert out["bfloat16_over_float32"] == {"plain_generate": 1.5, "rollout": 0.667}
    met = {(t["name"], t["engine"]): t["met"] for t in out["targets"]}
    assert met == {("vllm_rollout_over_vllm_generate", "vllm_float32"): True,  # 0.9 >= 0.85
                   ("vllm_rollout_over_hf_rollout", "vllm_float32"): True,  # 2.25 >= 1.5
                   ("vllm_rollout_over_vllm_generate", "vllm_bfloat16"): False,  # 0.4
                   ("vllm_rollout_over_hf_rollout", "vllm_bfloat16"): True}  # 1.5, the boundary counts
    alone = bench.side_by_side(None, {"float32": _phase(90.0, 100.0)}, {}, {})
    assert "vllm_over_hf" not in alone and [t["name"] for t in alone["targets"]] == ["vllm_rollout_over_vllm_generate"]


def test_peak_rss_includes_child_processes():
    # A child that holds ~200 MiB until told to exit: the sampler must see it among the children.
    code = "import sys; b = bytearray(200 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); sys.stdin.read()"
    with bench.PeakRss(interval_s=0.05) as rss:
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            rss.sample()
        finally:
            child.communicate("", timeout=30)
    assert rss.peak["processes"] >= 1
    assert rss.peak["children_mib"] >= 190
    assert rss.peak["total_mib"] == pytest.approx(rss.peak["main_mib"] + rss.peak["children_mib"], abs=0.2)


def test_plain_work_counts_each_episodes_own_length_and_the_observations_it_prefilled():
    # prompt of 3, then model 2, observation 2, model 1: 3 model tokens, 2 observation tokens
    first = Rollout(token_ids=list(range(8)), loss_mask=[0, 0, 0, 1, 1, 0, 0, 1], prompt_length=3)
    second = Rollout(token_ids=list(range(5)), loss_mask=[0, 0, 1, 1, 1], prompt_length=2)  # one turn, no observation
    assert [observation_tokens(r) for r in (first, second)] == [2, 0]
    run = rollout_summary([first, second], seconds=2.0, cpu_seconds=1.0, retrieval_seconds=0.0)
    assert run["observation_tokens"] == 2 and run["episode_tokens"] == [first.response_length, second.response_length]
    spec = plain_spec({**run, "prompts": [[1, 2, 3], [4, 5]]})
    assert spec["episode_tokens"] == run["episode_tokens"]
    assert spec["tokens_per_prompt"] == round(run["model_tokens"] / 2)
