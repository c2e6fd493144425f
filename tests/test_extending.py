"""docs/extending.md stays true: every python block in it runs against the real components."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
_BLOCK_RE = re.compile(r"^```python( setup)?\n(.*?)^```", re.S | re.M)


def _blocks():
    text = DOC.read_text(encoding="utf-8")
    blocks = [(bool(m.group(1)), m.group(2)) for m in _BLOCK_RE.finditer(text)]
    return [code for is_setup, code in blocks if is_setup], [code for is_setup, code in blocks if not is_setup]


def test_the_doc_has_its_setup_and_five_examples():
    setup, examples = _blocks()
    assert len(setup) == 1 and len(examples) == 5
    # the fixtures handed to the examples are exactly what the setup block builds
    assert "generate_world(seed=7, n_entities=300, n_questions=60)" in setup[0]
    assert "Retriever.build(world.corpus, openie=world.openie)" in setup[0]


@pytest.fixture
def clean_registries():
    yield
    import gymnasium

    from actors.engines.rollout_worker import ENGINE_FACTORIES
    from raggym.protocol import unregister_dialect
    from raggym.rewards.schedules import CUSTOM_SCHEDULES, REWARD_SECTIONS

    unregister_dialect("json_search")
    CUSTOM_SCHEDULES.pop("em_search_cost", None)
    REWARD_SECTIONS.pop("em_search_cost", None)
    ENGINE_FACTORIES.pop("hf-generate", None)
    gymnasium.registry.pop("raggym-examples/RetrieveThenAnswer-v0", None)


@pytest.mark.parametrize("index,title", [(0, "dialect"), (1, "reward"), (2, "environment"), (3, "engine")])
def test_doc_example_runs(index, title, small_world, small_world_retriever, clean_registries):
    import torch

    torch.set_num_threads(2)
    _, examples = _blocks()
    namespace = {"world": small_world, "retriever": small_world_retriever, "__name__": f"extending_{title}"}
    exec(_compiled(examples[index], title), namespace)


def _compiled(code: str, title: str):
    # dont_inherit: the block runs as a user's script would, without this file's
    # `from __future__ import annotations` (under which a dataclass in it looks for its module)
    return compile(code, f"{DOC}#{title}", "exec", dont_inherit=True)


@pytest.mark.integration  # a full train() step (~1 min on 2 cores): `make test-integration`
def test_doc_training_example_runs_one_real_step(small_world, small_world_retriever, clean_registries, tmp_path,
                                                 monkeypatch):
    """Section 5: train() with the custom reward, environment and engine of sections 2-4."""
    import tempfile

    import torch

    # The example's tempfile.mkdtemp() would leave its run (checkpoints included, ~2 GB) in /tmp
    # after every test run; under tmp_path pytest's retention removes it.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    torch.set_num_threads(2)
    _, examples = _blocks()
    namespace = {"world": small_world, "retriever": small_world_retriever, "__name__": "extending_training"}
    for index, title in ((1, "reward"), (2, "environment"), (3, "engine"), (4, "training")):
        exec(_compiled(examples[index], title), namespace)


def test_registration_hooks_refuse_builtin_names():
    from actors.engines import register_engine
    from raggym.protocol import RouteRAGDialect, register_dialect, unregister_dialect
    from raggym.rewards.schedules import register_reward_schedule

    with pytest.raises(ValueError, match="already registered"):
        register_dialect(RouteRAGDialect)
    with pytest.raises(ValueError, match="built-in"):
        unregister_dialect("routerag")
    with pytest.raises(ValueError, match="already registered"):
        register_reward_schedule("routerag", lambda options: None)
    with pytest.raises(ValueError, match="already registered"):
        register_engine("hf", dict)
    from actors.engines import make_engine

    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        make_engine("nope")
    with pytest.raises(ValueError, match="cannot import engine"):
        make_engine("no_such_module_xyz:Engine")
