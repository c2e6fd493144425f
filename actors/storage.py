"""One storage location per run, reachable from every node: a shared path or a ``pyarrow.fs`` URI.

A run keeps its index, logs, checkpoints and SFT policy under ``run.out_dir``, which is either

* an absolute path on storage every node mounts (NFS, Lustre, a shared disk), or a ``file://``
  URI of one: every process reads and writes it in place; or
* a URI of any filesystem ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://``, ``gs://``,
  ``hdfs://``, ...), or else of an installed ``fsspec`` protocol (``memory://``, ``az://``): objects are copied through ``pyarrow.fs`` to and from a *staging directory*
  on the node's own disk wherever a library wants a local path (FAISS, Hugging Face
  ``save_pretrained``/``from_pretrained``). This is how Ray Train's ``storage_path`` works.

A relative path means "relative to the driver's working directory", which no other node shares:
on a cluster of more than one node it is an error at start (``check_storage_on_every_node`` also
probes that every alive node sees what the driver wrote). On a single node it is resolved against
the driver's working directory.

``RunStorage`` is plain data (a string), so it travels to Ray tasks and actors as an argument.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

STAGING_ENV = "RAGGYM_STAGING_DIR"  # where a node keeps local copies of URI storage (default: the temp dir)


class StorageError(ValueError):
    """The run's storage is unusable from some node (or is a relative path on a cluster)."""


def _is_uri(location: str) -> bool:
    return "://" in location


def staging_root() -> Path:
    """This node's local directory for copies of remote storage (``$RAGGYM_STAGING_DIR`` or the temp dir)."""
    return Path(os.environ.get(STAGING_ENV) or Path(tempfile.gettempdir()) / "raggym-staging")


