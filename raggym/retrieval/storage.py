"""On-disk helpers for retrieval artifacts: checksummed manifests, safe formats.

Every index directory is written into a temporary sibling first and renamed into place at the
end (``raggym.atomic.atomic_directory``), so a crash (or Ctrl-C) never leaves a half-written
index where a reader might open it.
The manifest lists every file with its size and SHA-256; ``verify_files`` turns truncation,
bit rot or a swapped file into a ``ValueError`` that names the file, before FAISS or numpy get a
chance to fail in less readable ways.

Only safe formats are used: FAISS native files, ``.npy`` (loaded with ``allow_pickle=False``),
parquet and JSON. Nothing here ever unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT_NAME = "raggym-retrieval-index"
FORMAT_VERSION = 1


class IndexFormatError(ValueError):
    """An index directory is missing, corrupted, or does not match what the caller expects."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def file_table(root: Path) -> dict[str, dict]:
    """Size and checksum of every file under ``root`` except the manifest itself."""
    table = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            rel = path.relative_to(root).as_posix()
            table[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return table


def write_manifest(root: Path, manifest: dict) -> None:
    manifest = dict(manifest)
    manifest["format"] = FORMAT_NAME
    manifest["version"] = FORMAT_VERSION
    manifest["files"] = file_table(root)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")


def read_manifest(root: str | os.PathLike) -> dict:
    root = Path(root)
    if not root.exists():
        raise IndexFormatError(f"index directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise IndexFormatError(f"index path {str(root)!r} is not a directory")
    path = root / MANIFEST
    if not path.is_file():
        raise IndexFormatError(f"{str(root)!r} is not a raggym index: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexFormatError(f"{path}: corrupted manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise IndexFormatError(f"{path}: not a raggym retrieval index manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise IndexFormatError(
            f"{path}: index format version {manifest.get('version')!r} is not supported "
            f"(this raggym reads version {FORMAT_VERSION}); rebuild the index with `raggym index`"
        )
    if not isinstance(manifest.get("files"), dict):
        raise IndexFormatError(f"{path}: manifest has no file table")
    return manifest


def verify_files(root: Path, manifest: dict, *, checksums: bool = True) -> None:
    """Check that every listed file exists with the recorded size (and checksum)."""
    for rel, meta in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            raise IndexFormatError(f"{root}: index file {rel!r} is missing")
        size = path.stat().st_size
        if size != meta.get("bytes"):
            raise IndexFormatError(f"{root}: index file {rel!r} has {size} bytes, manifest says {meta.get('bytes')} (truncated or replaced)")
        if checksums and sha256_file(path) != meta.get("sha256"):
            raise IndexFormatError(f"{root}: index file {rel!r} is corrupted (SHA-256 mismatch)")


def load_npy(root: Path, rel: str, *, dtype=None, ndim: int | None = None) -> np.ndarray:
    path = root / rel
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise IndexFormatError(f"{root}: cannot read {rel!r} as a numpy array ({e})") from None
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise IndexFormatError(f"{root}: {rel!r} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if ndim is not None and arr.ndim != ndim:
        raise IndexFormatError(f"{root}: {rel!r} has {arr.ndim} dimensions, expected {ndim}")
    return arr


def write_table(path: Path, columns: dict[str, list | np.ndarray]) -> None:
    # pyarrow is imported on first use: it would add about a fifth to the time of `import raggym, envs`.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def read_table(root: Path, rel: str, required: tuple[str, ...]) -> dict[str, list]:
    # pyarrow is imported on first use: it would add about a fifth to the time of `import raggym, envs`.
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(root / rel)
    except Exception as e:  # noqa: BLE001 - pyarrow raises many exception types
        raise IndexFormatError(f"{root}: cannot read {rel!r} as parquet ({e})") from None
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise IndexFormatError(f"{root}: {rel!r} lacks column(s) {', '.join(missing)}")
    return {c: table.column(c).to_pylist() for c in table.column_names}
