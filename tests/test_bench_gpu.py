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