@dataclass(frozen=True)
class RunStorage:
    """The storage location ``root`` (an absolute path or a URI) and paths under it.

    Paths under the root are given relative to it (``"checkpoints/step-000002"``). For a local or
    shared filesystem ``local(rel)`` is the path itself; for a remote one it is this node's staging
    directory for that path, which ``download``/``upload`` fill and empty.
    """

    root: str

    def __post_init__(self):
        if not _is_uri(self.root) and not os.path.isabs(self.root):
            raise StorageError(f"storage {self.root!r} is a relative path; give an absolute path or a URI "
                               "(RunStorage.resolve turns a relative path into an absolute one on a single node)")

    # ------------------------------------------------------------------ construction

    @classmethod
    def resolve(cls, location: str | os.PathLike, *, nodes: int = 1, what: str = "run.out_dir") -> "RunStorage":
        """The storage of ``location``; a relative path is an error when ``nodes`` > 1."""
        location = str(location)
        if _is_uri(location):
            if location.startswith("file://"):
                return cls(location[len("file://"):].rstrip("/") or "/")
            return cls(location.rstrip("/"))
        if not os.path.isabs(location):
            if nodes > 1:
                raise StorageError(
                    f"{what}={location!r} is a relative path, but the Ray cluster has {nodes} nodes: other nodes "
                    "would write to their own copy of that path. Give an absolute path on storage every node "
                    "mounts (e.g. /mnt/shared/runs/x) or a URI (s3://bucket/runs/x); see docs/cluster.md")
            location = os.path.abspath(location)
        return cls(os.path.normpath(location))

    # ------------------------------------------------------------------ filesystem

    @property
    def is_remote(self) -> bool:
        """True for object stores and other filesystems reached only through ``pyarrow.fs``."""
        return _is_uri(self.root)

    def _fs(self):
        from pyarrow import fs

        if not self.is_remote:
            return fs.LocalFileSystem(), self.root
        try:
            filesystem, base = fs.FileSystem.from_uri(self.root)
        except Exception as native_error:  # noqa: BLE001 - pyarrow has no such scheme: try fsspec's
            try:
                import fsspec
            except ImportError:
                raise native_error from None
            # Any fsspec protocol (memory://, az://, ...) through pyarrow's fsspec adapter.
            filesystem_impl, base = fsspec.core.url_to_fs(self.root)
            filesystem = fs.PyFileSystem(fs.FSSpecHandler(filesystem_impl))
        return filesystem, base.rstrip("/")

    def _fs_path(self, rel: str = "") -> tuple[object, str]:
        filesystem, base = self._fs()
        return filesystem, f"{base}/{rel}".rstrip("/") if rel else base

    def uri(self, rel: str = "") -> str:
        """How other processes should name ``rel``: the absolute path, or the URI."""
        return f"{self.root}/{rel}".rstrip("/") if rel else self.root

    def local(self, rel: str = "") -> Path:
        """A local path for ``rel``: the path itself, or this node's staging copy of it."""
        if not self.is_remote:
            return Path(self.root, rel) if rel else Path(self.root)
        key = hashlib.sha256(self.root.encode()).hexdigest()[:16]
        return staging_root() / key / rel

    # ------------------------------------------------------------------ small files

    def exists(self, rel: str) -> bool:
        from pyarrow import fs

        filesystem, path = self._fs_path(rel)
        return filesystem.get_file_info(path).type != fs.FileType.NotFound

    def read_text(self, rel: str) -> str:
        filesystem, path = self._fs_path(rel)
        with filesystem.open_input_stream(path) as stream:
            return stream.read().decode("utf-8")

    def write_text(self, rel: str, text: str) -> None:
        """Write a small file whole: renamed into place on a filesystem, one PUT on an object store."""
        filesystem, path = self._fs_path(rel)
        parent = path.rsplit("/", 1)[0]
        filesystem.create_dir(parent, recursive=True)
        if self.is_remote:
            with filesystem.open_output_stream(path) as stream:
                stream.write(text.encode("utf-8"))
            return
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def list_dirs(self, rel: str) -> list[str]:
        """Names of the directories directly under ``rel`` (none when it does not exist)."""
        from pyarrow import fs

        filesystem, path = self._fs_path(rel)
        if filesystem.get_file_info(path).type == fs.FileType.NotFound:
            return []
        infos = filesystem.get_file_info(fs.FileSelector(path, recursive=False))
        return sorted(i.base_name for i in infos if i.type == fs.FileType.Directory)

    def remove(self, rel: str) -> None:
        """Delete the directory ``rel`` and everything under it, if it exists."""
        filesystem, path = self._fs_path(rel)
        if self.exists(rel):
            filesystem.delete_dir(path)

    # ------------------------------------------------------------------ directories

    def upload(self, local_dir: str | Path, rel: str) -> None:
        """Copy a local directory to ``rel`` (nothing to do when it already is that path)."""
        from pyarrow import fs

        filesystem, path = self._fs_path(rel)
        if not self.is_remote and Path(local_dir).resolve() == Path(path).resolve():
            return
        filesystem.create_dir(path, recursive=True)
        fs.copy_files(str(Path(local_dir).resolve()), path, source_filesystem=fs.LocalFileSystem(),
                      destination_filesystem=filesystem)

    def download(self, rel: str) -> Path:
        """``rel`` as a local directory: the path itself, or a fresh staging copy on this node."""
        from pyarrow import fs

        target = self.local(rel)
        if not self.is_remote:
            return target
        filesystem, path = self._fs_path(rel)
        partial = target.with_name(f"{target.name}.partial-{secrets.token_hex(4)}")
        partial.mkdir(parents=True)
        fs.copy_files(path, str(partial), source_filesystem=filesystem, destination_filesystem=fs.LocalFileSystem())
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # other processes on this node never read a half-copied directory
        return target

    def commit_directory(self, tmp_rel: str, final_rel: str, marker: str) -> None:
        """Make the staged ``tmp_rel`` (its ``marker`` file included) appear as ``final_rel`` in one step.

        A filesystem renames the directory (atomic). An object store has no rename: every other file
        is copied first and the marker last, and readers treat a directory without its marker as
        absent (``latest_checkpoint``), so a copy interrupted half-way is never used.
        """
        from pyarrow import fs

        filesystem, tmp = self._fs_path(tmp_rel)
        _, final = self._fs_path(final_rel)
        if not self.exists(f"{tmp_rel}/{marker}"):
            raise StorageError(f"{self.uri(tmp_rel)} has no {marker}: nothing to commit")
        self.remove(final_rel)
        if not self.is_remote:
            os.replace(tmp, final)
            return
        files = [i.path for i in filesystem.get_file_info(fs.FileSelector(tmp, recursive=True))
                 if i.type == fs.FileType.File]
        marker_path = f"{tmp}/{marker}"
        for path in [p for p in files if p != marker_path] + [marker_path]:
            target = final + path[len(tmp):]
            filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
            filesystem.copy_file(path, target)
        self.remove(tmp_rel)


