"""A two-node Ray cluster on this machine: what a real cluster breaks, caught here (issue #16).

The head node runs in this machine's mount namespace; the worker node in its own
(``unshare --mount``) with a private, empty ``/tmp``: a file the head writes under ``/tmp`` does
not exist on the worker, as on two machines. A real worker node has its own install of the code,
so the checkout and its Python environment, where they lie under ``/tmp`` (a clone there), are
bound back into the worker's ``/tmp`` at the same paths, and nothing else of the head's ``/tmp``.
Token auth is on. Custom resources put the index shard, the env runner and the learner (rank 0,
which writes the checkpoint) on the worker node, and the rollout engine on the head; the trainer's
driver runs on the head. The run's storage is a directory both nodes see (under /var/tmp, which the
worker's namespace still shares).

Cases, on one cluster: a relative ``run.out_dir`` and one under the head's private ``/tmp``, each
refused at start naming the problem; 2 GRPO steps uninterrupted, and the same run SIGKILLed after
its step-1 checkpoint and resumed by a new driver, whose step 2 must equal the uninterrupted one.
Runs in ``make test-cluster`` (marker ``cluster``), which ``.ci/run`` calls after ``make test``.

The recipe is the smallest that still trains: one prompt of two samples per step, a one-turn
budget of 16 tokens, one engine, one shard, one learner at ZeRO stage 0. Three trainer launches are the
minimum for the resume case, so the config is what decides the test's time; every wait has a
timeout, and a phase that times out fails with the tail of its log. Each phase's wall time is
printed (``make test-cluster`` runs pytest with ``-s``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from free_ports import free_ports

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = REPO / "experiments" / "configs" / "cpu_tiny.yaml"
TRAINER = "tests/e2e_trainer.py"  # the trainer with the `shorter_transcript` test reward registered
WORKER_LABEL, HEAD_LABEL = "raggym_worker_node", "raggym_head_node"
PLACEMENT = [  # shard, env runner and learner on the worker node; the engine on the head
    f"retrieval.shard_resources.{WORKER_LABEL}=1", f"rollout.env_runner_resources.{WORKER_LABEL}=1",
    f"learner_resources.resources.{WORKER_LABEL}=1", f"rollout.worker_resources.{HEAD_LABEL}=1",
    # the weights cross the nodes through the gloo broadcast (the CPU twin of vLLM's pynccl path)
    "rollout.weight_sync=collective",
]
# Object store per node: nothing large goes through it (weights use the broadcast, shards are
# read from the shared path), and Ray's default (30% of RAM per node) only invites memory pressure.
OBJECT_STORE_BYTES = 200 * 1024**2
NODE_START_TIMEOUT_S = 180
# Ray gives a joining node's raylet a fixed 30 s to register with the GCS (ray/_private/node.py), then
# `ray start` exits 1; on a shared 2-core machine that can pass. Such a start is retried; any other exit fails.
WORKER_START_ATTEMPTS = 3
RAY_STARTUP_TIMEOUT = "The current node timed out during startup"
TRAIN_TIMEOUT_S = 480  # one trainer launch: 1.5-3 min on this 2-core machine, 5 when it is shared
REFUSAL_TIMEOUT_S = 180  # a launch that must stop at its storage check
SHARED_PARENT = "/var/tmp"  # a directory both nodes see (the worker's /tmp is its own)
PRIVATE_TMP = Path("/tmp")  # the directory the worker node has its own, empty copy of
KEEP_LOGS_ENV = "RAGGYM_TWO_NODE_LOGS"  # a directory to copy the logs to before the cluster's storage is removed
# The resumed step must sample what the uninterrupted one did, so the engine must be batch-invariant
# (docs/runtime.md, "What reproduces needs"): vLLM one sequence at a time, every context prefilled whole.
RESUME_EXACT_ENGINE = {"engine": "vllm-async",
                       "engine_kwargs": {"kv_cache_gib": 1, "max_num_seqs": 1, "enable_prefix_caching": False}}


def _install_paths_under_tmp() -> list[Path]:
    """The checkout and the Python environment running it, where they lie under /tmp.

    The worker node must see them at the same paths (the venv's scripts and its editable install name
    them, and so do the module paths the driver passes), as a real node has its own install there. Each
    path counts as written and resolved (either may be a symlink's); one inside another is covered by
    that one's bind.
    """
    used = [REPO, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent]
    paths = {p for q in used for p in (Path(os.path.abspath(q)), q.resolve())}
    under = sorted(p for p in paths if p.is_relative_to(PRIVATE_TMP))
    if PRIVATE_TMP in under:
        pytest.fail(f"the checkout or its Python environment is /tmp itself ({used}): the worker node's /tmp "
                    "could not be private")
    return [p for p in under if not any(p != q and p.is_relative_to(q) for q in under)]


def _worker_node_command(ray_start: list[str]) -> str:
    """The shell command the worker node runs in its own mount namespace: a fresh tmpfs on /tmp, into
    which the install paths under /tmp are bound back, then ``ray start`` from the checkout.

    Each path is opened before the tmpfs hides it and bound from that descriptor (``/proc/self/fd/N``,
    not canonicalized: canonicalizing would resolve it to the new, empty directory).
    """
    binds = _install_paths_under_tmp()
    fds = range(3, 3 + len(binds))
    steps = [f"exec {' '.join(f'{fd}<{shlex.quote(str(p))}' for fd, p in zip(fds, binds))}"] if binds else []
    steps.append(f"mount -t tmpfs tmpfs {PRIVATE_TMP}")
    for fd, path in zip(fds, binds):
        steps.append(f"mkdir -p {shlex.quote(str(path))} && "
                     f"mount --no-canonicalize --bind /proc/self/fd/{fd} {shlex.quote(str(path))}")
    steps.append(f"cd {shlex.quote(str(REPO))}")
    close = "".join(f"{fd}<&- " for fd in fds)
    return " && ".join(steps) + f" && exec {close}" + " ".join(shlex.quote(a) for a in ray_start)


def _phase(name: str, t0: float) -> None:
    print(f"[two-node] {name}: {time.monotonic() - t0:.1f} s", flush=True)



def _stop(*procs: subprocess.Popen | None) -> None:
    """Stop process groups we started, together (`ray start --block` stops its node's processes on SIGTERM)."""
    running = [p for p in procs if p is not None and p.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    for proc in running:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _tail(path: Path, n: int = 6000) -> str:
    """The end of a log, after a line saying so when Ray killed a worker for memory."""
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace")
    return _memory_note(text) + text[-n:]


def _memory_note(log: str) -> str:
    if not re.search(r"memory pressure|low on memory|OutOfMemoryError", log):
        return ""
    return ("NOTE: Ray's memory monitor killed a worker (host memory above its threshold): check what else was "
            "using this machine's memory; the test's own processes peak at about 8 GB.\n")


@pytest.fixture(scope="module")
def cluster():
    """Head + worker node (private /tmp), token auth; yields (address, env, shared storage dir)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.fail("the two-node test needs `unshare` and root (a private mount namespace for the worker node)")
    t0 = time.monotonic()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_AUTH_MODE": "token",
           "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           # a stopped node exits at once instead of draining for 30 s (nothing here serves traffic)
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           # no idle workers prestarted for the first driver (the node-count probe, which needs none)
           "RAY_prestart_worker_first_driver": "0"}
    subprocess.run([str(bin_dir / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=60)
    tag = secrets.token_hex(4)
    head_tmp, worker_tmp = f"/tmp/rgh{tag}", f"/tmp/rgw{tag}"
    # On disk, not in RAM (/dev/shm): checkpoints are ~2 GB each; only /tmp is private to the worker.
    shared = Path(tempfile.mkdtemp(prefix="raggym-two-node-", dir=SHARED_PARENT))
    services = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
                "metrics-export-port", "node-manager-port", "object-manager-port")
    # Each node's ports are picked together (distinct), the worker's once the head holds its own.
    port, *head_ports = free_ports(1 + len(services))
    ports = lambda picked: [f"--{name}={p}" for name, p in zip(services, picked)]  # noqa: E731
    node = ["--block", "--num-cpus=3", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
    logs = shared / "node-logs"
    logs.mkdir()
    address = f"127.0.0.1:{port}"
    head = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", f"--port={port}", *node, f"--resources={json.dumps({HEAD_LABEL: 10})}",
         "--include-dashboard=false", f"--temp-dir={head_tmp}", *ports(head_ports)],
        env=env, stdout=(logs / "head.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    # The worker starts once the head has joined: started together, the two nodes' processes compete for
    # the two cores and the worker's raylet can miss Ray's registration deadline.
    start_worker = lambda: _worker_node_command([  # noqa: E731  (fresh ports for each attempt)
        str(bin_dir / "ray"), "start", f"--address={address}", *node,
        f"--resources={json.dumps({WORKER_LABEL: 10})}", f"--temp-dir={worker_tmp}", *ports(free_ports(len(services)))])
    worker = None
    try:
        _wait_for_nodes(address, env, 1, {"head": (head, logs / "head.log")})
        _phase("head up", t0)
        for attempt in range(1, WORKER_START_ATTEMPTS + 1):
            worker_log = logs / f"worker-{attempt}.log"
            worker = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", start_worker()],
                                      env=env, stdout=worker_log.open("w"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
            try:
                _wait_for_nodes(address, env, 2, {"head": (head, logs / "head.log"), "worker": (worker, worker_log)})
                break
            except _NodeExited as exited:
                if exited.node != "worker" or RAY_STARTUP_TIMEOUT not in exited.log or attempt == WORKER_START_ATTEMPTS:
                    raise
                _kill_group(worker)  # its raylet may outlive the `ray start` that spawned it
                print(f"[two-node] worker start {attempt} missed Ray's 30 s registration deadline; retrying",
                      flush=True)
        _phase("cluster up (head + worker)", t0)
        yield address, env, shared
    finally:
        t0 = time.monotonic()
        _stop(worker, head)
        _phase("cluster stopped", t0)
        if os.environ.get(KEEP_LOGS_ENV):  # the trainers' and nodes' logs, for a look after the run
            keep = Path(os.environ[KEEP_LOGS_ENV])
            shutil.copytree(shared, keep, dirs_exist_ok=True,
                            ignore=lambda d, names: [n for n in names if n.startswith("run_") and (Path(d) / n).is_dir()
                                                     or n == "index"])
            for log in Path(head_tmp).glob("session_latest/logs/raylet.*"):  # the worker's /tmp is gone with it
                shutil.copy(log, keep / "node-logs" / f"head-{log.name}")
        shutil.rmtree(head_tmp, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


# One process polls (a driver per poll would pay Ray's import and connect each time).
_COUNT_NODES = """
import sys, time, ray
address, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        ray.init(address=address, log_to_driver=False)
        break
    except Exception:  # the head's GCS is not up yet
        time.sleep(1)
while time.monotonic() < deadline and ray.is_initialized():
    if sum(1 for n in ray.nodes() if n["Alive"]) >= want:
        sys.exit(0)
    time.sleep(0.5)
sys.exit(3)
"""


class _NodeExited(AssertionError):
    """A `ray start` that exited before its node joined; ``log`` is its whole log."""

    def __init__(self, node: str, returncode: int, log: Path):
        self.node, self.log = node, log.read_text(errors="replace") if log.exists() else ""
        super().__init__(f"`ray start` of the {node} node exited with {returncode}:\n{_tail(log)}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _wait_for_nodes(address: str, env: dict, want: int, starters: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """Wait until ``want`` nodes are alive; fail naming a starter in ``starters`` that exited, or the timeout."""
    poll = subprocess.Popen([sys.executable, "-c", _COUNT_NODES, address, str(want), str(NODE_START_TIMEOUT_S)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + NODE_START_TIMEOUT_S + 30
    try:
        while poll.poll() is None and time.monotonic() < deadline:
            for name, (proc, log) in starters.items():
                if proc.poll() is not None:
                    raise _NodeExited(name, proc.returncode, log)
            time.sleep(0.5)
    finally:
        if poll.poll() is None:
            poll.kill()
            poll.wait(timeout=30)
    if poll.returncode != 0:
        raise AssertionError(f"the cluster at {address} did not reach {want} alive nodes in "
                             f"{NODE_START_TIMEOUT_S} s:\n" + "\n".join(_tail(log, 3000) for _, log in starters.values()))


@pytest.fixture(scope="module")
def config_file(cluster) -> Path:
    """cpu_tiny cut to the smallest run that still takes real policy-gradient steps."""
    cfg = yaml.safe_load(BASE_CONFIG.read_text(encoding="utf-8"))
    cfg["method"] = "shorter_transcript"  # every group of two gets differing rewards: a real update
    cfg["reward"] = {"method": "shorter_transcript"}
    cfg["data"]["synthetic"] = {"seed": 0, "n_entities": 60, "n_questions": 8, "max_hops": 2}
    # the index is built once, by the first run, on the shared storage; the others reuse it
    cfg["data"]["index_dir"] = str(cluster[2] / "index")
    cfg["rollout"].update({"workers": 1, "env_runners": 1, "prompts_per_step": 1, "group_size": 2,
                           **RESUME_EXACT_ENGINE,
                           "max_response_tokens": 16, "max_turn_tokens": 16, "max_observation_tokens": 32})
    # a checkpoint (policy, fp32 weights and Adam moments) is ~2.2 GB: keep one per run
    cfg["run"]["keep_checkpoints"] = 1
    cfg["learner"].update({"zero_stage": 0, "micro_batch_size": 2, "mini_batch_size": 2})
    cfg["learner"].setdefault("optimizer", {})["weight_decay"] = 0.0
    cfg["num_learners"] = 1
    cfg["retrieval"] = {"shards": 1, "replicas": 1, "routing": "round_robin"}
    path = cluster[2] / "two_node.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _args(config: Path, out_dir, address: str, steps: int = 2) -> list[str]:
    return [sys.executable, TRAINER, "--config", str(config), "--json", f"run.out_dir={out_dir}", f"run.steps={steps}",
            "run.dump_trajectories=true", f"ray.address={address}", *PLACEMENT]


def _launch(config: Path, out_dir, address: str, env: dict, log: Path) -> subprocess.Popen:
    """Start the trainer; its output goes to ``log``, each line stamped with the seconds since launch."""
    proc = subprocess.Popen(_args(config, out_dir, address), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True, errors="replace")
    t0 = time.monotonic()

    def copy() -> None:
        with log.open("w") as fh:
            for line in proc.stdout:
                fh.write(f"[{time.monotonic() - t0:6.1f}s] {line}")
                fh.flush()

    proc.log_copier = threading.Thread(target=copy, daemon=True)
    proc.log_copier.start()
    return proc


def _finish(proc: subprocess.Popen) -> None:
    """Wait for the log of an exited trainer to be written out."""
    proc.log_copier.join(timeout=30)


def _train(config: Path, out_dir, address: str, env: dict, log: Path, timeout_s: float = TRAIN_TIMEOUT_S) -> tuple[int, str]:
    """Run the trainer to its end; (exit status, its output). A run past ``timeout_s`` is killed and fails."""
    proc = _launch(config, out_dir, address, env, log)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        _finish(proc)
        pytest.fail(f"the trainer ({log.name}) did not finish in {timeout_s} s; its log ends:\n{_tail(log)}")
    _finish(proc)
    return proc.returncode, log.read_text(errors="replace")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _policy(ckpt: Path) -> dict[str, Path]:
    """Each tensor of a checkpoint's policy -> its safetensors file (read one at a time: ~0.5 GB in all)."""
    from safetensors import safe_open

    index = {}
    for f in sorted((ckpt / "policy").glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as tensors:
            index.update(dict.fromkeys(tensors.keys(), f))
    return index


def _tensor(policy: dict[str, Path], name: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(policy[name]), framework="numpy") as tensors:
        return tensors.get_tensor(name)


def _step_times(name: str, metrics: list[dict]) -> None:
    for m in metrics:
        print(f"[two-node]   {name} step {m['step']}: rollout {m['time/rollout']:.1f} s, learn {m['time/learn']:.1f} s, "
              f"sync {m['time/sync']:.1f} s", flush=True)


def test_a_relative_run_dir_is_refused_on_a_two_node_cluster(cluster, config_file):
    address, env, shared = cluster
    t0 = time.monotonic()
    code, out = _train(config_file, "runs/two-node-relative", address, env, shared / "relative.log", REFUSAL_TIMEOUT_S)
    _phase("relative run.out_dir refused", t0)
    assert code != 0
    assert "run.out_dir='runs/two-node-relative' is a relative path, but the Ray cluster has 2 nodes" in out, out[-3000:]
    assert not (REPO / "runs" / "two-node-relative").exists()  # refused before anything was written


def test_storage_a_node_cannot_see_is_refused_naming_that_node(cluster, config_file):
    """An absolute path under the head's /tmp: the worker node has its own, empty /tmp."""
    address, env, shared = cluster
    private = Path(tempfile.mkdtemp(prefix="raggym-head-only-", dir=PRIVATE_TMP))
    t0 = time.monotonic()
    try:
        code, out = _train(config_file, private / "run", address, env, shared / "head_only.log", REFUSAL_TIMEOUT_S)
        _phase("run.out_dir under the head's /tmp refused", t0)
        assert code != 0
        assert "is not shared by every Ray node" in out, out[-3000:]
        message = out[out.find("is not shared by every Ray node"):]
        assert "cannot read" in message and "that the driver wrote" in message
        named = re.findall(r"node ([0-9a-f]{12}) \(", message)
        assert len(named) == 1, message  # the worker is named; the head, which sees its own /tmp, is not
        assert not (private / "run" / "index").exists()  # refused before the index was built
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_killed_run_resumes_on_the_other_node_to_the_uninterrupted_step(cluster, config_file):
    address, env, shared = cluster
    t0 = time.monotonic()
    out_a = shared / "run_a"
    code, out = _train(config_file, out_a, address, env, shared / "run_a.log")
    _phase("run A (2 steps, uninterrupted)", t0)
    assert code == 0, _memory_note(out) + out[-6000:]
    metrics = _read(out_a / "metrics.jsonl")
    _step_times("run A", metrics)
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["sync/weight_version"] for m in metrics] == [1.0, 2.0]
    assert all(m["train_sequences"] == 2 and m["learner/weight_version"] == m["step"] for m in metrics)
    assert metrics[1]["weight_versions"] == [1]  # step 2 was generated by the weights step 1 broadcast
    assert "sync/bytes" in metrics[0]  # ... through the collective broadcast, across the nodes

    # Run B: SIGKILL the driver once step 1's checkpoint is committed, then resume with a new driver.
    t1 = time.monotonic()
    out_b = shared / "run_b"
    ckpts = out_b / "checkpoints"
    log = shared / "run_b_first.log"
    first = _launch(config_file, out_b, address, env, log)
    try:
        deadline = time.monotonic() + TRAIN_TIMEOUT_S
        while not (ckpts / "step-000001" / "trainer_state.json").exists():
            assert first.poll() is None, f"run B exited ({first.returncode}) before its step-1 checkpoint:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"run B wrote no step-1 checkpoint in {TRAIN_TIMEOUT_S} s:\n{_tail(log)}"
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
        _finish(first)
    _phase("run B to its step-1 checkpoint, killed", t1)
    assert not (ckpts / "step-000002").exists()
    # learner rank 0 (worker node) wrote the policy and optimizer; the driver (head) committed them
    assert (ckpts / "step-000001" / "learner" / "learner_state.json").exists()
    p1 = _policy(ckpts / "step-000001")
    step1 = {name: _tensor(p1, name) for name in sorted(p1)[:8]}  # the resumed run's save prunes step 1
    assert step1

    t2 = time.monotonic()
    code, out = _train(config_file, out_b, address, env, shared / "run_b_resumed.log")
    _phase("run B resumed by a new driver (step 2)", t2)
    assert code == 0, _memory_note(out) + out[-6000:]
    assert f"resumed from {ckpts / 'step-000001'} at step 1" in out
    metrics_b = _read(out_b / "metrics.jsonl")
    _step_times("run B", metrics_b)
    assert [m["step"] for m in metrics_b] == [1, 2]
    a2, b2 = _read(out_a / "trajectories" / "step-000002.jsonl"), _read(out_b / "trajectories" / "step-000002.jsonl")
    assert len(a2) == 2 and [t["token_ids"] for t in a2] == [t["token_ids"] for t in b2]
    pa, pb = _policy(out_a / "checkpoints" / "step-000002"), _policy(ckpts / "step-000002")
    assert pa.keys() == pb.keys() and pa
    for name in pa:  # the resumed step 2 equals the uninterrupted one ...
        np.testing.assert_allclose(_tensor(pa, name), _tensor(pb, name), rtol=0, atol=1e-6, err_msg=name)
    assert any(not np.array_equal(_tensor(pb, k), v) for k, v in step1.items())  # ... and it changed the weights
    _phase("runs A and B", t0)
