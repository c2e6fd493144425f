"""The served agent's HTTP layer without Ray (issue #17): FastAPI app, API keys, limits, validation.

``AgentApi`` apps run under a real uvicorn server on a free port, over a real ``AgentCore``
(SmolLM2 in the HF engine, the shared synthetic world's retriever), and are called over HTTP.
Generation is short (12 tokens per turn) except where an episode must outlast a deadline or a
client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from free_ports import free_port

from actors.serving import AgentCore, ServeSettings
from actors.serving_http import AgentApi, ApiError, ApiKeys, key_digest

KEY = "test-key-" + "q7Xw2" * 6
TURN_TOKENS = 12



@contextlib.contextmanager
def running(app):
    """``app`` under uvicorn in a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def request(url: str, method: str = "GET", body: bytes | None = None, content_type: str | None = "application/json",
            key: str | None = KEY):
    headers = {"Content-Type": content_type} if content_type and body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


def make_api(engine, retriever, **overrides) -> AgentApi:
    values = {"max_turn_tokens": TURN_TOKENS, "default_max_turns": 1, "max_turns_limit": 4, "status_endpoint": True,
              **overrides}
    settings_ = ServeSettings(**values)
    core = AgentCore(engine, retriever, engine.tokenizer, settings_)
    return AgentApi(core.answer, settings_, core.supported_modes, core.multi_mode, api_keys=ApiKeys.from_keys([KEY]))


@pytest.fixture(scope="module")
def agent_url(hf_engine, small_world_retriever):
    api = make_api(hf_engine, small_world_retriever, max_episodes_in_flight=2)
    with running(api.build()) as url:
        yield url, api


def _answer_body(question: str, max_turns: int = 1) -> bytes:
    return json.dumps({"question": question, "max_turns": max_turns}).encode()


# ----------------------------------------------------------------------------- API keys


def test_api_keys_guard_every_endpoint_but_healthz_and_the_docs(agent_url, small_world):
    url, _ = agent_url
    question = small_world.questions[0].question
    calls = [("GET", "/v1/models", None), ("GET", "/v1/status", None),
             ("POST", "/v1/answer", _answer_body(question)),
             ("POST", "/v1/chat/completions", json.dumps({"model": "raggym-agent", "messages": [
                 {"role": "user", "content": question}], "raggym": {"max_turns": 1}}).encode())]
    wrong = KEY[:-1] + ("x" if KEY[-1] != "x" else "y")
    for method, path, body in calls:
        got = [request(url + path, method, body, key=k)[:2] for k in (None, wrong, KEY)]
        assert [status for status, _ in got] == [401, 401, 200], (path, got)
        for (_, error), code in zip(got[:2], ("missing_api_key", "invalid_api_key")):
            assert error["error"]["code"] == code and error["error"]["type"] == "invalid_request_error"
            assert KEY not in json.dumps(error) and wrong not in json.dumps(error)
    status, body, headers = request(url + "/v1/models", key=None)
    assert headers["www-authenticate"] == "Bearer"
    for scheme in ("Basic", "bearer", "Token"):  # only the bearer scheme, in any case, carries the key
        req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        try:
            with urllib.request.urlopen(req) as r:
                assert scheme.lower() == "bearer" and r.status == 200
        except urllib.error.HTTPError as e:
            assert scheme.lower() != "bearer" and e.code == 401
    assert request(url + "/healthz", key=None)[:2] == (200, {"status": "ok"})
    with urllib.request.urlopen(url + "/docs") as r:  # the OpenAPI page and document stay readable
        assert r.status == 200 and b"swagger" in r.read().lower()
    with urllib.request.urlopen(url + "/openapi.json") as r:
        schema = json.loads(r.read())
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert schema["paths"]["/v1/answer"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]
    assert set(schema["components"]["schemas"]["AnswerBody"]["properties"]) == {"question", "max_turns", "modes"}


def test_api_keys_hold_digests_and_compare_every_one():
    keys = ApiKeys.from_keys(["first-key-0123456789", "second-key-0123456789"])
    assert keys.enabled and not ApiKeys().enabled
    assert keys.accepts("Bearer second-key-0123456789") and keys.accepts("bearer  first-key-0123456789 ")
    for bad in (None, "", "Bearer", "Bearer ", "first-key-0123456789", "Basic first-key-0123456789",
                "Bearer first-key-012345678", "Bearer \udcff"):
        assert not keys.accepts(bad), bad
    assert "first-key" not in repr(vars(keys))  # only digests are kept
    assert ApiKeys([key_digest("k" * 20)]).accepts("Bearer " + "k" * 20)