# ---------------------------------------------------------------------------------------------
# the probe: every alive node must see what the driver wrote, and the driver what each node wrote
# ---------------------------------------------------------------------------------------------

PROBE_DIR = ".storage-probe"


def _probe_node(storage_root: str, token: str, node_label: str) -> str:
    """On one node: read the driver's probe file, write this node's. Returns an error or ''."""
    storage = RunStorage(storage_root)
    rel = f"{PROBE_DIR}/{token}/driver"
    try:
        seen = storage.read_text(rel)
    except (OSError, FileNotFoundError) as exc:
        return f"cannot read {storage.uri(rel)} that the driver wrote ({type(exc).__name__}: {exc})"
    if seen != token:
        return f"{storage.uri(rel)} holds {seen!r}, not what the driver wrote"
    try:
        storage.write_text(f"{PROBE_DIR}/{token}/{node_label}", token)
    except OSError as exc:
        return f"cannot write under {storage.uri(PROBE_DIR)} ({type(exc).__name__}: {exc})"
    return ""


def check_storage_on_every_node(storage: RunStorage, *, timeout_s: float = 120.0) -> list[str]:
    """Probe the storage from a task pinned to every alive Ray node; raise naming the nodes that fail.

    Each node reads a file the driver wrote and writes its own, which the driver then reads; so a
    node with a private copy of the path (another machine, another mount namespace) fails here,
    not hours later when a checkpoint written there cannot be found. Returns the probed node ids.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    storage.write_text(f"{PROBE_DIR}/{token}/driver", token)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe_node)
    labels = {n["NodeID"]: f"node-{n['NodeID'][:12]}" for n in nodes}
    refs = {n["NodeID"]: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(storage.root, token, labels[n["NodeID"]]) for n in nodes}
    problems = []
    try:
        results = dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s)))
        for node in nodes:
            node_id, where = node["NodeID"], f"node {node['NodeID'][:12]} ({node.get('NodeManagerAddress')})"
            error = results[node_id]
            if not error and not storage.exists(f"{PROBE_DIR}/{token}/{labels[node_id]}"):
                error = "its probe file is not visible to the driver"
            if error:
                problems.append(f"{where}: {error}")
    finally:
        storage.remove(f"{PROBE_DIR}/{token}")
    if problems:
        raise StorageError(f"run storage {storage.uri()} is not shared by every Ray node: " + "; ".join(problems)
                           + ". Put run.out_dir on storage all nodes mount, or use a URI (see docs/cluster.md)")
    return list(refs)


def _download(storage_root: str, rel: str) -> str:
    return str(RunStorage(storage_root).download(rel))


def stage_on_every_node(storage: RunStorage, rel: str) -> Path:
    """``rel`` as a local directory on every node, at the same path; returns that path.

    Shared storage needs nothing (the path is the same everywhere). Remote storage is downloaded
    to each alive Ray node's staging directory (and this process's), so actors that load from a
    path (index shards, engines, learners) find it wherever Ray places them.
    """
    if not storage.is_remote:
        return storage.local(rel)
    local = storage.download(rel)
    import ray

    if ray.is_initialized():
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0)(_download)
        paths = ray.get([task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                         .remote(storage.root, rel) for n in ray.nodes() if n.get("Alive")])
        if set(paths) != {str(local)}:
            raise StorageError(f"nodes staged {storage.uri(rel)} at different local paths {sorted(set(paths))}; "
                               f"set {STAGING_ENV} to the same directory on every node")
    return local


__all__ = ["RunStorage", "STAGING_ENV", "StorageError", "check_storage_on_every_node", "stage_on_every_node",
           "staging_root"]
