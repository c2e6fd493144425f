"""Shared test settings: offline hub, the real shared data, one synthetic world per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_data_dir(name: str) -> Path:
    """Path of ``../shared/data/<name>``, skipping the test with a reason when it is absent."""
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"real data folder {path} is absent (it lives beside the repo in this workplace and in CI)")
    return path


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


@pytest.fixture(scope="session")
def hf_engine():
    """SmolLM2-135M in the HF engine, shared by the modules that generate in-process."""
    import torch

    from actors.engines.hf import HFEngine

    torch.manual_seed(0)
    return HFEngine("smollm2-135m")
