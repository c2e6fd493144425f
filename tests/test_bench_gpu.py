"""experiments/bench/gpu.py on CPU with tiny shapes: argument parsing, per-section isolation, JSON shape."""

import json

import pytest

from experiments.bench import gpu as bench_gpu


def test_shape_specs_parse_and_reject_garbage():
    assert bench_gpu.parse_shapes(["2048:1,2,4", "1024:8"]) == [(2048, [1, 2, 4]), (1024, [8])]
    with pytest.raises(Exception, match="SEQ_LEN:MICRO"):
        bench_gpu.parse_shapes(["2048"])


def test_tiny_cpu_run_reports_every_section_and_isolates_failures(tmp_path):
    out = tmp_path / "gpu.json"
    # Each section in its own process (the GPU default); rollout fails on purpose (no table).
    status = bench_gpu.main(["--device", "cpu", "--tiny", "--sections", "logprobs", "rollout",
                             "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert status == 1  # one section failed
    report = json.loads(out.read_text())
    assert report["bench"] == "gpu" and report["tiny"] is True
    assert set(report["sections"]) == {"logprobs", "rollout"}

    rollout = report["sections"]["rollout"]
    assert rollout["ok"] is False and "--retrieval-table" in rollout["error"]

    logprobs = report["sections"]["logprobs"]
    assert logprobs["ok"] is True, logprobs
    rows = logprobs["result"]["rows"]
    assert {r["variant"] for r in rows} == {"full", "chunked_1024", "chunked_4096"}
    for row in rows:
        assert row["seconds_fwd_bwd"] > 0 and "error" not in row
        if row["variant"] != "full":  # float32 on CPU: the chunked path agrees with the reference
            assert max(row["max_abs_diff_vs_full"].values()) < 1e-5


# vLLM's start (about a minute here) goes to the integration run; the HF engine keeps the section in make test
@pytest.mark.parametrize("engine", [pytest.param(e, marks=pytest.mark.integration) if e.startswith("vllm") else e
                                    for e in bench_gpu.ROLLOUT_ENGINES])
def test_tiny_rollout_section_runs_episodes_on_the_rollout_loop(engine, tmp_path, small_world, small_world_retriever,
                                                                 tiny_vllm_policy):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(bench_gpu.retrieval_table(small_world_retriever, small_world.questions[:2], 2, "small_world")))
    out = tmp_path / "gpu.json"
    # In its own process, as on the GPU; the tiny random Llama keeps the episodes short.
    status = bench_gpu.main(["--device", "cpu", "--tiny", "--sections", "rollout", "--rollout-engine", engine,
                             "--smollm", tiny_vllm_policy, "--retrieval-table", str(table),
                             "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    entry = json.loads(out.read_text())["sections"]["rollout"]
    assert entry["ok"] is True, entry
    assert status == 0
    result = entry["result"]
    assert result["engine"] == engine and result["retrieval"] == "small_world" and result["top_k"] == 2
    (row,) = result["rows"]
    assert row["episodes"] == 2 and row["episodes_finished"] == 2
    assert row["model_tokens"] > 0 and row["seconds"] > 0 and row["tok_s"] > 0 and row["episodes_per_s"] > 0
    assert row["engine_requests"] >= 2  # at least one model turn per episode
    # plain generate: the same prompts, each run to the rollout's mean length
    assert row["plain_tokens"] > 0 and abs(row["plain_tokens"] - row["model_tokens"]) <= row["episodes"]
    assert row["rollout_over_generate"] > 0
    assert set(row["retrieval_counts"]) >= {"retrieval_requests", "retrieval_unique"}
    if engine == "vllm-async":  # vLLM's own counters of the rollout and of plain generate
        counters = row["engine_counters"]
        assert counters["steps"] > 0 and counters["generation_tokens"] >= row["model_tokens"]
        assert counters["prompt_tokens"] > 0 and row["plain_engine_counters"]["generation_tokens"] == row["plain_tokens"]
        assert 0 <= row["prefix_cache"]["hits"] <= row["prefix_cache"]["queries"]
        assert result["engine_info"]["kind"] == "vllm-async"
    else:
        assert "engine_counters" not in row
