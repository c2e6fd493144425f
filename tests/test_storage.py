"""actors.storage: one storage location per run (a path every node sees, or a pyarrow.fs / fsspec URI),
checkpoints committed in one step by one process, and the probe that every node sees the storage."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from actors.storage import RunStorage, StorageError, check_storage_on_every_node, staging_root
from experiments.recipe.training import CHECKPOINT_MARKER, latest_checkpoint


def test_a_relative_location_is_refused_on_a_cluster_and_made_absolute_on_one_node(tmp_path, monkeypatch):
    with pytest.raises(StorageError, match=r"run.out_dir='runs/x' is a relative path, but the Ray cluster has 2 nodes"):
        RunStorage.resolve("runs/x", nodes=2)
    with pytest.raises(StorageError, match=r"data.index_dir='idx'"):
        RunStorage.resolve("idx", nodes=3, what="data.index_dir")
    monkeypatch.chdir(tmp_path)
    assert RunStorage.resolve("runs/x").root == str(tmp_path / "runs" / "x")
    assert RunStorage.resolve(f"file://{tmp_path}/y/", nodes=2).root == str(tmp_path / "y")
    assert not RunStorage.resolve(str(tmp_path)).is_remote and RunStorage.resolve("s3://bucket/run").is_remote
    with pytest.raises(StorageError, match="relative"):
        RunStorage("relative/dir")


def _stage(storage: RunStorage, rel: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        storage.write_text(f"{rel}/{name}", text)


@pytest.mark.parametrize("kind", ["shared path", "remote URI"])
def test_a_checkpoint_exists_only_once_committed_and_the_marker_comes_last(kind, tmp_path):
    storage = RunStorage(str(tmp_path / "run")) if kind == "shared path" else \
        RunStorage.resolve(f"memory://raggym-test-{secrets.token_hex(4)}/run")
    assert latest_checkpoint(storage) is None
    files = {"learner/learner_state.json": "{}", "policy/config.json": "{}"}
    _stage(storage, "checkpoints/.tmp-step-000001", files)
    _stage(storage, "checkpoints/step-000002", files)  # a copy interrupted before its marker
    assert latest_checkpoint(storage) is None  # neither the staging dir nor the markerless copy counts

    storage.write_text(f"checkpoints/.tmp-step-000001/{CHECKPOINT_MARKER}", json.dumps({"step": 1}))
    storage.commit_directory("checkpoints/.tmp-step-000001", "checkpoints/step-000001", CHECKPOINT_MARKER)
    found = latest_checkpoint(storage)
    assert str(found) == storage.uri("checkpoints/step-000001")
    assert isinstance(found, Path) == (kind == "shared path")
    assert storage.list_dirs("checkpoints") == ["step-000001", "step-000002"]  # the staging dir is gone
    assert json.loads(storage.read_text(f"checkpoints/step-000001/{CHECKPOINT_MARKER}")) == {"step": 1}
    assert storage.read_text("checkpoints/step-000001/policy/config.json") == "{}"
    with pytest.raises(StorageError, match="nothing to commit"):
        storage.commit_directory("checkpoints/.tmp-step-000009", "checkpoints/step-000009", CHECKPOINT_MARKER)


def test_remote_directories_go_through_a_local_staging_copy(tmp_path):
    storage = RunStorage.resolve(f"memory://raggym-test-{secrets.token_hex(4)}/run")
    source = tmp_path / "policy"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{\"a\": 1}")
    (source / "sub" / "weights.bin").write_bytes(b"\x00\x01")
    storage.upload(source, "sft/policy")
    assert storage.exists("sft/policy/sub/weights.bin")
    local = storage.download("sft/policy")
    assert local == storage.local("sft/policy") and local.is_relative_to(staging_root())
    assert (local / "config.json").read_text() == "{\"a\": 1}" and (local / "sub" / "weights.bin").read_bytes() == b"\x00\x01"
    # a shared path is its own local copy: nothing is copied
    shared = RunStorage(str(tmp_path / "shared"))
    assert shared.local("sft/policy") == tmp_path / "shared" / "sft" / "policy"


def test_the_probe_passes_on_every_node_that_sees_the_storage_and_cleans_up(tmp_path):
    import ray

    from actors.cluster import init_ray

    started = init_ray(num_cpus=1)
    try:
        storage = RunStorage(str(tmp_path / "run"))
        probed = check_storage_on_every_node(storage)
        assert probed == [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert storage.list_dirs(".storage-probe") == []
    finally:
        if started:
            ray.shutdown()
