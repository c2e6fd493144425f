"""End to end on local Ray (CPU): GRPO steps with SmolLM2-135M on a vLLM rollout worker, a learner
group of 2 (ZeRO-2, gloo) and the synthetic-world retrieval service; real kills and a resume as
a Ray job submitted to a `ray start --head` cluster with token auth on.

The config is ``cpu_tiny.yaml`` with two changes that give the runs a learning signal to check:
weight decay 0 (so parameters move only if the policy gradient is non-zero) and the test reward
``shorter_transcript`` of ``tests/e2e_trainer.py`` (registered through the public reward
registry; the untrained SmolLM2 earns 0 under every built-in reward), and a third that makes
token-exact resume a fair demand: vLLM made batch-invariant, ``max_num_seqs: 1`` and no prefix
cache (``BATCH_INVARIANT_VLLM``). As configured by default vLLM batches whatever requests are in
flight, so a row's batch neighbours depend on timing, and on CPU a row's logits move by up to ~4e-5
with its neighbours (GEMM kernels chosen by row count; a prefix-cached context is computed in other
pieces than a fresh one); now and then that flips a sampled token. One sequence at a time, each
context prefilled whole, two runs of the same step sample identically (measured: six seeded
requests together, alone and in reverse order gave identical ids and log-probs, bit for bit).
The trainer runs as its own process through that file, and as a Ray job.

One cluster serves the module (started here, stopped here). Runs: A = 2 uninterrupted steps;
B = the same run SIGKILLed in the middle of saving step 2 (step 1's checkpoint committed), then
resumed to step 2 by `ray job submit`. A run killed right after a committed checkpoint and resumed by
a new driver is ``tests/test_two_node.py``'s case (CI's ``make test-cluster``), so it is not repeated
here: each trainer launch costs minutes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

# Heavy end-to-end module (a Ray cluster with token auth, GRPO runs, kills and a resume as a Ray job): `make test-integration`.
pytestmark = pytest.mark.integration

import deepspeed  # noqa: E402,F401  (the learner group needs it; fail loudly when it is missing)
import ray  # noqa: E402,F401

from experiments.recipe.training import HOLD_CHECKPOINT_ENV  # noqa: E402
from free_ports import free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = REPO / "experiments" / "configs" / "cpu_tiny.yaml"
TRAINER = "tests/e2e_trainer.py"  # relative to the repository: the Ray job's working dir is a copy of it
REWARD_METHOD = "shorter_transcript"
# one sequence at a time, every context prefilled whole: samples independent of scheduling (docs/runtime.md)
BATCH_INVARIANT_VLLM = {"kv_cache_gib": 1, "max_num_seqs": 1, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    cfg = yaml.safe_load(BASE_CONFIG.read_text(encoding="utf-8"))
    cfg["method"] = REWARD_METHOD
    cfg["reward"] = {"method": REWARD_METHOD}
    cfg["learner"].setdefault("optimizer", {})["weight_decay"] = 0.0
    # batch-invariant vLLM: a resumed step samples what the uninterrupted one did
    cfg["rollout"].update({"engine": "vllm-async", "workers": 1, "engine_kwargs": BATCH_INVARIANT_VLLM})
    path = tmp_path_factory.mktemp("config") / "e2e.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path



@pytest.fixture(scope="module")
def cluster():
    """`ray start --head` with token auth; yields (gcs address, dashboard url, env for the CLI)."""
    ray_bin = Path(sys.executable).parent / "ray"
    temp_dir = f"/tmp/rg{secrets.token_hex(4)}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token", "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([str(ray_bin), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    port, dash, *agent = free_ports(6)
    # The job agent's HTTP port is fixed (52365) by default; under `pytest -n 2` another module's
    # local Ray may hold it, and then no job can be submitted. Give this cluster its own ports.
    agent_ports = [f"--{name}={p}" for name, p in zip(("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                       "runtime-env-agent-port", "metrics-export-port"), agent)]
    subprocess.run([str(ray_bin), "start", "--head", f"--port={port}", f"--dashboard-port={dash}", *agent_ports, "--num-cpus=8",
                    "--include-dashboard=true", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", env
    finally:
        # `ray stop` would stop every Ray instance on the machine; end only this cluster's processes.
        for signal in ("-TERM", "-KILL"):
            subprocess.run(["pkill", signal, "-f", temp_dir], check=False)
            subprocess.run(["pkill", signal, "-f", f"gcs_server_port={port}"], check=False)
            time.sleep(1.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _trainer_args(config: Path, out_dir: Path, steps: int, *extra: str) -> list[str]:
    return [TRAINER, "--config", str(config), "--json", f"run.out_dir={out_dir}", f"run.steps={steps}",
            "run.dump_trajectories=true", *extra]


def _train(config: Path, out_dir: Path, address: str, steps: int, env: dict) -> dict:
    """The trainer as its own driver process against the cluster, run to the end."""
    proc = subprocess.run([sys.executable, *_trainer_args(config, out_dir, steps, f"ray.address={address}")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _train_until(config: Path, out_dir: Path, address: str, env: dict, log: Path, ready, what: str) -> str:
    """Start the trainer (2 steps), SIGKILL it as soon as ``ready()`` holds; returns its output."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *_trainer_args(config, out_dir, 2, f"ray.address={address}")],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the trainer {'exited' if proc.poll() is not None else 'ran too long'} "
                                     f"before {what}:\n{log.read_text()[-5000:]}")
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # no cleanup of any kind runs in the trainer
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return log.read_text()


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _policy_tensors(ckpt: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted((ckpt / "policy").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _response_logprobs(model, row: dict) -> float:
    """Sum of the log-probabilities of a trajectory's model tokens (loss mask 1) under ``model``."""
    import torch

    ids = torch.tensor([row["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    taken = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return float(taken[torch.tensor(row["loss_mask"][1:], dtype=torch.bool)].sum())


@pytest.fixture(scope="module")
def run_a(cluster, config_file, tmp_path_factory):
    address, _, env = cluster
    out = tmp_path_factory.mktemp("runA")
    return out, _train(config_file, out, address, 2, env)


def test_two_grpo_steps_with_a_learning_signal_update_the_policy(run_a):
    out, last = run_a
    from raggym.models import converted_checkpoint, resolve_model_spec
    from safetensors.numpy import load_file

    metrics = _read(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # the groups' rewards differ, so the step has a direction and a size
        assert m["reward_std"] > 0 and m["advantage_abs_mean"] > 0
        assert np.isfinite(m["learner/grad_norm"]) and m["learner/grad_norm"] > 0
    # with weight decay 0, parameters change only through the policy gradient
    initial = load_file(str(converted_checkpoint(resolve_model_spec("smollm2-135m")) / "model.safetensors"))
    trained = _policy_tensors(out / "checkpoints" / "step-000002")
    common = [k for k in trained if k in initial]
    assert common and any(not np.array_equal(trained[k], initial[k]) for k in common)
    # sync works: the learner version reached the workers, and step 2 was generated by version 1
    assert [m["sync/weight_version"] for m in metrics] == [1.0, 2.0]
    assert metrics[0]["weight_versions"] == [0] and metrics[1]["weight_versions"] == [1]
    assert (out / "tb").is_dir() and any((out / "tb").iterdir())


def test_the_step_raises_the_rewarded_samples_log_probability(run_a):
    """After step 1, every sample with a positive advantage (the shorter transcript of its group)
    is more likely under the new policy, and every sample with a negative advantage less likely."""
    out, _ = run_a
    from raggym.models import load_policy

    rows = _read(out / "trajectories" / "step-000001.jsonl")
    before, _ = load_policy("smollm2-135m")
    after, _ = load_policy(str(out / "checkpoints" / "step-000001" / "policy"))
    change = [_response_logprobs(after, r) - _response_logprobs(before, r) for r in rows]
    signs = [np.sign(r["advantage"]) for r in rows]
    assert 1 in signs and -1 in signs, [r["advantage"] for r in rows]
    for sign, delta, row in zip(signs, change, rows):
        if sign != 0:
            assert np.sign(delta) == sign, (row["advantage"], delta)


def test_masks_spans_rewards_and_advantages_match_the_algorithms_layer(run_a):
    out, _ = run_a
    import torch

    from raggym.algorithms import grpo_advantages
    from raggym.algorithms.spans import SpanLabel
    from raggym.models import load_policy_tokenizer
    from raggym.rewards import EpisodeOutcome

    tok = load_policy_tokenizer("smollm2-135m")
    for step in (1, 2):
        rows = _read(out / "trajectories" / f"step-{step:06d}.jsonl")
        assert len(rows) == 4  # 2 prompts x G=2
        for t in rows:
            labels, mask = t["span_labels"], t["loss_mask"]
            assert len(labels) == len(mask) == len(t["token_ids"]) == len(t["sampled_logprobs"])
            for lab, m in zip(labels, mask):
                assert m == (0 if lab in (SpanLabel.PROMPT, SpanLabel.OBSERVATION) else 1)
            assert all(lab == SpanLabel.PROMPT for lab in labels[: t["prompt_length"]])
            # the model-token spans decode to exactly what the engine generated
            spans, current = [], []
            for tok_id, m in zip(t["token_ids"], mask):
                if m:
                    current.append(tok_id)
                elif current:
                    spans.append(current)
                    current = []
            if current:
                spans.append(current)
            assert spans == [t["token_ids"][x["start"]:x["end"]] for x in t["turns"]]  # the turns' spans
            assert [tok.decode(s) for s in spans] == [x["text"] for x in t["turns"]]
            assert sum(mask) <= 32
        outcomes = [EpisodeOutcome.from_dict(t["outcome"]) for t in rows]
        assert outcomes == [EpisodeOutcome.from_dict(t["episode"]) for t in rows]  # the record and its outcome agree
        rewards = [-len(o.response_text) / 100.0 for o in outcomes]  # shorter_transcript (tests/e2e_trainer.py)
        np.testing.assert_allclose([t["reward"] for t in rows], rewards, atol=1e-9)
        adv = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), [t["prompt_id"] for t in rows])
        np.testing.assert_allclose([t["advantage"] for t in rows], adv.numpy(), atol=1e-6)


def _submit(dashboard: str, env: dict, args: list[str]) -> subprocess.CompletedProcess:
    """`ray job submit`, retried while the freshly started dashboard has no job agent yet."""
    ray_bin = Path(sys.executable).parent / "ray"
    deadline = time.monotonic() + 300  # the job agent can take minutes to register on a busy 2-core machine
    while True:
        job = subprocess.run([str(ray_bin), "job", "submit", "--address", dashboard, "--working-dir", str(REPO), "--", *args],
                             env=env, capture_output=True, text=True, timeout=900)
        if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr or time.monotonic() > deadline:
            return job
        time.sleep(5)


def test_killed_runs_resume_from_the_last_committed_checkpoint_as_a_ray_job(run_a, cluster, config_file, tmp_path_factory):
    """Run B: SIGKILL in the middle of saving step 2 (all its files written, not committed), step 1's
    checkpoint committed; resume as a Ray job. The job must start from step 1 and reproduce run A's
    step-2 batch and parameters."""
    out_a, _ = run_a
    address, dashboard, env = cluster
    out_b = tmp_path_factory.mktemp("runB")
    ckpts = out_b / "checkpoints"

    log = out_b / "killed.log"
    _train_until(config_file, out_b, address, {**env, HOLD_CHECKPOINT_ENV: "2"}, log,
                 lambda: "holding checkpoint" in log.read_text(), "the step-2 save")
    assert (ckpts / "step-000001" / "trainer_state.json").exists()  # step 1 committed ...
    half = ckpts / ".tmp-step-000002"  # ... and step 2 written but not committed
    assert (half / "trainer_state.json").exists() and any((half / "policy").glob("*.safetensors"))
    assert not (ckpts / "step-000002").exists()

    job = _submit(dashboard, env, ["python", *_trainer_args(config_file, out_b, 2)])
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert f"resumed from {ckpts / 'step-000001'} at step 1" in job.stdout
    # the killed process logged step 2 before its save was killed; the job, resuming from step 1,
    # rewinds the logs to that checkpoint, so step 2 appears once (the job's)
    assert [m["step"] for m in _read(out_b / "metrics.jsonl")] == [1, 2]
    assert not half.exists()  # the job's own save replaced the half-written one
    # the step-2 batch and the step-2 parameters equal the uninterrupted run's
    a2, b2 = _read(out_a / "trajectories" / "step-000002.jsonl"), _read(out_b / "trajectories" / "step-000002.jsonl")
    assert [t["token_ids"] for t in a2] == [t["token_ids"] for t in b2]
    pa, pb = _policy_tensors(out_a / "checkpoints" / "step-000002"), _policy_tensors(ckpts / "step-000002")
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=0, atol=1e-6)


def test_job_submission_without_the_token_is_refused(cluster):
    _, dashboard, env = cluster
    plain = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    refused = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "list", "--address", dashboard],
                             env=plain, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "token" in (refused.stdout + refused.stderr).lower()