def test_healthz_is_liveness_and_status_is_off_by_default(hf_engine, small_world_retriever):
    api = make_api(hf_engine, small_world_retriever, status_endpoint=False)
    with running(api.build()) as url:
        assert request(url + "/healthz", key=None)[:2] == (200, {"status": "ok"})
        status, body, _ = request(url + "/v1/status")
        assert status == 404 and body["error"]["code"] == "unknown_endpoint"
        assert "GET /v1/status" not in body["error"]["message"]  # not listed among the available endpoints
    assert ServeSettings.from_dict({"status_endpoint": "true"}).status_endpoint is True


# ----------------------------------------------------------------------------- malformed bodies

_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=10)


def _not_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return True
    return False


# Bodies that are malformed by construction: not JSON, JSON but not an object, an object without a
# string question, or a valid question beside a field the endpoint does not know.
MALFORMED = st.one_of(
    st.binary(max_size=120).filter(_not_json),
    (_scalar | st.lists(_json, max_size=3)).map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(max_size=8).filter(lambda k: k != "question"), _json, max_size=4).map(
        lambda d: json.dumps(d).encode()),
    st.builds(lambda q, rest: json.dumps({"question": q, **rest}).encode(), _json.filter(lambda v: not isinstance(v, str)),
              st.dictionaries(st.sampled_from(["max_turns", "modes"]), _json, max_size=2)),
    st.builds(lambda k, v: json.dumps({"question": "who?", k: v}).encode(),
              st.text(min_size=1, max_size=8).filter(lambda k: k not in ("question", "max_turns", "modes")), _json),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=MALFORMED, path=st.sampled_from(["/v1/answer", "/v1/chat/completions"]))
def test_malformed_bodies_over_http_get_4xx(agent_url, body, path):
    url, _ = agent_url
    status, out, _ = request(url + path, "POST", body)
    assert 400 <= status < 500, (status, body, out)
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}


def test_server_answers_after_malformed_bodies(agent_url, small_world):
    url, api = agent_url
    status, out, _ = request(url + "/v1/answer", "POST", _answer_body(small_world.questions[1].question))
    assert status == 200 and len(out["turns"]) == 1
    assert api.responses["failed"] == 0


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "question": st.one_of(st.text(max_size=40), _json), "max_turns": st.one_of(st.integers(-3, 12), _json),
    "modes": st.one_of(st.lists(st.sampled_from(["passage", "graph", "hybrid", "web", ""]), max_size=4), _json),
    "extra": _json}))
def test_answer_parser_accepts_only_valid_requests(body):
    api = AgentApi(None, ServeSettings(max_turns_limit=8), ("passage", "graph", "hybrid"))
    try:
        req = api.parse_answer(body)
    except ApiError as e:
        assert e.status == 400 and e.payload()["error"]["message"] and e.code
        return
    assert isinstance(req.question, str) and req.question.strip() == req.question and req.question
    assert 1 <= req.max_turns <= 8
    assert req.modes is None or (req.modes and set(req.modes) <= {"passage", "graph", "hybrid"})
    assert "extra" not in body


def test_validation_messages_name_the_field_and_the_type():
    api = AgentApi(None, ServeSettings(), ("passage",))
    cases = [
        ([1], "invalid_json", None, "the request body must be a JSON object, got array"),
        ({"question": ["a"]}, "invalid_type", "question", "'question' must be a string, got array"),
        ({"question": "a", "modes": [3]}, "invalid_type", "modes", "'modes' must be an array of strings"),
        ({"question": "a", "modes": {}}, "invalid_type", "modes", "'modes' must be an array of strings, got object"),
        ({"question": "a", "max_turns": 1.5}, "invalid_type", "max_turns", "'max_turns' must be an integer, got number"),
        ({"question": "a", "Question": "b"}, "unknown_field", "Question",
         "unknown field 'Question'; accepted: question, max_turns, modes"),
    ]
    for body, code, param, message in cases:
        with pytest.raises(ApiError) as e:
            api.parse_answer(body)
        assert (e.value.code, e.value.param, e.value.message) == (code, param, message)


# ----------------------------------------------------------------------------- limits


async def _post_many(url: str, bodies: list[bytes]) -> list[tuple[int, dict, str | None]]:
    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        async def one(body):
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json(), r.headers.get("Retry-After")
        return await asyncio.gather(*[one(b) for b in bodies])


