"""Writes that are all-or-nothing: a reader sees the old file (or directory) or the new one, never half.

Every writer in raggym goes through these helpers:

* ``atomic_write(path, write_fn, mode="w")``: ``write_fn`` writes to an open temporary file in the
  same directory; the file is flushed, fsynced and renamed over ``path`` with ``os.replace``.
* ``atomic_write_text(path, text)`` / ``atomic_write_json(path, obj)``: the common cases.
* ``atomic_directory(final)``: a context manager yielding a fresh temporary sibling directory that
  is renamed to ``final`` when the block succeeds.

The temporary file or directory lives next to the target because ``os.replace`` is atomic only
within one filesystem. On any error (an exception in ``write_fn`` or the ``with`` block, or
Ctrl-C) the temporary is removed and the target is left exactly as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator

# mkstemp / mkdtemp create owner-only (0600 / 0700) entries; a new file or directory should get the
# permissions a plain open() / mkdir() gives under the usual umask 022.
NEW_FILE_MODE = 0o644
NEW_DIR_MODE = 0o755


def atomic_write(path: str | os.PathLike, write_fn: Callable[[IO[Any]], Any], mode: str = "w") -> Path:
    """Write ``path`` through ``write_fn(file_handle)`` all at once; returns ``path`` as a ``Path``.

    ``mode`` is ``"w"`` (text, UTF-8) or ``"wb"`` (bytes). A file that already exists keeps its
    permission bits; a new one gets ``0o644``. Parent directories are created.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            write_fn(fh)
            fh.flush()
            os.fsync(fh.fileno())  # the data is on disk before the rename makes it visible
        try:
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        except FileNotFoundError:
            os.chmod(tmp, NEW_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda fh: fh.write(text))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, **dumps_kwargs: Any) -> Path:
    """Write ``obj`` as JSON (UTF-8, trailing newline) to ``path`` atomically.

    The object is serialised before the temporary file is created, so an object that is not JSON
    serialisable raises without touching the disk. ``dumps_kwargs`` go to ``json.dumps``
    (``default=str``, ``sort_keys=True``, ...).
    """
    text = json.dumps(obj, indent=indent, **dumps_kwargs) + "\n"
    return atomic_write_text(path, text)


@contextmanager
def atomic_directory(final: str | os.PathLike, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``final``; when the block succeeds it becomes ``final``.

    An existing ``final`` is moved aside first and deleted only after the new directory is in
    place, so readers see either the old complete directory or the new complete one. With
    ``keep_existing=True`` a ``final`` that exists when the block ends wins instead (for caches
    that several processes may fill at once: the first complete copy stays, later ones are
    dropped). On error the temporary directory is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, NEW_DIR_MODE)
        yield tmp
        if final.exists() and keep_existing:
            shutil.rmtree(tmp, ignore_errors=True)
        elif final.exists():
            # mkdtemp reserves a free name; the directory itself must go so the rename can take it.
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.rmdir(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["atomic_directory", "atomic_write", "atomic_write_json", "atomic_write_text"]