def test_overload_gets_503_with_retry_after_and_nothing_else(agent_url, small_world):
    url, api = agent_url  # two episodes in flight at most
    bodies = [_answer_body(q.question) for q in small_world.questions[2:7]]
    results = asyncio.run(_post_many(url + "/v1/answer", bodies))
    statuses = sorted(s for s, _, _ in results)
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 2 and 503 in statuses, statuses
    for status, body, retry_after in results:
        if status == 503:
            assert retry_after == "1" and body["error"]["code"] == "server_overloaded"
            assert body["error"]["type"] == "server_overloaded"
    assert api.slots.counts["overloaded"] == statuses.count(503)
    assert request(url + "/v1/answer", "POST", bodies[0])[0] == 200  # slots are free again


def _wait_for(condition, timeout_s: float = 60.0) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not reached"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_client_that_disconnects_frees_its_slot(hf_engine, small_world_retriever, small_world):
    api = make_api(hf_engine, small_world_retriever, max_episodes_in_flight=1, max_turn_tokens=48, max_turns_limit=4)
    with running(api.build()) as url:
        body = _answer_body(small_world.questions[3].question, max_turns=4)
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            _wait_for(lambda: api.slots.in_flight == 1, 10)
            time.sleep(0.3)
        _wait_for(lambda: api.slots.in_flight == 0)  # stopped before its next model call
        assert api.slots.counts["client_disconnected"] == 1
        status, out, _ = request(url + "/v1/answer", "POST", _answer_body(small_world.questions[4].question))
        assert status == 200 and out["turns"]


def test_an_episode_past_its_deadline_gets_504_and_stops(hf_engine, small_world_retriever, small_world):
    api = make_api(hf_engine, small_world_retriever, request_deadline_s=0.3, max_turn_tokens=48,
                   max_episodes_in_flight=1)
    with running(api.build()) as url:
        started = time.monotonic()
        status, out, _ = request(url + "/v1/answer", "POST", _answer_body(small_world.questions[5].question, 4))
        assert status == 504 and out["error"]["code"] == "deadline_exceeded", out
        assert time.monotonic() - started < 5
        _wait_for(lambda: api.slots.in_flight == 0)
        assert api.slots.counts["deadline_exceeded"] == 1 and api.responses["failed"] == 1


# ----------------------------------------------------------------------------- vLLM mapping (no vLLM here)


def test_async_vllm_mapping_of_sampling_and_finish_reasons():
    from actors.engines.base import SamplingParams
    from actors.engines.vllm_engine import finish_of, sampling_kwargs

    # importing the engine modules does not import vLLM (checked in a fresh interpreter: other test
    # modules of this worker may have imported it already)
    fresh = subprocess.run([sys.executable, "-c", "import sys, actors.engines.vllm_engine, actors.engines.vllm_async; "
                            "print('vllm' in sys.modules)"], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "False"
    kwargs = sampling_kwargs(SamplingParams(temperature=0.0), ["</search>", "", "</answer>"], 24, None)
    assert kwargs["stop"] == ["</search>", "</answer>"] and kwargs["max_tokens"] == 24
    assert kwargs["include_stop_str_in_output"] and kwargs["top_k"] == -1 and kwargs["n"] == 1
    assert sampling_kwargs(SamplingParams(), [], 8, None)["stop"] is None
    assert finish_of("length", None) == ("length", None)
    assert finish_of("stop", "</search>") == ("stop", "</search>")
    assert finish_of("stop", None) == ("eos", None) and finish_of("stop", 2) == ("eos", None)


def test_a_failed_episode_becomes_a_5xx_in_the_error_shape():
    from ray.exceptions import GetTimeoutError

    from actors.serving_http import _episode_result

    async def settle(exc):
        future = asyncio.get_running_loop().create_future()
        future.set_exception(exc)
        with pytest.raises(ApiError) as e:
            _episode_result(future)
        return e.value

    timeout = asyncio.run(settle(GetTimeoutError("Get timed out: some object(s) not ready.")))
    assert (timeout.status, timeout.code, timeout.type) == (504, "upstream_timeout", "timeout_error")
    failure = asyncio.run(settle(RuntimeError("engine returned 1 results for 2 prompts")))
    assert (failure.status, failure.code) == (500, "internal_error") and "engine returned" in failure.message
    overloaded = ApiError(503, "busy", code="server_overloaded")
    assert asyncio.run(settle(overloaded)) is overloaded
